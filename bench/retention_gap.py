"""How far the retention policy is over Belady under the same window pins, over seeded random streams.

``python -m artcache.bench.retention_gap --family FAMILY [--streams 40] [--seed 0] [--workers 2] [--out F.json]``

Each stream: three consumers at speeds 1 : 1.5 : 3 (the slowest 1000 or 1500 positions/s; batches 32 / 48 /
96, shuffled), lookbehind 0, 16 or 64 (the same for all), lookahead 1024, 100,000 positions of a plan walked
epoch after epoch, the producer of ``tests/properties/test_retention_sim.py`` (2 ms + 0.1 ms per sample, batches of
64). For each it runs :func:`~artcache.bench.sim.simulate` and :func:`~artcache.bench.sim.offline_optimum`
under the run's pins in the run's room (``pins=res.pins, reserved=res.in_flight``) and reports captures per
consumed position for both and the gap (policy - optimum). Families:

- ``together`` / ``staggered``: the property test's distribution (``streams()``: plan 10,000 or 25,000,
  budget uniform between the floor and the plan, the third consumer stopping at 40,000 one time in three),
  with every consumer starting at 0 / the second and third starting uniformly in [0, 10] s;
- ``near-floor``: plan 25,000, starts uniform in [2, 10] s, budget the floor + up to 20 % of (plan - floor)
  (1.0-2.4x the floor), the third consumer stopping at 40,000 one time in two;
- ``near-floor-load``: the same streams, the late consumers registering at 0 and reading from their start
  (:attr:`~artcache.bench.sim.ConsumerSpec.load_s`).

Stream ``k`` is drawn from ``random.Random(seed * 1_000_003 + k)``, so a family's streams are the same on
every machine (``near-floor`` and ``near-floor-load`` share theirs). The JSON (``--out``) holds every
stream's figures, the summary (n, max, median, streams over 0.02) and the command, commit and hardware;
docs/scheduler.md ("Staggered starts") quotes it. Bad arguments (incl. an ``--out`` that is a directory): one line on
stderr, exit 2, before any stream runs; an ``--out`` that cannot be written (a full disk): one line, exit 1, nothing
written.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from multiprocessing import Pool
from pathlib import Path

from artcache.bench.provenance import record
from artcache.bench.sim import ConsumerSpec, ProducerSpec, offline_optimum, simulate
from artcache.errors import PublishError
from artcache.fsio import atomic_write
from artcache.scheduler import SchedulerLimits

FAMILIES = ("together", "staggered", "near-floor", "near-floor-load")
RATIOS = (1.0, 1.5, 3.0)
POSITIONS = 100_000


def floor_of(cons: list[ConsumerSpec]) -> int:
    """The floor budget in artifacts: every window, the windows' lookbehind once more and one capture batch of
    64 (the reserve of ``tests/properties/test_retention_sim.py``)."""
    return sum(c.lookahead + 2 * c.lookbehind + 1 for c in cons) + 64


def draw(family: str, rng: random.Random) -> tuple[list[ConsumerSpec], ProducerSpec, int, int]:
    """One stream of ``family``: ``(consumers, producer with its budget, budget in artifacts, plan length)``."""
    near = family.startswith("near-floor")
    plan_len = 25_000 if near else rng.choice([10_000, 25_000])
    base = rng.choice([1000.0, 1500.0])
    batches = rng.sample([32, 48, 96], 3)
    lookbehind = rng.choice([0, 16, 64])
    ratios = rng.sample(RATIOS, 3)
    cons = []
    for i, (ratio, batch) in enumerate(zip(ratios, batches, strict=True)):
        rate = base * ratio
        start = 0.0 if i == 0 or family == "together" else rng.uniform(2, 10) if near else rng.uniform(0, 10)
        end = (rng.choice([None, 40_000]) if near else rng.choice([None, None, 40_000])) if i == 2 else None
        c = ConsumerSpec(f"c{i}", batch / rate, batch, lookbehind, 1024, start_s=start, end=end)
        cons.append(replace(c, start_s=0.0, load_s=start) if family == "near-floor-load" else c)
    prod = ProducerSpec(fixed_s=0.002, per_sample_s=0.0001, poll_s=0.05,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=64, max_batch_tokens=64 * 256))
    floor = floor_of(cons)
    budget = int(rng.uniform(0, 0.2 if near else 1.0) * (plan_len - floor)) + floor
    return cons, prod.with_budget(budget), budget, plan_len


def one(job: tuple[str, int, int] | tuple[str, int, int, int]) -> dict:
    """Figures of stream ``k`` of ``family`` (seed ``seed``), over ``positions`` read positions (default
    :data:`POSITIONS`)."""
    family, seed, k, *rest = job
    cons, prod, budget, plan_len = draw(family, random.Random(seed * 1_000_003 + k))
    res = simulate(cons, prod, rest[0] if rest else POSITIONS, plan_len=plan_len)
    fair = offline_optimum(res.trace, budget, pins=res.pins, reserved=res.in_flight) / res.positions
    floor = floor_of(cons)
    return {"stream": k, "budget": budget, "budget_over_floor": round(budget / floor, 4), "plan_len": plan_len,
            "lookbehind": cons[0].lookbehind, "starts_s": [round(c.start_s + c.load_s, 3) for c in cons],
            "policy": res.captures_per_position, "pinned_optimum": fair,
            "gap": round(res.captures_per_position - fair, 6),
            "violations": len(res.budget_violations) + len(res.window_violations)}


def summarize(rows: list[dict]) -> dict:
    """n, max / median gap, streams over 0.02, violations (any > 0 is a bug)."""
    gaps = [r["gap"] for r in rows]
    return {"n": len(rows), "max_gap": max(gaps, default=None),
            "median_gap": statistics.median(gaps) if gaps else None, "over_0.02": sum(g > 0.02 for g in gaps),
            "violations": sum(r["violations"] for r in rows)}


def run_family(family: str, streams: int, seed: int = 0, workers: int = 1, positions: int | None = None) -> dict:
    """``streams`` streams of ``family`` over ``positions`` read positions each (default :data:`POSITIONS`), in
    ``workers`` processes: ``{"family", "seed", "positions", "summary": summarize(rows), "streams": rows}``."""
    positions = POSITIONS if positions is None else positions
    jobs = [(family, seed, k, positions) for k in range(streams)]
    if workers == 1:
        rows = [one(j) for j in jobs]
    else:
        with Pool(workers) as pool:
            rows = pool.map(one, jobs)
            # a graceful end: leaving the block terminates the pool (SIGTERM to its workers), and a worker killed
            # while it held the task queue's lock left another blocked on it and the bench hung in the pool's join
            pool.close()
            pool.join()
    return {"family": family, "seed": seed, "positions": positions, "summary": summarize(rows), "streams": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m artcache.bench.retention_gap", description=__doc__.split("\n")[0])
    ap.add_argument("--family", required=True, help=f"one of {', '.join(FAMILIES)}")
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    bad = (f"--family {a.family!r}: accepted {', '.join(FAMILIES)}" if a.family not in FAMILIES else
           f"--streams {a.streams}: accepted an integer >= 1" if a.streams < 1 else
           f"--workers {a.workers}: accepted 1 .. {os.cpu_count() or 1} (this machine's CPUs)"
           if not 1 <= a.workers <= (os.cpu_count() or 1) else
           f"--seed {a.seed}: accepted an integer >= 0" if a.seed < 0 else
           f"--out {a.out}: its directory does not exist" if a.out and not a.out.parent.is_dir() else
           f"--out {a.out}: is a directory; accepted: a file path in an existing directory" if a.out and a.out.is_dir()
           else None)
    if bad:
        print(f"retention_gap: error: {bad}", file=sys.stderr)
        return 2
    t0 = time.time()
    fam = run_family(a.family, a.streams, a.seed, a.workers)
    summary, rows = fam["summary"], fam["streams"]
    print(f"{a.family}: {summary['n']} streams, gap max {summary['max_gap']:+.4f}, median "
          f"{summary['median_gap']:+.4f}, {summary['over_0.02']} over 0.02, {summary['violations']} violations "
          f"({time.time() - t0:.0f} s)")
    if a.out:
        doc = {**record("artcache.bench.retention_gap", argv), "family": a.family, "seed": a.seed,
               "positions": POSITIONS, "summary": summary, "streams": rows}
        try:
            atomic_write(a.out, [json.dumps(doc, indent=1).encode()], a.out.parent, durable=False)
        except PublishError as exc:  # a full or read-only filesystem: nothing written (atomic_write cleaned up)
            print(f"retention_gap: error: --out {a.out}: {exc}", file=sys.stderr)
            return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
