"""Faults found by replaying public bug reports, each reproduced with real ``artcache producer``
processes on the fast ``random:tiny-llama`` target and the same injected errno (tests/support/faultinject's
sitecustomize wraps ``os`` calls in the child) or signal, or in-process where the fault is one call.

The consumer side of these runs is a registration this test process holds (its window is what the producer
serves; this process is alive, so it is live), so no trainer process is needed. Deadlines only bound a hang.
The process tests run in the reliability lane (a producer start is 10-20 s on a loaded 2-core machine) and
record their figures there (tests/support/reliability_figures.py, section "replays": faults injected per errno and
site, hangs, false violations); the in-process ones run in the default lane too.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from artcache import journal as J
from artcache import registry, store
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
from tests.support.procs import dead_pid
from tests.support.reliability_figures import record


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """An initialised root (as `artcache producer` leaves it), copied per test."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path_factory.mktemp("template") / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_samples=64,
                                max_length=32, draft_layers=3, heartbeat_timeout_s=600.0))
    return cache


@pytest.fixture()
def cache(template, tmp_path) -> Path:
    import shutil

    dest = tmp_path / "cache"
    shutil.copytree(template, dest, symlinks=True)
    return dest


def hold_window(cache: Path, cid: str = "c", lookahead: int = 7, end: int = 8, **kw) -> registry.ConsumerHandle:
    """A consumer registration held by this (live) process: the producer serves [0, end)."""
    reg = registry.register(CacheLayout(cache), registry.Registration(
        consumer_id=cid, draft="fake", lookahead=lookahead, end=end, pid=os.getpid(), **kw))
    return registry.ConsumerHandle(CacheLayout(cache), reg)


def figure(fault: str, site: str, injected: int, *, false_violations: int = 0, lost_steps: int = 0) -> None:
    """One row of the lane's "replays" table: the run ended (no hang) with these counts."""
    record("replays", f"{fault} at {site}", injected=injected, hangs=0, false_violations=false_violations,
           lost_steps=lost_steps, passed=1)


# ---- item 4: --exit-when-done exits when no consumer can come -------------------------------------------


def test_regression_exit_when_done_counts_every_expected_consumer_before_the_grace(layout):
    """Tidy item 3: the bench gave every producer ``--done-grace 5`` (20 s idle in the CPU bench) although its
    ``--expect-consumers`` already counts every consumer it serves. What makes ``--done-grace 0`` safe there:
    "done" (no consumer can come) never holds while fewer than ``--expect-consumers`` have registered, even when
    every one registered so far has ended; it holds once the last expected one registered and ended."""
    from artcache.producer import Producer, ProducerConfig
    from tests.support import crash_child as K

    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    cfg = ProducerConfig(cache=str(layout.root), exit_when_done=True, done_grace_s=0.0, expect_consumers=2)
    p = Producer(layout, K.settings(), K.FakePlan(), K.FakeBackend(), cfg, journal)
    try:
        first = hold_window(layout.root, "a")
        p.live_registrations()
        assert not p.done()  # "a" is live
        first.finish("completed")
        assert p.live_registrations() == [] and not p.done()  # "b" has not registered yet
        hold_window(layout.root, "b").finish("completed")
        assert p.live_registrations() == [] and p.done()
    finally:
        p.drain()
        journal.close()


@pytest.mark.parametrize("expect", [0, 2])
def test_regression_exit_when_done_ignores_registrations_that_ended_before_the_producer_started(layout, expect):
    """On a reused root, `artcache producer --exit-when-done` exited (rc 0, "0 captures") a grace after it
    started, before any new consumer came, because the completed registrations of earlier runs counted as
    consumers that had registered (also towards --expect-consumers); a `consume --resume` started seconds later
    then failed with CaptureTimeout. Only a registration made or renewed since the producer started counts."""
    from artcache.producer import Producer, ProducerConfig
    from tests.support import crash_child as K

    hold_window(layout.root, "old").finish("completed")  # an earlier run's
    hold_window(layout.root, "older").finish("failed")
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    cfg = ProducerConfig(cache=str(layout.root), exit_when_done=True, done_grace_s=0.0, expect_consumers=expect)
    p = Producer(layout, K.settings(), K.FakePlan(), K.FakeBackend(), cfg, journal)
    try:
        assert p.live_registrations() == [] and not p.done()  # nobody came for this producer yet
        again = hold_window(layout.root, "old")  # re-registered (--resume): generation bumped
        assert [r.consumer_id for r in p.live_registrations()] == ["old"] and not p.done()
        again.finish("completed")
        assert p.live_registrations() == [] and p.done() == (expect < 2)
        hold_window(layout.root, "new").finish("completed")
        assert p.live_registrations() == [] and p.done()
    finally:
        p.drain()
        journal.close()


# ---- item 6: ESTALE / EBUSY / EIO on a read is a miss; on eviction, retried later ----------------------------

def test_regression_estale_on_opening_an_artifact_is_a_miss(layout, monkeypatch):
    """As in PyTorch #173679, NFS: one ESTALE opening an artifact killed the consumer with a raw
    ``OSError: [Errno 116]``. It is a miss: the read is retried; after three in a row the file is
    quarantined so the producer recaptures it."""
    from artcache.client import CacheClient
    from tests.support import crash_child as K

    plan = K.FakePlan()
    fp_of = PlanFingerprints(K.CONTRACT, plan)
    for pos in (0, 1):
        store.publish(layout, fp_of(pos), K.CONTRACT, K.fake_capture(plan.sample(pos)), durable=False)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="d", lookahead=4, pid=os.getpid()))
    journal = J.JournalWriter(layout.journal_path("consumer", "c"))
    client = CacheClient(layout, K.settings(), plan, registry.ConsumerHandle(layout, reg), journal, 10.0)
    real_open = os.open
    stale = {"left": 1, "target": str(layout.object_path(fp_of(0)))}

    def flaky_open(path, *a, **kw):
        if str(path) == stale["target"] and stale["left"]:
            stale["left"] -= 1
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", flaky_open)
    item = client.acquire(0)
    assert item.artifact.fingerprint == fp_of(0) and stale["left"] == 0
    client.release(item)
    # stale three times in a row: quarantined; a republication (the producer's recapture) serves the wait
    stale.update(left=3, target=str(layout.object_path(fp_of(1))))
    threading.Timer(0.5, lambda: store.publish(layout, fp_of(1), K.CONTRACT, K.fake_capture(plan.sample(1)),
                                                durable=False)).start()
    item = client.acquire(1)
    assert item.artifact.fingerprint == fp_of(1) and len(os.listdir(layout.quarantine)) == 1
    journal.close()
    figure("ESTALE", "artifact open (read)", 4)


def test_regression_estale_on_eviction_is_retried_next_pass(layout, monkeypatch):
    """ESTALE once on the evictor's rename killed the producer. The artifact is kept for
    that pass and evicted by the next one."""
    from artcache.eviction import evict_pass
    from tests.support import crash_child as K

    plan = K.FakePlan()
    fp = PlanFingerprints(K.CONTRACT, plan)(0)
    store.publish(layout, fp, K.CONTRACT, K.fake_capture(plan.sample(0)), durable=False)
    real_replace = os.replace
    calls = {"n": 0}

    def stale_once(src, dst, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(src))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", stale_once)
    res = evict_pass(layout, [fp], set())
    assert res.deferred == {fp: errno.ESTALE} and store.exists(layout, fp)
    res = evict_pass(layout, [fp], set())
    assert set(res.evicted) == {fp} and not store.exists(layout, fp)
    figure("ESTALE", "eviction rename", 1)


# ---- item 8: group-shared roots are readable by the group ------------------------------------------------

def test_regression_group_shared_root_files_are_group_readable(tmp_path):
    """As in huggingface_hub #1215: with umask 007 plans/<id>/plan.safetensors was 0600
    (safetensors ignores the umask), so a group member's consumer could not read the plan; checkpoint
    tensors were 0600 too, so a teammate could not export them."""
    import stat

    import torch

    from artcache.producer import ProducerConfig, prepare_root
    from artcache.trainers.checkpoint import save_checkpoint

    old = os.umask(0o007)
    try:
        layout, settings, *_ = prepare_root(ProducerConfig(
            cache=str(tmp_path / "cache"), target="random:tiny-llama", dataset="synthetic", max_samples=4,
            max_length=32, draft_layers=3, group_shared=True))
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = save_checkpoint(tmp_path / "run", step=1, cursor=2, weights=model.state_dict(), optimizer=opt,
                               generators={}, extra_tensors={}, state={})
        j = J.JournalWriter(layout.journal_path("producer", "p"))
        j.close()
    finally:
        os.umask(old)
    plan_dir = layout.plan_dir(settings.plan_id)
    files = [*plan_dir.iterdir(), layout.settings, j.path, *ckpt.iterdir()]
    for f in files:
        mode = stat.S_IMODE(os.stat(f).st_mode)
        assert mode & 0o040, f"{f} is {oct(mode)}: not readable by the group"
    assert stat.S_IMODE(os.stat(plan_dir).st_mode) & 0o070 == 0o070


def test_group_shared_root_gives_group_read_whatever_the_umask(tmp_path):
    """In a group-shared (setgid) root, files artcache writes get the group's read bit even under umask
    077; elsewhere the umask is honoured."""
    import stat

    from artcache.fsio import atomic_write

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2770)
    private = tmp_path / "private"
    private.mkdir()
    old = os.umask(0o077)
    try:
        atomic_write(shared / "a", [b"x"], shared)
        atomic_write(private / "b", [b"x"], private)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(shared / "a").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(private / "b").st_mode) == 0o600


# ---- item 10: a producer whose every capture failed exits nonzero ------------------------------------------

def test_regression_every_capture_failing_exits_nonzero_and_accounts(layout):
    """A backend failing every batch left `captures 0 != publications 0 + failures 24`
    (inspect exit 3), and the producer printed 24 failures and exited 0."""
    from artcache.accounting import account
    from artcache.errors import ProducerFailed
    from artcache.producer import Producer, ProducerConfig
    from tests.support import crash_child as K

    class Broken:
        def capture(self, samples):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    registry.register(layout, registry.Registration(consumer_id="c", draft="d", lookahead=7, end=8, pid=os.getpid()))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    cfg = ProducerConfig(cache=str(layout.root), poll_interval_s=0.0, heartbeat_timeout_s=600)
    p = Producer(layout, K.settings(), K.FakePlan(), Broken(), cfg, journal)
    p._emit(J.ProducerStart(producer="p", pid=os.getpid(), contract_id="c", plan_id="p"))
    for _ in range(12):
        p.tick()
    p.drain()
    p._emit(J.ProducerStop(producer="p", reason="signal"))
    journal.close()
    with pytest.raises(ProducerFailed, match="every capture failed"):
        p.check_outcome()
    acc = account(layout)
    assert acc.violations == [] and acc.cache.failures == acc.cache.forward_failures == p.stats.failures > 0
    assert acc.cache.captures == 0


# ---- item 11: per-pass work is bounded by the plan and the consumers -------------------------------------

def test_regression_pass_work_is_bounded_by_the_plan_not_the_window(layout, monkeypatch):
    """`--window 0:2000000` on a 300-sample plan: 44 steps in 40 s against 840 with 0:64 and
    +220 MB producer RSS: retained_positions()/wanted() looped over every window position each pass. Since
    retention by need, the pass's work is the window positions :func:`artcache.eviction.decide` maps to
    samples (``EpochOrder.samples`` spans): counted here, they stay within two epochs of the plan."""
    from artcache.plan import EpochOrder
    from artcache.producer import Producer, ProducerConfig
    from tests.support import crash_child as K

    spans = []
    real = EpochOrder.samples

    def counting(self, lo, hi):
        spans.append(hi - lo)
        return real(self, lo, hi)

    monkeypatch.setattr(EpochOrder, "samples", counting)
    registry.register(layout, registry.Registration(consumer_id="c", draft="d", lookahead=2_000_000,
                                                    pid=os.getpid()))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    cfg = ProducerConfig(cache=str(layout.root), heartbeat_timeout_s=1e6)  # the consumer beats nowhere
    p = Producer(layout, K.settings(), K.FakePlan(), K.FakeBackend(), cfg, journal)
    try:
        for _ in range(30):  # capture everything (40 samples), then idle passes
            p.tick()
        p.drain()
        spans.clear()
        p.tick()
    finally:
        p.drain()
        journal.close()
    assert len(store.list_objects(layout)) == K.N_SAMPLES
    assert spans and max(spans) <= 2 * K.N_SAMPLES, max(spans, default=None)


# ---- item 12: messages ---------------------------------------------------------------------------------------


# ---- item 1 (library side): heartbeats are counters, timed on the reader's monotonic clock ---------------

def test_regression_wall_clock_step_fences_nobody(layout, monkeypatch):
    """A +40 s wall-clock step (NTP) fenced every live consumer: heartbeats were wall-clock
    times compared by another process. The producer now watches each registration's heartbeat counter on its
    own monotonic clock: a step of the wall clock (-40 s in the consumer while it beats, +40 s in the producer
    while it looks) changes nothing, and a consumer whose counter stops is fenced once it has been still for
    the timeout. Each step is applied to one side only (``time.time`` is one function for the whole test
    process): stepping both together leaves the heartbeat's age unchanged, and the pre-fix wall-clock
    comparison passed that version (checked on e3a6d61^; this one fails there: "live" is fenced)."""
    from artcache.producer import Producer, ProducerConfig
    from tests.support import crash_child as K

    now = [1000.0]
    live = hold_window(layout.root, "live")
    hold_window(layout.root, "still")  # registered, never beats again
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    cfg = ProducerConfig(cache=str(layout.root), heartbeat_timeout_s=5.0)
    p = Producer(layout, K.settings(), K.FakePlan(), K.FakeBackend(), cfg, journal)
    p._beats.clock = lambda: now[0]  # the producer's monotonic clock, advanced by hand
    real_time = time.time
    try:
        assert {r.consumer_id for r in p.live_registrations()} == {"live", "still"}
        for _ in range(2):
            now[0] += 2.0
            with monkeypatch.context() as m:
                m.setattr("time.time", lambda: real_time() - 40)  # the consumer's clock, while it beats
                live.heartbeat()
            assert {r.consumer_id for r in p.live_registrations()} == {"live", "still"}
        now[0] += 2.0
        live.heartbeat()
        with monkeypatch.context() as m:
            m.setattr("time.time", lambda: real_time() + 40)  # the producer's clock, while it looks
            assert {r.consumer_id for r in p.live_registrations()} == {"live"}  # "still": still for 6 s > 5 s
    finally:
        p.drain()
        journal.close()
    assert registry.read(layout, "live").state == "running"
    st = registry.read(layout, "still")
    assert st.state == "expired" and "no heartbeat progress for 6s" in st.reason


# ---- item 9: inspect reads one consistent snapshot (a test of its own, under load) -----------------------


# ---- item 1: a paused consumer keeps its work ----------------------------------------------------------------


def test_regression_fence_of_a_consumer_holding_its_lock_does_not_kill_the_producer(layout):
    """A SIGSTOPped consumer can hold its own registration lock; the producer's fence of it waited 30 s for
    the lock and then died with LockTimeout (seen in the paused-consumer replay after the faults-liveness
    rebase). It now waits FENCE_LOCK_TIMEOUT_S, keeps the consumer's window this pass and fences it once
    the lock is free."""
    from artcache.locking import cache_lock
    from artcache.producer import FENCE_LOCK_TIMEOUT_S, Producer, ProducerConfig
    from tests.support import crash_child as K

    registry.register(layout, registry.Registration(consumer_id="dead", draft="fake", lookahead=7, end=8,
                                                    pid=dead_pid()))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    p = Producer(layout, K.settings(), K.FakePlan(), K.FakeBackend(), ProducerConfig(cache=str(layout.root)),
                 journal)
    held = cache_lock(layout.consumer_lock("dead"), thread_local=False)
    held.acquire()
    try:
        t0 = time.monotonic()
        assert [r.consumer_id for r in p.live_registrations()] == ["dead"]  # window kept, no exception
        assert time.monotonic() - t0 < FENCE_LOCK_TIMEOUT_S + 5
        assert registry.read(layout, "dead").state == "running"
        held.release()
        assert p.live_registrations() == []
        assert registry.read(layout, "dead").state == "failed"
    finally:
        if held.is_locked:
            held.release()
        p.drain()
        journal.close()
