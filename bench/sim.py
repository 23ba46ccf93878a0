"""Deterministic discrete-event simulation of one producer and N consumers over the REAL scheduler.

Nothing sleeps and no model runs: a virtual clock advances from event to event. The producer uses
:func:`artcache.scheduler.wanted`, :func:`~artcache.scheduler.next_batch`,
:class:`~artcache.scheduler.SchedulerLimits` and :func:`~artcache.scheduler.window_bound` exactly as
``Producer.tick`` does, over real :class:`artcache.registry.Registration` structs:

* a **pass** (whenever the producer is idle and something happened): evict every published
  fingerprint outside the union of live windows (``[cursor - lookbehind, min(cursor + lookahead,
  end - 1)]``) that no lease holds (as ``Producer.evict``), build the queue (demand first, then
  prefetch by distance), take one batch under the limits and start capturing it;
* a **capture** takes ``fixed_s + per_sample_s * len(batch)`` of virtual time (one batch in flight)
  and then publishes the batch at once; a capture of a fingerprint published before and evicted
  since is a **recapture**;
* a **consumer** registers at ``start_s``, then repeatedly reads its next batch of consecutive
  positions ``[cursor, cursor + batch_size)`` in order (as ``artcache.trainers.consumer.reader.Reader``), leasing
  each position it reads; on an unpublished position it records it in ``Registration.demand`` and
  waits; with the whole batch read it trains for ``step_s``, commits the cursor, releases the
  batch's leases; at ``end`` it completes (fenced: its window stops counting);
* **liveness**: a consumer heart-beats every ``heartbeat_s`` while its process lives; one with
  ``killed_s`` dies then (mid-step or mid-read: no commit, its leases stay on disk). At each pass
  the producer fences every running consumer whose last heartbeat is older than
  ``heartbeat_timeout_s`` (as ``Producer.live_registrations``): state ``expired``, its leases
  expired, its window no longer live. While a killed consumer is unfenced the producer polls every
  ``poll_s`` (its idle poll), so the fence comes at the first pass after the timeout.

After every pass's eviction the retained artifacts must lie inside the union of live windows
(a lease outside it is reported), and after every event their number must not exceed that union's
size at the last pass (``union_violations``) nor Σ live window sizes (``retained_violations``).

Positions map to fingerprints through the plan index ``p % plan_len``.

Reproduce the figures of ``docs/scheduler.md``::

    python -m artcache.bench.sim --scenario overlap --positions 10000 --solo
    python -m artcache.bench.sim --scenario lagging --positions 10000 --solo
    python -m artcache.bench.sim --scenario killed --positions 10000
    python -m artcache.bench.sim --consumer fast:0.2:16:64:512 --consumer slow:0.1:4:0:32:30 --positions 4000
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from artcache.registry import Registration
from artcache.scheduler import SchedulerLimits, check_deadlock, next_batch, wanted, window_bound


class SimDeadlock(RuntimeError):
    """No event is left but some consumer has not reached its end."""


@dataclass(frozen=True)
class ConsumerSpec:
    """One simulated consumer.

    Attributes:
        name: consumer id. step_s: compute time of one optimizer step (virtual seconds).
        batch_size: positions per step. lookbehind, lookahead: its window.
        start_s: when it registers. end: exclusive last position (None: the run's ``positions``).
        killed_s: when its process dies (None: never). heartbeat_s: its heartbeat period.
    """

    name: str
    step_s: float
    batch_size: int
    lookbehind: int
    lookahead: int
    start_s: float = 0.0
    end: int | None = None
    killed_s: float | None = None
    heartbeat_s: float = 2.0

    @property
    def compute_rate(self) -> float:
        """Positions per second if it never waited."""
        return self.batch_size / self.step_s


@dataclass(frozen=True)
class ProducerSpec:
    """Capture latency of one batch: ``fixed_s + per_sample_s * samples``; scheduler limits;
    ``heartbeat_timeout_s`` (fence a consumer silent for longer, the producer's default 30 s) and
    ``poll_s`` (idle poll, the producer's 20 ms)."""

    fixed_s: float = 0.02
    per_sample_s: float = 0.005
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    sample_tokens: int = 256  # every sample's length (padded-token limit)
    max_length: int = 512
    heartbeat_timeout_s: float = 30.0
    poll_s: float = 0.02

    @property
    def capacity(self) -> float:
        """Samples per second with full batches."""
        n = min(self.limits.max_batch_samples, max(1, self.limits.max_batch_tokens // self.sample_tokens))
        return n / (self.fixed_s + self.per_sample_s * n)


@dataclass
class ConsumerResult:
    name: str
    start_s: float
    finish_s: float | None
    positions: int
    steps: int
    wait_s: float
    demand_waits: int
    max_demand_wait_s: float  # longest wait for one demanded position
    fenced_s: float | None = None  # when the producer fenced it (killed consumers)
    last_heartbeat_s: float | None = None  # its last heartbeat (killed consumers)

    @property
    def rate(self) -> float:
        """Positions per virtual second from registration to completion."""
        if self.finish_s is None or self.finish_s <= self.start_s:
            return 0.0
        return self.positions / (self.finish_s - self.start_s)


@dataclass
class SimResult:
    consumers: dict[str, ConsumerResult]
    positions: int  # distinct positions consumed (max end over consumers)
    captures: int
    recaptures: int
    distinct_fps_captured: int
    evictions: int
    batches: int
    passes: int
    busy_s: float
    end_s: float
    max_retained: int
    window_bound_all: int  # Σ window sizes of every consumer of the run
    max_queue: int  # longest queue wanted() returned in any pass
    retained_violations: list[str]
    demand_passes: int  # passes that found a blocked consumer's demand
    demand_with_prefetch_pending: int  # ... while other prefetch was queued as well
    demand_not_first: list[str]  # passes whose batch did not start with the demanded positions
    final_retained: int
    union_violations: list[str]  # retained outside / beyond the union of live windows
    max_union: int  # largest union of live windows at any pass
    retained_log: list[tuple[float, int, int]]  # per pass, after eviction: (t, retained, union size)
    leases_expired: int  # leases of fenced consumers, released by the producer

    @property
    def captures_per_position(self) -> float:
        return self.captures / self.positions if self.positions else 0.0

    @property
    def utilization(self) -> float:
        return self.busy_s / self.end_s if self.end_s else 0.0


class _Consumer:
    def __init__(self, spec: ConsumerSpec, end: int) -> None:
        self.spec = spec
        self.end = end
        self.reg = Registration(consumer_id=spec.name, draft="sim", state="completed", cursor=0,
                                lookbehind=spec.lookbehind, lookahead=spec.lookahead,
                                batch_size=spec.batch_size, end=end)
        self.started = False
        self.done = False
        self.training = False
        self.next_pos = 0  # next position of the current batch to read
        self.held: list[str] = []  # leased fingerprints of the current batch
        self.blocked_since: float | None = None
        self.wait_s = 0.0
        self.demand_waits = 0
        self.demand_since = 0.0
        self.max_demand_wait_s = 0.0
        self.steps = 0
        self.finish_s: float | None = None
        self.killed = False
        self.fenced_s: float | None = None

    def batch_stop(self) -> int:
        return min(self.reg.cursor + self.spec.batch_size, self.end)


class Simulation:
    """One run. ``positions`` is the run's length; ``plan_len`` the plan's (defaults to positions)."""

    def __init__(self, consumers: Sequence[ConsumerSpec], producer: ProducerSpec, positions: int,
                 plan_len: int | None = None, check: bool = True, max_events: int = 10_000_000) -> None:
        if not consumers:
            raise ValueError("at least one consumer")
        names = [c.name for c in consumers]
        if len(set(names)) != len(names):
            raise ValueError(f"consumer names must be unique: {names}")
        if check:
            for c in consumers:
                check_deadlock(producer.limits, c.batch_size, c.lookahead, producer.max_length)
        self.producer = producer
        self.positions = positions
        self.plan_len = plan_len or positions
        self._fps = [f"{i:040x}" for i in range(self.plan_len)]
        self.cons = [_Consumer(c, positions if c.end is None else c.end) for c in consumers]
        self.max_events = max_events
        self.now = 0.0
        self._seq = 0
        self._events: list = []
        self.published: set[str] = set()
        self.ever_published: set[str] = set()
        self.captured: set[str] = set()
        self.leases: Counter[str] = Counter()
        self.busy = False
        self.captures = self.recaptures = self.evictions = self.batches = self.passes = 0
        self.busy_s = 0.0
        self.max_retained = 0
        self.max_queue = 0
        self.bound_at_pass = 0
        self.violations: list[str] = []
        self.demand_passes = 0
        self.demand_with_prefetch = 0
        self.demand_not_first: list[str] = []
        self.batch_log: list[tuple[float, list[int], list[int]]] = []  # (time, positions, demanded)
        self.union_size = 0
        self.max_union = 0
        self.union_violations: list[str] = []
        self.retained_log: list[tuple[float, int, int]] = []
        self.leases_expired = 0

    # -- helpers -------------------------------------------------------------------------------
    def fp_of(self, p: int) -> str:
        return self._fps[p % self.plan_len]

    def length_of(self, p: int) -> int:
        return self.producer.sample_tokens

    def _push(self, t: float, kind: str, obj) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def live(self) -> list[Registration]:
        return [c.reg for c in self.cons if c.started and not c.done]

    # -- producer ------------------------------------------------------------------------------
    def _evict(self, live: list[Registration]) -> None:
        union = set()
        for reg in live:
            lo, hi = reg.window()
            union.update(self.fp_of(p) for p in range(lo, hi + 1))
        stray = set(self.leases) - union
        if stray:
            self.union_violations.append(f"t={self.now:.3f}: {len(stray)} leased artifacts outside every live window")
        gone = self.published - union - stray
        self.evictions += len(gone)
        self.published -= gone
        self.union_size = len(union)
        self.max_union = max(self.max_union, self.union_size)
        self.retained_log.append((self.now, len(self.published), self.union_size))

    def _last_beat(self, c: _Consumer) -> float:
        """The consumer's last heartbeat: every ``heartbeat_s`` from its start while its process lives."""
        alive_until = self.now if c.spec.killed_s is None else min(self.now, c.spec.killed_s)
        hb = c.spec.heartbeat_s
        return c.spec.start_s + math.floor((alive_until - c.spec.start_s) / hb) * hb

    def _fence_expired(self) -> None:
        """Fence every running consumer silent for longer than the heartbeat timeout; expire its leases."""
        for c in self.cons:
            if c.started and not c.done and self.now - self._last_beat(c) > self.producer.heartbeat_timeout_s:
                c.done, c.fenced_s = True, self.now
                c.reg.state, c.reg.demand = "expired", []
                for fp in c.held:
                    self.leases[fp] -= 1
                    if not self.leases[fp]:
                        del self.leases[fp]
                    self.leases_expired += 1
                c.held = []

    def _pass(self) -> None:
        self._fence_expired()
        live = self.live()
        self.passes += 1
        self._evict(live)
        self.bound_at_pass = window_bound(live)
        if not live:
            return
        limits = self.producer.limits
        queue = wanted(live, self.fp_of, self.published, limits.max_queue)
        self.max_queue = max(self.max_queue, len(queue))
        if not queue:
            return
        batch = next_batch(queue, self.length_of, limits)
        demanded = {p for reg in live for p in reg.demand
                    if reg.readable()[0] <= p <= reg.readable()[1] and self.fp_of(p) not in self.published}
        if demanded:
            self.demand_passes += 1
            if any(not w.demand for w in queue):
                self.demand_with_prefetch += 1
            # demand before prefetch: the batch starts with demanded positions, and holds all of them
            # that fit
            got = set().union(*(w.positions for w in batch))
            want_fps = {self.fp_of(p) for p in demanded}
            if not batch[0].demand or not (want_fps <= {w.fp for w in batch}
                                           or len(batch) == limits.max_batch_samples):
                self.demand_not_first.append(f"t={self.now:.3f} demanded {sorted(demanded)} batch {sorted(got)}")
        self.batch_log.append((self.now, [w.position for w in batch], sorted(demanded)))
        self.busy = True
        dt = self.producer.fixed_s + self.producer.per_sample_s * len(batch)
        self.busy_s += dt
        self.batches += 1
        self._push(self.now + dt, "captured", batch)

    def _captured(self, batch) -> None:
        self.busy = False
        for w in batch:
            self.captures += 1
            if w.fp in self.ever_published:
                self.recaptures += 1
            self.captured.add(w.fp)
            self.ever_published.add(w.fp)
            self.published.add(w.fp)

    # -- consumers -----------------------------------------------------------------------------
    def _advance(self, c: _Consumer) -> None:
        """Read the current batch as far as published; block with demand, or start the step."""
        if not c.started or c.done or c.training or c.killed:
            return
        stop = c.batch_stop()
        while c.next_pos < stop:
            fp = self.fp_of(c.next_pos)
            if fp not in self.published:
                if c.blocked_since is None:
                    c.blocked_since = self.now
                    c.demand_waits += 1
                if c.reg.demand != [c.next_pos]:
                    self._demand_served(c)
                    c.reg.demand = [c.next_pos]
                    c.demand_since = self.now
                return
            self.leases[fp] += 1
            c.held.append(fp)
            c.next_pos += 1
        if c.blocked_since is not None:
            c.wait_s += self.now - c.blocked_since
            c.blocked_since = None
        self._demand_served(c)
        c.reg.demand = []
        c.training = True
        self._push(self.now + c.spec.step_s, "step", c)

    def _demand_served(self, c: _Consumer) -> None:
        if c.reg.demand:
            c.max_demand_wait_s = max(c.max_demand_wait_s, self.now - c.demand_since)

    def _step_done(self, c: _Consumer) -> None:
        c.training = False
        c.steps += 1
        c.reg.cursor = c.batch_stop()  # commit after the step that consumed the positions
        for fp in c.held:
            self.leases[fp] -= 1
            if not self.leases[fp]:
                del self.leases[fp]
        c.held = []
        if c.reg.cursor >= c.end:
            c.done = True
            c.finish_s = self.now
            c.reg.state = "completed"  # fenced: its window stops counting
            c.reg.demand = []

    # -- run -----------------------------------------------------------------------------------
    def _check_retained(self) -> None:
        n = len(self.published)
        self.max_retained = max(self.max_retained, n)
        if n > self.bound_at_pass:
            self.violations.append(f"t={self.now:.3f}: retained {n} > window bound {self.bound_at_pass}")
        if n > self.union_size:
            self.union_violations.append(f"t={self.now:.3f}: retained {n} > union of live windows {self.union_size}")

    def run(self) -> SimResult:
        for c in self.cons:
            self._push(c.spec.start_s, "start", c)
            if c.spec.killed_s is not None:
                self._push(c.spec.killed_s, "kill", c)
        events = 0
        while self._events:
            events += 1
            if events > self.max_events:
                raise RuntimeError(f"more than {self.max_events} events")
            self.now, _, kind, obj = heapq.heappop(self._events)
            if kind == "start":
                obj.started = True
                obj.reg.state = "running"
                obj.reg.cursor = 0
                obj.next_pos = 0
            elif kind == "step":
                if obj.killed:  # died mid-step: nothing is committed
                    continue
                self._step_done(obj)
                if not obj.done:
                    obj.next_pos = obj.reg.cursor
            elif kind == "captured":
                self._captured(obj)
            elif kind == "kill":
                obj.killed = True
                self._push(self.now + self.producer.poll_s, "poll", None)
            elif kind == "poll" and any(c.killed and not c.done for c in self.cons):
                self._push(self.now + self.producer.poll_s, "poll", None)
            # publications and commits let waiting consumers read on (recording demand if blocked)
            for c in self.cons:
                self._advance(c)
            self._check_retained()
            if not self.busy:
                self._pass()
                self._check_retained()
        unfinished = [c.spec.name for c in self.cons if not c.done]
        if unfinished:
            raise SimDeadlock(
                f"no event left at t={self.now:.3f} but {unfinished} did not finish: cursors "
                f"{[c.reg.cursor for c in self.cons if not c.done]}, demand "
                f"{[c.reg.demand for c in self.cons if not c.done]}")
        return SimResult(
            consumers={c.spec.name: ConsumerResult(
                c.spec.name, c.spec.start_s, c.finish_s, c.reg.cursor if c.killed else c.end, c.steps, c.wait_s,
                c.demand_waits, c.max_demand_wait_s, c.fenced_s,
                self._last_beat(c) if c.killed else None) for c in self.cons},
            positions=max(c.reg.cursor for c in self.cons), captures=self.captures, recaptures=self.recaptures,
            distinct_fps_captured=len(self.captured), evictions=self.evictions, batches=self.batches,
            passes=self.passes, busy_s=self.busy_s, end_s=self.now, max_retained=self.max_retained,
            window_bound_all=sum(c.spec.lookbehind + c.spec.lookahead + 1 for c in self.cons),
            max_queue=self.max_queue, retained_violations=self.violations,
            demand_passes=self.demand_passes, demand_with_prefetch_pending=self.demand_with_prefetch,
            demand_not_first=self.demand_not_first, final_retained=len(self.published),
            union_violations=self.union_violations, max_union=self.max_union, retained_log=self.retained_log,
            leases_expired=self.leases_expired)


def simulate(consumers: Sequence[ConsumerSpec], producer: ProducerSpec | None = None, positions: int = 10_000,
             plan_len: int | None = None, check: bool = True) -> SimResult:
    """Run one simulation (see :class:`Simulation`)."""
    return Simulation(consumers, producer or ProducerSpec(), positions, plan_len, check).run()


def solo_rates(consumers: Sequence[ConsumerSpec], producer: ProducerSpec | None = None, positions: int = 10_000,
               plan_len: int | None = None) -> dict[str, float]:
    """Each consumer's rate when it runs alone with the same producer (start delay dropped)."""
    out = {}
    for c in consumers:
        alone = ConsumerSpec(c.name, c.step_s, c.batch_size, c.lookbehind, c.lookahead, 0.0, c.end)
        out[c.name] = simulate([alone], producer, positions, plan_len).consumers[c.name].rate
    return out


# ---- scenarios used by tests and docs/scheduler.md --------------------------------------------------
def overlap_consumers() -> list[ConsumerSpec]:
    """Three consumers, 80 / 78 / 76 positions/s compute-bound, windows overlapping for 10k positions."""
    return [
        ConsumerSpec("fast", step_s=0.2, batch_size=16, lookbehind=64, lookahead=512),
        ConsumerSpec("mid", step_s=8 / 78, batch_size=8, lookbehind=64, lookahead=512),
        ConsumerSpec("slow", step_s=4 / 76, batch_size=4, lookbehind=64, lookahead=512),
    ]


def lagging_consumer(start_s: float = 30.0, end: int | None = None) -> ConsumerSpec:
    """Starts late, slow (40 positions/s), small window 0:32: everything it reads was evicted."""
    return ConsumerSpec("lag", step_s=0.1, batch_size=4, lookbehind=0, lookahead=32, start_s=start_s, end=end)


def killed_consumer(killed_s: float = 41.3) -> ConsumerSpec:
    """20 positions/s with a 64:256 window, killed at ``killed_s`` (last heartbeat at 40 s): by then
    the others are about 2,500 positions ahead, so its window is its own."""
    return ConsumerSpec("victim", step_s=0.2, batch_size=4, lookbehind=64, lookahead=256, killed_s=killed_s)


def default_producer() -> ProducerSpec:
    """8 samples per 60 ms batch: 133 samples/s, about 1.7x what the fastest consumer needs."""
    return ProducerSpec(fixed_s=0.02, per_sample_s=0.005,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=8, max_batch_tokens=8192))


def diverge_consumers() -> list[ConsumerSpec]:
    """80 / 60 / 40 positions/s with 64:256 windows, plus the lagging one from 10 s: the windows part
    within the first 2,000 positions, so every consumer's window is its own from then on."""
    return [
        ConsumerSpec("a", step_s=0.2, batch_size=16, lookbehind=64, lookahead=256),
        ConsumerSpec("b", step_s=0.2, batch_size=12, lookbehind=64, lookahead=256),
        ConsumerSpec("c", step_s=0.1, batch_size=4, lookbehind=64, lookahead=256),
        lagging_consumer(start_s=10.0),
    ]


def diverge_producer() -> ProducerSpec:
    """8 samples per 30 ms batch: 267 samples/s for 220 positions/s of disjoint windows."""
    return ProducerSpec(fixed_s=0.01, per_sample_s=0.0025,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=8, max_batch_tokens=8192))


def saturated_consumers() -> list[ConsumerSpec]:
    """A 160 positions/s consumer with a 2048 lookahead (its prefetch never drains) and one that
    starts at 5 s with a 0:8 window: the producer (100 samples/s) is the bottleneck, so both block."""
    return [
        ConsumerSpec("greedy", step_s=0.1, batch_size=16, lookbehind=0, lookahead=2048),
        ConsumerSpec("late", step_s=0.05, batch_size=4, lookbehind=0, lookahead=8, start_s=5.0),
    ]


def saturated_producer() -> ProducerSpec:
    """4 samples per 40 ms batch: 100 samples/s."""
    return ProducerSpec(fixed_s=0.02, per_sample_s=0.005,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=4, max_batch_tokens=8192))


#: name -> (consumers, producer)
SCENARIOS = {
    "overlap": lambda: (overlap_consumers(), default_producer()),
    "lagging": lambda: ([*overlap_consumers(), lagging_consumer()], default_producer()),
    "killed": lambda: ([*overlap_consumers(), killed_consumer()], default_producer()),
    "diverge": lambda: (diverge_consumers(), diverge_producer()),
    "saturated": lambda: (saturated_consumers(), saturated_producer()),
}


# ---- CLI -----------------------------------------------------------------------------------------------
def parse_consumer(text: str) -> ConsumerSpec:
    """``NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]]``."""
    parts = text.split(":")
    if not 5 <= len(parts) <= 7:
        raise argparse.ArgumentTypeError(
            f"--consumer {text!r}: expected NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]]")
    try:
        return ConsumerSpec(parts[0], float(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]),
                            float(parts[5]) if len(parts) > 5 else 0.0,
                            int(parts[6]) if len(parts) > 6 else None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--consumer {text!r}: {exc}") from None


def format_table(res: SimResult, consumers: Sequence[ConsumerSpec], solo: dict[str, float] | None = None) -> str:
    lines = ["| consumer | batch | window | start s | positions | compute-bound pos/s | rate pos/s"
             + (" | solo pos/s | rate / solo" if solo else "") + " | waited s | demand waits | longest wait s |",
             "|---|---|---|---|---|---|---" + ("|---|---" if solo else "") + "|---|---|---|"]
    for c in consumers:
        r = res.consumers[c.name]
        row = (f"| {c.name} | {c.batch_size} | {c.lookbehind}:{c.lookahead} | {c.start_s:g} | {r.positions} | "
               f"{c.compute_rate:.1f} | {r.rate:.2f}")
        if solo:
            row += f" | {solo[c.name]:.2f} | {r.rate / solo[c.name]:.3f}"
        lines.append(row + f" | {r.wait_s:.2f} | {r.demand_waits} | {r.max_demand_wait_s:.3f} |")
    lines += [
        "",
        "| producer | value |",
        "|---|---|",
        f"| distinct positions | {res.positions} |",
        f"| captures | {res.captures} |",
        f"| captures per position | {res.captures_per_position:.4f} |",
        f"| recaptures | {res.recaptures} |",
        f"| evictions | {res.evictions} |",
        f"| capture batches | {res.batches} |",
        f"| max queue | {res.max_queue} |",
        f"| max retained | {res.max_retained} |",
        f"| window bound (Σ window sizes) | {res.window_bound_all} |",
        f"| max union of live windows | {res.max_union} |",
        f"| retained-bound violations (Σ, union) | {len(res.retained_violations)}, {len(res.union_violations)} |",
        f"| producer utilization | {res.utilization:.2f} |",
        f"| virtual run time s | {res.end_s:.2f} |",
        f"| passes with demand (with prefetch pending) | {res.demand_passes} ({res.demand_with_prefetch_pending}) |",
        f"| demand not served first | {len(res.demand_not_first)} |",
    ]
    for c in consumers:
        r = res.consumers[c.name]
        if r.fenced_s is not None:
            lines.append(f"| {c.name}: killed at / last heartbeat / fenced at (s) | {c.killed_s:g} / "
                         f"{r.last_heartbeat_s:g} / {r.fenced_s:.2f} (cursor {r.positions}, leases expired "
                         f"{res.leases_expired}) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m artcache.bench.sim", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), help="a preset set of consumers")
    ap.add_argument("--consumer", action="append", type=parse_consumer, default=[],
                    help="NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]] (repeatable)")
    ap.add_argument("--positions", type=int, default=10_000, help="run length in positions")
    ap.add_argument("--plan-len", type=int, default=None, help="plan length (positions wrap: p %% plan_len)")
    ap.add_argument("--fixed-s", type=float, help="capture latency per batch (default: the scenario's, 0.02)")
    ap.add_argument("--per-sample-s", type=float, help="capture latency per sample (default 0.005)")
    ap.add_argument("--batch-samples", type=int, help="max capture batch in samples (default 8)")
    ap.add_argument("--batch-tokens", type=int, help="max capture batch in padded tokens (default 8192)")
    ap.add_argument("--max-queue", type=int, help="max queued fingerprints per pass (default 1024)")
    ap.add_argument("--sample-tokens", type=int, help="every sample's length in tokens (default 256)")
    ap.add_argument("--solo", action="store_true", help="also simulate each consumer alone")
    args = ap.parse_args(argv)
    consumers, base = SCENARIOS[args.scenario]() if args.scenario else ([], default_producer())
    consumers = [*consumers, *args.consumer]
    if not consumers:
        ap.error("give --scenario or at least one --consumer")

    def pick(value, default):
        return default if value is None else value

    tokens = pick(args.sample_tokens, base.sample_tokens)
    producer = ProducerSpec(
        fixed_s=pick(args.fixed_s, base.fixed_s), per_sample_s=pick(args.per_sample_s, base.per_sample_s),
        sample_tokens=tokens, max_length=max(tokens, base.max_length) if args.sample_tokens is None else tokens,
        limits=SchedulerLimits(max_queue=pick(args.max_queue, base.limits.max_queue),
                               max_batch_samples=pick(args.batch_samples, base.limits.max_batch_samples),
                               max_batch_tokens=pick(args.batch_tokens, base.limits.max_batch_tokens)))
    try:
        res = simulate(consumers, producer, args.positions, args.plan_len)
    except (ValueError, SimDeadlock) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    solo = solo_rates(consumers, producer, args.positions, args.plan_len) if args.solo else None
    print(f"producer: {producer.fixed_s:g} s + {producer.per_sample_s:g} s/sample, batch ≤ "
          f"{producer.limits.max_batch_samples}: "
          f"capacity {producer.capacity:.1f} samples/s; {args.positions} positions"
          + (f", plan of {args.plan_len}" if args.plan_len else ""))
    print(format_table(res, consumers, solo))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
