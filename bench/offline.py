"""A pre-filled root used offline (issue 21, item 6): capture everything once, train many times.

``python -m artcache.bench.offline --out DIR [--target NAME] [--data D] [--max-samples N] [--steps S] ...``

1. ``artcache producer --fill`` captures the whole plan into ``DIR/cache`` and exits (timed); a second
   ``--fill`` on the same root captures nothing and exits (same contract and plan).
2. Rounds, alternated so that the machine's other load hits both alike: three DFlash consumers
   (block sizes ``--blocks``) train ``S`` steps each, at the same time, **from the root with no producer
   running**; then the same three train the same steps from batches **held in memory** (each process reads
   and collates its positions first, then times only ``Session.train_step``, the consumer's own compute).
3. ``report.json``: the fill, each consumer's steady steps/s in each mode and round (after ``--warmup`` steps,
   from the journal's step times / the in-memory loop's), the root/memory ratio per consumer (median over
   rounds), the captures made while the consumers ran (0: the root served everything), and the check that
   every ratio is >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from artcache import journal as J
from artcache.accounting import account
from artcache.layout import CacheLayout

GOAL = 0.95


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "artcache", *args]


def fill(args, root: Path, logs: Path, name: str) -> dict:
    """Run ``artcache producer --fill`` on ``root``; its wall time, exit status and captures."""
    before = account(CacheLayout(root)).cache.captures if (root / "artcache.json").is_file() else 0
    t0 = time.time()
    with open(logs / f"{name}.log", "wb") as log:
        cmd = _cli("producer", "--cache", str(root), "--target", args.target, "--data", args.data,
                   "--max-samples", str(args.max_samples), "--max-length", str(args.max_length),
                   "--draft-layers", "5", "--threads", str(args.threads), "--fill")
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    acc = account(CacheLayout(root))
    return {"exit_code": code, "wall_s": time.time() - t0, "captures": acc.cache.captures - before,
            "retained_artifacts": acc.cache.retained_artifacts, "retained_bytes": acc.cache.retained_bytes}


def consumer_config(args, root: Path, block: int, run_dir: Path, cid: str):
    from artcache.trainers.consumer import ConsumerConfig

    return ConsumerConfig(cache=str(root), consumer_id=cid, draft="dflash", block_size=block,
                          num_anchors=args.anchors, batch_size=1, steps=args.warmup + args.steps,
                          lookbehind=0, lookahead=8, threads=1, out_dir=str(run_dir), progress=False,
                          tensorboard=False, log_every=10)


def steady(times: list[float], warmup: int) -> float:
    """Steps per second from the end of step ``warmup`` to the last step (``times[i]``: end of step i+1)."""
    span = times[-1] - times[warmup - 1] if warmup else times[-1] - times[0]
    return (len(times) - warmup - (0 if warmup else 1)) / span if span > 0 else 0.0


def run_round(args, root: Path, out: Path, mode: str, k: int) -> dict[int, float]:
    """One round of ``mode`` (``root`` or ``memory``): three processes at once; block → steady steps/s."""
    procs = {}
    logs = out / "logs"
    for block in args.blocks:
        cid = f"dflash-b{block}-{mode}-{k}"
        cfg = consumer_config(args, root, block, out / "runs" / cid, cid)
        module = "artcache.bench.consume" if mode == "root" else "artcache.bench.offline"
        cmd = [sys.executable, "-m", module, *([] if mode == "root" else ["--memory"]),
               msgspec.json.encode(cfg).decode()]
        log = open(logs / f"{cid}.log", "wb")  # noqa: SIM115 (closed below, after the process)
        procs[block] = (cid, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              env=dict(os.environ, PYTHONUNBUFFERED="1")), log)
    rates = {}
    for block, (cid, p, log) in procs.items():
        code = p.wait(timeout=args.timeout_s)
        log.close()
        if code != 0:
            raise RuntimeError(f"{cid} exited {code}: {(logs / f'{cid}.log').read_text()[-2000:]}")
        if mode == "root":
            steps = sorted((e for e in J.read_events(CacheLayout(root).journal).events
                            if isinstance(e, J.Step) and e.consumer == cid), key=lambda e: e.step)
            rates[block] = steady([e.t for e in steps], args.warmup)
        else:
            text = (logs / f"{cid}.log").read_text().splitlines()
            rates[block] = json.loads([ln for ln in text if ln.startswith("{")][-1])["steps_per_s"]
    return rates


def memory_worker(cfg_json: str, warmup: int) -> dict:
    """Train ``cfg``'s steps from batches read and collated beforehand: the consumer's rate without the
    cache. Returns {consumer_id, steps, steps_per_s} (steady, after ``warmup`` steps)."""
    from artcache import store
    from artcache.client import Leased
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.consumer.reader import collate
    from artcache.trainers.consumer.session import Session

    cfg = msgspec.json.decode(cfg_json, type=ConsumerConfig)
    s = Session(cfg)
    s.setup()  # reads the root and builds the draft; registers nothing
    s.resume()
    from artcache.fingerprint import PlanFingerprints

    fps = PlanFingerprints(s.settings.contract, s.plan)
    n = cfg.steps * cfg.batch_size
    items = [Leased(p, store.read(s.layout, fps.of_sample(s.order.sample(p)), s.settings.contract), "")
             for p in range(n)]
    batches = [collate(items[i:i + cfg.batch_size], s.device, s.layers) for i in range(0, n, cfg.batch_size)]
    times = []
    for i, batch in enumerate(batches):
        s.train_step(batch, i)
        times.append(time.time())
    return {"consumer_id": cfg.consumer_id, "steps": len(times), "steps_per_s": steady(times, warmup)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m artcache.bench.offline", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/offline")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--max-samples", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per consumer (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--blocks", default="4,8,16", help="DFlash block sizes, one consumer each")
    ap.add_argument("--rounds", type=int, default=2, help="root / memory rounds, alternated")
    ap.add_argument("--threads", type=int, default=1, help="the producer's torch threads")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--memory", metavar="CONFIG_JSON", help=argparse.SUPPRESS)  # one in-memory worker
    args = ap.parse_args(argv)
    if args.memory:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(memory_worker(args.memory, args.warmup if args.warmup else 0)))
        return 0
    args.blocks = [int(b) for b in args.blocks.split(",")]
    if args.warmup + args.steps > args.max_samples:
        print(f"error: --warmup + --steps ({args.warmup + args.steps}) is not accepted: at most "
              f"--max-samples {args.max_samples} (each consumer reads one pass)", file=sys.stderr)
        return 2
    out = Path(args.out).absolute()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    root = out / "cache"
    report: dict = {"settings": {k: v for k, v in vars(args).items() if k != "memory"}}
    report["fill"] = fill(args, root, out / "logs", "fill")
    report["refill"] = fill(args, root, out / "logs", "refill")
    captures_before = account(CacheLayout(root)).cache.captures
    rounds: dict[str, list[dict[int, float]]] = {"root": [], "memory": []}
    for k in range(args.rounds):
        for mode in ("root", "memory") if k % 2 == 0 else ("memory", "root"):
            rounds[mode].append(run_round(args, root, out, mode, k))
            got = ", ".join(f"B{b} {r:.3f} steps/s" for b, r in rounds[mode][-1].items())
            print(f"round {k} {mode}: {got}", flush=True)
    acc = account(CacheLayout(root))
    pairs = list(zip(rounds["root"], rounds["memory"], strict=True))
    ratios = {f"B{b}": statistics.median(r[b] / m[b] for r, m in pairs) for b in args.blocks}
    report.update({
        "rounds": {mode: [{f"B{b}": v for b, v in r.items()} for r in rs] for mode, rs in rounds.items()},
        "root_over_memory": ratios,
        "captures_while_consumers_ran": acc.cache.captures - captures_before,
        "producer_running": False,
        "accounting_violations": acc.violations,
        "checks": {"fill_exit_0": report["fill"]["exit_code"] == 0 and report["refill"]["exit_code"] == 0,
                   "refill_captures_nothing": report["refill"]["captures"] == 0,
                   "no_capture_while_consumers_ran": acc.cache.captures == captures_before,
                   f"every_consumer_ge_{GOAL}_of_in_memory": all(v >= GOAL for v in ratios.values()),
                   "accounting_invariants": not acc.violations},
    })
    (out / "report.json").write_text(json.dumps(report, indent=2))
    shown = ("fill", "refill", "root_over_memory", "captures_while_consumers_ran", "checks")
    print(json.dumps({k: report[k] for k in shown}, indent=2))
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
