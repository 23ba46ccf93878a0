"""Durations come from monotonic clocks; the wall clock only stamps events. A wall-clock step (NTP, a VM
resumed, an operator's ``date -s``) during a run must not change any duration artcache reports: the
producer's busy time (``artcache inspect``'s ``producer busy (s)``, the journal's ``capture_batch``) and a
consumer's run time (its summary's ``seconds``)."""

from __future__ import annotations

import time

import pytest

from artcache import journal as J
from artcache.accounting import account
from artcache.layout import CacheLayout
from artcache.producer import ProducerConfig, run_producer
from artcache.report import format_accounting
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer.session import run_consumer

HOUR = 3600.0


class WallClock:
    """``time.time`` shifted by ``offset`` seconds, which a test steps while the code under test runs."""

    def __init__(self, monkeypatch) -> None:
        self.real, self.offset = time.time, 0.0
        monkeypatch.setattr(time, "time", lambda: self.real() + self.offset)

    def step(self, seconds: float) -> None:
        self.offset += seconds


def test_regression_a_wall_clock_step_back_during_a_capture_keeps_busy_time_positive(tmp_path, monkeypatch):
    """A wall-clock step back of an hour while a batch was captured made ``inspect`` report ``producer busy (s)
    -3598``: the producer timed its forward passes with ``time.time()``. Now each pass is timed on the monotonic
    clock (``capture_batch.end - start`` is its duration)."""
    from artcache.backends import hf

    clock = WallClock(monkeypatch)
    real_capture = hf.HFCaptureBackend.capture

    def capture(self, samples):
        clock.step(-HOUR)  # the clock steps back while the forward pass runs
        return real_capture(self, samples)

    monkeypatch.setattr(hf.HFCaptureBackend, "capture", capture)
    cfg = ProducerConfig(cache=str(tmp_path / "root"), target="random:tiny-llama", dataset="synthetic",
                         max_samples=4, max_length=32, draft_layers=3, fill=True, poll_interval_s=0.0)
    stats = run_producer(cfg)
    assert stats.fill_complete and 0 <= stats.busy_s < 60
    layout = CacheLayout(tmp_path / "root")
    batches = [e for e in J.read_events(layout.journal).events if isinstance(e, J.CaptureBatch)]
    assert batches and all(0 <= b.end - b.start < 60 for b in batches)
    acc = account(layout)
    assert 0 < acc.cache.producer_busy_s < 60
    busy = format_accounting(acc).split("producer busy (s)")[1].splitlines()[0].split()
    assert 0 <= float(busy[0]) < 60, busy  # printed to 3 decimals: a sub-millisecond capture reads 0.000


@pytest.fixture
def filled(tmp_path):
    root = tmp_path / "root"
    cfg = ProducerConfig(cache=str(root), target="random:tiny-llama", dataset="synthetic", max_samples=8,
                         max_length=32, draft_layers=3, fill=True, poll_interval_s=0.0)
    assert run_producer(cfg).fill_complete
    return root


def test_regression_a_wall_clock_step_forward_does_not_lengthen_a_consumer_run(filled, tmp_path, monkeypatch):
    """A wall-clock step forward during a consumer run made its summary report 718 s for an 18 s run: the
    summary's ``seconds`` was ``time.time() - start``. Now it is measured on the monotonic clock."""
    clock = WallClock(monkeypatch)
    t0 = time.monotonic()
    cfg = ConsumerConfig(cache=str(filled), consumer_id="d", draft="dflash", block_size=4, num_anchors=4,
                         batch_size=2, steps=3, lookbehind=0, lookahead=8, threads=1, out_dir=str(tmp_path / "d"),
                         progress=False, tensorboard=False, checkpoints=False)
    summary = run_consumer(cfg, step_hook=lambda i: clock.step(700.0) if i == 0 else None)
    took = time.monotonic() - t0
    assert summary["steps"] == 3 and clock.offset == 700.0
    assert 0 < summary["seconds"] <= took
