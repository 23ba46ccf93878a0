"""Rebuild the held-out prompts of a run trained on ``artcache regenerate`` output, when the regenerated
file itself is gone (it stayed on the GPU machine) but its source ShareGPT shard is at hand.

The chain it reproduces (configs/gpu-smollm2-long.sh, piece 1):

1. the shard: the first ``--shard-lines`` lines of the ShareGPT JSONL file;
2. ``artcache regenerate --max-samples S --max-prompt-tokens P`` kept the records that
   :func:`artcache.data.regenerate.select_prompts` keeps, in file order, one regenerated record each;
3. the plan (:func:`artcache.plan.build_plan`) visits the regenerated records in a
   ``numpy.random.default_rng(seed).permutation(len(records))`` order; every record made a sample (checked
   with ``--plan-len``: the plan's length, e.g. a report's ``epoch_len`` + ``eval_samples``);
4. the held-out split is the plan's **last** ``E`` samples (``artcache.trainers.evaluation.eval_split``).

So the held-out prompts are the selected prompts at ``permutation[-E:]``, in plan order. (Not the file's
last E records: the plan shuffles.) The selection counts are checked against the regenerate summary line
(``--regenerate-summary``: its ``samples``, ``visited``, ``skipped`` and ``prompt_tokens``); a mismatch exits
1 and writes nothing. A run regenerated in consecutive shards of the file (configs/gpu-smollm2-long.sh's
``split -l``, outputs concatenated in shard order) gives one summary line per shard: they are summed and
checked against one selection over all the shards' lines (``--shard-lines`` = their total, ``--max-samples``
at least the summed samples), which is exact when every shard was read to its end (:func:`read_summary`).

Output (``--out``, JSON): ``{"prompts": [[{"role", "content"}, ...], ...]`` (the chat messages before the
first assistant turn, as regenerate rendered them), ``"prompt_token_ids"`` (what regenerate fed the target:
the chat template with ``add_generation_prompt=True``, tokenized without special tokens), ``"record_ids"``,
``"plan_indices"``, ``"file_positions"`` and ``"provenance"``}. tests/vllm_spec_decode.py ``--prompts-file``
reads it.

Run: ``python -m artcache.bench.heldout_prompts --sharegpt FILE(.xz) --target DIR --regenerate-summary
regenerate.jsonl --plan-len 288 --eval-samples 64 --out heldout.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
import tempfile
from pathlib import Path

import numpy as np


def shard_lines(path: Path, n: int) -> bytes:
    """The first ``n`` lines of ``path`` (``.xz`` decompressed with lzma), as bytes."""
    opener = lzma.open if path.suffix == ".xz" else open
    out = []
    with opener(path, "rb") as f:
        for line in f:
            out.append(line)
            if len(out) >= n:
                break
    return b"".join(out)


def read_summary(path: Path) -> dict | str:
    """The regenerate summary to check the selection against: the file's only JSON line, or, for a run
    regenerated in consecutive shards (one line per shard, in shard order), their sums of ``samples``,
    ``visited``, ``prompt_tokens`` and every ``skipped`` reason.

    Summing is exact because :func:`artcache.data.regenerate.select_prompts` judges each record alone; the
    one thing that couples records is its ``max_samples`` stop, so with several lines every shard must have
    been read to its end (``visited == records``): then the shards' selections, concatenated, are one selection
    over all their lines. Returns a one-line reason (a str) instead when that does not hold or a line lacks
    a field.
    """
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        return f"--regenerate-summary {str(path)!r}: no summary line"
    rows = [json.loads(ln) for ln in lines]
    if len(rows) == 1:
        return rows[0]
    total: dict = {"samples": 0, "visited": 0, "skipped": {}, "prompt_tokens": 0}
    for n, row in enumerate(rows, 1):
        missing = [k for k in ("samples", "visited", "records", "skipped", "prompt_tokens") if k not in row]
        if missing:
            return f"--regenerate-summary {str(path)!r} line {n}: no {', '.join(missing)} (needed to sum shards)"
        if row["visited"] != row["records"]:
            return (f"--regenerate-summary {str(path)!r} line {n}: the shard stopped at --max-samples "
                    f"(visited {row['visited']} of {row['records']} records), so the shards' selections are not "
                    "one selection over all their lines")
        for k in ("samples", "visited", "prompt_tokens"):
            total[k] += row[k]
        for reason, count in row["skipped"].items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + count
    return total


def main(argv: list[str] | None = None) -> int:
    from artcache.data.regenerate import select_prompts
    from artcache.data.sharegpt import read_sharegpt
    from artcache.trainers.evaluation import eval_split

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sharegpt", required=True, type=Path, help="ShareGPT JSONL (.xz allowed)")
    ap.add_argument("--shard-lines", type=int, default=512)
    ap.add_argument("--target", required=True, help="target directory with the tokenizer")
    ap.add_argument("--max-samples", type=int, default=512, help="regenerate's --max-samples")
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--regenerate-summary", type=Path, required=True,
                    help="regenerate's JSON summary: one line, or one line per consecutive shard (summed)")
    ap.add_argument("--plan-seed", type=int, default=0, help="the plan's shuffle seed (data.seed)")
    ap.add_argument("--plan-len", type=int, required=True, help="the plan's length (epoch_len + eval_samples)")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.target)
    data = shard_lines(a.sharegpt, a.shard_lines)
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as tmp:
        tmp.write(data)
        tmp.flush()
        records = read_sharegpt(tmp.name).records
    prompts, skipped, visited = select_prompts(records, tok, max_samples=a.max_samples,
                                               max_prompt_tokens=a.max_prompt_tokens)
    summary = read_summary(a.regenerate_summary)
    if isinstance(summary, str):
        print(f"heldout_prompts: {summary}", file=sys.stderr)
        return 1
    got = {"samples": len(prompts), "visited": visited, "skipped": dict(sorted(skipped.items())),
           "prompt_tokens": sum(len(p.ids) for p in prompts)}
    want = {"samples": summary["samples"], "visited": summary["visited"],
            "skipped": dict(sorted(summary["skipped"].items())), "prompt_tokens": summary["prompt_tokens"]}
    if got != want:
        print(f"heldout_prompts: selection differs from the regenerate summary: got {got}, summary {want}",
              file=sys.stderr)
        return 1
    if a.plan_len != len(prompts):
        print(f"heldout_prompts: --plan-len {a.plan_len} != {len(prompts)} regenerated records: the plan skipped "
              "records, so its order cannot be rebuilt from the prompts alone", file=sys.stderr)
        return 1
    lo, hi = eval_split(a.plan_len, a.eval_samples)
    order = np.random.default_rng(a.plan_seed).permutation(len(prompts))  # artcache.plan.build_plan's order
    held = [int(i) for i in order[lo:hi]]
    out = {
        "prompts": [prompts[i].messages for i in held],
        "prompt_token_ids": [list(prompts[i].ids) for i in held],
        "record_ids": [prompts[i].record_id for i in held],
        "plan_indices": list(range(lo, hi)),
        "file_positions": [prompts[i].position for i in held],
        "provenance": {"sharegpt": str(a.sharegpt), "shard_lines": a.shard_lines,
                       "shard_sha256": hashlib.sha256(data).hexdigest(), "selection": got,
                       "max_prompt_tokens": a.max_prompt_tokens, "plan_seed": a.plan_seed, "plan_len": a.plan_len,
                       "eval_samples": a.eval_samples, "target": a.target,
                       "add_generation_prompt": True, "template_options": {}},
    }
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({"out": str(a.out), "held_out": len(held), **got,
                      "held_out_prompt_tokens": sum(len(p) for p in out["prompt_token_ids"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
