"""End to end on the tiny target: real ``artcache producer`` / ``artcache consume`` processes on one cache
root, checked through ``artcache inspect --json``, the journals and the consumers' checkpoints.

Deadlines below only bound a hung run (they turn a hang into a failure with the logs); nothing here
asserts how fast anything is.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file

from artcache import journal as J
from artcache import registry
from artcache.accounting import plan_samples
from artcache.layout import CacheLayout
from tests.support import TINY_SHAREGPT
from tests.support.procs import Proc as BaseProc
from tests.support.procs import inspect_json, wait_until

DATA = TINY_SHAREGPT
DEADLINE_S = 240.0
BATCH = 2


# ---- process helpers -------------------------------------------------------------------------------

class Proc(BaseProc):
    deadline = DEADLINE_S


def init_root(cache: Path, tiny_target) -> None:
    """Initialise the root as :func:`producer`'s process would (``prepare_root``, the same settings): consumers can
    then start before, or beside, the producer."""
    from artcache.producer import ProducerConfig, prepare_root

    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))


def producer(cache: Path, tiny_target, cwd: Path, *extra: str) -> Proc:
    return Proc("producer", ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(DATA),
                             "--max-samples", "40", "--max-length", "128", "--draft-layers", "3", "--threads", "1",
                             *extra], cwd)


def consumer(cache: Path, cwd: Path, cid: str, *, block_size: int, window: str, steps: int) -> Proc:
    return Proc(cid, ["consume", "--cache", str(cache), "--id", cid, "--block-size", str(block_size),
                      "--window", window, "--anchors", "4", "--steps", str(steps), "--batch-size", str(BATCH),
                      "--threads", "1", "--demand-timeout", "180", "--log-every", "1", "--json",
                      "--out", str(cwd / "runs" / cid)], cwd)


def by_id(acc: dict) -> dict[str, dict]:
    return {k["consumer"]: k for k in acc["consumers"]}


def registered(cache: Path, *ids: str):
    layout = CacheLayout(cache)

    def pred() -> bool:
        regs = {r.consumer_id: r for r in registry.read_all(layout)}
        return all(i in regs and regs[i].state in ("running", "completed") for i in ids)

    return pred


def events(cache: Path) -> list:
    res = J.read_events(CacheLayout(cache).journal)
    assert res.torn_lines == 0
    return res.events


def summary_line(proc: Proc) -> dict:
    """The JSON summary ``artcache consume`` prints on stdout when it finishes."""
    lines = [ln for ln in proc.text().splitlines() if ln.startswith("{")]
    assert lines, proc.text()[-2000:]
    return json.loads(lines[-1])


def check_checkpoint(run_dir: Path, consumer_id: str, steps: int) -> None:
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_symlink() and latest.resolve().name == f"step-{steps:08d}"
    ckpt = latest.resolve()
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights and all(t.numel() > 0 and bool(t.float().isfinite().all()) for t in weights.values())
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == steps
    assert state["cursor"] == steps * BATCH
    assert state["consumer_id"] == consumer_id and state["draft"] == "dflash"
    assert not [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".tmp")]


def common_invariants(acc: dict) -> None:
    c = acc["cache"]
    assert acc["violations"] == []
    assert c["captures"] == c["publications"] + c["failures"] and c["failures"] == 0
    assert c["logical_requests"] == c["hits"] + c["misses"]
    for k in acc["consumers"]:
        assert k["logical_requests"] == k["hits"] + k["misses"], k
    assert c["leases_acquired"] == c["leases_released"] + c["leases_expired"]
    assert c["leases_held"] == 0
    if c["retention"] == "need":  # what is retained stays under the disk budget (the default: most of the
        # free space), not under the windows
        assert c["budget_bytes"] > 0 and c["budget_exceeded_bytes"] == 0
        assert 0 < c["max_retained_bytes"] <= c["budget_bytes"] and c["max_retained_artifacts"] > 0
    else:  # --retention windows: the union of the live windows
        assert c["retention"] == "windows" and 0 < c["max_retained_artifacts"] <= c["window_bound_artifacts"]
    assert c["torn_journal_lines"] == 0


# ---- (1) two consumers, overlapping windows: one capture per position ---------------------------------

STEPS = 6
WINDOWS = {"a": "2:12", "b": "5:16"}  # lookaheads cover the whole run: nothing needed is ever evicted


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, tiny_target):
    """Root initialised first (as a producer would), both consumers registered and waiting on their first
    demand miss, then the producer started with --exit-when-done: every capture can serve both."""
    cwd = tmp_path_factory.mktemp("e2e-shared")
    cache = cwd / "cache"
    init_root(cache, tiny_target)
    cons = [consumer(cache, cwd, "a", block_size=4, window=WINDOWS["a"], steps=STEPS),
            consumer(cache, cwd, "b", block_size=8, window=WINDOWS["b"], steps=STEPS)]
    try:
        wait_until(registered(cache, "a", "b"), "both consumers to register", cons)
        prod = producer(cache, tiny_target, cwd, "--exit-when-done", "--done-grace", "1")
        for p in cons:
            p.expect(0)
        prod.expect(0)
    finally:
        for p in cons:
            p.kill()
    return {"cwd": cwd, "cache": cache, "consumers": cons, "producer": prod, "acc": inspect_json(cache)}


def test_shared_run_accounting(shared_run):
    acc = shared_run["acc"]
    common_invariants(acc)
    c = acc["cache"]
    positions = STEPS * BATCH
    assert c["distinct_positions_consumed"] == positions
    assert c["captures"] == positions, "a position was captured twice although both windows held it"
    assert c["recaptures"] == 0 and c["distinct_fingerprints_captured"] == positions
    assert c["captures_per_consumed_position"] == 1.0
    assert c["logical_requests"] == 2 * positions
    assert c["leases_expired"] == 0 and c["fences"] == 0
    # Σ (lookbehind + lookahead + 1) of the windows, at most the plan's samples (one artifact per sample)
    windows = sum(int(x) + int(y) + 1 for x, y in (w.split(":") for w in WINDOWS.values()))
    assert c["window_bound_artifacts"] == min(windows, plan_samples(CacheLayout(shared_run["cache"])))
    # no --disk-budget: the windows-only rule; once both consumers ended no window is live, so nothing is kept
    assert c["retention"] == "windows" and c["budget_bytes"] == 0
    assert c["retained_artifacts"] == 0 and c["evictions"] == positions
    assert c["evictions_by_reason"] == {"outside-windows": positions}
    ks = by_id(acc)
    assert set(ks) == {"a", "b"}
    for cid, block in (("a", 4), ("b", 8)):
        k = ks[cid]
        assert (k["state"], k["steps"], k["cursor"], k["block_size"]) == ("completed", STEPS, positions, block)
        assert k["logical_requests"] == positions
        assert k["leases_acquired"] == k["leases_released"]
        assert f"{k['lookbehind']}:{k['lookahead']}" == WINDOWS[cid]
        assert k["timeouts"] == 0 and k["quarantined"] == 0


def test_shared_run_journal(shared_run):
    evs = events(shared_run["cache"])
    captured = Counter(p for e in evs if isinstance(e, J.Capture) for p in e.positions)
    assert captured == Counter(range(STEPS * BATCH))  # each position exactly once
    for cid in ("a", "b"):
        requested = [e.position for e in evs if isinstance(e, J.Request) and e.consumer == cid]
        assert requested == list(range(STEPS * BATCH))  # in plan order, each once
        steps = [e for e in evs if isinstance(e, J.Step) and e.consumer == cid]
        assert [s.cursor for s in steps] == [BATCH * (i + 1) for i in range(STEPS)]
    stops = [e for e in evs if isinstance(e, J.ProducerStop)]
    assert len(stops) == 1 and stops[0].reason == "all consumers finished"


def test_shared_run_checkpoints(shared_run):
    for p in shared_run["consumers"]:
        check_checkpoint(shared_run["cwd"] / "runs" / p.name, p.name, STEPS)
        s = summary_line(p)
        assert s["consumer_id"] == p.name and s["steps"] == STEPS and s["cursor"] == STEPS * BATCH
        assert Path(s["checkpoint"]) == (shared_run["cwd"] / "runs" / p.name / "checkpoints" / "latest").resolve()


def test_shared_run_registrations_final(shared_run):
    regs = {r.consumer_id: r for r in registry.read_all(CacheLayout(shared_run["cache"]))}
    assert {cid: r.state for cid, r in regs.items()} == {"a": "completed", "b": "completed"}
    assert all(r.cursor == STEPS * BATCH and not r.demand for r in regs.values())
    assert not os.listdir(shared_run["cache"] / "leases")
    assert not os.listdir(shared_run["cache"] / "tmp")


# ---- (2) a consumer killed with SIGKILL mid-run ----------------------------------------------------------

def test_sigkilled_consumer_is_fenced_and_sibling_completes(tmp_path, tiny_target):
    cache = tmp_path / "cache"
    init_root(cache, tiny_target)  # the victim starts beside the producer
    prod = producer(cache, tiny_target, tmp_path, "--exit-when-done", "--done-grace", "1", "--heartbeat-timeout", "8")
    victim = sibling = None
    try:
        victim = consumer(cache, tmp_path, "victim", block_size=4, window="0:4", steps=10_000)
        # the long-running victim registers first, so the short sibling cannot finish (and, with
        # --exit-when-done, let the producer leave) before the victim is known (regression: under load the
        # sibling completed before the victim registered and the wait below failed)
        wait_until(registered(cache, "victim"), "the victim to register", [prod, victim])
        sibling = consumer(cache, tmp_path, "sibling", block_size=8, window="2:8", steps=STEPS)
        layout = CacheLayout(cache)

        def victim_mid_run() -> bool:
            reg = registry.read(layout, "victim")
            return reg is not None and reg.cursor >= 2 * BATCH

        # both registered first: with --exit-when-done the producer leaves as soon as every consumer it has
        # seen is finished or fenced, so a sibling registering after the kill would find no producer
        wait_until(registered(cache, "victim", "sibling"), "both consumers to register", [prod, victim])
        wait_until(victim_mid_run, "the victim to commit two steps", [prod, victim])
        victim.popen.send_signal(signal.SIGKILL)
        assert victim.wait() == -signal.SIGKILL
        sibling.expect(0)
        prod.expect(0)  # --exit-when-done: the fenced victim does not keep it running
    finally:
        for p in (victim, sibling, prod):
            if p is not None:
                p.kill()

    acc = inspect_json(cache)
    common_invariants(acc)
    c = acc["cache"]
    ks = by_id(acc)
    assert ks["victim"]["state"] in ("failed", "expired"), ks["victim"]
    assert ks["victim"]["steps"] >= 2 and ks["victim"]["cursor"] >= 2 * BATCH
    assert (ks["sibling"]["state"], ks["sibling"]["steps"]) == ("completed", STEPS)
    assert c["fences"] == 1

    evs = events(cache)
    fences = [e for e in evs if isinstance(e, J.Fence)]
    assert [(f.consumer, f.state) for f in fences] == [("victim", ks["victim"]["state"])]
    reg = registry.read(CacheLayout(cache), "victim")
    assert reg.state == ks["victim"]["state"] and reg.generation == fences[0].generation
    # the victim held leases when it died; every one of them expired, none leaked, none blocks eviction
    expired = Counter(e.lease.split("~")[1] for e in evs if isinstance(e, J.LeaseExpire))
    assert expired["victim"] >= 1 and expired["sibling"] == 0
    # a kill between the lease file's creation and its lease_acquire line leaves a lease that expires unjournaled
    # (e.g. acquired 262, released 258, expired 5, one of them unjournaled); only the victim was killed
    unjournaled = c["leases_unjournaled"]
    assert unjournaled <= 1
    assert ks["victim"]["leases_acquired"] == ks["victim"]["leases_released"] + expired["victim"] - unjournaled
    assert ks["sibling"]["leases_acquired"] == ks["sibling"]["leases_released"]
    assert not os.listdir(cache / "leases")
    # every publication is still on disk (the default budget holds them) or was evicted for a reason
    assert c["retained_artifacts"] == c["publications"] - c["evictions"]
    assert not any(isinstance(e, J.ConsumerEnd) and e.consumer == "victim" for e in evs)

    check_checkpoint(tmp_path / "runs" / "sibling", "sibling", STEPS)
    assert not (tmp_path / "runs" / "victim" / "checkpoints").exists()


# ---- (3) a lagging consumer after a fast one finished: recaptures -----------------------------------------

def test_lagging_consumer_forces_recaptures(tmp_path, tiny_target):
    """Under the windows-only rule (``--retention windows``) what the fast consumer read is evicted as its
    window passes, so the lagging consumer is served by recapture (test_producer_retention.py has the
    budget's version of this)."""
    cache = tmp_path / "cache"
    init_root(cache, tiny_target)  # the fast consumer starts beside the producer
    # no --exit-when-done: it must outlive the fast consumer
    prod = producer(cache, tiny_target, tmp_path, "--retention", "windows")
    fast = lagging = None
    fast_steps, lag_steps = STEPS, 4
    try:
        fast = consumer(cache, tmp_path, "fast", block_size=4, window="0:2", steps=fast_steps)
        fast.expect(0)
        # the fast consumer's window is gone: the producer evicts everything it had published
        wait_until(lambda: not any((cache / "objects").rglob("*.safetensors")), "eviction after the fast consumer",
                   [prod])
        lagging = consumer(cache, tmp_path, "lagging", block_size=8, window="1:2", steps=lag_steps)
        lagging.expect(0)
        prod.terminate_ready_producer()  # a signal finishes the batch and exits cleanly
    finally:
        for p in (fast, lagging, prod):
            if p is not None:
                p.kill()

    acc = inspect_json(cache)
    common_invariants(acc)
    c = acc["cache"]
    ks = by_id(acc)
    assert (ks["fast"]["state"], ks["fast"]["steps"]) == ("completed", fast_steps)
    assert (ks["lagging"]["state"], ks["lagging"]["steps"]) == ("completed", lag_steps)
    lag_positions = lag_steps * BATCH
    assert c["recaptures"] == lag_positions > 0
    assert c["captures"] == fast_steps * BATCH + lag_positions
    assert c["distinct_fingerprints_captured"] == fast_steps * BATCH
    assert ks["lagging"]["misses"] >= 1  # it had to wait for at least one recapture
    assert c["fences"] == 0 and c["leases_expired"] == 0

    evs = events(cache)
    recaptured = sorted(p for e in evs if isinstance(e, J.Capture) and e.recapture for p in e.positions)
    assert recaptured == list(range(lag_positions))
    stops = [e for e in evs if isinstance(e, J.ProducerStop)]
    assert len(stops) == 1 and stops[0].reason == "signal"
    check_checkpoint(tmp_path / "runs" / "fast", "fast", fast_steps)
    check_checkpoint(tmp_path / "runs" / "lagging", "lagging", lag_steps)
