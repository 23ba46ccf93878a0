"""The consumer's reader with a pool of read workers (``--read-workers``): one batch's positions are leased and
read at once, yet batches come out whole and in position order, the window bound holds, and a failure or a
stop leaves no lease behind. A fake client stands in for the cache (the real protocol is covered by the
consumer's process tests; ``test_a_consumer_with_read_workers_trains_as_one_without`` runs it for real)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

import pytest

from artcache.errors import CaptureTimeout
from artcache.trainers.consumer.config import ConsumerConfig, read_workers
from artcache.trainers.consumer.reader import Fetched, Reader
from artcache.trainers.consumer.session import HOST_PHASES, host_ms_per_step
from tests.protocol.test_consumer_resume import DATA, consume_args


class FakeClient:
    """Leases are ints; ``acquire`` sleeps ``delay`` s (as a read would) and records concurrency."""

    def __init__(self, delay: float = 0.02, fail_at: int | None = None) -> None:
        self.delay, self.fail_at = delay, fail_at
        self.lock = threading.Lock()
        self.held: set[int] = set()
        self.started: list[int] = []
        self.active = self.max_active = 0

    def acquire(self, p: int, stop: threading.Event | None = None):
        with self.lock:
            self.started.append(p)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if stop is not None and stop.wait(self.delay):
                raise InterruptedError("stopped")
            if p == self.fail_at:
                raise CaptureTimeout(f"position {p} was not published")
            with self.lock:
                self.held.add(p)
            return p
        finally:
            with self.lock:
                self.active -= 1

    def release(self, item) -> None:
        with self.lock:
            self.held.remove(item)


def _next(reader: Reader, timeout: float = 10.0):
    return reader.out.get(timeout=timeout)


@pytest.mark.parametrize("workers", [1, 4])
def test_batches_come_whole_and_in_order_and_reads_overlap_with_workers(workers):
    client = FakeClient(delay=0.05)
    reader = Reader(client, 0, batch=4, lookahead=100, depth=2, end=16, workers=workers)
    reader.start()
    got = [_next(reader) for _ in range(4)]
    reader.join(10)
    assert [f.items for f in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert all(isinstance(f, Fetched) for f in got)
    assert client.max_active == (workers if workers > 1 else 1)
    for f in got:
        for it in f.items:
            client.release(it)
    assert client.held == set()


def test_workers_never_read_past_the_window():
    client = FakeClient(delay=0.0)
    reader = Reader(client, 0, batch=4, lookahead=5, depth=4, end=40, workers=4)
    reader.start()
    first = _next(reader)
    time.sleep(0.3)  # the reader may lease up to cursor + lookahead = 5, never 6 or beyond
    assert first.items == [0, 1, 2, 3]
    assert max(client.started) == 5
    reader.authorize(4)  # the trainer committed batch [0, 4): the window is now [4, 9]
    second = _next(reader)
    time.sleep(0.3)
    assert second.items == [4, 5, 6, 7] and max(client.started) == 9
    reader.stop.set()
    reader.join(10)
    for f in (first, second):
        for it in f.items:
            client.release(it)
    assert client.held == set(), "the partial batch's leases were not released on stop"


def test_regression_a_failed_read_in_a_pooled_batch_releases_every_lease_of_it():
    """A read failing inside a batch read by several workers must end the reader with that error (naming the
    position) and leave no lease of the batch held: a leaked lease pins its artifact against eviction."""
    client = FakeClient(delay=0.02, fail_at=6)
    reader = Reader(client, 0, batch=4, lookahead=100, depth=4, end=40, workers=4)
    reader.start()
    first = _next(reader)
    err = _next(reader)
    reader.join(10)
    assert first.items == [0, 1, 2, 3]
    assert isinstance(err, CaptureTimeout) and "position 6" in str(err)
    for it in first.items:
        client.release(it)
    assert client.held == set(), f"leases of the failed batch left: {sorted(client.held)}"
    assert not reader.is_alive()


def test_stop_while_reads_are_in_flight_leaves_no_lease():
    client = FakeClient(delay=0.5)
    reader = Reader(client, 0, batch=8, lookahead=100, depth=1, end=80, workers=4)
    reader.start()
    time.sleep(0.1)  # four reads in flight
    reader.stop.set()
    reader.join(10)
    assert not reader.is_alive()
    with pytest.raises(queue.Empty):
        reader.out.get_nowait()
    assert client.held == set()


def test_read_workers_default_to_one_and_never_exceed_the_batch():
    assert read_workers(ConsumerConfig(cache="/x", batch_size=8, device="cuda")) == 1
    assert read_workers(ConsumerConfig(cache="/x", batch_size=2, read_workers=4)) == 2
    assert read_workers(ConsumerConfig(cache="/x", batch_size=8, read_workers=3)) == 3


def test_read_workers_out_of_range_is_one_line(tmp_path):
    got = subprocess.run([sys.executable, "-m", "artcache", "consume", "--cache", str(tmp_path / "none"),
                          "--read-workers", "0"], capture_output=True, text=True, timeout=120)
    assert got.returncode != 0
    assert "--read-workers" in got.stderr and "0" in got.stderr and "Traceback" not in got.stderr


def test_host_ms_per_step_takes_medians_so_a_compiling_first_step_does_not_count():
    host = {"wait": [0.001, 0.001, 0.001], "launch": [30.0, 0.004, 0.006], "leases": [0.0, 0.001, 0.001],
            "commit": [0.002, 0.002, 0.002], "record": [0.001, 0.0, 0.002]}
    got = host_ms_per_step(host)
    assert got == pytest.approx({"wait": 1.0, "launch": 6.0, "leases": 1.0, "commit": 2.0, "record": 1.0,
                                 "total": 12.0})  # per-step totals 30.004, 0.008, 0.012 s: median 12 ms
    assert host_ms_per_step({phase: [] for phase in HOST_PHASES}) is None


def test_a_consumer_with_read_workers_trains_as_one_without(tmp_path, tiny_target):
    """Real processes: a producer fills a root; one consumer reads with 1 worker, another with 3; their losses
    are the same step for step (the same batches, in the same order)."""
    from tests.protocol.test_consumer_resume import Proc, file_events, steps_of

    cache = tmp_path / "cache"
    fill = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                           tiny_target.path, "--data", str(DATA), "--max-samples", "24", "--max-length", "128",
                           "--draft-layers", "3", "--threads", "1", "--fill"], capture_output=True, text=True,
                          timeout=600)
    assert fill.returncode == 0, fill.stderr[-2000:]
    losses, procs = {}, {}
    for cid, workers in (("one", "1"), ("three", "3")):  # two readers of the filled root: started together
        args = consume_args(cache, tmp_path, cid, 5, "--read-workers", workers, "--json")
        args[args.index("--batch-size") + 1] = "4"
        procs[cid] = Proc(cid, args, tmp_path)
    try:
        for cid, proc in procs.items():
            proc.expect(0)
            (evs,) = file_events(cache, cid)
            losses[cid] = [(s.step, s.cursor, s.loss) for s in steps_of(evs)]
            (line,) = [ln for ln in proc.text().splitlines() if ln.startswith('{"consumer_id"')]
            host = json.loads(line)["host_ms_per_step"]  # the summary on stdout says where the step's time went
            assert set(host) == {*HOST_PHASES, "total"} and min(host.values()) >= 0
            assert host["launch"] > 0 and host["total"] >= host["launch"]
    finally:
        for proc in procs.values():
            proc.kill()
    assert len(losses["one"]) == 5
    assert losses["three"] == losses["one"]


class DemandClient(FakeClient):
    """Positions in ``fail`` raise their exception at once; every other one waits on demand (``stop``) as a
    missing artifact would, up to ``wait_s``, then raises CaptureTimeout, like a demand timeout."""

    def __init__(self, fail: dict[int, BaseException], wait_s: float = 30.0) -> None:
        super().__init__(delay=0.0)
        self.fail, self.wait_s = fail, wait_s
        self.timed_out: list[int] = []

    def acquire(self, p: int, stop: threading.Event | None = None):
        with self.lock:
            self.started.append(p)
        if p in self.fail:
            raise self.fail[p]
        if stop.wait(self.wait_s):
            raise InterruptedError("stopped while waiting for a demand miss")
        with self.lock:
            self.timed_out.append(p)
        raise CaptureTimeout(f"position {p} was not published within {self.wait_s:.0f}s")


def test_regression_a_failed_position_ends_the_pooled_batch_instead_of_one_demand_timeout_per_round():
    """Position 0 times out: the batch's other positions (waiting on demand, or queued behind the pool's workers)
    give up at once. Was: every queued round waited out its own demand timeout (batch 12, 3 workers, producer
    killed, --demand-timeout 5: the CaptureTimeout 'within 5s' came after 21 s)."""
    client = DemandClient({0: CaptureTimeout("position 0 was not published within 5s")})
    reader = Reader(client, 0, batch=8, lookahead=100, depth=2, end=80, workers=2)
    reader.start()
    err = _next(reader, timeout=20)
    reader.join(10)
    assert isinstance(err, CaptureTimeout) and "position 0" in str(err)
    assert client.timed_out == [], f"positions that waited out their own timeout after 0 failed: {client.timed_out}"
    # at most the first round (0 failed before or after 1 was handed to the pool): none of the queued ones
    assert 0 in client.started and set(client.started) <= {0, 1}, f"started after 0 failed: {client.started}"
    assert client.held == set() and not reader.is_alive()


def test_regression_a_later_position_failing_is_raised_not_the_interrupted_wait_before_it():
    """Position 2 fails while 0 and 1 wait on demand: the reader hands over position 2's error (the waits it
    interrupted are no stop of the reader, which would leave the trainer waiting for a batch that never comes)."""
    from artcache.errors import CaptureFailed

    client = DemandClient({2: CaptureFailed("the producer gave up capturing position 2", fingerprint="ab" * 8,
                                           attempts=3, retryable=False)})
    reader = Reader(client, 0, batch=4, lookahead=100, depth=2, end=40, workers=4)
    reader.start()
    err = _next(reader, timeout=20)
    reader.join(10)
    assert isinstance(err, CaptureFailed) and "position 2" in str(err)
    assert client.timed_out == [] and client.held == set() and not reader.is_alive()
