"""Tests for `artcache export`: DFlash and EAGLE-3 checkpoints written as serving-engine draft
directories (hf and speculators formats), read back with strict keys, layer-id conversion, errors and
atomicity."""

from __future__ import annotations

import json
import os
import stat
import types
from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.errors import ConfigError
from artcache.layer_ids import dflash_layer_ids
from artcache.trainers.checkpoint import point_latest, save_checkpoint, write_state
from artcache.trainers.dflash import DFlashConfig, DFlashDraft, sample_anchors
from artcache.trainers.dflash.export import (
    dflash_config_from_export,
    dflash_export_config,
    load_dflash_export,
)
from artcache.trainers.eagle3.export import load_eagle3_export
from artcache.trainers.export import export_checkpoint
from tests.support.ckpt_damage import flip_byte, truncate

V, H, L = 40, 32, 8  # tiny target: vocab, width, decoder layers
DFLASH_KEYS_PER_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


@pytest.fixture
def target_dir(tmp_path) -> Path:
    """A target config directory (config.json only: export needs no target weights)."""
    return make_target_dir(tmp_path / "target")


def make_target_dir(d: Path) -> Path:
    """Write the tiny target's config.json (a Llama of vocab V, hidden H, L layers) into ``d``."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
                rope_theta=50000.0, architectures=["LlamaForCausalLM"]).save_pretrained(str(d))
    return d


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random values in every trainable tensor (norms too), so a misnamed tensor changes outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2 + (1.0 if p.dim() == 1 else 0.0))


def _frozen(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.3


def _save(run_dir: Path, model, state: dict, weights=None, extra=None) -> Path:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    path = save_checkpoint(run_dir, step=3, cursor=6, weights=weights if weights is not None
                           else model.trainable_state_dict(), optimizer=opt, generators={},
                           extra_tensors=extra or {}, state=state)
    point_latest(run_dir, path)
    return path


def dflash_checkpoint(run_dir: Path, *, block_size: int = 4, weights=None):
    emb, head = _frozen()
    n = 2
    ids = dflash_layer_ids(L, n)
    cfg = DFlashConfig(hidden_size=H, num_layers=n, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       vocab_size=V, num_context_layers=len(ids), mask_token_id=V - 1, block_size=block_size,
                       num_anchors=4, rope_theta=50000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = DFlashDraft(cfg, emb, head)
    _perturb(model, 1)
    state = {"consumer_id": "dflash-b4", "draft": "dflash", "draft_config": {**msgspec.to_builtins(cfg),
                                                                             "layer_ids": ids},
             "layer_ids": ids, "plan_id": "plan", "contract_id": "contract"}
    path = _save(run_dir, model, state, weights)
    return model, cfg, ids, path


def _dflash_outputs(model, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    T = 20
    ctx = torch.randn(2, T, model.cfg.num_context_layers, H, generator=g)
    ids = torch.randint(0, V - 1, (2, T), generator=g)
    anchors, valid = sample_anchors(torch.ones(2, T, dtype=torch.bool), 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ctx, ids, anchors, valid), model.infer_block(ctx[:1, :9], ids[0, 9:10])


def _no_leftovers(parent: Path) -> None:
    assert [p.name for p in parent.iterdir() if p.name.startswith(".")] == []


# ------------------------------------------------------------------------------------ DFlash

@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_dflash_export_roundtrip_strict(tmp_path, target_dir, fmt):
    model, cfg, ids, _ = dflash_checkpoint(tmp_path / "run")
    out = tmp_path / f"draft-{fmt}"
    res = export_checkpoint(tmp_path / "run", out, fmt, target=str(target_dir), dtype="float32")
    assert res.draft == "dflash" and sorted(p.name for p in out.iterdir()) == [
        "config.json", "export.json", "model.safetensors"]
    tensors = safetensors.torch.load_file(out / "model.safetensors")
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in DFLASH_KEYS_PER_LAYER}
    assert set(tensors) == want  # no context_norm, no embed_tokens / lm_head (shared from the target)
    emb, head = _frozen()
    fresh, got_ids = load_dflash_export(out, emb, head)
    assert got_ids == ids
    for a, b in zip(_dflash_outputs(model), _dflash_outputs(fresh), strict=True):
        assert torch.equal(a, b)
    _no_leftovers(tmp_path)


def test_dflash_hf_config_fields(tmp_path, target_dir):
    _, cfg, ids, _ = dflash_checkpoint(tmp_path / "run")
    c = export_checkpoint(tmp_path / "run", tmp_path / "d", "hf", target=str(target_dir)).config
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"block_size": 4, "mask_token_id": V - 1, "target_layer_ids": ids,
                                  "use_aux_hidden_state": True}
    assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # input-of-layer = output + 1
    assert (c["num_hidden_layers"], c["num_target_layers"], c["hidden_size"], c["head_dim"]) == (2, L, H, 8)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]) == (4, 2, 48)
    assert c["is_causal"] is False and c["layer_types"] == ["full_attention"] * 2
    assert c["rope_parameters"]["rope_theta"] == 50000.0 and c["rms_norm_eps"] == 1e-5
    assert c["max_position_embeddings"] == 256 and c["dtype"] == "bfloat16"
    t = safetensors.torch.load_file(tmp_path / "d" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    emb, head = _frozen()
    fresh, _ = load_dflash_export(tmp_path / "d", emb, head)
    ref = DFlashDraft(cfg, emb, head)
    ref.load_state_dict(_dflash_state(tmp_path / "run"))
    for k, v in fresh.trainable_state_dict().items():
        assert torch.equal(v, ref.trainable_state_dict()[k].to(torch.bfloat16).float()), k


def _dflash_state(run: Path) -> dict:
    return safetensors.torch.load_file(run / "checkpoints" / "latest" / "model.safetensors")


def test_dflash_speculators_config_fields(tmp_path, target_dir):
    _, cfg, ids, _ = dflash_checkpoint(tmp_path / "run")
    c = export_checkpoint(tmp_path / "run", tmp_path / "d", "speculators", target=str(target_dir)).config
    assert c["speculators_model_type"] == "dflash" and c["architectures"] == ["DFlashSpeculator"]
    assert c["aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # vLLM: target_layer_ids = aux - 1
    sc = c["speculators_config"]
    assert sc["algorithm"] == "dflash" and sc["proposal_methods"][0]["speculative_tokens"] == cfg.block_size - 1
    # regression: the verifier was the target's absolute local path; it is the target's name
    assert sc["verifier"]["name_or_path"] == target_dir.name and "/" not in sc["verifier"]["name_or_path"]
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert c["transformer_layer_config"]["num_hidden_layers"] == 2 and c["mask_token_id"] == V - 1
    assert c["sliding_window_non_causal"] is True  # vLLM 0.32: dflash_config.causal = not this
    assert c["draft_vocab_size"] == V and c["block_size"] == 4


def test_layer_id_conversion_golden_smollm2():
    """SmolLM2-135M (L = 30), 5-layer DFlash: output-of-layer [1, 8, 14, 20, 27] is written as z-lab's
    target_layer_ids unchanged and as vLLM / speculators input-of-layer aux ids [2, 9, 15, 21, 28]."""
    ids = dflash_layer_ids(30, 5)
    assert ids == [1, 8, 14, 20, 27]
    cfg = DFlashConfig(hidden_size=576, num_layers=5, num_heads=9, num_kv_heads=3, head_dim=64,
                       intermediate_size=1536, vocab_size=49152, num_context_layers=5, mask_token_id=3,
                       block_size=16)
    tc = types.SimpleNamespace(num_hidden_layers=30, hidden_size=576, vocab_size=49152, max_position_embeddings=8192,
                               architectures=["LlamaForCausalLM"])
    hf = dflash_export_config(cfg, ids, tc, "hf")
    sp = dflash_export_config(cfg, ids, tc, "speculators")
    assert hf["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert hf["eagle_aux_hidden_state_layer_ids"] == sp["aux_hidden_state_layer_ids"] == [2, 9, 15, 21, 28]
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 15
    for c in (hf, sp):
        back, back_ids = dflash_config_from_export(c)
        assert back_ids == ids and back.block_size == 16 and back.num_layers == 5
    bad = json.loads(json.dumps(hf))
    bad["eagle_aux_hidden_state_layer_ids"] = ids  # claims input-of-layer, holds output-of-layer
    with pytest.raises(ConfigError, match=r"\+ 1"):
        dflash_config_from_export(bad)


def test_dflash_export_rejects_wrong_target_and_ids():
    cfg = DFlashConfig(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       vocab_size=V, num_context_layers=2, mask_token_id=V - 1, block_size=4)
    tc = types.SimpleNamespace(num_hidden_layers=L, hidden_size=H + 8, vocab_size=V)
    with pytest.raises(ConfigError, match="hidden_size"):
        dflash_export_config(cfg, [1, 5], tc)
    tc.hidden_size = H
    with pytest.raises(ConfigError, match=r"\[0, 8\)"):
        dflash_export_config(cfg, [1, 8], tc)
    with pytest.raises(ConfigError, match="num_context_layers"):
        dflash_export_config(cfg, [1, 3, 5], tc)
    with pytest.raises(ConfigError, match="bogus"):
        dflash_export_config(cfg, [1, 5], tc, "bogus")


# ------------------------------------------------------------------------------------ EAGLE-3

def eagle3_checkpoint(run_dir: Path, *, vocab_map_in_extra: bool = False):
    """An EAGLE-3 checkpoint; ``vocab_map_in_extra``: its d2t / t2d in extra.safetensors (read the same way),
    so the checkpoint holds every file kind."""
    from artcache.layer_ids import eagle3_capture_ids
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft, vocab_map_from_used

    g = torch.Generator().manual_seed(7)
    cfg = Eagle3Config(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=V,
                       draft_vocab_size=16, ttt_steps=3, rope_theta=50000.0, rms_norm_eps=1e-5)
    used = torch.sort(torch.randperm(V, generator=g)[:16]).values
    d2t, t2d = vocab_map_from_used(used, V)
    emb, head = _frozen()
    norm = torch.rand(H, generator=g) + 0.5
    torch.manual_seed(0)
    model = Eagle3Draft(cfg, emb, norm, head, d2t, t2d)
    _perturb(model, 2)
    ids = eagle3_capture_ids(L)
    state = {"consumer_id": "eagle3", "draft": "eagle3", "draft_config": {**msgspec.to_builtins(cfg),
                                                                          "layer_ids": ids},
             "layer_ids": ids, "plan_id": "plan", "contract_id": "contract"}
    weights, extra = model.trainable_state_dict(), {}
    if vocab_map_in_extra:
        extra = {k: weights.pop(k) for k in ("d2t", "t2d")}
    _save(run_dir, model, state, weights, extra)
    return model, cfg, (emb, norm, head)


def with_weights(target_dir: Path, emb: torch.Tensor, norm: torch.Tensor, head: torch.Tensor) -> Path:
    """``target_dir`` with the frozen tensors the draft was built around as its weights (a resolvable target)."""
    safetensors.torch.save_file({"model.embed_tokens.weight": emb.contiguous(), "model.norm.weight": norm.contiguous(),
                                 "lm_head.weight": head.contiguous()}, str(target_dir / "model.safetensors"))
    return target_dir


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_eagle3_export_roundtrip_strict(tmp_path, target_dir, fmt):
    model, cfg, frozen = eagle3_checkpoint(tmp_path / "run")
    out = tmp_path / "draft"
    res = export_checkpoint(tmp_path / "run", out, fmt, target=str(with_weights(target_dir, *frozen)), dtype="float32")
    assert res.draft == "eagle3"
    tensors = safetensors.torch.load_file(out / "model.safetensors")
    layer = "midlayer." if fmt == "hf" else "layers.0."
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", f"{layer}self_attn.q_proj.weight",
            f"{layer}hidden_norm.weight"} <= set(tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["lm_head.weight"].shape == (16, H)
    c = res.config
    aux = c["eagle_aux_hidden_state_layer_ids"]
    assert aux == [2, L // 2, L - 3]  # output-of-layer [1, L//2-1, L-4] + 1
    if fmt == "speculators":
        assert c["speculators_model_type"] == "eagle3" and c["norm_before_residual"] is False
        assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        # regression: speculators' Eagle3DraftModel reads embed_tokens.weight from the checkpoint
        # (absent, it stayed zeros and its logits were off): the export carries the target's embedding
        assert torch.equal(tensors["embed_tokens.weight"], frozen[0])
    else:
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["draft_vocab_size"] == 16
    fresh, got_aux = load_eagle3_export(out, *frozen)
    assert got_aux == aux
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 12, 3, H, generator=g)
    ids = torch.randint(0, V, (2, 12), generator=g)
    with torch.no_grad():
        for a, b in zip(model(hidden, ids, steps=2), fresh(hidden, ids, steps=2), strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------ CLI and errors

def test_cli_export_and_errors(tmp_path, target_dir):
    dflash_checkpoint(tmp_path / "run")
    runner = CliRunner()
    out = tmp_path / "drafts" / "d"
    args = ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--target", str(target_dir)]
    r = runner.invoke(main, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["draft"] == "dflash"
    before = (out / "model.safetensors").read_bytes()
    # an existing --out is refused and left as it was
    r = runner.invoke(main, [*args, "--format", "speculators"])
    assert r.exit_code == 2 and "--overwrite" in r.output
    assert (out / "model.safetensors").read_bytes() == before and "speculators_model_type" not in (
        out / "config.json").read_text()
    r = runner.invoke(main, [*args, "--format", "speculators", "--overwrite"])
    assert r.exit_code == 0 and "speculators_model_type" in (out / "config.json").read_text()
    # a missing checkpoint
    r = runner.invoke(main, ["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "x"),
                             "--target", str(target_dir)])
    assert r.exit_code == 2 and "nope" in r.output and not (tmp_path / "x").exists()
    # a target of another size
    from transformers import LlamaConfig

    other = tmp_path / "other"
    LlamaConfig(vocab_size=V, hidden_size=H * 2, num_hidden_layers=L, num_attention_heads=4,
                intermediate_size=48).save_pretrained(str(other))
    r = runner.invoke(main, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "y"),
                             "--target", str(other)])
    assert r.exit_code == 2 and "hidden_size" in r.output and not (tmp_path / "y").exists()
    _no_leftovers(tmp_path / "drafts")
    _no_leftovers(tmp_path)


def test_mismatched_checkpoint_weights_are_refused(tmp_path, target_dir):
    model, *_ = dflash_checkpoint(tmp_path / "run")
    weights = dict(model.trainable_state_dict())
    del weights["layers.1.mlp.up_proj.weight"]
    weights["layers.0.self_attn.q_proj.weight"] = weights["layers.0.self_attn.q_proj.weight"][:, :-1].clone()
    weights["extra.bias"] = torch.zeros(3)
    dflash_checkpoint(tmp_path / "bad", weights=weights)
    with pytest.raises(ConfigError) as exc:
        export_checkpoint(tmp_path / "bad", tmp_path / "d", target=str(target_dir))
    msg = str(exc.value)
    assert "layers.1.mlp.up_proj.weight" in msg and "extra.bias" in msg and "layers.0.self_attn.q_proj" in msg
    assert not (tmp_path / "d").exists()
    # a checkpoint of an unknown draft kind, and an unreadable state.json
    ck = tmp_path / "run" / "checkpoints" / "latest"
    state = json.loads((ck / "state.json").read_text())
    write_state(ck, {**state, "draft": "medusa"})
    with pytest.raises(ConfigError, match="medusa"):
        export_checkpoint(ck, tmp_path / "d", target=str(target_dir))
    (ck / "state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        export_checkpoint(ck, tmp_path / "d", target=str(target_dir))
    with pytest.raises(ConfigError, match="bogus"):
        export_checkpoint(ck, tmp_path / "d", "bogus", target=str(target_dir))
    _no_leftovers(tmp_path)


def test_nothing_half_written(tmp_path, target_dir, monkeypatch):
    """A failure while writing leaves no --out (and an existing one untouched with --overwrite)."""
    import artcache.trainers.export as ex

    dflash_checkpoint(tmp_path / "run")
    real = safetensors.torch.save_file

    def failing(tensors, path, metadata=None):
        real({k: tensors[k] for k in list(tensors)[:2]}, path, metadata=metadata)  # a partial file ...
        raise OSError(28, "No space left on device")  # ... then the disk fills up

    monkeypatch.setattr(ex.safetensors.torch, "save_file", failing)
    out = tmp_path / "d"
    with pytest.raises(OSError):
        export_checkpoint(tmp_path / "run", out, target=str(target_dir))
    assert not out.exists()
    _no_leftovers(tmp_path)
    monkeypatch.setattr(ex.safetensors.torch, "save_file", real)
    export_checkpoint(tmp_path / "run", out, target=str(target_dir))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(ex.safetensors.torch, "save_file", failing)
    with pytest.raises(OSError):
        export_checkpoint(tmp_path / "run", out, "speculators", target=str(target_dir), overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    _no_leftovers(tmp_path)


# ------------------------------------------------------------------------------ regressions

def _tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (links as their target, files as their bytes), to show nothing changed."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = ("link:" + str(p.readlink())) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def _training_run(run: Path) -> Path:
    """A DFlash checkpoint in ``run`` plus the other things a consumer run holds."""
    *_, path = dflash_checkpoint(run)
    (run / "metrics.csv").write_text("step,loss\n1,2.0\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out").write_bytes(b"\x00events")
    return path


def _one_line_error(r, *needles: str, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    assert isinstance(r.exception, SystemExit), r.exception  # no traceback
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcache: error:"), r.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_regression_export_refuses_out_overlapping_the_checkpoint_or_run(tmp_path, target_dir):
    """`export --checkpoint RUN --out RUN --overwrite` used to delete the training run and write the
    export there. An --out that is, contains or is inside the checkpoint or its run directory (after
    resolving links) is refused, with or without --overwrite, and nothing is touched."""
    run = tmp_path / "runs" / "dflash-0"
    step = _training_run(run)
    (tmp_path / "link-to-run").symlink_to(run)
    before = _tree(tmp_path)
    runner = CliRunner()
    outs = [run, step, run / "checkpoints", run / "checkpoints" / "latest", tmp_path / "runs", tmp_path,
            run / "export", step / "sub", tmp_path / "link-to-run", tmp_path / "link-to-run" / "x"]
    for ckpt in (run, run / "checkpoints" / "latest", step):
        for out in outs:
            for extra in ([], ["--overwrite"]):
                r = runner.invoke(main, ["export", "--checkpoint", str(ckpt), "--out", str(out),
                                         "--target", str(target_dir), *extra])
                line = _one_line_error(r, str(out))
                assert "of checkpoint" in line and "outside" in line, line
                assert _tree(tmp_path) == before, (ckpt, out, extra)
    with pytest.raises(ConfigError, match="run directory"):
        export_checkpoint(run, run, target=str(target_dir), overwrite=True)
    assert _tree(tmp_path) == before


def test_regression_overwrite_replaces_only_a_previous_export(tmp_path, target_dir):
    """--overwrite used to replace any existing path (a regular file became a directory; a non-export
    directory was deleted). Only a previous export directory (holding export.json) is replaced now."""
    dflash_checkpoint(tmp_path / "run")
    runner = CliRunner()
    base = ["export", "--checkpoint", str(tmp_path / "run"), "--target", str(target_dir), "--overwrite"]
    other_run = tmp_path / "other-run"
    _training_run(other_run)
    plain = tmp_path / "notes"
    plain.mkdir()
    (plain / "keep.txt").write_text("precious")
    empty = tmp_path / "empty"
    empty.mkdir()
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"not a directory")
    prev = tmp_path / "prev"
    assert runner.invoke(main, [*base[:-1], "--out", str(prev)]).exit_code == 0
    (tmp_path / "link-to-prev").symlink_to(prev)
    before = _tree(tmp_path)
    for out, kind in ((other_run, "a directory"), (plain, "a directory"), (empty, "a directory"),
                      (afile, "a regular file"), (tmp_path / "link-to-prev", "a symbolic link")):
        r = runner.invoke(main, [*base, "--out", str(out)])
        _one_line_error(r, str(out), kind, "not a previous export", "export.json")
        assert _tree(tmp_path) == before, out
    assert afile.is_file() and afile.read_bytes() == b"not a directory"
    # a previous export is replaced, atomically (no temp or old directory left beside it)
    r = runner.invoke(main, [*base, "--out", str(prev), "--format", "speculators"])
    assert r.exit_code == 0, r.output
    assert "speculators_model_type" in (prev / "config.json").read_text()
    assert json.loads((prev / "export.json").read_text())["exported_by"] == "artcache export"
    _no_leftovers(tmp_path)
    # without --overwrite an existing path is refused as before, naming what would be accepted
    r = runner.invoke(main, [*base[:-1], "--out", str(afile)])
    _one_line_error(r, str(afile), "--overwrite", "previous export")


def test_regression_out_parent_not_a_writable_directory_is_one_line_error(tmp_path, target_dir):
    """`--out /proc/x` and `--out some-file/x` used to raise FileNotFoundError / NotADirectoryError
    tracebacks. They are one-line errors (exit 2) naming the path, and nothing is written."""
    dflash_checkpoint(tmp_path / "run")
    afile = tmp_path / "afile"
    afile.write_text("x")
    before = _tree(tmp_path)
    runner = CliRunner()
    outs = [afile / "x", afile / "a" / "b"]
    if Path("/proc/self").is_dir():
        outs += [Path("/proc/x"), Path("/proc/a/b")]
    for out in outs:
        for extra in ([], ["--overwrite"]):
            r = runner.invoke(main, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out),
                                     "--target", str(target_dir), *extra])
            _one_line_error(r, str(out))
            assert "writable directory" in r.output, r.output
            assert not os.path.lexists(out)
            assert _tree(tmp_path) == before


def test_regression_failed_export_removes_parents_it_created(tmp_path, target_dir, monkeypatch):
    """An export failing on a full disk left the parent directories it had created for ``--out``; it removes them
    and re-raises."""
    import artcache.trainers.export as ex

    dflash_checkpoint(tmp_path / "run")

    def failing(tensors, path, metadata=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ex.safetensors.torch, "save_file", failing)
    with pytest.raises(OSError):
        export_checkpoint(tmp_path / "run", tmp_path / "new" / "deeper" / "d", target=str(target_dir))
    assert not (tmp_path / "new").exists()
    _no_leftovers(tmp_path)


@pytest.fixture
def weighted_targets(target_dir, tmp_path) -> tuple[Path, Path]:
    """Two tiny random Llama targets of ``target_dir``'s config with weights (different seeds, so
    different weights digests), like conftest's ``tiny_target`` but of this file's sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dirs = []
    for seed in (0, 1):
        d = tmp_path / f"tiny-target-{seed}"
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig.from_pretrained(str(target_dir))).save_pretrained(str(d))
        dirs.append(d)
    return dirs[0], dirs[1]


def _record_target(ckpt: Path, name: str | None, digest: str | None) -> None:
    """Write target_name / target_weights_digest into a checkpoint's state.json, as the consumer does."""
    state = json.loads((ckpt / "state.json").read_text())
    state.pop("target_name", None)
    state.pop("target_weights_digest", None)
    if name is not None:
        state["target_name"] = name
    if digest is not None:
        state["target_weights_digest"] = digest
    write_state(ckpt, state)


def test_regression_target_defaults_to_the_checkpoint_record(tmp_path, target_dir, weighted_targets):
    """--target used to default to smollm2-135m-instruct whatever the checkpoint was trained for. It
    defaults to the checkpoint's recorded target_name now; an explicit target with another weights
    digest is refused naming both."""
    from artcache.target import resolve_target

    good, other = weighted_targets
    good_digest, other_digest = resolve_target(str(good)).weights_digest, resolve_target(str(other)).weights_digest
    assert good_digest != other_digest
    *_, step = dflash_checkpoint(tmp_path / "run")
    runner = CliRunner()
    base = ["export", "--checkpoint", str(tmp_path / "run")]
    _record_target(step, str(good), good_digest)
    r = runner.invoke(main, [*base, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a" / "export.json").read_text())["target"] == str(good.resolve())
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_target_layers"] == L
    # an explicit target: the same one, or a config-only directory (no digest at hand), is accepted
    assert runner.invoke(main, [*base, "--out", str(tmp_path / "b"), "--target", str(good)]).exit_code == 0
    assert runner.invoke(main, [*base, "--out", str(tmp_path / "c"), "--target", str(target_dir)]).exit_code == 0
    # ... one with other weights is refused, naming both digests
    r = runner.invoke(main, [*base, "--out", str(tmp_path / "d"), "--target", str(other)])
    _one_line_error(r, str(other), good_digest, other_digest)
    assert not (tmp_path / "d").exists()
    # the recorded name resolving to other weights is refused too
    _record_target(step, str(other), good_digest)
    r = runner.invoke(main, [*base, "--out", str(tmp_path / "e")])
    _one_line_error(r, good_digest, other_digest, "--target")
    # no recorded target, or a recorded name that resolves to nothing here: say to pass --target
    _record_target(step, None, None)
    r = runner.invoke(main, [*base, "--out", str(tmp_path / "f")])
    _one_line_error(r, "target_name", "--target")
    _record_target(step, "tiny-target-gone", good_digest)
    r = runner.invoke(main, [*base, "--out", str(tmp_path / "g")])
    _one_line_error(r, "tiny-target-gone", "--target")
    # a target given as a directory is recorded by base name (target_name) and path (target_path): the
    # path finds it again, so --target is not needed (it used to be)
    state = json.loads((step / "state.json").read_text())
    state["target_name"], state["target_path"] = good.name, str(good)
    write_state(step, state)
    r = runner.invoke(main, [*base, "--out", str(tmp_path / "h")])
    assert r.exit_code == 0, r.output
    prov = json.loads((tmp_path / "h" / "export.json").read_text())  # the name, never the local path
    assert prov["target"] == prov["target_name"] == good.name and prov["target_weights_digest"] == good_digest
    assert not any((tmp_path / n).exists() for n in "defg")
    _no_leftovers(tmp_path)


def test_regression_eagle3_hidden_size_mismatch_says_pass_target(tmp_path):
    """An EAGLE-3 export against a target of another hidden size must be a ConfigError naming hidden_size and
    telling the user to pass ``--target``, and leave no ``--out`` behind."""
    from transformers import LlamaConfig

    eagle3_checkpoint(tmp_path / "run")
    other = tmp_path / "other"
    LlamaConfig(vocab_size=V, hidden_size=H * 2, num_hidden_layers=L, num_attention_heads=4,
                intermediate_size=48).save_pretrained(str(other))
    with pytest.raises(ConfigError, match=r"hidden_size.*--target"):
        export_checkpoint(tmp_path / "run", tmp_path / "d", target=str(other))
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_regression_exported_files_are_readable_by_others(tmp_path, target_dir, umask):
    """model.safetensors used to be written 0600 (safetensors' own mode) beside a 0644 config.json: a
    serving process of another user could not read the weights. Every file is 0666 & ~umask now."""
    dflash_checkpoint(tmp_path / "run")
    old = os.umask(umask)
    try:
        export_checkpoint(tmp_path / "run", tmp_path / "d", target=str(target_dir))
        export_checkpoint(tmp_path / "run", tmp_path / "d", "speculators", target=str(target_dir), overwrite=True)
    finally:
        os.umask(old)
    files = sorted((tmp_path / "d").iterdir())
    assert [p.name for p in files] == ["config.json", "export.json", "model.safetensors"]
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, (p.name, oct(p.stat().st_mode))
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o777 & ~umask


@pytest.mark.parametrize("kind,damage", [("model.safetensors", "flip"), ("extra.safetensors", "flip"),
                                         ("state.json", "flip"), ("model.safetensors", "truncate"),
                                         ("optimizer.safetensors", "flip"), ("rng.safetensors", "flip")])
def test_regression_export_refuses_a_checkpoint_file_that_does_not_match_its_digest(tmp_path, target_dir, kind,
                                                                                    damage):
    """A checkpoint whose model.safetensors had a byte flipped on disk (inside a tensor's data, so
    safetensors loads it) was exported with garbage weights and exit 0. Export now checks state.json and the
    files it reads against the digests recorded at save: one line naming the file and the expected and actual
    digest, exit 1, nothing written. The optimizer and RNG state are not exported: damage there leaves the
    exported weights intact, and the export goes ahead."""
    from artcache.hashing import digest_file
    from artcache.trainers.checkpoint import find_checkpoint, read_state

    model, _, frozen = eagle3_checkpoint(tmp_path / "run", vocab_map_in_extra=True)
    step = find_checkpoint(tmp_path / "run")
    assert sorted(p.name for p in step.iterdir()) == ["extra.safetensors", "model.safetensors",
                                                     "optimizer.safetensors", "rng.safetensors", "state.json"]
    rec = read_state(step).digests
    (flip_byte if damage == "flip" else truncate)(step / kind)
    out = tmp_path / "exports" / "d"
    args = ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--dtype", "float32",
            "--target", str(with_weights(target_dir, *frozen))]
    r = CliRunner().invoke(main, args)
    if kind in ("optimizer.safetensors", "rng.safetensors"):
        assert r.exit_code == 0, r.output
        got = safetensors.torch.load_file(out / "model.safetensors")
        assert torch.equal(got["fc.weight"], model.trainable_state_dict()["fc.weight"])
        return
    line = _one_line_error(r, f"CheckpointCorrupt: checkpoint file {step / kind} does not match", code=1)
    if kind == "state.json":
        assert f"expected xxh3_128 {rec.state}, actual " in line
    else:
        want = rec.files[kind]
        size = (step / kind).stat().st_size
        assert f"expected xxh3_128 {want.digest} ({want.size:,} B), actual {digest_file(step / kind)} ({size:,} B)" \
            in line
    assert not out.exists() and not out.parent.exists()
    _no_leftovers(tmp_path)


def test_regression_export_of_a_checkpoint_without_digests_warns_that_it_is_unverified(tmp_path, target_dir,
                                                                                       caplog):
    """A checkpoint written before digests were recorded is still exported (exit 0), with one warning."""
    dflash_checkpoint(tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "latest"
    doc = json.loads((step / "state.json").read_text())
    del doc["digests"]
    (step / "state.json").write_text(json.dumps(doc))
    with caplog.at_level("WARNING", logger="artcache.consumer"):
        r = CliRunner().invoke(main, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "d"),
                                      "--target", str(target_dir)])
    assert r.exit_code == 0, r.output
    warned = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert warned == [f"checkpoint {step.resolve()} records no content digests (written before artcache recorded "
                      "them): its files are used unverified"]


def test_regression_export_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, target_dir, monkeypatch):
    """`artcache export` onto a full tmpfs printed safetensors' raw traceback
    (`SafetensorError: ... No space left on device (os error 28)`). Now one line naming the errno, exit 1, no
    temp directory and no --out left."""
    import artcache.trainers.export as export_mod

    _, _, frozen = eagle3_checkpoint(tmp_path / "run")
    real = export_mod.safetensors.torch.save_file

    def full(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        if ".d.tmp-" not in str(path):  # only the export's own writes (not the test's target fixture)
            return
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                          "message: \"No space left on device\" }) (os error 28)")

    monkeypatch.setattr(export_mod.safetensors.torch, "save_file", full)
    out = tmp_path / "exports" / "d"
    r = CliRunner().invoke(main, ["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out), "--dtype",
                                  "float32", "--target", str(with_weights(target_dir, *frozen))])
    _one_line_error(r, f"export to {out} could not be written", "No space left on device",
                    "free space on that filesystem", code=1)
    assert not out.exists() and not (tmp_path / "exports").exists()


_KILLED_EXPORT = """
import os, signal, sys
import artcache.trainers.export as ex
how, ckpt, out, target = sys.argv[1:]
if how == "mid-write":  # SIGKILL while model.safetensors is half written in the temp directory
    real = ex.safetensors.torch.save_file
    def dying(tensors, path, metadata=None):
        real({k: tensors[k] for k in list(tensors)[:1]}, path, metadata=metadata)
        os.kill(os.getpid(), signal.SIGKILL)
    ex.safetensors.torch.save_file = dying
else:  # SIGKILL after the new export is in place, before the one renamed aside is removed
    import artcache.fsio as fsio  # publish_dir, which removes the old export once the new one is in place
    fsio.shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
ex.export_checkpoint(ckpt, out, target=target, overwrite=how != "mid-write")
"""


def test_regression_export_killed_mid_write_leaves_no_temp_behind_the_next_export(tmp_path, target_dir):
    """Tidy item 2: `artcache export` killed with SIGKILL mid-write left `.<out>.tmp-<writer>.<nonce>/` (up to a
    whole draft's bytes) beside --out for ever, and one killed before removing the export it replaced left
    `.<out>.old-<writer>.<nonce>/`. The next export to that --out removes a dead writer's, and leaves a live
    writer's and a name artcache does not make alone."""
    import subprocess
    import sys

    from artcache.layout import unique_suffix

    dflash_checkpoint(tmp_path / "run")
    out = tmp_path / "d"

    def killed(how: str) -> set[str]:
        before = {p.name for p in tmp_path.iterdir()}
        proc = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, how, str(tmp_path / "run"), str(out),
                               str(target_dir)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr
        return {p.name for p in tmp_path.iterdir()} - before

    left = killed("mid-write")
    assert len(left) == 1 and next(iter(left)).startswith(".d.tmp-") and not out.exists(), left
    assert any(f.stat().st_size for f in (tmp_path / next(iter(left))).iterdir())  # the killed writer's bytes
    live, foreign = tmp_path / f".d.tmp-{unique_suffix()}", tmp_path / ".d.tmp-not-ours"  # this (live) process's
    live.mkdir()
    foreign.write_bytes(b"x")
    export_checkpoint(tmp_path / "run", out, target=str(target_dir))
    keep = {live.name, foreign.name}
    assert {p.name for p in tmp_path.iterdir() if p.name.startswith(".")} == keep
    left = killed("after-swap")
    assert len(left) == 1 and next(iter(left)).startswith(".d.old-") and (out / "export.json").is_file(), left
    export_checkpoint(tmp_path / "run", out, "speculators", target=str(target_dir), overwrite=True)
    assert {p.name for p in tmp_path.iterdir() if p.name.startswith(".")} == keep
    assert "speculators_model_type" in (out / "config.json").read_text()
