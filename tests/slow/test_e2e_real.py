"""``artcache bench --scenario 1p3c`` end to end on the real SmolLM2-135M target (minutes on a CPU).

Run with ``python3 -m pytest -m slow tests/slow/test_e2e_real.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

WARMUP, STEPS = 1, 3
CACHE_KEYS = ("logical_requests", "hits", "misses", "coalesced", "publications", "evictions", "recaptures",
              "max_retained_artifacts", "window_bound_artifacts")
# the same counts under the same names in `artcache inspect --json`'s "cache" object
SHARED_KEYS = (*CACHE_KEYS, "captures", "failures", "distinct_positions_consumed", "leases_acquired",
               "leases_released", "leases_expired")
CONSUMER_KEYS = ("id", "draft", "block_size", "steps", "steps_per_s", "wait_s", "final_loss")


@pytest.fixture(scope="module")
def bench_1p3c(tmp_path_factory, smollm2_target):
    out = tmp_path_factory.mktemp("bench-real") / "out"
    # artcache mode only: the naive/lockstep baselines triple the run and are covered by test_bench_cpu
    proc = subprocess.run([sys.executable, "-m", "artcache", "bench", "--scenario", "1p3c", "--modes", "artcache",
                           "--warmup", str(WARMUP), "--steps", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=1800)
    base = out / "1p3c"
    report_path = base / "report.json"
    assert report_path.is_file(), f"bench exited {proc.returncode} without a report:\n{proc.stdout[-3000:]}\n" \
                                  f"{proc.stderr[-3000:]}"
    return {"proc": proc, "base": base, "report": json.loads(report_path.read_text())}


def test_report_has_the_documented_keys(bench_1p3c):
    r = bench_1p3c["report"]
    assert r["scenario"] == "1p3c"
    # with 1 + 3 steps the common post-warm-up interval can be (nearly) empty: only its type is checked
    assert isinstance(r["interval_s"], float) and r["interval_s"] >= 0
    assert [c["block_size"] for c in r["consumers"]] == [4, 8, 16]
    for c in r["consumers"]:
        missing = [k for k in CONSUMER_KEYS if k not in c]
        assert not missing, f"consumer {c.get('id')} lacks {missing}"
        assert c["draft"] == "dflash" and c["steps"] == WARMUP + STEPS
        assert c["steps_per_s"] > 0 and c["wait_s"] >= 0
        assert c["final_loss"] is not None and c["final_loss"] > 0
    for k in ("captures", "busy_s", "utilization"):
        assert k in r["producer"], k
    assert r["producer"]["busy_s"] > 0 and 0 <= r["producer"]["utilization"] <= 1
    assert r["producer"]["captures"] > 0
    missing = [k for k in CACHE_KEYS if k not in r["cache"]]
    assert not missing, f"report cache lacks {missing}"


def test_checks_other_than_loss_pass(bench_1p3c):
    r = bench_1p3c["report"]
    assert set(r["checks"]) >= {"all_consumers_finished", "captures_per_consumed_position_le_1.1",
                                "max_retained_within_window_bound", "every_loss_went_down",
                                "accounting_invariants", "producer_exit_ok"}
    failed = [k for k, ok in r["checks"].items() if not ok and k != "every_loss_went_down"]
    assert not failed, f"failed checks {failed}; consumers {r['consumers']}"
    assert r["accounting_violations"] == []


def test_every_check_passes(bench_1p3c):
    r = bench_1p3c["report"]
    failed = [k for k, ok in r["checks"].items() if not ok]
    assert not failed, f"failed checks {failed}; consumers {r['consumers']}"
    assert bench_1p3c["proc"].returncode == 0, bench_1p3c["proc"].stdout[-3000:]


def test_outputs_on_disk(bench_1p3c):
    base = bench_1p3c["base"]
    assert (base / "progress.png").stat().st_size > 0
    assert (base / "report.md").is_file()
    for c in bench_1p3c["report"]["consumers"]:
        state = json.loads((base / "runs" / c["id"] / "checkpoints" / "latest" / "state.json").read_text())
        # one committed cursor position per sample read (regression: the test assumed batch size 2)
        assert state["step"] == WARMUP + STEPS
        assert state["cursor"] == (WARMUP + STEPS) * state["run"]["batch_size"]


def test_inspect_agrees_with_report(bench_1p3c):
    r = bench_1p3c["report"]
    cache = bench_1p3c["base"] / "cache"
    proc = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(cache), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    acc = json.loads(proc.stdout)
    assert acc["violations"] == []
    assert {k: acc["cache"][k] for k in SHARED_KEYS} == {k: r["cache"][k] for k in SHARED_KEYS}
    assert r["producer"]["captures"] == acc["cache"]["captures"]
    per = {k["consumer"]: k for k in acc["consumers"]}
    for c in r["consumers"]:
        k = per[c["id"]]
        assert (k["state"], k["logical_requests"], k["hits"], k["misses"]) == \
            (c["state"], c["requests"], c["hits"], c["misses"])
    # one producer served three trainers: shared counts are not the sum of the consumers' requests
    assert acc["cache"]["captures"] < acc["cache"]["logical_requests"]
