"""A consumer waiting on a fingerprint the producer gave up on gets CaptureFailed, not a hang."""

from __future__ import annotations

import json
import os
import time

import pytest

from artcache import journal as J
from artcache import registry
from artcache.client import CacheClient
from artcache.errors import CaptureFailed
from artcache.layout import CacheLayout
from artcache.settings import RootSettings


def make_client(tmp_path, fake_plan, small_contract, demand_timeout_s: float = 60, **reg_fields):
    """A fresh root with consumer ``c`` registered; its CacheClient and journal."""
    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=small_contract, target_path="/nowhere")
    reg_fields.setdefault("lookahead", 4)
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", pid=os.getpid(),
                                                          **reg_fields))
    journal = J.JournalWriter(layout.journal_path("consumer", "c"))
    client = CacheClient(layout, settings, fake_plan, registry.ConsumerHandle(layout, reg), journal,
                         demand_timeout_s=demand_timeout_s)
    return layout, client, journal


def test_regression_consumer_gets_capture_failed_when_producer_gives_up(tmp_path, fake_plan, small_contract):
    """On a full disk the producer failed forever while consumers waited out --demand-timeout."""
    layout, client, journal = make_client(tmp_path, fake_plan, small_contract)
    fp = client.fp_of(1)
    layout.failure_path(fp).write_text(json.dumps({"fingerprint": fp, "attempts": 3, "retryable": False,
                                                   "error": "PublishError: not enough free space"}))
    t0 = time.monotonic()
    with pytest.raises(CaptureFailed, match="not enough free space") as info:
        client.acquire(1)
    assert time.monotonic() - t0 < 5
    assert info.value.fingerprint == fp and info.value.attempts == 3 and not info.value.retryable
    assert os.listdir(layout.leases) == []  # the lease taken for the read was released
    journal.close()


def test_regression_eval_split_is_demanded_at_once(tmp_path, fake_plan, small_contract):
    """The held-out pass used to announce one position per acquire, so the producer captured one batch
    per eval sample (16 samples took 16 producer batches, ~4 min, on SmolLM2/CPU). ``want`` announces the
    whole split as demand in one registration update; acquiring or ``unwant`` withdraws it."""
    import math

    import numpy as np

    from artcache.eviction import Reader, decide
    from artcache.plan import EpochOrder

    layout, client, journal = make_client(tmp_path, fake_plan, small_contract, lookahead=2, pinned=(10, 14))
    assert client.want_samples(range(10, 14)) == [10, 11, 12, 13]
    live = registry.read(layout, "c")
    assert live.pinned_demand == [10, 11, 12, 13] and live.demand == []
    reader = Reader.of(live, EpochOrder(20, 20, 0), 1.0)
    queue = decide([reader], sizes=np.zeros(20, dtype=np.int64), budget=math.inf, est_size=1, max_queue=8).capture
    # the whole split is demand (priority 0), ahead of the window's prefetch (positions 0..2)
    assert [w.sample for w in queue if w.demand] == [10, 11, 12, 13]
    assert all(not w.demand for w in queue if w.sample < 10)
    client.unwant([12, 13], held_out=True)
    assert registry.read(layout, "c").pinned_demand == [10, 11]
    client.unwant(range(10, 14), held_out=True)
    assert registry.read(layout, "c").pinned_demand == []
    journal.close()


def test_regression_long_demand_wait_is_not_silent(tmp_path, fake_plan, small_contract, monkeypatch, caplog):
    """A consumer whose producer was gone logged nothing for the whole --demand-timeout (600 s by default)."""
    import logging

    from artcache import client as client_mod
    from artcache.errors import CaptureTimeout

    monkeypatch.setattr(client_mod, "WAIT_NOTE_S", 0.05)
    _, client, journal = make_client(tmp_path, fake_plan, small_contract, demand_timeout_s=0.3)
    with caplog.at_level(logging.WARNING, logger="artcache.client"), pytest.raises(CaptureTimeout):
        client.acquire(1)
    notes = [r.getMessage() for r in caplog.records if "is `artcache producer` running" in r.getMessage()]
    assert notes and "position 1" in notes[0] and str(tmp_path) in notes[0]
    journal.close()


def test_regression_capture_failed_says_how_to_recover(tmp_path, fake_plan, small_contract):
    """Breakfix report: after a full disk the running producer had given up position 0; space was freed, and a
    new consumer still died at once with the old "not enough free space" and no word on what to do (a producer
    gives up a fingerprint for its whole run; only a new producer retries it)."""
    layout, client, journal = make_client(tmp_path, fake_plan, small_contract)
    fp = client.fp_of(0)
    layout.failure_path(fp).write_text(json.dumps({"fingerprint": fp, "attempts": 3, "retryable": False,
                                                   "error": "PublishError: not enough free space"}))
    with pytest.raises(CaptureFailed) as info:
        client.acquire(0)
    msg = str(info.value)
    assert "not enough free space" in msg and "restart `artcache producer`" in msg and str(layout.root) in msg
    journal.close()


def _space_marker(layout, fp) -> None:
    """A give-up marker for a full disk, as the running producer writes it (``space``: it withdraws it once
    space is back)."""
    layout.failure_path(fp).write_text(json.dumps({
        "fingerprint": fp, "attempts": 1, "retryable": False, "space": True,
        "error": "PublishError: not enough free space in tmp: 147456 B free, need 41704 B plus a 1048576 B reserve"}))


def test_regression_a_full_disk_give_up_is_waited_for_within_the_demand_timeout(tmp_path, fake_plan, small_contract,
                                                                                caplog):
    """A capture's ENOSPC ended every waiting consumer within milliseconds (CaptureFailed),
    although the producer withdraws a full-disk give-up once space is back (every 10 s). A consumer now waits
    for that within its --demand-timeout (logged once); when the marker goes and the artifact is published, it
    reads it."""
    import threading

    from artcache import store

    layout, client, journal = make_client(tmp_path, fake_plan, small_contract, demand_timeout_s=30)
    fp = client.fp_of(1)
    _space_marker(layout, fp)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(client.acquire(1)))
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive() and not got, "the consumer did not wait for a full-disk give-up"
    layout.failure_path(fp).unlink()  # the producer withdrew it: space is back; it captures again
    import torch

    sample = fake_plan.sample(client.order.sample(1))
    store.publish(layout, fp, small_contract, {"hidden_states": torch.randn(len(sample.input_ids), 1, 16).to(
        torch.bfloat16), "input_ids": sample.input_ids, "loss_mask": sample.loss_mask})
    reader.join(10)
    assert got and got[0].artifact.fingerprint == fp
    assert caplog.text.count("for a full disk") == 1
    client.release(got[0])
    journal.close()


def test_regression_a_full_disk_give_up_fails_after_the_demand_timeout_with_its_message(tmp_path, fake_plan,
                                                                                       small_contract):
    """When space does not come back within --demand-timeout the consumer fails with the
    producer's give-up message (CaptureFailed, not a bare CaptureTimeout), saying how long it waited."""
    layout, client, journal = make_client(tmp_path, fake_plan, small_contract, demand_timeout_s=1)
    fp = client.fp_of(1)
    _space_marker(layout, fp)
    t0 = time.monotonic()
    with pytest.raises(CaptureFailed, match="not enough free space") as info:
        client.acquire(1)
    assert 1 <= time.monotonic() - t0 < 10
    assert "waited 1s (--demand-timeout) for free space" in str(info.value) and info.value.fingerprint == fp
    assert os.listdir(layout.leases) == []
    journal.close()
