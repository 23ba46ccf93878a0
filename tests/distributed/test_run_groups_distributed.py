"""Experiments of several ranks in `artcache run`, run as torch.distributed groups on gloo (the rest:
tests/protocol/test_run_groups.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from artcache import journal as J
from artcache.layout import CacheLayout
from artcache.rolespec import read_spec, spec_digest
from artcache.trainers.consumer import ConsumerConfig
from tests.protocol.test_run import base_toml, exp, write
from tests.support import REPO, TINY_SHAREGPT


def test_regression_run_waits_for_and_reports_a_group_by_its_rank_0(tiny_target, tmp_path):
    """Two experiments on one root, one a group of 2 ranks on gloo: both complete, the group is one consumer to
    the cache (one registration, its cursor at steps x global batch), each child journaled the spec it was
    handed, and the root's invariants hold.

    Regression: ``artcache run`` looked for an experiment's registration and journal under the pid of the process
    it started, but a group registers and journals from its rank 0, a child of that process: the run waited for a
    registration that never came before starting the producer, and its report showed a group that had completed
    as ``not started`` with 0 steps."""
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("solo", steps=4),
                                                   exp("pair", steps=4, nproc=2)))
    res = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "experiment pair started" in res.stdout and "cpu, 2 ranks" in res.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    got = {x["name"]: x for x in report["experiments"]}
    assert {n: (x["state"], x["exit_code"], x["nproc"]) for n, x in got.items()} == {
        "solo": ("completed", 0, 1), "pair": ("completed", 0, 2)}
    layout = CacheLayout(tmp_path / "out" / "cache")
    from artcache import registry

    regs = {r.consumer_id: r for r in registry.read_all(layout)}
    assert regs["pair"].cursor == 4 * 2 * 2 and regs["solo"].cursor == 4 * 2
    starts = {ev.consumer: ev for ev in J.read_events(layout.journal).events if isinstance(ev, J.ConsumerStart)}
    for name in ("solo", "pair"):
        spec = read_spec(tmp_path / "out" / "experiments" / name / "consumer.spec.json", "consumer", ConsumerConfig)
        assert starts[name].spec == spec_digest(spec)
    assert starts["pair"].ranks == 2 and starts["solo"].ranks == 1
    inspect = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(layout.root), "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0 and not json.loads(inspect.stdout)["violations"], inspect.stdout[-2000:]


def test_bench_1p3c_with_two_rank_consumers_captures_each_position_once(tiny_target, tmp_path):
    """``artcache bench --scenario 1p3c --consumer-ranks 2`` on the CPU (gloo), short: every consumer a 2-rank
    group finishes its steps, each position consumed is captured once, and every check passes."""
    import os

    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "artcache", "bench", "--scenario", "1p3c", "--device", "cpu", "--consumer-ranks", "2",
         "--modes", "artcache", "--target", tiny_target.path, "--data", str(TINY_SHAREGPT),
         "--max-length", "128", "--max-samples", "32", "--anchors", "8", "--draft-layers", "3", "--warmup", "1",
         "--steps", "3", "--window", "8:8", "--out", str(out)],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "1p3c" / "report.json").read_text())
    assert report["consumer_ranks"] == 2 and all(report["checks"].values()), report["checks"]
    assert [(c["steps"], c["exit_code"]) for c in report["consumers"]] == [(4, 0)] * 3
    cache = report["cache"]
    assert cache["distinct_positions_consumed"] == 4 * 2 and cache["captures_per_consumed_position"] == 1.0, cache
