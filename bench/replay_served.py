"""Offline greedy replay of exported drafts on the sequences vLLM generated, two ways: the evaluation's mean
over positions, and a serving-style walk. It separates what the data change from what the averaging changes
when the offline held-out τ is put beside vLLM's mean acceptance length (docs/training.md, "Served by vLLM").

Input: the stdout of one ``tests/support/vllm_spec_decode.py`` run of the target alone (``--run``: its
``prompt_token_ids`` and ``output_token_ids``); the sequences are prompt + output, supervised on the output
tokens. The target (transformers, ``--dtype``) gives the captured layers (output-of-layer ``i`` =
``hidden_states[i + 1]``) and its greedy token at every position (the argmax of its logits); the drafts are
rebuilt from their export directories alone (``load_dflash_export`` / ``load_eagle3_export``).

For every position whose first proposal is supervised, the draft's proposals are walked against the target's
greedy token exactly as the held-out evaluation walks them (:func:`artcache.trainers.draft.replay_accepted`;
DFlash: all B-1 slots of the block anchored there, EAGLE-3: the TTT steps from there). Then:

- ``replay_tau`` = 1 + mean over **all** those positions of the accepted count: the offline figure's
  definition (**incl. +1 bonus**), here on vLLM's own greedy text (DFlash: every anchor, not the
  evaluation's 64 evenly spaced ones);
- ``walk_tau`` = 1 + accepted / drafts over the positions a greedy speculative decoder **visits**: start at
  the first supervised position, accept ``a`` there, continue at ``a + 1`` positions further (the bonus token
  is the next anchor), as vLLM does; **incl. +1 bonus**. A position is visited with probability about
  ``1 / (a + 1)``, so ``walk_tau`` is close to the harmonic mean of ``1 + a`` where ``replay_tau`` is the
  arithmetic mean: long accepted runs count once per draft in serving, once per position offline.

Also per position k: ``walk_accepted_per_pos`` (drafts whose first k+1 proposals were accepted, vLLM's
``accepted_per_pos``). Output: one JSON line ``REPLAY_SERVED <json>`` and ``--out``.

Run: ``python -m artcache.bench.replay_served --target DIR --run base.out --dflash DIR --eagle3 DIR --out F``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RESULT_PREFIX = "VLLM_SPEC_RESULT "


def walk(accepted: list[int], start: int = 0) -> tuple[int, int, list[int]]:
    """Serving-style walk over per-position accepted counts (``accepted[i]`` for the i-th position, in order,
    consecutive): from ``start``, take ``accepted[i]`` and jump ``accepted[i] + 1`` positions.

    Returns:
        (drafts, accepted tokens, per-position counts: drafts whose first k+1 proposals were accepted).
    """
    drafts = total = 0
    per_pos: list[int] = []
    i = start
    while i < len(accepted):
        a = int(accepted[i])
        drafts += 1
        total += a
        per_pos += [0] * max(0, a - len(per_pos))
        for k in range(a):
            per_pos[k] += 1
        i += a + 1
    return drafts, total, per_pos


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from artcache.target import load_embedding_and_lm_head, load_final_norm, resolve_target
    from artcache.trainers.dflash.adapter import replay_inputs as dflash_replay_inputs
    from artcache.trainers.dflash.anchors import eligible_anchors
    from artcache.trainers.dflash.export import load_dflash_export
    from artcache.trainers.draft import replay_accepted
    from artcache.trainers.eagle3.adapter import replay_inputs as eagle3_replay_inputs
    from artcache.trainers.eagle3.export import load_eagle3_export

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--run", required=True, type=Path, help="stdout of tests/support/vllm_spec_decode.py (no draft)")
    ap.add_argument("--dflash", default=None, help="DFlash export directory")
    ap.add_argument("--eagle3", default=None, help="EAGLE-3 export directory (with embed_tokens.weight or not)")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype (the drafts run in float32)")
    ap.add_argument("--prompts", type=int, default=None, help="the first N sequences only")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    lines = [ln[len(RESULT_PREFIX):] for ln in a.run.read_text().splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        print(f"--run {str(a.run)!r}: no {RESULT_PREFIX.strip()} line", file=sys.stderr)
        return 2
    run = json.loads(lines[-1])
    seqs = list(zip(run["prompt_token_ids"], run["output_token_ids"], strict=True))[: a.prompts]

    info = resolve_target(a.target)
    target = AutoModelForCausalLM.from_pretrained(info.path, dtype=getattr(torch, a.dtype)).eval()
    emb, head = load_embedding_and_lm_head(info)
    drafts = {}
    if a.dflash:
        drafts["dflash"] = load_dflash_export(a.dflash, emb, head)
    if a.eagle3:
        drafts["eagle3"] = load_eagle3_export(a.eagle3, emb, load_final_norm(info), head)
    res: dict = {name: {"accepted_sum": 0, "positions": 0, "truncated": 0, "drafts": 0, "walk_accepted": 0,
                        "walk_accepted_per_pos": []} for name in drafts}
    greedy_agree = greedy_total = 0
    t0 = time.time()
    with torch.no_grad():
        for prompt, output in seqs:
            if len(output) < 2:
                continue
            ids = torch.tensor([prompt + output])
            T = ids.shape[1]
            lm = torch.zeros(1, T, dtype=torch.bool)
            lm[0, len(prompt):] = True
            valid = torch.ones(1, T, dtype=torch.bool)
            out = target(ids, output_hidden_states=True)
            hs = [h.float() for h in out.hidden_states]
            g = out.logits.argmax(dim=-1)  # [1, T]: the target's greedy token after x_<=t
            greedy_agree += int((g[0, len(prompt) - 1:T - 1] == ids[0, len(prompt):]).sum())
            greedy_total += T - len(prompt)
            for name, (model, layer_ids) in drafts.items():
                if name == "dflash":
                    ctx = torch.stack([hs[i + 1] for i in layer_ids], dim=2)
                    anchors = eligible_anchors(lm)[0].nonzero().squeeze(1)[None]  # every eligible anchor, in order
                    acc, trunc = [], []
                    for s in range(0, anchors.shape[1], 64):
                        an = anchors[:, s:s + 64]
                        h = model(ctx, ids, an, torch.ones_like(an, dtype=torch.bool), context_valid=valid)
                        x, t = replay_accepted(*dflash_replay_inputs(model, h, ids, lm, an, g))
                        acc.append(x)
                        trunc.append(t)
                    accepted, truncated = torch.cat(acc), torch.cat(trunc)
                else:
                    aux = torch.stack([hs[i] for i in layer_ids], dim=2)  # vLLM ids are input-of-layer
                    walked = eagle3_replay_inputs(model, aux, ids, lm, valid, g, model.cfg.ttt_steps)
                    if walked is None:
                        continue
                    rows = walked[0]
                    if not bool((rows[1:] - rows[:-1] == 1).all()):
                        raise RuntimeError("EAGLE-3 replay rows are not consecutive positions")
                    accepted, truncated = replay_accepted(*walked[1:])
                r = res[name]
                r["accepted_sum"] += int(accepted.sum())
                r["positions"] += int(accepted.numel())
                r["truncated"] += int(truncated.sum())
                n, tot, per = walk(accepted.tolist())
                r["drafts"] += n
                r["walk_accepted"] += tot
                pp = r["walk_accepted_per_pos"]
                pp += [0] * max(0, len(per) - len(pp))
                for k, v in enumerate(per):
                    pp[k] += v
    summary = {"sequences": len(seqs), "target_dtype": a.dtype, "draft_dtype": "float32", "seconds": time.time() - t0,
               "target_greedy_agrees_with_vllm_output": greedy_agree / max(greedy_total, 1), "drafts": {}}
    for name, r in res.items():
        summary["drafts"][name] = {
            "replay_tau": 1 + r["accepted_sum"] / r["positions"], "positions": r["positions"],
            "replay_truncated_frac": r["truncated"] / r["positions"],
            "walk_tau": 1 + r["walk_accepted"] / r["drafts"], "walk_drafts": r["drafts"],
            "walk_accepted_per_pos": r["walk_accepted_per_pos"], "tau_includes_bonus": True}
    print("REPLAY_SERVED " + json.dumps(summary), flush=True)
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
