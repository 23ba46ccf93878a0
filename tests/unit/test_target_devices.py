"""A target on several devices: the producer's placement is not part of what an artifact is.

- ``--tensor-parallel-size 2`` (real processes, torch.distributed on gloo, transformers' tensor-parallel plan)
  publishes the same fingerprints as a one-device producer of the same plan, with captured layers equal to
  within 1e-4 in fp32 (the ``distributed`` lane).
- ``--devices`` builds a ``device_map`` with the decoder layers in contiguous blocks; a model placed by it is
  captured layer for layer as the one-device model is.
- Bad placements are refused in one line before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from artcache.errors import ConfigError
from tests.support import TINY_SHAREGPT

DATA = TINY_SHAREGPT


def test_layer_device_map_splits_the_decoder_in_contiguous_blocks(tiny_target):
    from artcache.target import layer_device_map

    dm = layer_device_map(tiny_target, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])  # 6 layers over 4: 2, 2, 1, 1
    layers = [dm[f"model.layers.{i}"] for i in range(6)]
    assert layers == ["cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:2", "cuda:3"]
    rest = {k: v for k, v in dm.items() if not k.startswith("model.layers.")}
    assert rest == {"model.embed_tokens": "cuda:0", "model.norm": "cuda:0", "model.rotary_emb": "cuda:0",
                    "lm_head": "cuda:0"}
    with pytest.raises(ConfigError, match="7 devices for a target of 6 decoder layers"):
        layer_device_map(tiny_target, [f"cuda:{i}" for i in range(7)])


def placed_equals_one_device(tiny_target, fake_plan, devices: list[str]) -> None:
    from artcache.backends.hf import HFCaptureBackend
    from artcache.contract import CaptureContract
    from artcache.target import load_target_model

    contract = CaptureContract(target_name="t", target_revision="r", target_config_hash="c",
                               target_weights_digest="w", layer_ids=(0, 3, 5), dtype="float32", max_length=64,
                               tokenizer_digest="k", template_digest="m")
    samples = [fake_plan.sample(i) for i in range(3)]
    outs = []
    for placement in (None, devices):
        model = load_target_model(tiny_target, devices[0], torch.float32, devices=placement)
        if placement and len(set(placement)) > 1:  # transformers records a map that spans devices
            assert model.hf_device_map["model.layers.0"] in (placement[0], torch.device(placement[0]).index)
            assert model.model.layers[0].self_attn.q_proj.weight.device == torch.device(placement[0])
            assert model.model.layers[-1].self_attn.q_proj.weight.device == torch.device(placement[-1])
        backend = HFCaptureBackend(model, contract, device=devices[0])
        outs.append([{k: v.clone() for k, v in x.items()} for x in backend.capture(samples)])
        backend.close()
    for x, y in zip(*outs, strict=True):
        assert x["hidden_states"].device.type == "cpu"
        assert (x["hidden_states"] - y["hidden_states"]).abs().max().item() <= 1e-5


def test_a_placed_model_is_captured_as_the_one_device_model(tiny_target, fake_plan):
    """``load_target_model(devices=...)`` through transformers' device_map (two CPU entries here: the map, the
    hooks and the gather run, the device is the same) captures what the one-device model does."""
    placed_equals_one_device(tiny_target, fake_plan, ["cpu", "cpu"])


@pytest.mark.parametrize(("flags", "message"), [
    (["--devices", "cpu", "--tensor-parallel-size", "2"], "two placements: give one"),
    (["--devices", "cpu,cpu"], "names a device twice"),
    (["--devices", "cuda:1"], "--devices 'cuda:1'"),
    (["--devices", "tpu:0"], "--devices 'tpu:0' is not accepted"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--tensor-parallel-size", "2", "--target", "random:tiny-llama"], "needs an HF checkpoint"),
    (["--tensor-parallel-size", "2", "--backend", "vllm"], "not accepted with --backend vllm"),
])
def test_bad_placements_are_refused_in_one_line(tmp_path, flags, message):
    from click.testing import CliRunner

    from artcache.app.cli import main

    cache = tmp_path / "cache"
    result = CliRunner().invoke(main, ["producer", "--cache", str(cache), "--data", "synthetic",
                                       "--max-samples", "4", *flags])
    assert result.exit_code != 0
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (cache / "artcache.json").exists()


def test_placement_is_not_part_of_the_contract(tmp_path, tiny_target):
    """The same root settings with and without a placement: one contract (so one set of fingerprints), and the
    ``auto`` compute dtype follows the first device of ``devices``."""
    from artcache.producer import ProducerConfig, prepare_root, resolve_compute_dtype

    base = {"cache": str(tmp_path / "cache"), "target": tiny_target.path, "dataset": str(DATA), "max_samples": 4,
            "max_length": 64, "draft_layers": 3}
    contract = prepare_root(ProducerConfig(**base))[1].contract
    for placement in ({"tensor_parallel_size": 2}, {"devices": ["cpu"]}):
        cfg = ProducerConfig(**base, **placement)
        cfg.validate()
        assert prepare_root(cfg)[1].contract == contract
    gpus = ProducerConfig(cache="x", devices=["cuda:1", "cuda:0"])
    assert gpus.first_device == "cuda:1" and resolve_compute_dtype("auto", gpus.first_device) == "bfloat16"


def test_run_config_places_the_producers_target(tmp_path):
    """``target.devices`` / ``target.tensor_parallel_size`` in a run config, by override and by the producer's
    flags with ``--config``, reach the producer's settings."""
    from artcache.app import config as C

    path = tmp_path / "run.toml"
    path.write_text(f'out = "{tmp_path / "out"}"\n[target]\nname = "random:tiny-llama"\n')
    cfg = C.load_run_config(str(path), ["target.devices=cuda:0,cuda:1"], {})
    assert C.producer_config(cfg).devices == ["cuda:0", "cuda:1"]
    cfg = C.load_run_config(str(path), [], C.flag_paths("producer", {"devices": "cuda:2,cuda:3",
                                                                     "tensor_parallel_size": 4}))
    pcfg = C.producer_config(cfg)
    assert (pcfg.devices, pcfg.tensor_parallel_size) == (["cuda:2", "cuda:3"], 4)
    with pytest.raises(ConfigError, match="two placements"):
        pcfg.validate()
