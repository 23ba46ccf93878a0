"""registry: registration, generation fencing, monotonic cursor, terminal states, concurrent updates."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from artcache import registry
from artcache.errors import ConfigError, ConsumerFenced
from artcache.layout import CacheLayout
from artcache.liveness import HeartbeatWatch, ProcessIdentity, this_process
from artcache.registry import ConsumerHandle, Registration


@pytest.fixture()
def layout(tmp_path) -> CacheLayout:
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    return lay


def reg(cid: str = "c1", **kw) -> Registration:
    kw.setdefault("pid", os.getpid())
    return Registration(consumer_id=cid, draft="dflash", lookbehind=2, lookahead=4, **kw)


def test_register_sets_running_and_generation(layout):
    t0 = time.time()
    r = registry.register(layout, reg())
    assert r.generation == 1 and r.state == "running"
    assert r.identity == this_process() and r.host == this_process().hostname and r.heartbeat >= t0
    assert registry.read(layout, "c1") == r
    r2 = registry.register(layout, reg())  # same pid: a restart of the same process is allowed
    assert r2.generation == 2
    assert registry.read(layout, "c1").generation == 2


def test_register_bumps_past_terminal_generation(layout):
    r = registry.register(layout, reg())
    registry.fence(layout, "c1", "failed", "boom")
    assert registry.read(layout, "c1").generation == r.generation + 1
    r3 = registry.register(layout, reg())
    assert r3.generation == r.generation + 2 and r3.state == "running" and r3.cursor == 0


def test_register_rejects_bad_id(layout):
    for bad in ("../x", ".hidden", "a~b", "", "x" * 65, "a/b"):
        with pytest.raises(ConfigError):
            registry.register(layout, Registration(consumer_id=bad, draft="d"))
    assert list(layout.consumers.iterdir()) == []


def test_regression_id_with_trailing_newline_rejected(layout):
    """check_id used re.match with "$", which also matches before a trailing newline: "c1\\n" became a
    consumer file name."""
    for bad in ("c1\n", "producer\n"):
        with pytest.raises(ConfigError):
            registry.register(layout, Registration(consumer_id=bad, draft="d"))
        with pytest.raises(ConfigError):
            layout.journal_path("consumer", bad)
    assert list(layout.consumers.iterdir()) == []


def test_read_absent_and_read_all(layout):
    assert registry.read(layout, "nobody") is None
    registry.register(layout, reg("a"))
    registry.register(layout, reg("b"))
    (layout.consumers / "broken.json").write_bytes(b"{not json")
    (layout.consumers / "other.json").write_bytes(b'{"consumer_id":"other","draft":"d","bogus":1}')
    assert [r.consumer_id for r in registry.read_all(layout)] == ["a", "b"]


def test_window_and_liveness():
    r = Registration(consumer_id="c", draft="d", cursor=10, lookbehind=3, lookahead=5, heartbeat=100.0)
    assert r.window() == (7, 15) and r.window_size() == 9
    assert Registration(consumer_id="c", draft="d", cursor=1, lookbehind=3, lookahead=5).window() == (0, 6)
    # liveness by heartbeat progress on the reader's clock: silent for the timeout = dead
    now = [0.0]
    watch = HeartbeatWatch(30.0, clock=lambda: now[0])
    assert r.dead_reason(watch) is None  # first sight
    now[0] = 30.0
    assert r.dead_reason(watch) is None
    beat = msgspec.structs.replace(r, beat=1, heartbeat=50.0)  # progress: the silence starts again
    now[0] = 45.0
    assert beat.dead_reason(watch) is None
    now[0] = 76.0
    assert "no heartbeat progress for 31s" in beat.dead_reason(watch)


def test_window_wider_than_the_plan_is_bounded_by_it():
    """--window 0:2000000 on a 300-sample plan made every producer pass build a set of
    2 million positions; modulo the plan's length it is the 300 samples."""
    r = Registration(consumer_id="c", draft="d", cursor=5, lookbehind=0, lookahead=2_000_000)
    t0 = time.perf_counter()
    assert r.retained_positions(300) == set(range(300))
    assert time.perf_counter() - t0 < 0.05
    small = Registration(consumer_id="c", draft="d", cursor=298, lookbehind=1, lookahead=3, pinned=(310, 312))
    assert small.retained_positions(300) == {297, 298, 299, 0, 1, 10, 11}


# ---- fencing -------------------------------------------------------------------------------------
def test_handle_writes_fail_after_fence(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    h.heartbeat()
    h.commit_cursor(3)
    f = registry.fence(layout, "c1", "expired", "no heartbeat")
    assert f.state == "expired" and f.generation == h.generation + 1 and f.reason == "no heartbeat"
    before = registry.read(layout, "c1")
    for op in (h.heartbeat, lambda: h.commit_cursor(4), lambda: h.set_demand([5])):
        with pytest.raises(ConsumerFenced):
            op()
    assert registry.read(layout, "c1") == before  # nothing written by the fenced handle
    assert before.cursor == 3


def test_fence_is_a_noop_on_terminal_or_absent(layout):
    assert registry.fence(layout, "ghost", "failed", "x") is None
    assert registry.read(layout, "ghost") is None
    registry.register(layout, reg())
    first = registry.fence(layout, "c1", "failed", "first")
    assert registry.fence(layout, "c1", "expired", "second") is None
    assert registry.read(layout, "c1") == first


def test_fence_expect_generation(layout):
    r = registry.register(layout, reg())
    assert registry.fence(layout, "c1", "failed", "stale", expect_generation=r.generation - 1) is None
    assert registry.read(layout, "c1").state == "running"
    assert registry.fence(layout, "c1", "failed", "ok", expect_generation=r.generation).state == "failed"


def test_reregistration_fences_old_handle(layout):
    old = ConsumerHandle(layout, registry.register(layout, reg()))
    new = ConsumerHandle(layout, registry.register(layout, reg()))
    with pytest.raises(ConsumerFenced):
        old.commit_cursor(1)
    new.commit_cursor(1)
    assert registry.read(layout, "c1").cursor == 1


def test_handle_fenced_when_registration_deleted(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    layout.consumer_path("c1").unlink()
    with pytest.raises(ConsumerFenced):
        h.heartbeat()


# ---- cursor --------------------------------------------------------------------------------------
def test_commit_cursor_monotonic(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    assert h.commit_cursor(5).cursor == 5
    assert h.commit_cursor(5).cursor == 5  # equal is allowed
    with pytest.raises(ValueError):
        h.commit_cursor(4)
    assert registry.read(layout, "c1").cursor == 5
    h.commit_cursor(9)
    assert registry.read(layout, "c1").cursor == 9


def test_regression_commit_cursor_checks_on_disk_value(layout):
    """The monotonic check must be made against the registration under the lock, not a cached copy:
    a stale in-memory view (another thread's update landed after ours) moved the cursor backwards."""
    r = registry.register(layout, reg())
    a = ConsumerHandle(layout, r)
    b = ConsumerHandle(layout, r)  # same generation, stale view
    a.commit_cursor(10)
    with pytest.raises(ValueError):
        b.commit_cursor(5)
    assert registry.read(layout, "c1").cursor == 10


def test_heartbeat_and_demand_update(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    hb = registry.read(layout, "c1").heartbeat
    time.sleep(0.01)
    assert h.heartbeat().heartbeat > hb
    assert h.set_demand([7, 3, 7]).demand == [3, 7]
    assert registry.read(layout, "c1").demand == [3, 7]


# ---- finish --------------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["completed", "cancelled", "failed"])
def test_finish_sets_terminal_state(layout, state):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    h.set_demand([2])
    h.commit_cursor(2)
    out = h.finish(state, reason="done here")
    assert out.state == state and out.generation == h.generation + 1
    assert out.demand == [] and out.reason == "done here" and out.cursor == 2
    assert registry.read(layout, "c1") == out
    assert out.fenced_from == h.generation
    with pytest.raises(ConsumerFenced):
        h.commit_cursor(3)
    assert h.finish("failed") is None  # second finish: no-op
    assert registry.read(layout, "c1").state == state


def test_finish_after_fence_is_noop(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    fenced = registry.fence(layout, "c1", "expired", "timeout")
    assert h.finish("completed") is None
    assert registry.read(layout, "c1") == fenced


# ---- concurrency ---------------------------------------------------------------------------------
def test_threads_heartbeating_and_committing_lose_nothing(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    n = 150
    errors: list[BaseException] = []
    observed: list[int] = []
    stop = threading.Event()

    def committer():
        try:
            for c in range(1, n + 1):
                h.commit_cursor(c)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def beater():
        try:
            while not stop.is_set():
                h.heartbeat()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def demander():
        try:
            i = 0
            while not stop.is_set():
                h.set_demand([i % 5])
                i += 1
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def watcher():
        while not stop.is_set():
            r = registry.read(layout, "c1")
            observed.append(r.cursor)

    ts = [threading.Thread(target=f) for f in (beater, demander, watcher)]
    for t in ts:
        t.start()
    c = threading.Thread(target=committer)
    c.start()
    c.join()
    stop.set()
    for t in ts:
        t.join()
    assert errors == []
    final = registry.read(layout, "c1")
    assert final.cursor == n and final.generation == h.generation and final.state == "running"
    assert observed == sorted(observed), "cursor moved backwards on disk"
    with pytest.raises(ValueError):
        h.commit_cursor(n - 1)
    assert registry.read(layout, "c1").cursor == n


def test_fence_races_heartbeat(layout):
    """A fence concurrent with heartbeats always wins: afterwards the state is terminal and the
    heartbeating thread gets ConsumerFenced (it is not overwritten back to running)."""
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    started = threading.Event()
    raised: list[BaseException] = []

    def beater():
        try:
            for _ in range(100_000):
                h.heartbeat()
                started.set()
        except ConsumerFenced as exc:
            raised.append(exc)

    t = threading.Thread(target=beater)
    t.start()
    assert started.wait(30)
    assert registry.fence(layout, "c1", "failed", "test") is not None
    t.join(60)
    assert not t.is_alive()
    r = registry.read(layout, "c1")
    assert r.state == "failed" and r.generation == h.generation + 1
    assert len(raised) == 1


def test_second_live_registration_from_other_pid_refused(layout):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        first = registry.register(layout, reg(pid=child.pid))
        # bad input (exit 2), not a fence: nothing was fenced (regression: the message said ConsumerFenced)
        with pytest.raises(ConfigError, match="already running"):
            registry.register(layout, reg(pid=os.getpid()))
        assert registry.read(layout, "c1") == first
        # a different id is fine
        assert registry.register(layout, reg("c2")).generation == 1
    finally:
        child.kill()
        child.wait()
    # its process is gone: the id may be taken over
    r = registry.register(layout, reg(pid=os.getpid()))
    assert r.generation == first.generation + 1 and r.pid == os.getpid()


def test_registration_of_finished_consumer_with_live_pid_allowed(layout):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        h = ConsumerHandle(layout, registry.register(layout, reg(pid=child.pid)))
        h.finish("completed")
        assert registry.register(layout, reg(pid=os.getpid())).state == "running"
    finally:
        child.kill()
        child.wait()


def test_record_checkpoint(layout):
    h = ConsumerHandle(layout, registry.register(layout, reg()))
    assert registry.read(layout, "c1").checkpoint_cursor == -1
    h.commit_cursor(6)
    h.record_checkpoint(4)
    assert registry.read(layout, "c1").checkpoint_cursor == 4
    with pytest.raises(ValueError, match="past the committed cursor 6"):
        h.record_checkpoint(7)
    registry.fence(layout, "c1", "failed", "test")
    with pytest.raises(ConsumerFenced):  # a fenced incarnation cannot move the resume point
        h.record_checkpoint(6)
    assert registry.read(layout, "c1").checkpoint_cursor == 4


def test_register_check_runs_under_the_lock_and_can_refuse(layout):
    first = registry.register(layout, reg())
    seen = []

    def refuse(old):
        seen.append(old)
        raise ConfigError("no")

    with pytest.raises(ConfigError, match="no"):
        registry.register(layout, reg(cursor=3), check=refuse)
    assert seen == [first] and registry.read(layout, "c1") == first
    # a resumed consumer re-registers with its checkpoint's cursor: the window moves back, the old holder is fenced
    old = ConsumerHandle(layout, first)
    old.commit_cursor(9)
    r = registry.register(layout, reg(cursor=4, checkpoint_cursor=4), check=lambda o: None)
    assert (r.cursor, r.checkpoint_cursor, r.generation) == (4, 4, first.generation + 1)
    with pytest.raises(ConsumerFenced):
        old.heartbeat()


FAR = ProcessIdentity(host="f" * 16, pid=1, start=7, hostname="elsewhere")


def test_register_refuses_a_holder_on_another_host_while_its_heartbeat_moves(layout):
    """Another host's consumer is judged by heartbeat progress watched on this process's
    monotonic clock (never by comparing its wall-clock heartbeat with ours, nor by its pid)."""
    far = registry.register(layout, reg(identity=FAR))
    other = ConsumerHandle(layout, far)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            other.heartbeat()

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(ConfigError, match="running as pid 1 on elsewhere .*heartbeat is progressing"):
            registry.register(layout, reg(), live_timeout_s=5, poll_s=0.05)
    finally:
        stop.set()
        t.join()
    # silent for the watch (its wall-clock heartbeat is "fresh" by our clock: irrelevant): taken over
    t0 = time.monotonic()
    r = registry.register(layout, reg(), live_timeout_s=0.5, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.5 and r.generation == far.generation + 1 and r.identity == this_process()
    with pytest.raises(ConsumerFenced):
        other.heartbeat()


def test_register_takes_over_a_legacy_registration_after_watching_it(layout):
    """Migration rule: a registration written before identities (no identity, beat 0, a host name) is never
    pid-checked, whatever its host name says; it is watched like another host's."""
    legacy = b'{"consumer_id":"c1","draft":"d","state":"running","generation":3,"pid":1,"host":"vm",' \
             b'"heartbeat":1.5}'
    layout.consumer_path("c1").write_bytes(legacy)
    old = registry.read(layout, "c1")
    assert old.identity is None and old.beat == 0 and old.progress_token() == (3, 0, 1.5)
    r = registry.register(layout, reg(), live_timeout_s=0.3, poll_s=0.05)
    assert r.generation == 4 and r.identity == this_process()


def test_pinned_positions_are_readable_and_retained():
    r = Registration(consumer_id="c", draft="d", cursor=5, lookahead=2, lookbehind=1, end=7, pinned=(20, 23))
    assert r.window() == (4, 6) and r.pinned_range() == range(20, 23)
    assert [p for p in range(0, 30) if r.may_read(p)] == [5, 6, 20, 21, 22]
    assert r.retained_positions() == {4, 5, 6, 20, 21, 22} and r.retain_bound() == 4 + 3


def test_regression_read_of_a_garbage_registration_names_it(layout):
    """Breakfix report: registry.read raised a bare msgspec.DecodeError for a registration that is not JSON;
    read_all still skips it (fsck reports it)."""
    from artcache.errors import CacheRootError

    layout.consumer_path("g").write_text("{garbage")
    with pytest.raises(CacheRootError, match="fsck"):
        registry.read(layout, "g")
    assert [r.consumer_id for r in registry.read_all(layout)] == []


def _failing_writes(monkeypatch, code: int, times: int) -> list[int]:
    """registry._write raises PublishError(code) for its next ``times`` calls (-1: always); the count of
    failures so far is returned (a list of one)."""
    import errno as _errno

    from artcache.errors import PublishError

    real, failed = registry._write, [0]

    def write(layout, reg):
        if times < 0 or failed[0] < times:
            failed[0] += 1
            raise PublishError(f"writing {reg.consumer_id}.json failed: {os.strerror(code)}",
                               retryable=code not in (_errno.ENOSPC, _errno.EDQUOT), errno_=code)
        return real(layout, reg)

    monkeypatch.setattr(registry, "_write", write)
    return failed


def test_regression_a_heartbeat_on_a_full_disk_is_retried_not_fatal(layout, monkeypatch, caplog):
    """With 0 bytes free a consumer died on its first registration rewrite (PublishError
    ENOSPC) while the disk was only momentarily full. A write failing for space is now tried again for up to
    ``space_wait_s`` (the root's heartbeat timeout), logged once; it succeeds once space is back."""
    import errno

    monkeypatch.setattr(registry, "SPACE_RETRY_S", 0.05)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="d", pid=os.getpid()))
    handle = registry.ConsumerHandle(layout, reg, space_wait_s=5.0)
    failed = _failing_writes(monkeypatch, errno.ENOSPC, 3)
    assert handle.commit_cursor(2).cursor == 2 and failed[0] == 3
    assert registry.read(layout, "c").cursor == 2
    assert caplog.text.count("writing its registration failed") == 1


def test_regression_a_full_disk_fails_the_heartbeat_after_space_wait_s(layout, monkeypatch):
    """... and past ``space_wait_s`` the write fails with the existing error (PublishError, ENOSPC); any
    other error (EIO) is raised at once."""
    import errno

    from artcache.errors import PublishError

    monkeypatch.setattr(registry, "SPACE_RETRY_S", 0.05)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="d", pid=os.getpid()))
    handle = registry.ConsumerHandle(layout, reg, space_wait_s=0.5)
    _failing_writes(monkeypatch, errno.ENOSPC, -1)
    t0 = time.monotonic()
    with pytest.raises(PublishError, match="No space left") as info:
        handle.heartbeat()
    assert info.value.errno == errno.ENOSPC and 0.3 <= time.monotonic() - t0 < 3
    failed = _failing_writes(monkeypatch, errno.EIO, -1)
    t0 = time.monotonic()
    with pytest.raises(PublishError):
        handle.heartbeat()
    assert failed[0] == 1 and time.monotonic() - t0 < 0.3


def test_regression_a_registration_on_a_full_disk_names_the_full_path(tmp_path, monkeypatch):
    """Regression: a registration that failed for space said ``writing c.json failed: No space left on device``,
    a basename that does not say which filesystem is full. The message names the file's full path (also for a
    cache root given as a relative path)."""
    import errno

    from artcache import fsio
    from artcache.errors import PublishError

    monkeypatch.chdir(tmp_path)
    lay = CacheLayout(Path("root"))
    lay.create()

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsio.os, "write", full)
    with pytest.raises(PublishError) as info:
        registry.register(lay, Registration(consumer_id="c", draft="d", pid=os.getpid()))
    monkeypatch.undo()
    assert str(info.value) == f"writing {tmp_path / 'root' / 'consumers' / 'c.json'} failed: No space left on device"
    assert info.value.errno == errno.ENOSPC and list((tmp_path / "root" / "tmp").iterdir()) == []
