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


def test_second_producer_on_a_root_is_warned_about(tmp_path, caplog):
    """New-user finding: a second `artcache producer` on the same root started silently. It now logs a
    warning while another live process holds locks/producer.lock; the first producer's lock is released
    when it exits, after which a producer claims it without a warning."""
    import subprocess
    import sys
    import time

    from artcache.producer import claim_producer_presence

    layout = CacheLayout(tmp_path / "root")
    layout.create()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from artcache.layout import CacheLayout\n"
        "from artcache.producer import claim_producer_presence\n"
        "lock = claim_producer_presence(CacheLayout(Path(sys.argv[1])))\n"
        "print('held' if lock else 'not held', flush=True)\n"
        "time.sleep(60)\n"), str(layout.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level("WARNING", logger="artcache.producer"):
            assert claim_producer_presence(layout) is None
        assert "another producer is running" in caplog.text and str(layout.root) in caplog.text
    finally:
        holder.kill()
        holder.wait()
    caplog.clear()
    deadline = time.monotonic() + 10
    lock = None
    while lock is None and time.monotonic() < deadline:  # the kernel drops a dead holder's flock
        with caplog.at_level("WARNING", logger="artcache.producer"):
            lock = claim_producer_presence(layout)
    assert lock is not None
    lock.release()


def _tiny_root_cfg(cache, **kw) -> ProducerConfig:
    return ProducerConfig(cache=str(cache), target="random:tiny-llama", dataset="synthetic", max_samples=8,
                          max_length=32, draft_layers=3, **kw)


def test_cache_in_a_foreign_non_empty_directory_is_warned_about(tmp_path, caplog):
    """New-user finding: `--cache` naming an existing non-empty directory (a mistyped home or data
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
    """New-user finding: a producer restarted with another --heartbeat-timeout than the root was created
    with said nothing, while fsck keeps using the root's recorded value."""
    from artcache.producer import prepare_root

    prepare_root(_tiny_root_cfg(tmp_path / "root", heartbeat_timeout_s=30.0))
    with caplog.at_level("WARNING", logger="artcache.producer"):
        prepare_root(_tiny_root_cfg(tmp_path / "root", heartbeat_timeout_s=30.0))
    assert "heartbeat" not in caplog.text
    with caplog.at_level("WARNING", logger="artcache.producer"):
        prepare_root(_tiny_root_cfg(tmp_path / "root", heartbeat_timeout_s=5.0))
    assert "fences consumers silent for 5 s" in caplog.text and "records 30 s" in caplog.text
