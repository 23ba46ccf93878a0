"""artcache's speculators-format EAGLE-3 and DFlash exports loaded by vllm-project/speculators' own loader (the
``speculators`` lane: ``.ci/speculators-lane``, or ``ARTCACHE_SPECULATORS_PYTHON=... pytest -m speculators``).

Each test builds an EAGLE-3 draft (random weights, every tensor perturbed so a misnamed or misplaced one
changes the output) around a tiny random Llama target (vocab 40, hidden 32, 8 layers; weights on disk, so
speculators can read its verifier from the directory), exports it with ``--format speculators``, runs
``tests/support/speculators_draft_logits.py`` with the Python named by ``$ARTCACHE_SPECULATORS_PYTHON`` (it loads
the export with ``SpeculatorModel.from_pretrained`` and runs ``Eagle3DraftModel.forward``), and asserts that
speculators loads every tensor (no unexpected key; missing only the verifier tensors it reads from the
verifier; nothing left NaN) and that its per-TTT-step logits equal artcache's on the same inputs.

Input conventions bridged here (and documented in docs/export.md): artcache's step 0 at position t reads
the hidden state at t and the token ``input_ids[t + 1]``; speculators' reads ``input_ids[t]``, so it is
fed ``input_ids`` shifted left by one (pad 0, as artcache pads). Positions: artcache's RoPE position of
step i at t is ``t + i``, speculators' default ``1 + t + i``; RoPE scores depend only on position
differences, so the default is used unchanged. Hidden states: artcache's [b, T, 3, H] is speculators'
[1, T, 3H] (concatenated in ``eagle_aux_hidden_state_layer_ids`` order).

Tolerance: both sides compute in float32 (a bf16 export is upcast on load by both, from the same
bf16-rounded weights), so the only difference is summation order in attention / matmuls: atol 1e-4,
rtol 1e-4 on logits of magnitude ~1-5 (measured: about 3e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch

from artcache.trainers.eagle3.export import load_eagle3_export
from artcache.trainers.eagle3.model import ttt_input_ids
from artcache.trainers.export import export_checkpoint
from tests.support import SUPPORT
from tests.unit.test_export import H, V, eagle3_checkpoint, make_target_dir, with_weights

SCRIPT = SUPPORT / "speculators_draft_logits.py"
STEPS = 3
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def speculators_python() -> str:
    py = os.environ.get("ARTCACHE_SPECULATORS_PYTHON")
    if not py:
        pytest.skip("ARTCACHE_SPECULATORS_PYTHON is not set (a Python that imports speculators==0.9.0; "
                    ".ci/speculators-lane makes one)")
    try:
        proc = subprocess.run([py, "-c", "import speculators"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"ARTCACHE_SPECULATORS_PYTHON={py!r} cannot be run ({exc})")
    if proc.returncode != 0:
        pytest.skip(f"ARTCACHE_SPECULATORS_PYTHON={py!r} does not import speculators: {proc.stderr.strip()[-300:]}")
    return py


def run_speculators(py: str, draft: Path, inputs: Path, out: Path, *extra: str) -> dict:
    """Run the loader script; its SPECULATORS_RESULT json (the logits are in ``out``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([py, str(SCRIPT), "--draft", str(draft), "--inputs", str(inputs), "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    prefix = "SPECULATORS_RESULT "
    lines = [ln[len(prefix):] for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("dtype,attn,T", [("float32", None, 128), ("bfloat16", "eager", 20)])
def test_speculators_loads_eagle3_export_with_equal_logits(tmp_path, speculators_python, dtype, attn, T):
    """The export loads in speculators' Eagle3DraftModel and gives artcache's logits at every TTT step.
    float32 with speculators' default flex attention (T a multiple of its 128 block); the default bf16
    export with eager attention at a T that is not."""
    model, cfg, (emb, norm, head) = eagle3_checkpoint(tmp_path / "run")
    target = with_weights(make_target_dir(tmp_path / "target"), emb, norm, head)
    out = tmp_path / "draft"
    res = export_checkpoint(tmp_path / "run", out, "speculators", target=str(target), dtype=dtype)
    assert res.config["speculators_config"]["verifier"]["name_or_path"] == target.name  # a name, not a path
    if dtype == "float32":
        ref_model = model  # the trained draft itself
    else:  # both sides read the same bf16-rounded tensors (the embedding included), computed in float32
        ref_model, _ = load_eagle3_export(out, emb.to(torch.bfloat16).float(), norm, head)

    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(1, T, 3, H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        want = torch.stack([ref_model.draft_logits(h) for h in ref_model(hidden, ids, steps=STEPS)]).float()
    inputs = tmp_path / "inputs.safetensors"
    safetensors.torch.save_file({"hidden_states": hidden.reshape(1, T, 3 * H).contiguous(),
                                 "input_ids": ttt_input_ids(ids, 0).contiguous()}, str(inputs))
    extra = ["--verifier", str(target), "--ttt-steps", str(STEPS)] + (["--attn-implementation", attn] if attn else [])
    got_path = tmp_path / "logits.safetensors"
    info = run_speculators(speculators_python, out, inputs, got_path, *extra)

    assert info["model_class"] == "Eagle3DraftModel"
    assert info["unexpected"] == [], info  # every exported tensor has a home in speculators' model
    assert set(info["missing"]) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, info  # read from verifier
    assert info["nan_parameters"] == [], info  # embed_tokens / lm_head start NaN in speculators: all loaded
    got = safetensors.torch.load_file(str(got_path))["logits"]
    assert got.shape == (STEPS, 1, T, cfg.draft_vocab_size)
    diff = (got - want).abs().max().item()
    print(f"\n[eagle3/speculators {dtype}, attn {info['attn_implementation']}, T={T}] max |logit diff| "
          f"{diff:.3g} (logits up to {want.abs().max().item():.3g})")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_speculators_refuses_an_unresolvable_verifier_name(tmp_path, speculators_python):
    """The loader contract: speculators resolves the verifier the export names (artcache writes the target's
    name, not its local path); a name that is neither a hub id it can reach nor a directory is refused, which
    is why a converted target's directory is passed as --verifier (docs/export.md)."""
    model, cfg, (emb, norm, head) = eagle3_checkpoint(tmp_path / "run")
    target = with_weights(make_target_dir(tmp_path / "target"), emb, norm, head)
    out = tmp_path / "draft"
    export_checkpoint(tmp_path / "run", out, "speculators", target=str(target), dtype="float32")
    T = 128
    inputs = tmp_path / "inputs.safetensors"
    safetensors.torch.save_file({"hidden_states": torch.zeros(1, T, 3 * H), "input_ids": torch.zeros(1, T,
                                                                                                   dtype=torch.long)},
                                str(inputs))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([speculators_python, str(SCRIPT), "--draft", str(out), "--inputs", str(inputs),
                           "--out", str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=900,
                          env=env, cwd=out)  # not tmp_path: it holds a directory named like the target
    assert proc.returncode == 1 and "speculators refused" in proc.stderr, proc.stderr[-3000:]


def test_speculators_loads_dflash_export_with_equal_logits(tmp_path, speculators_python):
    """The DFlash speculators export loads in speculators' DFlashDraftModel (its embedding and full-vocab
    lm_head rebuilt from the verifier, as speculators does for DFlash) and gives artcache's block logits.

    speculators' DFlash forward is its training step: it draws anchors among the ``loss_mask`` positions
    (the last block_size excluded); the script makes every such position an anchor (deterministic), and
    artcache's draft is run on the same anchors. Block n = ``[x_p, MASK x (B-1)]`` at positions p..p+B-1,
    seeing the context before p, in both. Eager attention (speculators' flex path compiles its block mask).
    """
    from tests.unit.test_export import dflash_checkpoint

    model, cfg, _ids, _path = dflash_checkpoint(tmp_path / "run")
    emb, head = model.embed_weight, model.lm_head_weight
    target = with_weights(make_target_dir(tmp_path / "target"), emb, torch.ones(H), head)
    out = tmp_path / "draft"
    export_checkpoint(tmp_path / "run", out, "speculators", target=str(target), dtype="float32")
    T = 20
    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(1, T, cfg.num_context_layers, H, generator=g)
    ids = torch.randint(0, V - 1, (1, T), generator=g)
    inputs = tmp_path / "inputs.safetensors"
    safetensors.torch.save_file({"hidden_states": ctx.reshape(1, T, -1).contiguous(), "input_ids": ids}, str(inputs))
    got_path = tmp_path / "logits.safetensors"
    info = run_speculators(speculators_python, out, inputs, got_path, "--verifier", str(target),
                           "--attn-implementation", "eager")

    assert info["model_class"] == "DFlashDraftModel" and info["mask_token_id"] == cfg.mask_token_id
    assert info["unexpected"] == [], info
    # DFlash checkpoints omit what speculators rebuilds from the verifier (a full-vocabulary draft's lm_head too)
    assert set(info["missing"]) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                    "verifier_norm.weight"}, info
    assert info["nan_parameters"] == [], info
    got = safetensors.torch.load_file(str(got_path))
    anchors = got["anchors"]
    assert anchors.tolist() == list(range(T - cfg.block_size))
    with torch.no_grad():
        want = model.logits(model(ctx, ids, anchors[None], torch.ones(1, anchors.numel(), dtype=torch.bool)))[0]
    diff = (got["logits"] - want.float()).abs().max().item()
    print(f"\n[dflash/speculators float32, attn eager, T={T}, B={cfg.block_size}] max |logit diff| {diff:.3g} "
          f"(logits up to {want.abs().max().item():.3g})")
    torch.testing.assert_close(got["logits"], want.float(), atol=ATOL, rtol=RTOL)
