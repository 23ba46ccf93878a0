"""kill -9 at every named crash point (``ARTCACHE_CRASH_AT``), with real ``artcache producer`` / ``artcache
consume`` processes on the fast ``random:tiny-llama`` target and synthetic data.

After each kill: every artifact in ``objects/`` verifies (no torn or temp file is ever readable), the
killed work is captured again by a restarted producer and a consumer runs to completion, orphaned temp
files are removed by the next producer start, a killed consumer is fenced and its leases expire, and
``artcache inspect --json`` reports no invariant violation except the one a killed producer explains:
captures it journaled but never published (``captures != publications + failures``).

Run: ``python -m pytest -q -m reliability tests/reliability/test_crash.py`` (deadlines only bound a hang).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from artcache import journal as J
from artcache import registry, store
from artcache.layout import CacheLayout
from artcache.trainers.checkpoint import find_checkpoint, read_state
from tests.support.procs import Proc as BaseProc
from tests.support.procs import inspect_json, verify_all_published, wait_until

DEADLINE_S = 150.0
STEPS, BATCH = 4, 2
PLAN = ["--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "16", "--max-length", "32",
        "--draft-layers", "3"]
#: the one violation a SIGKILLed producer explains: it journaled captures it never got to publish
KILLED_PRODUCER_VIOLATION = "captures "
#: a consumer SIGKILLed after committing its cursor but before releasing the batch's leases leaves
#: leases on positions now behind its window (lookbehind 0 here) until the producer expires them (its
#: next pass): a Retained event of that pass can exceed the window bound by those leased artifacts
KILLED_AFTER_COMMIT_VIOLATION = "max retained artifacts "


class Proc(BaseProc):
    deadline = DEADLINE_S


def start_producer(cwd: Path, cache: Path, crash_at: str | None = None) -> Proc:
    # --retention windows: these crash points test the window protocol (evict what left every window);
    # retention by need under the default budget would keep everything and never reach evict.* points
    return Proc("producer", ["producer", "--cache", str(cache), *PLAN, "--threads", "1", "--batch-samples", "2",
                             "--heartbeat-timeout", "20", "--retention", "windows"], cwd, crash_at)


def start_consumer(cwd: Path, cache: Path, cid: str, crash_at: str | None = None, window: str = "0:2",
                   resume: bool = False, out: str | None = None) -> Proc:
    return Proc(cid, ["consume", "--cache", str(cache), "--id", cid, "--block-size", "4", "--window", window,
                      "--anchors", "4", "--steps", str(STEPS), "--batch-size", str(BATCH), "--threads", "1",
                      "--demand-timeout", "120", "--log-every", "1", "--out", str(cwd / "runs" / (out or cid)),
                      *(["--resume"] if resume else [])], cwd, crash_at)


def init_root(cwd: Path) -> Path:
    """Initialise the root in-process (as a producer would) so producer and consumers start together."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = cwd / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_samples=16,
                                max_length=32, draft_layers=3))
    return cache


def tmp_of(cache: Path, pid: int) -> list[str]:
    from artcache.layout import parse_temp_name

    out = []
    for p in (cache / "tmp").iterdir():
        w = parse_temp_name(p.name)
        if w is not None and w.identity is not None and w.identity.pid == pid:
            out.append(p.name)
    return sorted(out)


def unexplained(acc: dict, producer_killed: bool = False, consumer_killed_after_commit: bool = False) -> list[str]:
    allowed = (KILLED_PRODUCER_VIOLATION,) if producer_killed else ()
    if consumer_killed_after_commit:
        allowed += (KILLED_AFTER_COMMIT_VIOLATION,)
    return [v for v in acc["violations"] if not v.startswith(allowed)]


def file_events(cache: Path, role: str, ident: str, pid: int) -> list:
    path = CacheLayout(cache).journal_of(role, ident, pid)
    return [e for e in J.iter_file(path) if e is not None] if path is not None else []


def consumed_positions(cache: Path, cid: str) -> set[int]:
    evs = J.read_events(CacheLayout(cache).journal).events
    return {e.position for e in evs if isinstance(e, J.Request) and e.consumer == cid}


# ---- producer-side crash points --------------------------------------------------------------------------

PRODUCER_POINTS = {
    # point: temp-file suffix the dead producer leaves in tmp/ (None: nothing)
    "publish.after-write": ".part",
    "publish.after-fsync": ".part",
    "publish.after-rename": None,
    "capture.after-forward": None,
    "evict.after-rename": ".evict",
}


@pytest.mark.parametrize("point", list(PRODUCER_POINTS))
def test_producer_killed_at_crash_point(tmp_path, point):
    cache = init_root(tmp_path)
    cons = start_consumer(tmp_path, cache, "c")
    prod = start_producer(tmp_path, cache, crash_at=point)
    restarted = None
    try:
        prod.expect(-signal.SIGKILL)
        # nothing torn or temporary is ever readable: every published file verifies
        verify_all_published(cache)
        suffix = PRODUCER_POINTS[point]
        orphans = tmp_of(cache, prod.pid)
        if suffix is None:
            assert orphans == []
        else:
            assert len(orphans) == 1 and orphans[0].endswith(suffix), orphans
        killed = file_events(cache, "producer", "producer", prod.pid)
        published = {e.fp for e in killed if isinstance(e, J.Publish)}
        lost = {e.fp for e in killed if isinstance(e, J.Capture)} - published
        if point.startswith("publish."):
            assert lost, "the producer died inside a publication: one capture was never journaled as published"
        if point == "publish.after-rename":  # renamed, so it is published (complete) though not journaled
            # the one being renamed is complete in objects/ (the batch's later ones were never written)
            assert sum(store.exists(CacheLayout(cache), fp) for fp in lost) == 1

        restarted = start_producer(tmp_path, cache)
        # the next producer start removes the dead writer's temp files
        wait_until(lambda: tmp_of(cache, prod.pid) == [], "orphan cleanup", [restarted])
        cons.expect(0)
        verify_all_published(cache)
        restarted.terminate_ready_producer()
    finally:
        for p in (cons, prod, restarted):
            if p is not None:
                p.kill()

    assert consumed_positions(cache, "c") == set(range(STEPS * BATCH))
    again = file_events(cache, "producer", "producer", restarted.pid)
    republished = {e.fp for e in again if isinstance(e, J.Publish)}
    for fp in lost:
        # the killed fingerprint was captured again (unless the rename had already published it)
        assert fp in republished or point == "publish.after-rename", fp
    acc = inspect_json(cache)
    assert unexplained(acc, producer_killed=True) == [], acc["violations"]
    if not lost:
        assert acc["violations"] == []
    assert acc["cache"]["leases_held"] == 0 and acc["cache"]["quarantined"] == 0
    assert not os.listdir(cache / "tmp")


# ---- consumer-side crash points --------------------------------------------------------------------------

CONSUMER_POINTS = ["lease.after-create:3", "cursor.before-commit:2", "cursor.after-commit:2"]


@pytest.mark.parametrize("crash_at", CONSUMER_POINTS)
def test_consumer_killed_at_crash_point(tmp_path, crash_at):
    _consumer_killed(tmp_path, crash_at)


def test_regression_no_lease_outside_window_after_commit_kill(tmp_path):
    """Leases used to be released after the cursor commit: a consumer killed in between left leased
    artifacts behind its window and `inspect` reported max retained > window bound."""
    _consumer_killed(tmp_path, "cursor.after-commit:1")


def _consumer_killed(tmp_path, crash_at):
    cache = init_root(tmp_path)
    layout = CacheLayout(cache)
    prod = start_producer(tmp_path, cache)
    victim = start_consumer(tmp_path, cache, "v", crash_at=crash_at)
    again = None
    try:
        victim.expect(-signal.SIGKILL)
        verify_all_published(cache)

        def fenced() -> bool:
            reg = registry.read(layout, "v")
            return reg is not None and reg.state in ("failed", "expired")

        wait_until(fenced, "the producer to fence the killed consumer", [prod])
        wait_until(lambda: not [n for n in os.listdir(cache / "leases") if "~v~" in n],
                   "the killed consumer's leases to expire", [prod])
        reg = registry.read(layout, "v")
        nth = int(crash_at.split(":")[1]) if ":" in crash_at else 1
        if crash_at.startswith("cursor.after-commit"):
            assert reg.cursor == nth * BATCH  # the n-th step committed just before the kill
        elif crash_at.startswith("cursor.before-commit"):
            assert reg.cursor == (nth - 1) * BATCH  # the n-th step's commit never happened
        # restarted with the same --id: registers (generation bumped past the fence) and completes
        again = start_consumer(tmp_path, cache, "v")
        again.expect(0)
        prod.terminate_ready_producer()
    finally:
        for p in (prod, victim, again):
            if p is not None:
                p.kill()

    evs = J.read_events(layout.journal).events
    fences = [e for e in evs if isinstance(e, J.Fence)]
    assert [(f.consumer, f.state) for f in fences] == [("v", "failed")]
    assert registry.read(layout, "v").generation > fences[0].generation
    expired = [e for e in evs if isinstance(e, J.LeaseExpire)]
    assert all(e.reason == "holder-dead" for e in expired)
    acc = inspect_json(cache)
    # leases are released before the cursor commit, so no kill point leaves a leased artifact
    # outside the window (test_regression_no_lease_outside_window_after_commit_kill)
    assert acc["violations"] == []
    c = acc["cache"]
    assert c["leases_held"] == 0 and c["fences"] == 1
    if crash_at.startswith("lease."):
        assert c["leases_unjournaled"] == 1  # created, killed before journaling: expired, counted apart
    assert not os.listdir(cache / "leases") and not os.listdir(cache / "tmp")


# ---- SIGKILL at a random time ----------------------------------------------------------------------------

def test_random_time_sigkill(tmp_path):
    seed = int(os.environ.get("ARTCACHE_CRASH_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"random-kill seed={seed} (rerun with ARTCACHE_CRASH_SEED={seed})")
    rng = random.Random(seed)
    cache = init_root(tmp_path)
    layout = CacheLayout(cache)
    victim_role = rng.choice(["producer", "consumer"])
    prod = start_producer(tmp_path, cache)
    cons = start_consumer(tmp_path, cache, "r", window=rng.choice(["0:2", "1:4", "2:8"]))
    procs = [prod, cons]
    try:
        # kill somewhere between the first registration and the end of the run
        wait_until(lambda: registry.read(layout, "r") is not None, "registration", procs)
        delay = rng.uniform(0.0, 3.0)
        print(f"killing the {victim_role} after {delay:.2f}s")
        time.sleep(delay)
        victim = prod if victim_role == "producer" else cons
        if victim.popen.poll() is None:
            victim.popen.send_signal(signal.SIGKILL)
        victim.wait()
        verify_all_published(cache)
        if victim_role == "producer":
            prod = start_producer(tmp_path, cache)
            procs.append(prod)
            wait_until(lambda: tmp_of(cache, victim.pid) == [], "orphan cleanup", [prod])
            cons.expect(0)
        else:
            if victim.popen.returncode == -signal.SIGKILL:
                wait_until(lambda: registry.read(layout, "r").state != "running", "fence", [prod])
                # Since today a consumer refuses an --out holding checkpoints unless --resume
                # (restore.refuse_existing_run): the restart continues the killed run from the checkpoint
                # the registry recorded; it starts afresh when the kill came before the first one, and in
                # another --out when that checkpoint is already the last step (--resume: nothing left to train).
                cursor = registry.read(layout, "r").checkpoint_cursor
                ckpt = find_checkpoint(tmp_path / "runs" / "r", cursor=cursor) if cursor >= 0 else None
                done = ckpt is not None and read_state(ckpt).step >= STEPS
                cons = start_consumer(tmp_path, cache, "r", resume=ckpt is not None and not done,
                                      out="r-again" if done else None)
                procs.append(cons)
                cons.expect(0)
            else:  # it finished before the kill: its run is complete, there is nothing to restart
                assert victim.popen.returncode == 0, victim.tail()
        verify_all_published(cache)
        prod.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()
    assert registry.read(layout, "r").state == "completed"
    acc = inspect_json(cache)
    assert unexplained(acc, producer_killed=victim_role == "producer",
                       consumer_killed_after_commit=victim_role == "consumer") == [], (seed, acc["violations"])
    assert acc["cache"]["leases_held"] == 0 and acc["cache"]["quarantined"] == 0
    assert acc["cache"]["torn_journal_lines"] <= 1  # at most the line being written at the kill
    assert not os.listdir(cache / "leases") and not os.listdir(cache / "tmp")
