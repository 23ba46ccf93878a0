"""Tests for `artcache export`: DFlash and EAGLE-3 checkpoints written as serving-engine draft
directories (hf and speculators formats), read back with strict keys, layer-id conversion, errors and
atomicity."""

from __future__ import annotations

import json
import types
from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from artcache.cli import main
from artcache.errors import ConfigError
from trainers.checkpoint import point_latest, save_checkpoint
from trainers.dflash import DFlashConfig, DFlashDraft, dflash_layer_ids, sample_anchors
from trainers.export import (
    dflash_config_from_export,
    dflash_export_config,
    export_checkpoint,
    load_dflash_export,
    load_eagle3_export,
)

V, H, L = 40, 32, 8  # tiny target: vocab, width, decoder layers
DFLASH_KEYS_PER_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


@pytest.fixture
def target_dir(tmp_path) -> Path:
    """A target config directory (config.json only: export needs no target weights)."""
    from transformers import LlamaConfig

    d = tmp_path / "target"
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


def _save(run_dir: Path, model, state: dict, weights=None) -> Path:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    path = save_checkpoint(run_dir, step=3, cursor=6, weights=weights if weights is not None
                           else model.trainable_state_dict(), optimizer=opt, generators={}, extra_tensors={},
                           state=state)
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
    assert sc["verifier"]["name_or_path"] == str(target_dir.resolve())
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

def eagle3_checkpoint(run_dir: Path):
    from trainers.eagle3 import Eagle3Config, Eagle3Draft, eagle3_capture_ids, vocab_map_from_used

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
    _save(run_dir, model, state)
    return model, cfg, (emb, norm, head)


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_eagle3_export_roundtrip_strict(tmp_path, target_dir, fmt):
    model, cfg, frozen = eagle3_checkpoint(tmp_path / "run")
    out = tmp_path / "draft"
    res = export_checkpoint(tmp_path / "run", out, fmt, target=str(target_dir), dtype="float32")
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
    (ck / "state.json").write_text(json.dumps({**state, "draft": "medusa"}))
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
    import trainers.export as ex

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
