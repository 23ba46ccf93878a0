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
