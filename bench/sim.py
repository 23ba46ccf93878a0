"""Deterministic discrete-event simulation of one producer and N consumers over the REAL retention policy.

Nothing sleeps and no model runs: a virtual clock advances from event to event. The producer calls
:func:`artcache.eviction.decide` (the retain set, the evictions with their reasons, the capture queue
inside the disk budget), :func:`~artcache.scheduler.next_batch`, :class:`~artcache.scheduler.SchedulerLimits`
and :class:`~artcache.eviction.RateEstimator` exactly as ``Producer.tick`` does, over the consumers'
real :class:`~artcache.plan.EpochOrder` position orders:

* a **pass** (right after a capture completes; otherwise at most every ``poll_s``, the producer's idle
  poll, when something happened): fence expired consumers, observe every live cursor (rates),
  decide, evict what the decision names (never a leased artifact), take one batch from the queue
  and start capturing it;
* a **capture** takes ``fixed_s + per_sample_s * len(batch)`` of virtual time (one batch in flight)
  and then publishes the batch at once (``artifact_bytes`` each); a capture of a sample published
  before and evicted since is a **recapture**;
* a **consumer** registers at ``start_s`` (with ``load_s``, it reads from ``start_s + load_s``: loading its
  draft meanwhile, registered at cursor 0 with its window live), then repeatedly reads its next batch of consecutive
  positions ``[cursor, cursor + batch_size)`` in order (as the consumer's reader), leasing each
  position it reads; on an unpublished position it records it in its demand and waits; with the
  whole batch read it trains for ``step_s``, commits the cursor, releases the batch's leases; at
  ``end`` it completes (its window stops counting);
* **liveness**: a consumer heart-beats every ``heartbeat_s`` while its process lives; one with
  ``killed_s`` dies then (no commit, its leases stay). At each pass the producer fences every
  running consumer whose last heartbeat is older than ``heartbeat_timeout_s``: its leases expired,
  its window no longer live.

Checked as it runs: after every event, retained bytes <= the budget (unless the live windows alone
exceed it, which the decision reports); at every eviction, that no evicted artifact lies inside a
live window or is leased; after every pass that found a blocked consumer, that the batch starts with
the demanded position. Every read is logged (``trace``), so :func:`offline_optimum` can compute what
Belady's MIN — the whole trace known in advance, any artifact evictable at any time — needs for the
same reads and budget; and with it what the guarantee pinned at each read (``pins``: published and in a
live window, or leased), so that it can compute Belady under the same window pins, the fair bound.

Reproduce the figures of ``docs/scheduler.md``::

    python -m artcache.bench.sim --scenario hetero --positions 10000 --solo --opt
    python -m artcache.bench.sim --scenario hetero --positions 10000 --policy windows
    python -m artcache.bench.sim --scenario hetero --positions 10000 --budget 2000 --opt
    python -m artcache.bench.sim --scenario overlap --positions 10000 --solo
    python -m artcache.bench.sim --scenario killed --positions 10000 --policy windows
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import msgspec.inspect as mi
import numpy as np

from artcache.errors import ConfigError
from artcache.eviction import POLICIES, RateEstimator, Reader, decide, retention_rule
from artcache.plan import EpochOrder
from artcache.ranges import Count, NonNegativeFloat, Positive, WindowSide, check_value, describe_number
from artcache.scheduler import SchedulerLimits, check_deadlock, next_batch


class SimDeadlock(RuntimeError):
    """No event is left but some consumer has not reached its end."""


@dataclass(frozen=True)
class ConsumerSpec:
    """One simulated consumer.

    Attributes:
        name: consumer id. step_s: compute time of one optimizer step (virtual seconds).
        batch_size: positions per step. lookbehind, lookahead: its window.
        start_s: when it registers. load_s: seconds from registering to its first read (loading its draft):
            registered at cursor 0 meanwhile, its window live and its rate the others' median (as a registered
            consumer that commits nothing is to :class:`~artcache.eviction.RateEstimator`).
        end: exclusive last position (None: the run's ``positions``).
        killed_s: when its process dies (None: never). heartbeat_s: its heartbeat period.
        epoch_len: training samples per epoch (None: the whole plan).
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
    epoch_len: int | None = None
    load_s: float = 0.0

    @property
    def compute_rate(self) -> float:
        """Positions per second if it never waited."""
        return self.batch_size / self.step_s


@dataclass(frozen=True)
class ProducerSpec:
    """Capture latency of one batch: ``fixed_s + per_sample_s * samples``; scheduler limits;
    ``heartbeat_timeout_s`` (fence a consumer silent for longer, the producer's default 30 s),
    ``poll_s`` (idle poll, the producer's 20 ms), ``artifact_bytes`` (every artifact's size),
    ``budget_bytes`` (the disk budget; inf: none), ``policy`` (``need`` or the old ``windows`` rule)."""

    fixed_s: float = 0.02
    per_sample_s: float = 0.005
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    sample_tokens: int = 256  # every sample's length (padded-token limit)
    max_length: int = 512
    heartbeat_timeout_s: float = 30.0
    poll_s: float = 0.02
    artifact_bytes: int = 1 << 20
    budget_bytes: float = math.inf
    policy: str = "need"

    @property
    def capacity(self) -> float:
        """Samples per second with full batches."""
        n = min(self.limits.max_batch_samples, max(1, self.limits.max_batch_tokens // self.sample_tokens))
        return n / (self.fixed_s + self.per_sample_s * n)

    @classmethod
    def of_settings(cls, disk_budget: int | str = 0, retention: str = "", fill: bool = False,
                    **fields) -> ProducerSpec:
        """The simulated producer an ``artcache producer`` with these retention settings is: its rule from
        :func:`artcache.eviction.retention_rule`, the producer's own (no ``--disk-budget``: ``windows``), and its
        budget in bytes (``auto``: none here, the simulator has no filesystem). ``fields``: the other fields."""
        policy = retention_rule(disk_budget, retention, fill)
        budget = disk_budget if isinstance(disk_budget, int) and disk_budget else math.inf
        return cls(budget_bytes=budget, policy=policy, **fields)

    def with_budget(self, artifacts: float) -> ProducerSpec:
        """This producer with a budget of ``artifacts`` artifacts (inf: none)."""
        from dataclasses import replace

        return replace(self, budget_bytes=artifacts * self.artifact_bytes)


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


@dataclass(frozen=True, eq=False)
class PinLog:
    """What the guarantee pinned at each read of a run: ``sample[k]`` was published and inside some live
    window (or leased), so the producer could not evict it, at every read ``start[k] <= j < end[k]``
    (indices into :attr:`SimResult.trace`, ``start < end``). Equal-length int64 arrays; one sample may have
    several rows (it leaves the windows, or is evicted, and comes back). Taken from the run's own state at
    each read: the windows where its consumers' cursors were then, the artifacts its policy had published."""

    start: np.ndarray
    end: np.ndarray
    sample: np.ndarray

    def __len__(self) -> int:
        return len(self.sample)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PinLog):
            return NotImplemented
        return all(np.array_equal(a, b) for a, b in
                   ((self.start, other.start), (self.end, other.end), (self.sample, other.sample)))

    __hash__ = None  # type: ignore[assignment]  # holds arrays

    def at(self, j: int) -> set[int]:
        """The samples pinned at read ``j`` (for tests and debugging: O(len))."""
        sel = (self.start <= j) & (j < self.end)
        return set(self.sample[sel].tolist())


@dataclass
class SimResult:
    consumers: dict[str, ConsumerResult]
    positions: int  # distinct (epoch, sample) pairs consumed
    captures: int
    recaptures: int
    distinct_fps_captured: int
    evictions: int
    evictions_by_reason: dict[str, int]
    batches: int
    passes: int
    busy_s: float
    end_s: float
    max_retained: int  # artifacts
    max_retained_bytes: int
    budget_bytes: float
    binding_passes: int  # passes whose decision said the budget binds
    windows_exceed_budget_passes: int
    window_bound_all: int  # Σ window sizes of every consumer of the run
    max_queue: int  # longest capture queue a decision returned
    budget_violations: list[str]  # retained bytes above the budget after some event
    window_violations: list[str]  # an evicted artifact inside a live window, or leased
    demand_passes: int  # passes that found a blocked consumer's demand
    demand_with_prefetch_pending: int  # ... while other prefetch was queued as well
    demand_not_first: list[str]  # passes whose batch did not start with the demanded positions
    final_retained: int
    max_union: int  # largest union of live windows at any pass
    retained_log: list[tuple[float, int, int]]  # per pass, after eviction: (t, retained, union size)
    leases_expired: int  # leases of fenced consumers, released by the producer
    trace: list[int] = field(default_factory=list, repr=False)  # sample of every read, in time order
    pins: PinLog | None = field(default=None, repr=False)  # what the guarantee pinned at each read of trace
    # one int per read of trace: artifacts of the batch in capture then (the room the run's decision had made
    # for them, so its published artifacts fitted budget - in_flight then); offline_optimum(reserved=)
    in_flight: list[int] = field(default_factory=list, repr=False)

    @property
    def captures_per_position(self) -> float:
        return self.captures / self.positions if self.positions else 0.0

    @property
    def utilization(self) -> float:
        return self.busy_s / self.end_s if self.end_s else 0.0

    @property
    def binding(self) -> bool:
        return self.binding_passes > 0


class _Consumer:
    def __init__(self, spec: ConsumerSpec, end: int, order: EpochOrder) -> None:
        self.spec = spec
        self.end = end
        self.order = order
        self.cursor = 0
        self.demand: list[int] = []
        self.started = False  # registered (live until done)
        self.ready = False  # reads (after its load_s)
        self.done = False
        self.training = False
        self.next_pos = 0  # next position of the current batch to read
        self.held: list[int] = []  # leased samples of the current batch
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
        return min(self.cursor + self.spec.batch_size, self.end)

    def reader(self, rate: float) -> Reader:
        return Reader(self.spec.name, self.cursor, self.spec.lookbehind, self.spec.lookahead, self.end, self.order,
                      rate, demand=tuple(self.demand), batch_size=self.spec.batch_size)


class Simulation:
    """One run. ``positions`` is the run's length; ``plan_len`` the plan's (defaults to positions);
    positions past a consumer's epoch walk its next epoch (:class:`~artcache.plan.EpochOrder`, seed 0)."""

    def __init__(self, consumers: Sequence[ConsumerSpec], producer: ProducerSpec, positions: int,
                 plan_len: int | None = None, check: bool = True, max_events: int = 20_000_000) -> None:
        if not consumers:
            raise ValueError("at least one consumer")
        names = [c.name for c in consumers]
        if len(set(names)) != len(names):
            raise ValueError(f"consumer names must be unique: {names}")
        if producer.policy not in POLICIES:
            raise ValueError(f"policy {producer.policy!r}: accepted {', '.join(POLICIES)}")
        if check:
            for c in consumers:
                check_deadlock(producer.limits, c.batch_size, c.lookahead, producer.max_length)
        self.producer = producer
        self.positions = positions
        self.plan_len = plan_len or positions
        orders: dict[int, EpochOrder] = {}
        self.cons = []
        for c in consumers:
            n = c.epoch_len or self.plan_len
            if n not in orders:
                orders[n] = EpochOrder(self.plan_len, n, 0)
            self.cons.append(_Consumer(c, positions if c.end is None else c.end, orders[n]))
        self.max_events = max_events
        self.now = 0.0
        self._seq = 0
        self._events: list = []
        self.sizes = np.zeros(self.plan_len, dtype=np.int64)
        self.retained = 0  # artifacts; bytes = retained * artifact_bytes
        self.ever_published = np.zeros(self.plan_len, dtype=bool)
        self.leases: Counter[int] = Counter()
        self.rates = RateEstimator()
        self.busy = False
        self.idle_until = -1.0  # an idle pass waits for the poll interval
        self.poll_pending = False
        self.dirty = False  # something happened since the last pass
        self.captures = self.recaptures = self.evictions = self.batches = self.passes = 0
        self.by_reason: Counter[str] = Counter()
        self.busy_s = 0.0
        self.max_retained = 0
        self.max_queue = 0
        self.binding_passes = self.exceed_passes = 0
        self.exceeds = False  # the last decision: windows alone exceed the budget
        self.budget_violations: list[str] = []
        self.window_violations: list[str] = []
        self.demand_passes = 0
        self.demand_with_prefetch = 0
        self.demand_not_first: list[str] = []
        self.union_size = 0
        self.max_union = 0
        self.retained_log: list[tuple[float, int, int]] = []
        self.leases_expired = 0
        self.trace: list[int] = []
        # what the guarantee pins (published and in a live window, or leased), logged per read of the trace
        self._pinned = np.zeros(self.plan_len, dtype=bool)
        self._pin_open = np.zeros(self.plan_len, dtype=np.int64)  # read index where each open pin began
        self._pin_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pins_stale = True  # an event may have moved a window or published / evicted since
        self.in_flight = 0  # artifacts of the batch being captured (room the decision made for them)
        self._in_flight_log: list[int] = []  # in_flight at each read of the trace
        # as the producer: what it could not capture in time if it waited (its poll and two batches)
        self.urgent_s = producer.poll_s + 2 * (producer.fixed_s
                                               + producer.per_sample_s * producer.limits.max_batch_samples)

    # -- helpers -------------------------------------------------------------------------------
    def length_of(self, sample: int) -> int:
        return self.producer.sample_tokens

    def _push(self, t: float, kind: str, obj) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def live(self) -> list[_Consumer]:
        return [c for c in self.cons if c.started and not c.done]

    # -- producer ------------------------------------------------------------------------------
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
                c.demand = []
                self._release(c)

    def _release(self, c: _Consumer, expired: bool = True) -> None:
        for s in c.held:
            self.leases[s] -= 1
            if not self.leases[s]:
                del self.leases[s]
            self.leases_expired += expired
        c.held = []

    def _window_mask(self, live: Sequence[_Consumer], readers: Sequence[Reader] | None = None) -> np.ndarray:
        """The union of the live windows, as a bool mask over plan samples."""
        mask = np.zeros(self.plan_len, dtype=bool)
        for i, c in enumerate(live):
            lo, hi = (readers[i] if readers is not None else c.reader(0.0)).window()
            if hi >= lo:
                mask[c.order.samples(lo, hi + 1)] = True
        return mask

    def _log_pins(self, final: bool = False) -> None:
        """Bring the pin log up to the next read: what is published and inside a live window or leased now
        (``final``: close every open pin at the end of the trace)."""
        j = len(self.trace)
        if final:
            now = np.zeros(self.plan_len, dtype=bool)
        else:
            now = self._window_mask(self.live())
            if self.leases:
                now[np.fromiter(self.leases, dtype=np.int64, count=len(self.leases))] = True
            now &= self.sizes > 0
        self._pin_open[now & ~self._pinned] = j
        closed = np.flatnonzero(self._pinned & ~now)
        begun = self._pin_open[closed]
        keep = begun < j  # pinned and unpinned between two reads: pinned at no read
        if keep.any():
            self._pin_rows.append((begun[keep], np.full(int(keep.sum()), j, dtype=np.int64), closed[keep]))
        self._pinned = now
        self._pins_stale = False

    def _pass(self) -> None:
        self.dirty = False
        self._fence_expired()
        live = self.live()
        self.passes += 1
        prod = self.producer
        for c in live:
            self.rates.observe(c.spec.name, 0, c.cursor, self.now)
        readers = [c.reader(self.rates.rate(c.spec.name)) for c in live]
        in_window = self._window_mask(live, readers)
        dec = decide(readers, sizes=self.sizes, budget=prod.budget_bytes, est_size=prod.artifact_bytes,
                     leased=np.fromiter(self.leases, dtype=np.int64, count=len(self.leases)),
                     max_queue=prod.limits.max_queue, policy=prod.policy, urgent_s=self.urgent_s)
        if dec.evict:
            gone = np.fromiter(dec.evict, dtype=np.int64, count=len(dec.evict))
            inside = gone[in_window[gone]]
            if len(inside):
                self.window_violations.append(f"t={self.now:.3f}: evicted {len(inside)} inside a live window")
            leased = [s for s in gone.tolist() if s in self.leases]
            if leased:
                self.window_violations.append(f"t={self.now:.3f}: evicted {len(leased)} leased")
            self.sizes[gone] = 0
            self.retained -= len(gone)
            self.evictions += len(gone)
            self.by_reason.update(dec.evict.values())
        self.binding_passes += dec.binding
        self.exceed_passes += dec.windows_exceed_budget
        self.exceeds = dec.windows_exceed_budget
        self.union_size = int(np.count_nonzero(in_window))
        self.max_union = max(self.max_union, self.union_size)
        self.retained_log.append((self.now, self.retained, self.union_size))
        self.max_queue = max(self.max_queue, len(dec.capture_samples))
        limits = prod.limits
        batch = next_batch(dec.head(limits.max_batch_samples), self.length_of, limits) \
            if len(dec.capture_samples) else []
        if not batch:
            self.idle_until = self.now + prod.poll_s
            return
        demanded = {(c.spec.name, p) for c in live for p in c.demand
                    if c.cursor <= p < c.batch_stop() and not self.sizes[c.order.sample(p)]}
        if demanded:
            self.demand_passes += 1
            if (dec.capture_samples.size > len([w for w in batch if w.demand])
                    and any(not w.demand for w in dec.head(len(dec.capture_samples)))):
                self.demand_with_prefetch += 1
            want = {next(c for c in live if c.spec.name == n).order.sample(p) for n, p in demanded}
            if not batch[0].demand or not (want <= {w.sample for w in batch}
                                           or len(batch) == limits.max_batch_samples):
                self.demand_not_first.append(f"t={self.now:.3f} demanded {sorted(want)} batch "
                                             f"{[w.sample for w in batch]}")
        self.busy = True
        self.in_flight = len(batch)
        dt = prod.fixed_s + prod.per_sample_s * len(batch)
        self.busy_s += dt
        self.batches += 1
        self._push(self.now + dt, "captured", batch)

    def _captured(self, batch) -> None:
        self.busy = False
        self.in_flight = 0
        for w in batch:
            s = w.sample
            self.captures += 1
            self.recaptures += bool(self.ever_published[s])
            self.ever_published[s] = True
            if not self.sizes[s]:
                self.sizes[s] = self.producer.artifact_bytes
                self.retained += 1

    # -- consumers -----------------------------------------------------------------------------
    def _advance(self, c: _Consumer) -> None:
        """Read the current batch as far as published; block with demand, or start the step."""
        if not c.ready or c.done or c.training or c.killed:
            return
        stop = c.batch_stop()
        while c.next_pos < stop:
            s = c.order.sample(c.next_pos)
            if not self.sizes[s]:
                if c.blocked_since is None:
                    c.blocked_since = self.now
                    c.demand_waits += 1
                if c.demand != [c.next_pos]:
                    self._demand_served(c)
                    c.demand = [c.next_pos]
                    c.demand_since = self.now
                return
            if self._pins_stale:
                self._log_pins()
            self.leases[s] += 1
            c.held.append(s)
            self.trace.append(s)
            self._in_flight_log.append(self.in_flight)
            c.next_pos += 1
        if c.blocked_since is not None:
            c.wait_s += self.now - c.blocked_since
            c.blocked_since = None
        self._demand_served(c)
        c.demand = []
        c.training = True
        self._push(self.now + c.spec.step_s, "step", c)

    def _demand_served(self, c: _Consumer) -> None:
        if c.demand:
            c.max_demand_wait_s = max(c.max_demand_wait_s, self.now - c.demand_since)

    def _step_done(self, c: _Consumer) -> None:
        c.training = False
        c.steps += 1
        c.cursor = c.batch_stop()  # commit after the step that consumed the positions
        self._release(c, expired=False)
        if c.cursor >= c.end:
            c.done = True
            c.finish_s = self.now
            c.demand = []

    # -- run -----------------------------------------------------------------------------------
    def _check_retained(self) -> None:
        self.max_retained = max(self.max_retained, self.retained)
        nbytes = self.retained * self.producer.artifact_bytes
        if nbytes > self.producer.budget_bytes and not self.exceeds:
            self.budget_violations.append(f"t={self.now:.3f}: retained {nbytes} > budget {self.producer.budget_bytes}")

    def _consumed_pairs(self) -> int:
        """Distinct (epoch, sample) pairs the consumers committed."""
        lens = {c.order.epoch_len for c in self.cons}
        if len(lens) == 1:
            return max(c.cursor for c in self.cons)
        pairs: set[tuple[int, int]] = set()
        for c in self.cons:
            m = c.order.epoch_len
            samples = c.order.samples(0, c.cursor).tolist()
            pairs.update((p // m, s) for p, s in enumerate(samples))
        return len(pairs)

    def run(self, keep_trace: bool = True) -> SimResult:
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
            self._pins_stale = True
            captured = kind == "captured"
            if kind == "poll":
                self.poll_pending = False
            else:
                self.dirty = True
            if kind == "start":
                obj.started = True
                obj.ready = not obj.spec.load_s
                if obj.spec.load_s:
                    self._push(self.now + obj.spec.load_s, "ready", obj)
            elif kind == "ready":
                obj.ready = True
            elif kind == "step":
                if obj.killed:  # died mid-step: nothing is committed
                    continue
                self._step_done(obj)
                if not obj.done:
                    obj.next_pos = obj.cursor
            elif captured:
                self._captured(obj)
            elif kind == "kill":
                obj.killed = True
            # publications and commits let waiting consumers read on (recording demand if blocked)
            for c in self.cons:
                self._advance(c)
            self._check_retained()
            if self.busy:
                continue
            awaiting_fence = any(c.killed and not c.done for c in self.cons)
            if captured or (self.now >= self.idle_until and (self.dirty or awaiting_fence)):
                self._pass()
                self._check_retained()
            if not self.busy and not self.poll_pending and (self.dirty or awaiting_fence):
                self.poll_pending = True  # the idle producer's next poll
                self._push(max(self.idle_until, self.now), "poll", None)
        unfinished = [c.spec.name for c in self.cons if not c.done]
        if unfinished:
            raise SimDeadlock(
                f"no event left at t={self.now:.3f} but {unfinished} did not finish: cursors "
                f"{[c.cursor for c in self.cons if not c.done]}, demand "
                f"{[c.demand for c in self.cons if not c.done]}")
        prod = self.producer
        self._log_pins(final=True)
        rows = self._pin_rows or [(np.zeros(0, np.int64),) * 3]
        pins = PinLog(*(np.concatenate([r[k] for r in rows]) for k in range(3)))
        return SimResult(
            consumers={c.spec.name: ConsumerResult(
                c.spec.name, c.spec.start_s, c.finish_s, c.cursor if c.killed else c.end, c.steps, c.wait_s,
                c.demand_waits, c.max_demand_wait_s, c.fenced_s,
                self._last_beat(c) if c.killed else None) for c in self.cons},
            positions=self._consumed_pairs(), captures=self.captures, recaptures=self.recaptures,
            distinct_fps_captured=int(self.ever_published.sum()), evictions=self.evictions,
            evictions_by_reason=dict(self.by_reason), batches=self.batches, passes=self.passes,
            busy_s=self.busy_s, end_s=self.now, max_retained=self.max_retained,
            max_retained_bytes=self.max_retained * prod.artifact_bytes, budget_bytes=prod.budget_bytes,
            binding_passes=self.binding_passes, windows_exceed_budget_passes=self.exceed_passes,
            window_bound_all=sum(c.spec.lookbehind + c.spec.lookahead + 1 for c in self.cons),
            max_queue=self.max_queue, budget_violations=self.budget_violations,
            window_violations=self.window_violations, demand_passes=self.demand_passes,
            demand_with_prefetch_pending=self.demand_with_prefetch, demand_not_first=self.demand_not_first,
            final_retained=self.retained, max_union=self.max_union, retained_log=self.retained_log,
            leases_expired=self.leases_expired, trace=self.trace if keep_trace else [],
            pins=pins if keep_trace else None,
            in_flight=self._in_flight_log if keep_trace else [])


def simulate(consumers: Sequence[ConsumerSpec], producer: ProducerSpec | None = None, positions: int = 10_000,
             plan_len: int | None = None, check: bool = True) -> SimResult:
    """Run one simulation (see :class:`Simulation`)."""
    return Simulation(consumers, producer or ProducerSpec(), positions, plan_len, check).run()


def offline_optimum(trace: Sequence[Hashable], capacity: int, pins: PinLog | None = None,
                    reserved: Sequence[int] | np.ndarray | None = None) -> int:
    """Captures an offline optimum needs for ``trace`` (the samples read, in order) with room for
    ``capacity`` artifacts (every artifact the same size).

    ``pins=None``: **Belady's MIN**. Every first read and every read of an evicted sample is a capture; a
    captured sample is published before it is read (it takes room, as every artifact a consumer reads is
    on disk), and a capture into a full cache evicts the sample whose next read is furthest away (never
    read again first). This is the fewest captures any demand-fetching policy can make for these reads
    (Belady 1966; Mattson et al. 1970), and prefetching cannot need fewer (it only moves captures
    earlier); it knows the future and keeps no window, so it is a lower bound for the producer on the
    same reads.

    ``pins`` (a :class:`PinLog`, :attr:`SimResult.pins`): **Belady under the same window pins**. At read
    ``j`` every sample pinned at ``j`` must be on disk as well as the one read: pins count in the capacity,
    a pinned sample that is not on disk is captured (a capture, as for a read), and a capture into a full
    cache evicts, among the samples not pinned at that read, the one whose next need (its next read or
    the start of its next pin, whichever is first) is furthest away. This is the same rule with each read
    widened to a set of samples that must be present at once, and Belady's exchange argument does not use
    that a request is one sample (swap the victim for the furthest-needed one; the swapped schedule
    mimics the other until one of the two is needed, and pays no more), so with unit sizes it is the
    fewest captures of any schedule that holds every pin at every read; ``tests/properties/test_retention_sim.py``
    checks it against an exhaustive search on small traces. It is a lower bound for the run that logged
    the pins with ``capacity`` = that run's budget in artifacts: that run's own disk satisfied every pin
    at every read within the budget. It is not a policy-independent bound: the pins are where that run's
    cursors were at each read (its producer's timing moved them) and what of the windows it had
    published then (its prefetch), i.e. the same trace and the same windows the policy had; it is never
    below MIN for the same capacity (pins only add requirements).

    ``reserved`` (ints, one per read; :attr:`SimResult.in_flight`): room the schedule may not use at each
    read, so the capacity at read ``j`` is ``capacity - reserved[j]``. The run's producer captures a batch
    at a time and its decision makes room for the whole batch before the capture starts, so while a batch
    is in capture its published artifacts fit the budget less the batch; with ``reserved=res.in_flight``
    the optimum has, at every read, the room the run's published artifacts had — the same trace, pins and
    room. The exchange argument above holds read by read (the swapped schedule holds as many samples as the
    other at every read), so a capacity that varies per read leaves it optimal; the exhaustive search of the
    tests covers it.

    Returns the number of captures (int). Raises:
        ValueError: ``capacity < 1``; a pin row outside ``0 <= start < end <= len(trace)``; more samples
        pinned at one read than the capacity there; ``reserved`` not one int per read.
    """
    if capacity < 1:
        raise ValueError(f"capacity {capacity} must be >= 1")
    n = len(trace)
    room = None
    if reserved is not None:
        room = capacity - np.asarray(reserved, dtype=np.int64)
        if room.shape != (n,):
            raise ValueError(f"reserved has shape {room.shape}: accepted one int per read, ({n},)")
    spans: dict[Hashable, list[tuple[int, int]]] = {}  # sample -> the reads at which it must be on disk
    for j, s in enumerate(trace):
        spans.setdefault(s, []).append((j, j + 1))
    if pins is not None and len(pins):
        st, en = pins.start.tolist(), pins.end.tolist()
        bad = [(a, b) for a, b in zip(st, en, strict=True) if not 0 <= a < b <= n]
        if bad:
            raise ValueError(f"pin reads [{bad[0][0]}, {bad[0][1]}) outside the trace of {n} reads "
                             f"(accepted: 0 <= start < end <= {n})")
        for a, b, s in zip(st, en, pins.sample.tolist(), strict=True):
            spans.setdefault(s, []).append((a, b))
    # merge each sample's spans (overlapping or adjacent: held throughout), then list (start, end, sample,
    # next need after the end)
    rows: list[tuple[int, int, Hashable, float]] = []
    for s, iv in spans.items():
        iv.sort()
        merged = [list(iv[0])]
        for a, b in iv[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for k, (a, b) in enumerate(merged):
            rows.append((a, b, s, merged[k + 1][0] if k + 1 < len(merged) else math.inf))
    by_start = sorted(range(len(rows)), key=lambda q: rows[q][0])
    by_end = sorted(range(len(rows)), key=lambda q: rows[q][1])
    pinned = -1.0  # cache value of a sample pinned now (next needs are >= 0)
    cache: dict[Hashable, float] = {}  # sample on disk -> its next need, or `pinned`
    heap: list[tuple[float, int, Hashable]] = []  # (-next need, tie, sample) of unpinned samples, lazily stale
    misses = e = i = tie = 0
    # the reads where the rule acts: where a sample must be on disk from (a read or a pin begins), and with
    # ``reserved`` every read (the room may shrink at a read where nothing begins)
    points = range(n) if room is not None else sorted({r[0] for r in rows})
    for j in points:
        while e < len(by_end) and rows[by_end[e]][1] <= j:  # pins over before read j: evictable from now
            _, _, s, nxt = rows[by_end[e]]
            cache[s] = nxt
            tie += 1
            heapq.heappush(heap, (-nxt, tie, s))
            e += 1
        group = []
        while i < len(by_start) and rows[by_start[i]][0] == j:
            group.append(rows[by_start[i]][2])
            i += 1
        missing = [s for s in group if s not in cache]
        for s in group:
            cache[s] = pinned
        misses += len(missing)
        cap = capacity if room is None else int(room[j])
        for _ in range(len(cache) - cap):  # one eviction per capture that does not fit (or room taken)
            while True:
                if not heap:
                    raise ValueError(f"more than capacity {cap} samples pinned at read {j}")
                neg, _, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg:
                    break
            del cache[victim]
    return misses


def solo_rates(consumers: Sequence[ConsumerSpec], producer: ProducerSpec | None = None, positions: int = 10_000,
               plan_len: int | None = None) -> dict[str, float]:
    """Each consumer's rate when it runs alone with the same producer (start delay dropped)."""
    out = {}
    for c in consumers:
        alone = ConsumerSpec(c.name, c.step_s, c.batch_size, c.lookbehind, c.lookahead, 0.0, c.end,
                             epoch_len=c.epoch_len)
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


def hetero_consumers(positions: int = 10_000) -> list[ConsumerSpec]:
    """Speeds 1 : 1.5 : 3 (40 / 60 / 120 positions/s), started 0 / 10 / 20 s apart (the fastest last),
    windows 64:256, and a fourth that stops a third of the way (``quit``: 60 positions/s, from 5 s).
    The fastest passes the others within seconds and leads the slowest by thousands of positions at
    its end: with windows as the only rule every position they read again was evicted."""
    return [
        ConsumerSpec("slow", step_s=0.1, batch_size=4, lookbehind=64, lookahead=256),
        ConsumerSpec("mid", step_s=0.2, batch_size=12, lookbehind=64, lookahead=256, start_s=10.0),
        ConsumerSpec("fast", step_s=0.2, batch_size=24, lookbehind=64, lookahead=256, start_s=20.0),
        ConsumerSpec("quit", step_s=0.1, batch_size=6, lookbehind=64, lookahead=256, start_s=5.0,
                     end=positions // 3),
    ]


def hetero_producer() -> ProducerSpec:
    """16 samples per 50 ms batch: 320 samples/s, above what all four need even with disjoint windows."""
    return ProducerSpec(fixed_s=0.01, per_sample_s=0.0025,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=16, max_batch_tokens=8192))


def hetero_lead(consumers: Sequence[ConsumerSpec], positions: int) -> int:
    """Positions between the fastest and the slowest cursor when the fastest finishes (compute-bound
    rates, its own start): what a budget must hold beside the windows for nothing to be recaptured."""
    ends = {c.name: positions if c.end is None else c.end for c in consumers}
    fast = max(consumers, key=lambda c: c.compute_rate)
    t_end = fast.start_s + ends[fast.name] / fast.compute_rate
    behind = [min(ends[c.name], max(0.0, (t_end - c.start_s) * c.compute_rate)) for c in consumers
              if c is not fast and ends[c.name] > ends[fast.name] * 0.99]
    return int(ends[fast.name] - min(behind, default=ends[fast.name]))


#: name -> (consumers, producer)
SCENARIOS = {
    "overlap": lambda n: (overlap_consumers(), default_producer()),
    "lagging": lambda n: ([*overlap_consumers(), lagging_consumer()], default_producer()),
    "killed": lambda n: ([*overlap_consumers(), killed_consumer()], default_producer()),
    "diverge": lambda n: (diverge_consumers(), diverge_producer()),
    "saturated": lambda n: (saturated_consumers(), saturated_producer()),
    "hetero": lambda n: (hetero_consumers(n), hetero_producer()),
}


# ---- CLI -----------------------------------------------------------------------------------------------
#: the fields of ``--consumer NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]]`` after NAME: (name, parse, range)
CONSUMER_FIELDS = (("STEP_S", float, Positive), ("BATCH", int, Count), ("LOOKBEHIND", int, WindowSide),
                   ("LOOKAHEAD", int, WindowSide), ("START_S", float, NonNegativeFloat), ("END", int, Count))
#: the flags with a declared range (None: the scenario's or the default), checked before the scenarios
RANGES = {"--positions": Count, "--plan-len": Count | None, "--fixed-s": NonNegativeFloat | None,
          "--per-sample-s": NonNegativeFloat | None, "--sample-tokens": Count | None, "--budget-lead": Positive | None}


def parse_consumer(text: str) -> ConsumerSpec:
    """``NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]]``, each field in its range (:data:`CONSUMER_FIELDS`).

    Raises:
        ConfigError: one line naming the spec, the field, its value and what is accepted.
    """
    form = "NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]]"
    parts = text.split(":")
    if not 5 <= len(parts) <= 7 or not parts[0].strip():
        raise ConfigError(f"--consumer {text!r}: expected {form} (a non-empty NAME)")
    values = []
    for (name, parse, declared), part in zip(CONSUMER_FIELDS, parts[1:], strict=False):
        try:
            value = parse(part)
        except ValueError:
            raise ConfigError(f"--consumer {text!r}: {name} {part!r} is not {describe_number(mi.type_info(declared))}"
                              f"; expected {form}") from None
        check_value(value, declared, f"--consumer {text!r}: {name}", seconds=name.endswith("_S"))
        values.append(value)
    return ConsumerSpec(parts[0], *values[:4], *values[4:5], *values[5:6])


def format_table(res: SimResult, consumers: Sequence[ConsumerSpec], solo: dict[str, float] | None = None,
                 opt: int | None = None, artifact_bytes: int = 1 << 20, pinned_opt: int | None = None) -> str:
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
    budget = "none" if math.isinf(res.budget_bytes) else f"{res.budget_bytes / artifact_bytes:.0f} artifacts"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(res.evictions_by_reason.items())) or "-"
    lines += [
        "",
        "| producer | value |",
        "|---|---|",
        f"| distinct (epoch, position) pairs consumed | {res.positions} |",
        f"| captures | {res.captures} |",
        f"| captures per position | {res.captures_per_position:.4f} |",
    ]
    if opt is not None:
        lines.append(f"| offline optimum (Belady, trace known) per position | {opt / res.positions:.4f} "
                     f"({opt} captures) |")
    if pinned_opt is not None:
        lines.append(f"| offline optimum under the same window pins per position | "
                     f"{pinned_opt / res.positions:.4f} ({pinned_opt} captures) |")
    lines += [
        f"| recaptures | {res.recaptures} |",
        f"| evictions (by reason) | {res.evictions} ({reasons}) |",
        f"| budget | {budget} |",
        f"| max retained | {res.max_retained} artifacts |",
        f"| budget binding (passes) | {'yes' if res.binding else 'no'} ({res.binding_passes}) |",
        f"| budget / window violations | {len(res.budget_violations)} / {len(res.window_violations)} |",
        f"| window bound (Σ window sizes) | {res.window_bound_all} |",
        f"| max union of live windows | {res.max_union} |",
        f"| capture batches | {res.batches} |",
        f"| max queue | {res.max_queue} |",
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
    ap.add_argument("--consumer", action="append", default=[],
                    help="NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]] (repeatable)")
    ap.add_argument("--positions", type=int, default=10_000, help="run length in positions")
    ap.add_argument("--plan-len", type=int, default=None, help="plan length (later epochs reshuffled)")
    ap.add_argument("--fixed-s", type=float, help="capture latency per batch (default: the scenario's, 0.02)")
    ap.add_argument("--per-sample-s", type=float, help="capture latency per sample (default 0.005)")
    ap.add_argument("--batch-samples", type=int, help="max capture batch in samples (default 8)")
    ap.add_argument("--batch-tokens", type=int, help="max capture batch in padded tokens (default 8192)")
    ap.add_argument("--max-queue", type=int, help="max queued fingerprints per pass (default 1024)")
    ap.add_argument("--sample-tokens", type=int, help="every sample's length in tokens (default 256)")
    ap.add_argument("--budget", type=float, default=math.inf,
                    help="disk budget in artifacts (default: none; 'lead' is not a number: see --budget-lead)")
    ap.add_argument("--budget-lead", type=float, default=None, metavar="F",
                    help="budget = F x (the fastest consumer's lead + Σ windows), from the compute-bound rates")
    ap.add_argument("--policy", choices=POLICIES, default="need",
                    help="need (retention by future need) or windows (the rule before: windows only)")
    ap.add_argument("--solo", action="store_true", help="also simulate each consumer alone")
    ap.add_argument("--opt", action="store_true",
                    help="also compute the offline optima for the same reads and budget: Belady's MIN, and Belady "
                         "under the same window pins (it must hold what the run's live windows held at each read)")
    args = ap.parse_args(argv)
    try:  # before the scenarios (hetero's consumers derive from it) and the consumers' window checks
        for flag, declared in RANGES.items():
            check_value(getattr(args, flag[2:].replace("-", "_")), declared, flag, seconds=flag.endswith("-s"))
        extra = [parse_consumer(text) for text in args.consumer]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    consumers, base = SCENARIOS[args.scenario](args.positions) if args.scenario else ([], default_producer())
    consumers = [*consumers, *extra]
    if not consumers:
        ap.error("give --scenario or at least one --consumer")

    def pick(value, default):
        return default if value is None else value

    tokens = pick(args.sample_tokens, base.sample_tokens)
    budget = args.budget
    if args.budget_lead is not None:
        budget = args.budget_lead * (hetero_lead(consumers, args.positions) + sum(
            c.lookbehind + c.lookahead + 1 for c in consumers))
    if not budget >= 1:
        print(f"error: --budget {budget} must be >= 1 artifact", file=sys.stderr)
        return 2
    producer = ProducerSpec(
        fixed_s=pick(args.fixed_s, base.fixed_s), per_sample_s=pick(args.per_sample_s, base.per_sample_s),
        sample_tokens=tokens, max_length=max(tokens, base.max_length) if args.sample_tokens is None else tokens,
        limits=SchedulerLimits(max_queue=pick(args.max_queue, base.limits.max_queue),
                               max_batch_samples=pick(args.batch_samples, base.limits.max_batch_samples),
                               max_batch_tokens=pick(args.batch_tokens, base.limits.max_batch_tokens)),
        policy=args.policy).with_budget(math.floor(budget) if math.isfinite(budget) else budget)
    try:
        res = simulate(consumers, producer, args.positions, args.plan_len)
    except (ValueError, SimDeadlock) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    solo = solo_rates(consumers, producer, args.positions, args.plan_len) if args.solo else None
    opt = pinned_opt = None
    if args.opt:
        cap = res.budget_bytes / producer.artifact_bytes
        cap = int(cap) if math.isfinite(cap) else len(res.trace) + 1
        opt = offline_optimum(res.trace, cap)
        if not res.windows_exceed_budget_passes:  # else the pins may not fit the budget
            pinned_opt = offline_optimum(res.trace, cap, pins=res.pins)
    print(f"producer: {producer.fixed_s:g} s + {producer.per_sample_s:g} s/sample, batch ≤ "
          f"{producer.limits.max_batch_samples}: "
          f"capacity {producer.capacity:.1f} samples/s; {args.positions} positions"
          + (f", plan of {args.plan_len}" if args.plan_len else "") + f"; policy {producer.policy}")
    print(format_table(res, consumers, solo, opt, producer.artifact_bytes, pinned_opt))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
