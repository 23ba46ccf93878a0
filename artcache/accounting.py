"""Aggregate the journals of one cache root into counts, and check the accounting invariants.

Shared production (what the producer captured and published once) is reported apart from what
each consumer requested and committed; consumer counts are never summed into "unique production".
"""

from __future__ import annotations

from collections import defaultdict

import msgspec

from artcache import journal as J
from artcache import leases as leases_mod
from artcache import store
from artcache.layout import CacheLayout, host_id, pid_alive


class ConsumerCounts(msgspec.Struct, kw_only=True):
    consumer: str
    epoch_len: int = 0  # training samples per epoch (0: the whole plan)
    epoch: int = 0  # epoch of its last committed step
    draft: str = ""
    block_size: int = 0
    lookbehind: int = 0
    lookahead: int = 0
    state: str = "running"
    error: str = ""
    steps: int = 0
    cursor: int = 0
    logical_requests: int = 0
    hits: int = 0
    misses: int = 0
    wait_s: float = 0.0
    leases_acquired: int = 0
    leases_released: int = 0
    quarantined: int = 0
    timeouts: int = 0


class CacheCounts(msgspec.Struct, kw_only=True):
    """Totals over the root. ``logical_requests``/``hits``/``misses`` add consumers' requests (each
    is one request); ``captures``/``publications`` count the producer's work, done once."""

    logical_requests: int = 0
    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    captures: int = 0
    publications: int = 0
    failures: int = 0
    evictions: int = 0
    recaptures: int = 0
    leases_acquired: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_held: int = 0
    #: leases expired by the producer whose ``lease_acquire`` never reached the journal (the holder
    #: was killed between creating the lease file and journaling it): outside the lease invariant
    #: (a lease file still on disk counts as held until then)
    leases_unjournaled: int = 0
    #: leases whose removal never reached the journal: no ``lease_release``/``lease_expire``, the file is
    #: gone, and the holder process is dead (this host). Its holder (release) or the producer/fsck
    #: (expiry) was killed between unlinking the file and journaling it: outside the lease invariant
    leases_removal_unjournaled: int = 0
    captures_lost_in_crash: int = 0
    timeouts: int = 0
    quarantined: int = 0
    fences: int = 0
    #: distinct (epoch, sample) pairs the consumers committed (every consumer's positions below its cursor)
    distinct_positions_consumed: int = 0
    distinct_fingerprints_captured: int = 0
    captures_per_consumed_position: float = 0.0
    retained_artifacts: int = 0
    retained_bytes: int = 0
    max_retained_artifacts: int = 0
    max_retained_bytes: int = 0
    window_bound_artifacts: int = 0
    #: the disk budget of the latest producer (0: none recorded) and its retention rule
    budget_bytes: int = 0
    retention: str = ""
    #: a decision evicted something needed or left a capture out because of the budget
    budget_binding: bool = False
    #: the live windows alone held more than the budget at some point (the guarantee won)
    windows_exceeded_budget: bool = False
    #: the most the retained bytes ever exceeded the producer's budget while its live windows fitted it
    #: (the budget invariant: must be 0)
    budget_exceeded_bytes: int = 0
    #: evictions by reason: unneeded, needed-later, outside-windows (journal ``evict.reason``)
    evictions_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    published_bytes: int = 0
    producer_busy_s: float = 0.0
    torn_journal_lines: int = 0


class RetentionNow(msgspec.Struct, kw_only=True):
    """The retention decision the root's state implies now (:func:`artcache.eviction.decide` over the live
    registrations, ``objects/``, the leases, the consumers' rates from their journaled steps, and the
    latest producer's budget and rule); read-only: nothing is evicted.

    Attributes:
        policy: the rule (``need`` / ``windows``). budget_bytes: 0 when no producer recorded one (none).
        retained_bytes, retained_artifacts: ``objects/`` now. live_consumers: running, heart-beating.
        kept: reason → artifacts kept (``window`` incl. pinned ranges, ``leased``, ``needed`` by a live
            consumer later, ``unneeded`` kept while the budget has room). would_evict: reason → artifacts.
        binding, windows_exceed_budget: as :class:`artcache.eviction.RetentionDecision`.
        rates: consumer → positions per second the decision assumed.
    """

    policy: str
    budget_bytes: int
    retained_bytes: int
    retained_artifacts: int
    live_consumers: int
    kept: dict[str, int]
    would_evict: dict[str, int]
    binding: bool
    windows_exceed_budget: bool
    rates: dict[str, float]


class Accounting(msgspec.Struct, kw_only=True):
    cache: CacheCounts
    consumers: list[ConsumerCounts]
    violations: list[str]
    retention_now: RetentionNow | None = None


def account(layout: CacheLayout, retention_now: bool = False) -> Accounting:
    """Read every journal of ``layout`` and the live state on disk; check invariants. ``retention_now``:
    also compute :class:`RetentionNow` (loads the plan and fingerprints every sample: ``artcache inspect``)."""
    res = J.read_events(layout.journal)
    c = CacheCounts(torn_journal_lines=res.torn_lines)
    per: dict[str, ConsumerCounts] = {}
    captured_fps: set[str] = set()

    def cons(name: str) -> ConsumerCounts:
        if name not in per:
            per[name] = ConsumerCounts(consumer=name)
        return per[name]

    windows: dict[str, int] = defaultdict(int)
    acquired = {ev.lease for ev in res.events if isinstance(ev, J.LeaseAcquire)}
    settled = {ev.lease for ev in res.events if isinstance(ev, (J.LeaseRelease, J.LeaseExpire))}
    for ev in res.events:
        if isinstance(ev, J.Request):
            k = cons(ev.consumer)
            k.logical_requests += 1
            k.hits += ev.hit
            k.misses += not ev.hit
            k.wait_s += ev.wait_s
        elif isinstance(ev, J.LeaseAcquire):
            cons(ev.consumer).leases_acquired += 1
        elif isinstance(ev, J.LeaseRelease):
            cons(ev.consumer).leases_released += 1
        elif isinstance(ev, J.LeaseExpire):
            if ev.lease in acquired:
                c.leases_expired += 1
            else:
                c.leases_unjournaled += 1
        elif isinstance(ev, J.Capture):
            c.captures += 1
            c.recaptures += ev.recapture
            captured_fps.add(ev.fp)
        elif isinstance(ev, J.CaptureBatch):
            c.producer_busy_s += ev.end - ev.start
        elif isinstance(ev, J.Publish):
            c.publications += 1
            c.published_bytes += ev.nbytes
        elif isinstance(ev, J.CaptureFailure):
            c.failures += 1
        elif isinstance(ev, J.Evict):
            c.evictions += 1
            why = ev.reason or "outside-windows"  # producers before retention by need evicted by windows only
            c.evictions_by_reason[why] = c.evictions_by_reason.get(why, 0) + 1
        elif isinstance(ev, J.ProducerStart):
            c.budget_bytes, c.retention = ev.budget_bytes, ev.policy or "windows"
        elif isinstance(ev, J.Coalesced):
            c.coalesced += ev.requesters
        elif isinstance(ev, J.Retained):
            c.max_retained_artifacts = max(c.max_retained_artifacts, ev.artifacts)
            c.max_retained_bytes = max(c.max_retained_bytes, ev.nbytes)
            c.budget_binding |= ev.binding
            c.windows_exceeded_budget |= ev.windows_exceed_budget
            if not ev.windows_exceed_budget and ev.budget:
                c.budget_exceeded_bytes = max(c.budget_exceeded_bytes, ev.nbytes - ev.budget)
        elif isinstance(ev, J.Fence):
            c.fences += 1
            cons(ev.consumer).state = ev.state
        elif isinstance(ev, J.Quarantined):
            cons(ev.consumer).quarantined += 1
        elif isinstance(ev, J.ConsumerStart):
            k = cons(ev.consumer)
            # a (re)start supersedes an earlier fence/end: a resumed consumer is running again
            k.state, k.error = "running", ""
            k.draft, k.block_size = ev.draft, ev.block_size
            k.lookbehind, k.lookahead = ev.lookbehind, ev.lookahead
            k.epoch_len = ev.epoch_len
            windows[ev.consumer] = ev.lookbehind + ev.lookahead + 1 + ev.pinned  # as Registration.retain_bound
        elif isinstance(ev, J.Step):
            k = cons(ev.consumer)
            k.steps = max(k.steps, ev.step)
            k.cursor = max(k.cursor, ev.cursor)
            k.epoch = max(k.epoch, ev.epoch)
        elif isinstance(ev, J.ConsumerEnd):
            k = cons(ev.consumer)
            k.state, k.error = ev.state, ev.error
            k.cursor = max(k.cursor, ev.cursor)
            if "CaptureTimeout" in ev.error:
                k.timeouts += 1

    consumers = sorted(per.values(), key=lambda k: k.consumer)
    for k in consumers:
        c.logical_requests += k.logical_requests
        c.hits += k.hits
        c.misses += k.misses
        c.leases_acquired += k.leases_acquired
        c.leases_released += k.leases_released
        c.timeouts += k.timeouts
        c.quarantined += k.quarantined
    c.distinct_positions_consumed = consumed_pairs(layout, consumers)
    c.captures_lost_in_crash = captures_lost_in_crash(layout.journal)
    c.distinct_fingerprints_captured = len(captured_fps)
    if c.distinct_positions_consumed:
        c.captures_per_consumed_position = c.captures / c.distinct_positions_consumed
    c.window_bound_artifacts = sum(windows.values())
    objects = store.list_objects(layout)
    c.retained_artifacts, c.retained_bytes = len(objects), sum(objects.values())
    on_disk = {info.name for infos in leases_mod.scan(layout).values() for info in infos}
    c.leases_held = len(on_disk)
    c.leases_removal_unjournaled = sum(removal_unjournaled(name) for name in acquired - settled - on_disk)
    now = None
    if retention_now:
        from artcache.errors import ArtcacheError

        try:
            now = current_retention(layout, res.events, c, objects)
        except (ArtcacheError, OSError, ValueError):  # e.g. a bad plan (fsck reports it): the counts still stand
            now = None
    return Accounting(cache=c, consumers=consumers, violations=check_invariants(c, consumers), retention_now=now)


def current_retention(layout: CacheLayout, events: list, c: CacheCounts, objects: dict[str, int]) -> RetentionNow:
    """:class:`RetentionNow` for ``layout`` (see there)."""
    import math
    import time

    import numpy as np

    from artcache import registry
    from artcache.eviction import RateEstimator, Reader, decide
    from artcache.fingerprint import PlanFingerprints
    from artcache.plan import Plan
    from artcache.settings import load_settings

    settings = load_settings(layout)
    plan = Plan.load(layout.plan_dir(settings.plan_id))
    fps, index_of, canon = PlanFingerprints(settings.contract, plan).table()
    rates = RateEstimator()
    for ev in events:  # the consumers' committed cursors over time, as the producer observes them
        if isinstance(ev, J.Step):
            rates.observe(ev.consumer, 0, ev.cursor, ev.t)
    now = time.time()
    live = [r for r in registry.read_all(layout) if r.is_live(now, settings.heartbeat_timeout_s)]
    readers = [Reader.of(r, plan.order(r.epoch_len), rates.rate(r.consumer_id)) for r in live]
    sizes = np.zeros(len(plan), dtype=np.int64)
    for fp, n in objects.items():
        if fp in index_of:
            sizes[index_of[fp]] = max(n, 1)
    live_ids = {r.consumer_id for r in live}
    leased = [index_of[info.fp] for infos in leases_mod.scan(layout).values() for info in infos
              if info.fp in index_of and info.consumer in live_ids]
    budget = c.budget_bytes if c.retention == "need" and c.budget_bytes else math.inf
    est = int(sizes[sizes > 0].mean()) if (sizes > 0).any() else 1
    d = decide(readers, sizes=sizes, budget=budget, est_size=est, leased=leased, canon=canon,
               policy="windows" if c.retention == "windows" else "need", explain=True)
    would: dict[str, int] = {}
    for why in d.evict.values():
        would[why] = would.get(why, 0) + 1
    return RetentionNow(policy=c.retention or "need", budget_bytes=c.budget_bytes,
                        retained_bytes=sum(objects.values()), retained_artifacts=len(objects),
                        live_consumers=len(live), kept=d.kept, would_evict=would, binding=d.binding,
                        windows_exceed_budget=d.windows_exceed_budget,
                        rates={r.consumer_id: round(r.rate, 3) for r in readers})


def consumed_pairs(layout: CacheLayout, consumers: list[ConsumerCounts]) -> int:
    """Distinct (epoch, sample) pairs committed: position ``p < cursor`` of a consumer is pair
    ``(p // epoch_len, order.sample(p))``. Consumers of one epoch length share their positions, so that
    is the largest cursor; with several lengths the pairs are counted from the plan's epoch order."""
    lens = {k.epoch_len for k in consumers if k.cursor}
    if len(lens) <= 1:
        return max((k.cursor for k in consumers), default=0)
    import json

    from artcache.plan import EPOCH_ORDER_VERSION, EpochOrder
    from artcache.settings import load_settings

    prov = json.loads((layout.plan_dir(load_settings(layout).plan_id) / "plan.json").read_text())
    n = int(prov["counts"]["kept"])
    order = prov.get("epoch_order") or {"version": EPOCH_ORDER_VERSION, "seed": prov["spec"]["seed"]}
    pairs: set[tuple[int, int]] = set()
    for k in consumers:
        m = k.epoch_len or n
        samples = EpochOrder(n, m, int(order["seed"])).samples(0, k.cursor).tolist()
        pairs.update((p // m, s) for p, s in enumerate(samples))
    return len(pairs)


def removal_unjournaled(lease: str) -> bool:
    """True if ``lease`` (acquired, never released or expired in the journal, and no longer on disk) was
    held by a process of this host that is dead: a kill between its unlink and the journal line explains
    it. A live holder (or one on another host) leaves it unexplained: an invariant violation."""
    info = leases_mod.parse(lease)
    return info is not None and info.host == host_id() and not pid_alive(info.pid)


def captures_lost_in_crash(journal_dir) -> int:
    """Captures journaled by a producer process that died (its journal has no ``producer_stop``)
    before publishing them or recording their failure: the kill lost them, nothing else did."""
    lost = 0
    for path in sorted(journal_dir.glob("producer-*.jsonl")) if journal_dir.is_dir() else []:
        captured, settled, stopped = 0, 0, False
        for ev in J.iter_file(path):
            if isinstance(ev, J.Capture):
                captured += 1
            elif isinstance(ev, (J.Publish, J.CaptureFailure)):
                settled += 1
            elif isinstance(ev, J.ProducerStop):
                stopped = True
        if not stopped:
            lost += max(0, captured - settled)
    return lost


def check_invariants(c: CacheCounts, consumers: list[ConsumerCounts]) -> list[str]:
    """Invariants that must hold on any root; each violation is a sentence naming the numbers."""
    out = []
    if c.captures != c.publications + c.failures + c.captures_lost_in_crash:
        out.append(f"captures {c.captures} != publications {c.publications} + failures {c.failures} + lost "
                   f"in a producer crash {c.captures_lost_in_crash}")
    if c.leases_acquired != (c.leases_released + c.leases_expired + c.leases_held
                             + c.leases_removal_unjournaled):
        out.append(f"leases acquired {c.leases_acquired} != released {c.leases_released} + expired "
                   f"{c.leases_expired} + held {c.leases_held} + removed unjournaled by a killed process "
                   f"{c.leases_removal_unjournaled}")
    if c.logical_requests != c.hits + c.misses:
        out.append(f"logical requests {c.logical_requests} != hits {c.hits} + misses {c.misses}")
    if c.retention in ("", "windows") and c.window_bound_artifacts \
            and c.max_retained_artifacts > c.window_bound_artifacts:
        out.append(f"max retained artifacts {c.max_retained_artifacts} exceeded the window bound "
                   f"{c.window_bound_artifacts}")
    if c.budget_exceeded_bytes > 0:
        out.append(f"retained bytes exceeded the disk budget by {c.budget_exceeded_bytes} while the live windows "
                   "fitted it")
    if c.recaptures > c.captures:
        out.append(f"recaptures {c.recaptures} > captures {c.captures}")
    if c.distinct_fingerprints_captured > c.captures:
        out.append("more distinct fingerprints than captures")
    return out
