"""Rebuild the held-out prompts of a run trained on ``artcache regenerate`` output, when the regenerated
file itself is gone (it stayed on the GPU machine) but its source ShareGPT shard is at hand.

The chain it reproduces (configs/gpu-smollm2-long.sh, piece 1):

1. the shard: the first ``--shard-lines`` lines of the ShareGPT JSONL file;
2. ``artcache regenerate --max-samples S --max-prompt-tokens P`` kept the records that
   :func:`artcache.data.regenerate.select_prompts` keeps, in file order, one regenerated record each;
3. the plan of the regenerated file (one source of weight 1, :func:`artcache.plan.build_mixed_plan`) visits
   its records in a ``numpy.random.default_rng([seed, 0])`` permutation and then shuffles the samples with
   ``numpy.random.default_rng(seed)``; every record made a sample (checked with ``--plan-len``: the plan's
   length, e.g. a report's ``epoch_len`` + ``eval_samples``). ``--plan-order file`` rebuilds the order of a plan
   made by an artcache that read a ``data.dataset`` file on its own (one ``default_rng(seed)`` permutation of the
   file's records);
4. the held-out split is the plan's **last** ``E`` samples (``artcache.trainers.evaluation.eval_split``).

So the held-out prompts are the selected prompts at ``order[-E:]``, in plan order (:func:`plan_order`). (Not the
file's last E records: the plan shuffles.) The selection counts are checked against the regenerate summary line
(``--regenerate-summary``: its ``samples``, ``visited``, ``skipped`` and ``prompt_tokens``); a mismatch exits
1 and writes nothing. A run regenerated in consecutive shards of the file (configs/gpu-smollm2-long.sh's
``split -l``, outputs concatenated in shard order) gives one summary line per shard: they are summed and
checked against one selection over all the shards' lines (``--shard-lines`` = their total, ``--max-samples``
at least the summed samples), which is exact when every shard was read to its end (:func:`read_summary`).

Bad input is refused with one line naming the value and what is accepted, exit 2, nothing written: a flag
outside its declared range (:data:`RANGES`), ``--eval-samples`` that leaves the plan no training sample, a
missing ``--sharegpt`` or ``--regenerate-summary`` file, an unknown ``--target``, a summary line that is not
regenerate's JSON (or lacks one of its fields, or visited more records than it has), a shard that stopped at
its ``--max-samples``, an ``--out`` in a directory that does not exist. ``--out`` is written atomically: one that
cannot be written (a full or read-only filesystem) is one line, exit 1, nothing written.

Output (``--out``, JSON): ``{"prompts": [[{"role", "content"}, ...], ...]`` (the chat messages before the
first assistant turn, as regenerate rendered them), ``"prompt_token_ids"`` (what regenerate fed the target:
the chat template with ``add_generation_prompt=True``, tokenized without special tokens), ``"record_ids"``,
``"plan_indices"``, ``"file_positions"`` and ``"provenance"``}. tests/support/vllm_spec_decode.py ``--prompts-file``
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

import msgspec
import numpy as np

from artcache.errors import ArtcacheError, ConfigError, DataError, PublishError
from artcache.fsio import atomic_write
from artcache.ranges import Count, NonNegative, check_value, path_of

#: the flags with a declared range (checked by :func:`check_args` before anything is read)
RANGES = {"--shard-lines": Count, "--max-samples": Count, "--max-prompt-tokens": Count, "--plan-seed": NonNegative,
          "--plan-len": Count, "--eval-samples": Count}


#: ``--plan-order`` values (:func:`plan_order`)
PLAN_ORDERS = ("source", "file")


def plan_order(n: int, seed: int, rule: str = "source") -> np.ndarray:
    """The plan index → record index order of a plan of ``n`` records that each made a sample.

    ``source``: :func:`artcache.plan.build_mixed_plan` with one source of weight 1 (how artcache plans a data file):
    records visited in ``default_rng([seed, 0]).permutation(n)``, the samples then shuffled by
    ``default_rng(seed).permutation(n)``. ``file``: one ``default_rng(seed).permutation(n)`` (artcache versions that
    read a ``data.dataset`` file on its own). Returns int64 [n]."""
    if rule == "file":
        return np.random.default_rng(seed).permutation(n)
    visit = np.random.default_rng([seed, 0]).permutation(n)
    return visit[np.random.default_rng(seed).permutation(n)]


class SummaryLine(msgspec.Struct):
    """The fields of one ``artcache regenerate`` summary line this script checks (the others are ignored).
    ``records`` is needed only to sum several lines (:func:`read_summary`)."""

    samples: NonNegative
    visited: NonNegative
    skipped: dict[str, NonNegative]
    prompt_tokens: NonNegative
    records: NonNegative | None = None


def shard_lines(path: Path, n: int) -> bytes:
    """The first ``n`` lines of ``path`` (``.xz`` decompressed with lzma), as bytes.

    Raises:
        DataError: the file cannot be read or is not valid xz (names ``--sharegpt`` and the file).
    """
    opener = lzma.open if path.suffix == ".xz" else open
    out = []
    try:
        with opener(path, "rb") as f:
            for line in f:
                out.append(line)
                if len(out) >= n:
                    break
    except (OSError, lzma.LZMAError, EOFError) as exc:  # a cut .xz file raises EOFError
        raise DataError(f"--sharegpt {str(path)!r}: cannot read its first {n} lines ({exc}); accepted: a readable "
                        "ShareGPT JSONL file, .xz-compressed when its name ends .xz") from None
    return b"".join(out)


def read_summary(path: Path) -> dict:
    """The regenerate summary to check the selection against: the file's only JSON line, or, for a run
    regenerated in consecutive shards (one line per shard, in shard order), their sums of ``samples``,
    ``visited``, ``prompt_tokens`` and every ``skipped`` reason.

    Summing is exact because :func:`artcache.data.regenerate.select_prompts` judges each record alone; the
    one thing that couples records is its ``max_samples`` stop, so with several lines every shard must have
    been read to its end (``visited == records``): then the shards' selections, concatenated, are one selection
    over all their lines.

    Raises:
        DataError: one line naming the file and the line: the file cannot be read or has no line, a line is not
            a JSON object with regenerate's ``samples``, ``visited``, ``skipped`` and ``prompt_tokens``
            (non-negative integers; ``records`` too with several lines), it visited more records than it has,
            or a shard stopped at its ``--max-samples``.
    """
    name = f"--regenerate-summary {str(path)!r}"
    accepted = ("accepted: the JSON summary lines artcache regenerate prints, one per shard, each with samples, "
                "visited, skipped and prompt_tokens (non-negative integers; records too, to sum shards)")
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise DataError(f"{name}: cannot read it ({why}); {accepted}") from None
    if not lines:
        raise DataError(f"{name}: no summary line; {accepted}")
    rows = []
    for n, ln in enumerate(lines, 1):
        try:
            row = msgspec.json.decode(ln, type=SummaryLine)
        except msgspec.DecodeError as exc:  # not JSON, or a field missing, mistyped or negative
            where, problem = path_of(exc) if isinstance(exc, msgspec.ValidationError) else ("", str(exc))
            raise DataError(f"{name} line {n}: {problem}{f' (at {where})' if where else ''}; {accepted}") from None
        if row.records is not None and row.visited > row.records:
            raise DataError(f"{name} line {n}: visited {row.visited} is more than its {row.records} records "
                            "(regenerate visits each record at most once): not a summary regenerate wrote; "
                            f"{accepted}")
        rows.append(row)
    if len(rows) == 1:
        return msgspec.structs.asdict(rows[0])
    total: dict = {"samples": 0, "visited": 0, "skipped": {}, "prompt_tokens": 0}
    for n, row in enumerate(rows, 1):
        if row.records is None:
            raise DataError(f"{name} line {n}: no records (needed to sum shards); {accepted}")
        if row.visited != row.records:
            raise DataError(f"{name} line {n}: the shard stopped at --max-samples (visited {row.visited} of "
                            f"{row.records} records), so the shards' selections are not one selection over all "
                            "their lines; accepted: several lines only when every shard was read to its end")
        for k in ("samples", "visited", "prompt_tokens"):
            total[k] += getattr(row, k)
        for reason, count in row.skipped.items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + count
    return total


def check_args(a: argparse.Namespace) -> None:
    """Refuse bad flags before anything is read: a value outside its declared range (:data:`RANGES`),
    ``--eval-samples`` that leaves the plan no training sample, a missing ``--sharegpt`` file, an ``--out``
    that is a directory or lies in a directory that does not exist.

    Raises:
        ConfigError: one line naming the flag, its value and what is accepted.
    """
    from artcache.trainers.evaluation import eval_split

    for flag, declared in RANGES.items():
        check_value(getattr(a, flag[2:].replace("-", "_")), declared, flag)
    eval_split(a.plan_len, a.eval_samples, need_split=True)  # ConfigError: leaves no training sample
    if not a.sharegpt.is_file():
        raise ConfigError(f"--sharegpt {str(a.sharegpt)!r}: no such file; accepted: an existing ShareGPT JSONL file "
                          "(.xz allowed)")
    if not a.out.parent.is_dir() or a.out.is_dir():
        raise ConfigError(f"--out {str(a.out)!r}: " + ("is a directory" if a.out.is_dir() else
                          f"its directory {str(a.out.parent)!r} does not exist") +
                          "; accepted: a file path in an existing directory")


def select(a: argparse.Namespace) -> tuple[bytes, list, dict, int]:
    """``(shard bytes, prompts, skipped, visited)``: regenerate's selection over the shard, with the target's
    tokenizer resolved as regenerate resolves ``--target``.

    Raises:
        ConfigError: ``--target`` is not a target with a tokenizer.
        DataError: the shard cannot be read or holds no ShareGPT record (names ``--sharegpt``).
    """
    from artcache.data.regenerate import select_prompts
    from artcache.data.sharegpt import read_sharegpt
    from artcache.target import load_tokenizer, resolve_target

    tok = load_tokenizer(resolve_target(a.target))
    if tok is None:
        raise ConfigError(f"--target {a.target!r} has no tokenizer (a random benchmark target); accepted: the "
                          "target regenerate ran with, a name or an HF directory with its tokenizer")
    data = shard_lines(a.sharegpt, a.shard_lines)
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as tmp:
        tmp.write(data)
        tmp.flush()
        try:
            records = read_sharegpt(tmp.name).records
        except DataError as exc:  # named by the temp file: name the shard instead
            raise DataError(str(exc).replace(f"dataset {tmp.name!r}", f"--sharegpt {str(a.sharegpt)!r} (its "
                                                                       f"first {a.shard_lines} lines)")) from None
    prompts, skipped, visited = select_prompts(records, tok, max_samples=a.max_samples,
                                               max_prompt_tokens=a.max_prompt_tokens)
    return data, prompts, skipped, visited


def main(argv: list[str] | None = None) -> int:
    from artcache.trainers.evaluation import eval_split

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sharegpt", required=True, type=Path, help="ShareGPT JSONL (.xz allowed)")
    ap.add_argument("--shard-lines", type=int, default=512)
    ap.add_argument("--target", required=True, help="the target regenerate ran with (a name or an HF directory)")
    ap.add_argument("--max-samples", type=int, default=512, help="regenerate's --max-samples")
    ap.add_argument("--max-prompt-tokens", type=int, default=768)
    ap.add_argument("--regenerate-summary", type=Path, required=True,
                    help="regenerate's JSON summary: one line, or one line per consecutive shard (summed)")
    ap.add_argument("--plan-seed", type=int, default=0, help="the plan's shuffle seed (data.seed)")
    ap.add_argument("--plan-order", choices=PLAN_ORDERS, default="source",
                    help="source: the plan of a data file as artcache builds it (one source of weight 1); file: a "
                         "plan made when a data.dataset file was read on its own (one permutation of its records)")
    ap.add_argument("--plan-len", type=int, required=True, help="the plan's length (epoch_len + eval_samples)")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    try:
        check_args(a)
        summary = read_summary(a.regenerate_summary)
        data, prompts, skipped, visited = select(a)
    except ArtcacheError as exc:
        print(f"heldout_prompts: error: {exc}", file=sys.stderr)
        return exc.exit_code
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
    lo, hi = eval_split(a.plan_len, a.eval_samples, need_split=True)
    order = plan_order(len(prompts), a.plan_seed, a.plan_order)
    held = [int(i) for i in order[lo:hi]]
    out = {
        "prompts": [prompts[i].messages for i in held],
        "prompt_token_ids": [list(prompts[i].ids) for i in held],
        "record_ids": [prompts[i].record_id for i in held],
        "plan_indices": list(range(lo, hi)),
        "file_positions": [prompts[i].position for i in held],
        "provenance": {"sharegpt": str(a.sharegpt), "shard_lines": a.shard_lines,
                       "shard_sha256": hashlib.sha256(data).hexdigest(), "selection": got,
                       "max_prompt_tokens": a.max_prompt_tokens, "plan_seed": a.plan_seed, "plan_order": a.plan_order,
                       "plan_len": a.plan_len,
                       "eval_samples": a.eval_samples, "target": a.target,
                       "add_generation_prompt": True, "template_options": {}},
    }
    try:
        atomic_write(a.out, [json.dumps(out, indent=1).encode()], a.out.parent, durable=False)
    except PublishError as exc:  # a full or read-only --out filesystem: nothing written (atomic_write cleaned up)
        print(f"heldout_prompts: error: --out {str(a.out)!r}: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({"out": str(a.out), "held_out": len(held), **got,
                      "held_out_prompt_tokens": sum(len(p) for p in out["prompt_token_ids"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
