"""The producer gives up on a fingerprint after MAX_ATTEMPTS failed captures and says so on disk."""

from __future__ import annotations

import json
import os

from artcache import journal as J
from artcache import registry
from artcache.layout import CacheLayout
from artcache.producer import MAX_ATTEMPTS, Producer, ProducerConfig
from artcache.settings import RootSettings


class _BrokenBackend:
    calls = 0

    def capture(self, samples):
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_producer_gives_up_after_max_attempts_and_writes_the_failure(tmp_path, fake_plan, small_contract):
    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=small_contract, target_path="/nowhere")
    registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", lookahead=0, end=1,
                                                    pid=os.getpid()))
    backend = _BrokenBackend()
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, settings, fake_plan, backend, ProducerConfig(cache=str(tmp_path)), journal)
    try:
        for _ in range(MAX_ATTEMPTS + 2):
            producer.tick()
    finally:
        producer.drain()
        journal.close()
    fp = producer.fp_of(0)
    assert backend.calls == MAX_ATTEMPTS  # then it stops retrying
    record = json.loads(layout.failure_path(fp).read_text())
    assert record["fingerprint"] == fp and record["attempts"] == MAX_ATTEMPTS
    assert "illegal memory access" in record["error"]
    fails = [e for e in J.read_events(layout.journal).events if isinstance(e, J.CaptureFailure)]
    assert len(fails) == MAX_ATTEMPTS and all(e.fp == fp for e in fails)


def test_second_producer_on_a_root_is_warned_about(tmp_path):
    """A second `artcache producer` on the same root started silently. It now logs a
    warning while another live process holds locks/producer.lock. Once
    the first producer exited, a third one started while the second still ran got no warning; the warned
    producer now takes the lock over when it is freed."""
    import subprocess
    import sys
    import time

    from artcache.locking import Timeout, cache_lock
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    claim = ("import sys, time\n"
             "from pathlib import Path\n"
             "from artcache.layout import CacheLayout\n"
             "from artcache.producer import claim_producer_presence\n"
             "lock = claim_producer_presence(CacheLayout(Path(sys.argv[1])))\n"
             "print('held' if lock else 'not held', flush=True)\n"
             "time.sleep(float(sys.argv[2]))\n")

    def producer(stay_s: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", claim, str(layout.root), str(stay_s)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def held_by_another() -> bool:  # a plain try-lock: no waiter thread in this process
        lock = cache_lock(layout.lock_path("producer"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return True
        lock.release()
        return False

    first, second = producer(60), None
    try:
        assert first.stdout.readline().strip() == "held"
        second = producer(60)
        assert second.stdout.readline().strip() == "not held"
        assert held_by_another()
        first.kill()
        first.wait()
        deadline = time.monotonic() + 15
        while not held_by_another() and time.monotonic() < deadline:  # the second takes the lock over
            time.sleep(0.2)
        third = producer(0)
        out, err = third.communicate(timeout=60)
        assert out.strip() == "not held" and "another producer is running" in err and str(layout.root) in err
        second.kill()
        second_err = second.communicate()[1]
        assert "another producer is running" in second_err
        assert not held_by_another()  # every holder gone: the next producer claims it without a warning
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


def _tiny_root_cfg(cache, **kw) -> ProducerConfig:
    return ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_samples=8,
                          max_length=32, draft_layers=3, **kw)


def test_cache_in_a_foreign_non_empty_directory_is_warned_about(tmp_path, caplog):
    """`--cache` naming an existing non-empty directory (a mistyped home or data
    directory) silently got artcache's subdirectories added beside its files."""
    from artcache.producer import prepare_root

    foreign = tmp_path / "mydata"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with caplog.at_level("WARNING", logger="artcache.producer"):
        prepare_root(_tiny_root_cfg(foreign))
    assert "not an artcache root" in caplog.text and "notes.txt" in caplog.text
    assert (foreign / "notes.txt").read_text() == "mine"
    caplog.clear()
    with caplog.at_level("WARNING", logger="artcache.producer"):
        prepare_root(_tiny_root_cfg(foreign))  # now a root: no warning
        prepare_root(_tiny_root_cfg(tmp_path / "new"))  # a new directory: none either
    assert "not an artcache root" not in caplog.text


def test_heartbeat_timeout_other_than_the_roots_is_warned_about(tmp_path, caplog):
    """A producer restarted with another --heartbeat-timeout than the root was created
    with said nothing, while fsck keeps using the root's recorded value."""
    from artcache.producer import prepare_root

    prepare_root(_tiny_root_cfg(tmp_path / "root", heartbeat_timeout_s=30.0))
    with caplog.at_level("WARNING", logger="artcache.producer"):
        prepare_root(_tiny_root_cfg(tmp_path / "root", heartbeat_timeout_s=30.0))
    assert "heartbeat" not in caplog.text
    with caplog.at_level("WARNING", logger="artcache.producer"):
        prepare_root(_tiny_root_cfg(tmp_path / "root", heartbeat_timeout_s=5.0))
    assert "fences consumers silent for 5 s" in caplog.text and "records 30 s" in caplog.text


def test_regression_cache_dir_holding_a_file_named_like_a_subdirectory(tmp_path):
    """`--cache DIR` where DIR holds a file called `objects` failed with exit 1
    (UnsafePath) after creating plans/; it is a clear ConfigError now, before anything is created."""
    import pytest

    from artcache.errors import ConfigError
    from artcache.producer import prepare_root

    d = tmp_path / "mine"
    d.mkdir()
    (d / "objects").write_text("not a directory")
    with pytest.raises(ConfigError, match="holds objects as file"):
        prepare_root(_tiny_root_cfg(d))
    assert sorted(p.name for p in d.iterdir()) == ["objects"]


def _settle(producer, timeout_s: float = 20.0) -> None:
    """Wait until the publisher thread has published or failed everything captured (drain() would stop it)."""
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with producer._state:
            busy = bool(producer._inflight)
        if not busy and producer._publish_queue.empty():
            return
        time.sleep(0.02)
    raise AssertionError("the publisher thread did not settle")


class _GoodBackend:
    def capture(self, samples):
        import torch

        from artcache.backends.hf import CapturedBatch

        out = [{"hidden_states": torch.randn(8, 1, 16).to(torch.bfloat16), "input_ids": s.input_ids,
                "loss_mask": s.loss_mask} for s in samples]
        return CapturedBatch(out, [True] * len(out))

    def close(self):
        pass


def test_regression_a_full_disk_give_up_is_withdrawn_once_space_is_back(tmp_path, fake_plan, small_contract,
                                                                        monkeypatch):
    """A producer that gave up a capture on ENOSPC kept the give-up for its
    lifetime, so a consumer restarted after space was freed died at once on the old ``failed/<fp>.json``;
    only a new producer retried it. The same producer now withdraws a full-disk give-up once the filesystem
    has room again (and keeps every other give-up)."""
    import errno

    from artcache import producer as P
    from artcache import store
    from artcache.errors import PublishError

    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=small_contract, target_path="/nowhere")
    registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", lookahead=0, end=1,
                                                    pid=os.getpid()))
    real_publish, disk_full = store.publish, [True]

    def publish(*a, **k):
        if disk_full[0]:
            raise PublishError("No space left on device", retryable=False, errno_=errno.ENOSPC)
        return real_publish(*a, **k)

    free = [0]
    monkeypatch.setattr(P.store, "publish", publish)
    monkeypatch.setattr(P, "free_space", lambda path: (free[0], 1 << 40, path))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, settings, fake_plan, _GoodBackend(), ProducerConfig(cache=str(tmp_path)), journal)
    fp = producer.fp_of(0)
    try:
        for _ in range(MAX_ATTEMPTS + 2):
            producer.tick()
            _settle(producer)
        assert layout.failure_path(fp).exists() and producer.fill_missing() == [producer.fp_of(i) for i in (1, 2, 3)]
        assert producer.retry_space_bound(now=1e12) == []  # still full: the give-up stands
        assert layout.failure_path(fp).exists()
        disk_full[0], free[0] = False, 1 << 30  # space freed
        assert producer.retry_space_bound(now=1e12) == []  # looked at most every SPACE_RETRY_S
        assert producer.retry_space_bound(now=2e12) == [fp]
        assert not layout.failure_path(fp).exists()
        for _ in range(3):
            producer.tick()
            _settle(producer)
    finally:
        producer.drain()
        journal.close()
    assert fp in store.list_objects(layout)  # captured again by the same producer and published
    events = J.read_events(layout.journal).events
    assert sum(isinstance(e, J.CaptureFailure) for e in events) == 1  # a full disk gives up at once
    assert any(isinstance(e, J.Publish) and e.fp == fp for e in events)


def test_a_give_up_that_is_not_a_full_disk_stays(tmp_path, fake_plan, small_contract, monkeypatch):
    from artcache import producer as P

    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=small_contract, target_path="/nowhere")
    registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", lookahead=0, end=1,
                                                    pid=os.getpid()))
    monkeypatch.setattr(P, "free_space", lambda path: (1 << 40, 1 << 40, path))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, settings, fake_plan, _BrokenBackend(), ProducerConfig(cache=str(tmp_path)), journal)
    try:
        for _ in range(MAX_ATTEMPTS + 2):
            producer.tick()
        assert producer.retry_space_bound(now=1e12) == []
        assert layout.failure_path(producer.fp_of(0)).exists()
    finally:
        producer.drain()
        journal.close()


def _full_disk_producer(tmp_path, fake_plan, small_contract, monkeypatch):
    """A producer whose every publication fails with ENOSPC (free space 0), consumer ``c`` reading position 0."""
    import errno

    from artcache import producer as P
    from artcache.errors import PublishError

    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=small_contract, target_path="/nowhere")
    registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", lookahead=0, end=1,
                                                    pid=os.getpid()))

    def publish(*a, **k):
        raise PublishError("not enough free space in tmp: 0 B free", retryable=False, errno_=errno.ENOSPC)

    monkeypatch.setattr(P.store, "publish", publish)
    monkeypatch.setattr(P, "free_space", lambda path: (0, 1 << 40, path))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    backend = _GoodBackend()
    backend.calls = 0
    real = backend.capture

    def capture(samples):
        backend.calls += 1
        return real(samples)

    backend.capture = capture
    producer = Producer(layout, settings, fake_plan, backend, ProducerConfig(cache=str(tmp_path)), journal)
    return layout, producer, backend, journal


def test_regression_a_full_disk_does_not_burn_the_attempts_back_to_back(tmp_path, fake_plan, small_contract,
                                                                        monkeypatch):
    """A capture's ENOSPC burned its 3 attempts in the same millisecond (three passes
    against the same full disk), so waiting consumers died at once. A space error now gives up at once, with
    a marker saying ``space`` (waiting consumers wait for its withdrawal: artcache.client), and the fingerprint
    is tried again only once space is back (retry_space_bound)."""
    layout, producer, backend, journal = _full_disk_producer(tmp_path, fake_plan, small_contract, monkeypatch)
    fp = producer.fp_of(0)
    try:
        for _ in range(MAX_ATTEMPTS + 2):
            producer.tick()
            _settle(producer)
    finally:
        producer.drain()
        journal.close()
    assert backend.calls == 1, "the full disk was retried back-to-back"
    record = json.loads(layout.failure_path(fp).read_text())
    assert record["space"] is True and record["attempts"] == 1 and "free space" in record["error"]
    fails = [e for e in J.read_events(layout.journal).events if isinstance(e, J.CaptureFailure)]
    assert len(fails) == 1


def test_regression_a_fence_failing_for_space_does_not_kill_the_producer(tmp_path, fake_plan, small_contract,
                                                                          monkeypatch, caplog):
    """With 0 bytes free a dead consumer's fence (a registration rewrite) raised
    PublishError ENOSPC out of live_registrations(), which caught only LockTimeout: the producer died. Now a
    fence failing for space is logged once and retried on every pass; the dead consumer does not count as live
    (its window stops protecting artifacts, so eviction can free space). Once space is back the fence lands and
    is journaled. Another error (EIO) still raises."""
    import errno

    import pytest

    from artcache.errors import PublishError
    from tests.support.procs import dead_pid

    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=small_contract, target_path="/nowhere")
    registry.register(layout, registry.Registration(consumer_id="dead", draft="dflash", lookahead=0, end=1,
                                                    pid=dead_pid()))
    real_write, code = registry._write, [errno.ENOSPC]

    def write(layout_, reg):
        if code[0]:
            raise PublishError(f"writing {reg.consumer_id}.json failed: {os.strerror(code[0])}",
                               retryable=False, errno_=code[0])
        return real_write(layout_, reg)

    monkeypatch.setattr(registry, "_write", write)
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, settings, fake_plan, _GoodBackend(), ProducerConfig(cache=str(tmp_path)), journal)
    try:
        for _ in range(3):
            assert producer.live_registrations() == []  # dead: not live, though its fence could not be written
        assert registry.read(layout, "dead").state == "running"
        assert caplog.text.count("cannot fence consumer dead yet") == 1
        code[0] = errno.EIO
        with pytest.raises(PublishError):
            producer.live_registrations()
        code[0] = 0  # space is back
        assert producer.live_registrations() == []
        assert registry.read(layout, "dead").state == "failed"
    finally:
        producer.drain()
        journal.close()
    fences = [e for e in J.read_events(layout.journal).events if isinstance(e, J.Fence)]
    assert [e.consumer for e in fences] == ["dead"]


def test_regression_a_producer_started_on_a_full_disk_leaves_no_empty_journal(tmp_path, monkeypatch):
    """Restarting the producer while the disk was still full failed with one line
    (JournalError writing its ProducerStart) but left a 0-byte journal file behind. It still fails so (a
    producer that cannot journal its start does not start), and removes the empty file."""
    import errno

    import pytest

    from artcache.errors import JournalError
    from artcache.producer import prepare_root, run_producer

    cfg = _tiny_root_cfg(tmp_path / "root")
    prepare_root(cfg)
    real_write = os.write

    def write(fd, data):
        if "/journal/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(JournalError, match="ProducerStart event failed: No space left"):
        run_producer(cfg)
    monkeypatch.undo()
    assert os.listdir(tmp_path / "root" / "journal") == [], "a refused start left a journal file"
