"""Held-out acceptance of drafts trained from a bf16 and from an fp8 cache root, with the run-to-run noise of
two bf16 seeds beside it.

``python -m artcache.bench.fp8_tau --out DIR [--device cpu|cuda] [--steps 300] [--target NAME] ...``

Two ``artcache run`` invocations (at the same time, or one after the other with ``--no-parallel``), on
the same target, plan (dataset, data seed, max length, samples) and step count:

- ``DIR/bfloat16``: a bf16 root; a DFlash and an EAGLE-3 draft for each of ``--seeds`` (default 0 and 1:
  the second seed measures how far two bf16 runs differ by their draft seed alone);
- ``DIR/fp8``: an fp8 root (``target.dtype = "fp8"``: e4m3fn codes, one fp32 scale per token row per
  layer, dequantised on read); the same two drafts with the first seed only.

Every experiment is evaluated on the plan's last ``--eval-samples`` samples (the same captures' values
for every draft of one root). The report (``DIR/fp8_tau.json``, ``DIR/fp8_tau.md``, printed) gives, per
draft, each run's final held-out figures: greedy-replay τ (``replay_tau``, **+1 bonus included**), DFlash
τ on data tokens (+1 bonus included) and EAGLE-3 ``sim_acc_len`` (no bonus), the bf16 seed spread and
fp8 − bf16 at the same seed, plus the bytes each root published.

Layers: the producer captures the union of the drafts' views (DFlash ``--dflash-layers`` formula,
EAGLE-3 low/mid/high plus the last layer, which also gives DFlash's greedy replay its target argmax;
``artcache run`` would add the last layer for the held-out split anyway: ``capture.replay_layer``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from artcache.bench.provenance import record

#: the figures compared, in the report's order: (key in the consumer's eval summary, label)
METRICS = (("replay_tau", "greedy-replay τ (+1 bonus)"), ("tau", "DFlash τ on data (+1 bonus)"),
           ("sim_acc_len", "EAGLE-3 sim_acc_len (no bonus)"), ("loss", "held-out loss"))


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"no TOML form for {v!r}")


def run_config(args, dtype: str, seeds: list[int], out: Path) -> str:
    """The TOML run config of one root: the target, plan and schedule shared by every run of this report."""
    lines = [f"out = {_toml_value(str(out))}", "", "[target]", f"name = {_toml_value(args.target)}",
             f"device = {_toml_value(args.device)}", f"dtype = {_toml_value(dtype)}", f"threads = {args.threads}",
             "", "[data]", f"dataset = {_toml_value(args.data)}", f"seed = {args.data_seed}",
             f"max_length = {args.max_length}", f"max_samples = {args.max_samples}", "",
             "[capture]", f"batch_samples = {args.batch_samples}", f"draft_layers = {args.dflash_layers}", "",
             "[cache]", f"demand_timeout_s = {_toml_value(float(args.demand_timeout))}",
             f"heartbeat_timeout_s = {_toml_value(float(args.heartbeat_timeout))}", ""]
    common = {"batch_size": args.batch_size, "steps": args.steps, "lr": args.lr, "window": args.window,
              "threads": args.threads, "log_every": max(1, args.steps // 10)}
    consumer = {"eval_samples": args.eval_samples, "eval_interval": args.eval_interval, "progress": False,
                "tensorboard": False}
    for seed in seeds:
        for draft in ("dflash", "eagle3"):
            lines += ["[[experiments]]", f"name = {_toml_value(f'{draft}-s{seed}')}", f"draft = {_toml_value(draft)}",
                      f"seed = {seed}"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in common.items()]
            extra = dict(consumer)
            if draft == "dflash":
                lines += [f"block_size = {args.dflash_block}", f"anchors = {args.dflash_anchors}",
                          f"draft_layers = {args.dflash_layers}"]
                extra["eval_anchors"] = args.dflash_eval_anchors
            else:
                extra.update(ttt_steps=args.eagle3_ttt, draft_vocab=args.eagle3_vocab)
            lines += ["[experiments.consumer]"] + [f"{k} = {_toml_value(v)}" for k, v in extra.items()] + [""]
    return "\n".join(lines)


def _results(report: dict) -> dict[str, dict]:
    out = {}
    for x in report.get("experiments", []):
        summ = x.get("consumer_summary") or {}
        ev = summ.get("eval") or {}
        out[x["name"]] = {"state": x.get("registration"), "steps": summ.get("steps"),
                          "eval_step": ev.get("step"), "eval_samples": ev.get("samples"),
                          **{k: ev.get(k) for k, _ in METRICS if ev.get(k) is not None}}
    return out


def compare(runs: dict[str, dict], seeds: list[int]) -> list[dict]:
    """Rows per (draft, metric): bf16 per seed, the bf16 seed spread (max - min), fp8 at the first seed
    and fp8 - bf16 at that seed."""
    rows = []
    s0 = seeds[0]
    for draft in ("dflash", "eagle3"):
        for key, label in METRICS:
            bf = [runs["bfloat16"].get(f"{draft}-s{s}", {}).get(key) for s in seeds]
            f8 = runs["fp8"].get(f"{draft}-s{s0}", {}).get(key)
            if all(v is None for v in bf) and f8 is None:
                continue
            have = [v for v in bf if v is not None]
            rows.append({"draft": draft, "metric": key, "label": label,
                         **{f"bf16_s{s}": v for s, v in zip(seeds, bf, strict=True)},
                         "bf16_seed_spread": (max(have) - min(have)) if len(have) > 1 else None,
                         f"fp8_s{s0}": f8, "fp8_minus_bf16": (f8 - bf[0]) if f8 is not None and bf[0] is not None
                         else None})
    return rows


def markdown(rows: list[dict], seeds: list[int], meta: dict) -> str:
    s0 = seeds[0]
    head = ["draft", "figure", *[f"bf16 seed {s}" for s in seeds], "bf16 seed spread", f"fp8 seed {s0}",
            "fp8 − bf16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v):
        return "" if v is None else f"{v:.3f}"

    for r in rows:
        lines.append("| " + " | ".join([r["draft"], r["label"], *[f(r[f"bf16_s{s}"]) for s in seeds],
                                        f(r["bf16_seed_spread"]), f(r[f"fp8_s{s0}"]), f(r["fp8_minus_bf16"])]) + " |")
    lines.append("")
    lines.append(f"published bytes: bf16 {meta['bytes']['bfloat16']:,}, fp8 {meta['bytes']['fp8']:,} "
                 f"(fp8 / bf16 = {meta['bytes_ratio']:.3f}); wall {meta['wall_s']['bfloat16']:.0f} s + "
                 f"{meta['wall_s']['fp8']:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[int]]:
    """The flags and the draft seeds; exits 2 with one line naming a bad value (argparse)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]: the producer and every consumer")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--max-samples", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1", help="draft seeds of the bf16 runs; fp8 runs the first")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--batch-samples", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--window", default="16:64")
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--eval-interval", type=int, default=0, help="0: evaluate at the end only")
    ap.add_argument("--dflash-layers", type=int, default=3)
    ap.add_argument("--dflash-block", type=int, default=16)
    ap.add_argument("--dflash-anchors", type=int, default=32)
    ap.add_argument("--dflash-eval-anchors", type=int, default=64)
    ap.add_argument("--eagle3-ttt", type=int, default=3)
    ap.add_argument("--eagle3-vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    ap.add_argument("--demand-timeout", type=float, default=3600.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=600.0,
                    help="cache.heartbeat_timeout_s: generous, since a whole-machine stall on a shared CPU fenced "
                    "every DFlash consumer of a 30 s default run at once")
    ap.add_argument("--parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="run the bf16 and the fp8 root at the same time (default) or one after the other")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not seeds or args.steps < 1 or args.eval_samples < 1:
        ap.error(f"--seeds {args.seeds!r}, --steps {args.steps}, --eval-samples {args.eval_samples}: need at least "
                 "one seed, one step and one held-out sample")
    return args, seeds


def main(argv: list[str] | None = None) -> int:
    args, seeds = parse_args(argv)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    runs, wall, nbytes = {}, {}, {}
    procs = {}
    for dtype, run_seeds in (("bfloat16", seeds), ("fp8", seeds[:1])):
        cfg = out / f"{dtype}.toml"
        cfg.write_text(run_config(args, dtype, run_seeds, out / dtype))
        print(f"== {dtype}: artcache run --config {cfg}", flush=True)
        procs[dtype] = (subprocess.Popen([sys.executable, "-m", "artcache", "run", "--config", str(cfg)],
                                         env=os.environ), time.monotonic())
        if not args.parallel:
            procs[dtype][0].wait()
    failed = []
    for dtype, (proc, t0) in procs.items():
        rc = proc.wait()
        wall[dtype] = time.monotonic() - t0
        run_dir = out / dtype
        report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
        runs[dtype] = _results(report)
        nbytes[dtype] = int((report.get("shared_production") or {}).get("published_bytes") or 0)
        if rc != 0:
            failed.append(f"artcache run for {dtype} exited {rc}; see {run_dir}/report.md")
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    rows = compare(runs, seeds)
    meta = {**record("artcache.bench.fp8_tau", argv, args.device), "args": vars(args), "bytes": nbytes,
            "bytes_ratio": nbytes["fp8"] / nbytes["bfloat16"] if nbytes["bfloat16"] else float("nan"),
            "wall_s": wall}
    (out / "fp8_tau.json").write_text(json.dumps({**meta, "runs": runs, "rows": rows}, indent=1))
    text = markdown(rows, seeds, meta)
    (out / "fp8_tau.md").write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
