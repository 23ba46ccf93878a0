"""Regressions of races between processes (each test named after its bug), fast enough for the default lane."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from artcache import journal as J
from artcache import registry, store
from artcache.client import CacheClient
from artcache.errors import ConsumerFenced, IntegrityError
from artcache.fingerprint import PlanFingerprints
from artcache.producer import Producer, ProducerConfig
from tests.support import crash_child as K

PLAN = K.FakePlan()
FP = PlanFingerprints(K.CONTRACT, PLAN)


def _client(layout, cid="c", lookahead=K.N_SAMPLES, timeout=30.0):
    reg = registry.register(layout, registry.Registration(consumer_id=cid, draft="d", lookahead=lookahead,
                                                          pid=os.getpid()))
    journal = J.JournalWriter(layout.journal_path("consumer", cid))
    return CacheClient(layout, K.settings(), PLAN, registry.ConsumerHandle(layout, reg), journal,
                       demand_timeout_s=timeout), journal


def _publish(layout, pos):
    store.publish(layout, FP(pos), K.CONTRACT, K.fake_capture(PLAN.sample(pos)), durable=False)


def test_regression_fenced_consumer_cannot_acquire(layout):
    """A fenced consumer's reader kept acquiring published positions (only a miss or a commit noticed the
    fence); now every acquire checks the registration after taking its lease."""
    client, journal = _client(layout)
    _publish(layout, 0)
    client.release(client.acquire(0))
    for state in ("failed", "cancelled"):
        registry.fence(layout, "c", state, "test")
        with pytest.raises(ConsumerFenced):
            client.acquire(0)
        assert os.listdir(layout.leases) == []  # its lease was released
        client, journal = _client(layout)  # re-registers (generation bumped): the new handle may acquire
        client.release(client.acquire(0))
    client.handle.finish("completed")
    with pytest.raises(ConsumerFenced):
        client.acquire(0)
    journal.close()


def test_regression_another_samples_capture_under_a_fingerprint_is_detected(layout):
    """An artifact with a valid content hash holding another sample's capture (a producer bug, a stray copy)
    was returned as the requested one; a read with ``verify_tokens`` (consumers) now refuses it."""
    fp = FP(3)
    header, chunks = store._encode(fp, K.CONTRACT, K.fake_capture(PLAN.sample(4)))
    layout.object_path(fp).parent.mkdir(exist_ok=True)
    layout.object_path(fp).write_bytes(header + b"".join(bytes(c) for c in chunks))
    assert store.read(layout, fp, K.CONTRACT).input_ids.tolist() == PLAN.sample(4).input_ids.tolist()  # unchecked
    with pytest.raises(IntegrityError, match="token ids"):
        store.read(layout, fp, K.CONTRACT, verify_tokens=True)
    assert not store.exists(layout, fp) and len(os.listdir(layout.quarantine)) == 1
    with pytest.raises(IntegrityError, match="token ids"):  # and the producer side refuses to publish it
        store.publish(layout, fp, K.CONTRACT, K.fake_capture(PLAN.sample(4)), verify_tokens=True)
    assert not store.exists(layout, fp)


def test_regression_quarantined_artifact_is_recaptured_by_a_running_producer(layout):
    """The producer kept every fingerprint it had once seen published in its in-memory map, so an artifact
    quarantined by a reader (or removed by fsck) was never captured again and the consumer waited until
    its demand timeout."""
    client, cj = _client(layout, timeout=20.0)
    pj = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, K.settings(), PLAN, K.FakeBackend(),
                        ProducerConfig(cache=str(layout.root), heartbeat_timeout_s=1e9, poll_interval_s=0.0), pj)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if not producer.tick():
                time.sleep(0.002)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    try:
        client.release(client.acquire(5))
        path = layout.object_path(FP(5))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        item = client.acquire(5)  # quarantined, then a demand the running producer serves
        assert torch.equal(item.artifact.input_ids, PLAN.sample(5).input_ids)
        client.release(item)
    finally:
        stop.set()
        th.join()
        producer.drain()
        pj.close()
        cj.close()
    evs = J.read_events(layout.journal).events
    assert sum(isinstance(e, J.Quarantined) for e in evs) == 1
    assert [e.recapture for e in evs if isinstance(e, J.Capture) and e.fp == FP(5)] == [False, True]
