"""Aggregate the journals of one cache root into counts, and check the accounting invariants.

Shared production (what the producer captured and published once) is reported apart from what
each consumer requested and committed; consumer counts are never summed into "unique production".

One consistent snapshot, also beside a live run: the journals are read once (each file
up to its last complete line), then ``leases/`` is listed, then only what the journals gained since is
read, to settle leases released between the two reads. A live producer's captures not yet published are
``captures_in_flight``, not a crash; only a producer that is provably dead (same host id, pid gone) or
stopped by a failure has ``captures_lost_in_crash``.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from artcache import journal as J
from artcache import leases as leases_mod
from artcache import store
from artcache.layout import CacheLayout, parse_journal_name
from artcache.liveness import ProcessIdentity, dead_reason
from artcache.scheduler import bound_of


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
    # one past the last position trained on: the journal's last Step (or ConsumerEnd) cursor. The registration's
    # committed cursor may lag it by up to the consumer's --commit-interval (docs/protocol.md)
    cursor: int = 0
    logical_requests: int = 0
    hits: int = 0
    misses: int = 0
    wait_s: float = 0.0
    leases_acquired: int = 0
    leases_released: int = 0
    quarantined: int = 0
    timeouts: int = 0
    ranks: int = 1  # a torch.distributed group of this many ranks (one consumer to the cache)


class CacheCounts(msgspec.Struct, kw_only=True):
    """Totals over the root. ``logical_requests``/``hits``/``misses`` add consumers' requests (each
    is one request); ``captures``/``publications`` count the producer's work, done once."""

    logical_requests: int = 0
    hits: int = 0
    misses: int = 0
    coalesced: int = 0
    captures: int = 0
    publications: int = 0
    #: failed capture attempts (every ``capture_failure`` line); ``forward_failures`` of them failed in
    #: the forward pass (no ``capture`` line: outside captures = publications + failures)
    failures: int = 0
    forward_failures: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    recaptures: int = 0
    leases_acquired: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_held: int = 0
    #: lease files on disk whose ``lease_acquire`` is not (yet) in the journal: being acquired now, or
    #: left by a holder killed before journaling it (the producer expires those): outside the invariant
    leases_held_unjournaled: int = 0
    #: leases expired by the producer whose ``lease_acquire`` never reached the journal (the holder
    #: was killed between creating the lease file and journaling it): outside the lease invariant
    #: (a lease file still on disk counts as held until then)
    leases_unjournaled: int = 0
    #: leases whose removal never reached the journal: no ``lease_release``/``lease_expire``, the file is
    #: gone, and the holder process is dead (this host). Its holder (release) or the producer/fsck
    #: (expiry) was killed between unlinking the file and journaling it: outside the lease invariant
    leases_removal_unjournaled: int = 0
    #: leases whose release line its live holder holds in memory for a full filesystem (its journal is
    #: :func:`artcache.journal.holding_events`): released, journaled once space is back
    leases_release_held: int = 0
    #: journals whose live writer holds events in memory for a full filesystem (lines that will follow)
    journals_holding: int = 0
    captures_lost_in_crash: int = 0
    #: captures of a producer that has not stopped and may be alive (same host: its pid lives; another
    #: host: cannot be checked), not yet published or failed: work in flight, not a crash
    captures_in_flight: int = 0
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
    #: Σ over the consumers started on the root of lookbehind + lookahead + 1 + held-out (pinned) samples, at most
    #: the plan's samples (:func:`artcache.scheduler.bound_of`)
    window_bound_artifacts: int = 0
    #: artifacts of a filled root (``artcache producer --fill``) a producer kept beyond its rule (the most any
    #: producer recorded at start): they count beside the window bound
    kept_fill_artifacts: int = 0
    #: the disk budget of the latest producer and its retention rule; ``budget_recorded``: that producer
    #: recorded one (its ``producer_start`` names a rule: 0 is then a budget of 0 bytes, not "none")
    budget_bytes: int = 0
    retention: str = ""
    budget_recorded: bool = False
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
    #: capture batches the producers ran (``capture_batch`` lines) and their seconds
    capture_batches: int = 0
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


@dataclass
class Fold:
    """What :func:`fold` counts of some journal events: the root's totals (``cache``; the consumer totals and
    the snapshot's figures are :func:`account`'s), each consumer's counts, each consumer's retained window
    (lookbehind + lookahead + 1 + pinned, as ``Registration.retain_bound``), the fingerprints captured, the
    leases acquired and settled (released or expired), and the last ``producer_stop`` reason ("" if none)."""

    cache: CacheCounts
    consumers: dict[str, ConsumerCounts]
    windows: dict[str, int]
    captured: set[str]
    acquired: set[str]
    settled: set[str]
    stop_reason: str


def fold(events: Iterable[J.Event]) -> Fold:
    """The one fold of journal events into counts (in the order given; :func:`account` sorts a root's by time):
    :func:`account` folds every journal of a root, ``artcache run``'s report one producer's or one consumer's
    process (:func:`artcache.app.experiments.production`, :func:`~artcache.app.experiments.committed_work`)."""
    events = list(events)
    c = CacheCounts()
    stop = ""
    per: dict[str, ConsumerCounts] = {}
    captured_fps: set[str] = set()

    def cons(name: str) -> ConsumerCounts:
        if name not in per:
            per[name] = ConsumerCounts(consumer=name)
        return per[name]

    windows: dict[str, int] = defaultdict(int)
    acquired = {ev.lease for ev in events if isinstance(ev, J.LeaseAcquire)}
    settled = {ev.lease for ev in events if isinstance(ev, (J.LeaseRelease, J.LeaseExpire))}
    for ev in events:
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
            c.capture_batches += 1
            c.producer_busy_s += ev.end - ev.start
        elif isinstance(ev, J.Publish):
            c.publications += 1
            c.published_bytes += ev.nbytes
        elif isinstance(ev, J.CaptureFailure):
            c.failures += 1
            c.forward_failures += ev.stage == "forward"
        elif isinstance(ev, J.Evict):
            c.evictions += 1
            c.evicted_bytes += ev.nbytes
            why = ev.reason or "outside-windows"  # producers before retention by need evicted by windows only
            c.evictions_by_reason[why] = c.evictions_by_reason.get(why, 0) + 1
        elif isinstance(ev, J.ProducerStart):
            c.budget_bytes, c.retention = ev.budget_bytes, ev.policy or "windows"
            c.kept_fill_artifacts = max(c.kept_fill_artifacts, ev.kept_fill)
            c.budget_recorded = bool(ev.policy) and ev.policy == "need"
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
            k.ranks = ev.ranks
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
        elif isinstance(ev, J.ProducerStop):
            stop = ev.reason
    return Fold(c, per, dict(windows), captured_fps, acquired, settled, stop)



def account(layout: CacheLayout, retention_now: bool = False) -> Accounting:
    """Read every journal of ``layout`` and the live state on disk as one snapshot (see the module
    docstring); check invariants. ``retention_now``: also compute :class:`RetentionNow` (loads the plan
    and fingerprints every sample: ``artcache inspect``)."""
    files = J.read_files(layout.journal)
    on_disk = {info.name: info for infos in leases_mod.scan(layout).values() for info in infos}
    later = J.read_files(layout.journal, since={f.path.name: f.end for f in files})
    events = sorted((ev for f in files for ev in f.events), key=lambda e: e.t)
    folded = fold(events)
    c, per, windows, captured_fps = folded.cache, folded.consumers, folded.windows, folded.captured
    acquired, settled = folded.acquired, folded.settled
    c.torn_journal_lines = sum(f.torn_lines for f in files) + _dead_tails(files)

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
    c.captures_lost_in_crash, c.captures_in_flight = unsettled_captures(files)
    c.distinct_fingerprints_captured = len(captured_fps)
    if c.distinct_positions_consumed:
        c.captures_per_consumed_position = c.captures / c.distinct_positions_consumed
    c.window_bound_artifacts = bound_of(windows.values(), plan_samples(layout))
    objects = store.list_objects(layout)
    c.retained_artifacts, c.retained_bytes = len(objects), sum(objects.values())
    holding = [f for f in files if J.holding_events(f.path)]
    c.journals_holding = len(holding)
    held_by = {w[2].token() for f in holding if (w := _writer(f.path)) is not None and w[2] is not None}
    _count_leases(c, acquired, settled, on_disk, files, later, layout, held_by)
    now = None
    if retention_now:
        from artcache.errors import ArtcacheError

        try:
            now = current_retention(layout, events, c, objects)
        except (ArtcacheError, OSError, ValueError):  # e.g. a bad plan (fsck reports it): the counts still stand
            now = None
    return Accounting(cache=c, consumers=consumers, violations=damaged_journals(files) + check_invariants(c, consumers),
                      retention_now=now)


def damaged_journals(files) -> list[str]:
    """One sentence per journal file (:func:`artcache.journal.read_files`) holding damaged lines: undecodable
    lines with complete lines after them, which no killed writer leaves (:func:`artcache.journal._scan`); their
    events are missing, so other invariants may fail because of them."""
    return [f"journal {f.path.name} line {f.corrupt[0]}" + (f" (and {len(f.corrupt) - 1} more line(s))"
                                                            if len(f.corrupt) > 1 else "")
            + " is damaged: not a journal event, with complete lines after it (a line torn by a killed writer can "
            "only be the last); the counts miss its events, so other invariants may fail because of it"
            for f in files if f.corrupt]


#: seconds :func:`account` waits for a live holder's release line when its lease is gone from disk but not
#: released in the journal: the holder unlinks the file, then journals the release, and under load the
#: line can come well after the lease scan (a false "leases acquired != ..." of ``inspect`` beside a
#: healthy run, reliability lane 2026-12-01, 1 of 150 snapshots)
RELEASE_SETTLE_S = 2.0


def _count_leases(c: CacheCounts, acquired: set[str], settled: set[str], on_disk: dict, files, later,
                  layout: CacheLayout | None = None, held_by: set[str] = frozenset()) -> None:
    """Lease counts of the snapshot: ``acquired``/``settled`` lease names from the journals read first,
    ``on_disk`` the lease files scanned next, ``later`` the journal lines written since the first read.
    A lease acquired, unsettled and gone whose removal is not explained by a kill (a live holder, or one
    whose journal ended cleanly) is waited for up to :data:`RELEASE_SETTLE_S`, re-reading the journals'
    new lines (``layout``; None: not waited for): a live holder between its unlink and its release line
    settles it, one that never journals it stays a violation. ``held_by``: identity tokens of writers
    holding journal events in memory for a full filesystem; a gone lease of one of them is
    ``leases_release_held`` (its release line follows once space is back)."""
    unsettled = acquired - settled

    def settled_in(lines) -> set[str]:
        return {ev.lease for f in lines for ev in f.events if isinstance(ev, (J.LeaseRelease, J.LeaseExpire))}

    settled_since = settled_in(later)
    ended = _cleanly_ended_consumers(files, later)
    gone = unsettled - on_disk.keys()
    release_held = {n for n in gone if (info := leases_mod.parse(n)) is not None and info.holder is not None
                    and info.holder.token() in held_by}
    gone -= release_held
    c.leases_release_held = len(release_held)
    deadline = time.monotonic() + RELEASE_SETTLE_S
    while layout is not None and any(not removal_unjournaled(n, ended) for n in gone - settled_since) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        later = J.read_files(layout.journal, since={f.path.name: f.end for f in files})
        settled_since, ended = settled_in(later), _cleanly_ended_consumers(files, later)
    # held at the snapshot: on disk, or released right after it (the journal line came after the first read)
    c.leases_held = len(unsettled & on_disk.keys()) + len(gone & settled_since)
    c.leases_held_unjournaled = len(on_disk.keys() - acquired)
    c.leases_removal_unjournaled = sum(removal_unjournaled(name, ended) for name in gone - settled_since)


def current_retention(layout: CacheLayout, events: list, c: CacheCounts, objects: dict[str, int]) -> RetentionNow:
    """:class:`RetentionNow` for ``layout`` (see there)."""
    import math

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
    # running and not provably dead (same host id, process gone): one snapshot cannot watch heartbeat
    # progress (artcache.liveness), and a wall-clock heartbeat age is no liveness test across hosts
    live = [r for r in registry.read_all(layout) if r.state == "running" and r.dead_reason() is None]
    readers = [Reader.of(r, plan.order(r.epoch_len), rates.rate(r.consumer_id)) for r in live]
    sizes = np.zeros(len(plan), dtype=np.int64)
    for fp, n in objects.items():
        if fp in index_of:
            sizes[index_of[fp]] = max(n, 1)
    live_ids = {r.consumer_id for r in live}
    leased = [index_of[info.fp] for infos in leases_mod.scan(layout).values() for info in infos
              if info.fp in index_of and info.consumer in live_ids]
    budget = c.budget_bytes if c.retention == "need" and (c.budget_bytes or c.budget_recorded) else math.inf
    est = int(sizes[sizes > 0].mean()) if (sizes > 0).any() else 1
    keep = np.flatnonzero(sizes) if J.fill_recorded(events) else None  # a filled root keeps its artifacts
    d = decide(readers, sizes=sizes, budget=budget, est_size=est, leased=leased, canon=canon,
               policy="windows" if c.retention == "windows" else "need", explain=True, keep=keep)
    would: dict[str, int] = {}
    for why in d.evict.values():
        would[why] = would.get(why, 0) + 1
    return RetentionNow(policy=c.retention or "need", budget_bytes=c.budget_bytes,
                        retained_bytes=sum(objects.values()), retained_artifacts=len(objects),
                        live_consumers=len(live), kept=d.kept, would_evict=would, binding=d.binding,
                        windows_exceed_budget=d.windows_exceed_budget,
                        rates={r.consumer_id: round(r.rate, 3) for r in readers})


def plan_samples(layout: CacheLayout) -> int | None:
    """The samples of the root's plan (``plan.json``'s kept count), or None while the root names no published plan
    (no ``artcache.json`` yet, or its plan not saved)."""
    import json

    from artcache.settings import load_settings

    if not layout.settings.is_file():
        return None
    doc = layout.plan_dir(load_settings(layout).plan_id) / "plan.json"
    return int(json.loads(doc.read_text())["counts"]["kept"]) if doc.is_file() else None


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


def _writer(path) -> tuple[str, str, ProcessIdentity | None, int] | None:
    """(role, id, identity, legacy pid) of a journal file's writer, from its name."""
    parsed = parse_journal_name(os.path.basename(path))
    if parsed is None:
        return None
    role, ident, w = parsed
    return role, ident, w.identity, w.legacy_pid


def _cleanly_ended_consumers(files, later) -> set[tuple[str, str]]:
    """Keys (consumer id, writer token or legacy pid) of consumer journals that end with ``consumer_end``."""
    out = set()
    for f in [*files, *later]:
        w = _writer(f.path)
        if w is not None and w[0] == "consumer" and any(isinstance(ev, J.ConsumerEnd) for ev in f.events):
            out.add((w[1], w[2].token() if w[2] else str(w[3])))
    return out


def removal_unjournaled(lease: str, ended: set[tuple[str, str]] = frozenset()) -> bool:
    """True if ``lease`` (acquired, never released or expired in the journal, and no longer on disk) is
    explained by a kill between its unlink and the journal line: its holder is provably dead (same host
    id, pid gone), or its pid cannot be checked from here (another host; a legacy name) and its journal
    (``ended``: consumer journals that end cleanly) does not end with ``consumer_end``. A live local holder,
    or a cleanly ended one, leaves it unexplained: an invariant violation."""
    info = leases_mod.parse(lease)
    if info is None:
        return False
    if info.holder is not None and info.holder.comparable():
        return dead_reason(info.holder) is not None
    key = (info.consumer, info.holder.token() if info.holder else str(info.pid))
    return key not in ended


def _producer_alive(identity: ProcessIdentity) -> bool:
    """A producer journal's writer may be alive: same host id and its pid lives, or not checkable here."""
    return not identity.comparable() or dead_reason(identity) is None


def unsettled_captures(files) -> tuple[int, int]:
    """(lost, in flight): captures a producer journaled and neither published nor failed. Lost: its journal
    has no ``producer_stop`` and its writer is provably dead, or it stopped with a ``failed: ...`` reason
    (its queued batches were abandoned). In flight: no ``producer_stop`` yet and the writer may be alive
    (this host: its pid lives; another host: cannot be checked, so not called a crash). Migration rule: a
    legacy-named journal (``<role>-<id>-<pid>.jsonl``) without ``producer_stop`` counts as lost, as before."""
    lost = in_flight = 0
    for f in files:
        w = _writer(f.path)
        if w is None or w[0] != "producer":
            continue
        captured = settled = 0
        stop = None
        for ev in f.events:
            if isinstance(ev, J.Capture):
                captured += 1
            elif isinstance(ev, J.Publish) or (isinstance(ev, J.CaptureFailure) and ev.stage != "forward"):
                settled += 1
            elif isinstance(ev, J.ProducerStop):
                stop = ev.reason
        n = max(0, captured - settled)
        if stop is None and w[2] is not None and _producer_alive(w[2]):
            in_flight += n
        elif stop is None or stop.startswith("failed"):
            lost += n
    return lost, in_flight


def _dead_tails(files) -> int:
    """Incomplete last lines of journals whose writer is gone (killed mid-line): torn for good. A writer
    that may be alive (this host: its pid lives; another host) may still be writing its line: not counted.
    A legacy-named journal's tail counts, as before identities."""
    n = 0
    for f in files:
        try:
            size = os.stat(f.path).st_size
        except FileNotFoundError:
            continue
        w = _writer(f.path)
        if size <= f.end or w is None:
            continue
        ident = w[2]
        if ident is None or (ident.comparable() and dead_reason(ident) is not None):
            n += 1
    return n


def check_invariants(c: CacheCounts, consumers: list[ConsumerCounts]) -> list[str]:
    """Invariants that must hold on any root; each violation is a sentence naming the numbers."""
    out = []
    publish_failures = c.failures - c.forward_failures
    if c.captures != c.publications + publish_failures + c.captures_lost_in_crash + c.captures_in_flight:
        out.append(f"captures {c.captures} != publications {c.publications} + failures {publish_failures} + lost "
                   f"in a producer crash {c.captures_lost_in_crash} + in flight {c.captures_in_flight}")
    if c.leases_acquired != (c.leases_released + c.leases_expired + c.leases_held
                             + c.leases_removal_unjournaled + c.leases_release_held):
        out.append(f"leases acquired {c.leases_acquired} != released {c.leases_released} + expired "
                   f"{c.leases_expired} + held {c.leases_held} + removed unjournaled by a killed process "
                   f"{c.leases_removal_unjournaled} + released with the line held in memory (full disk) "
                   f"{c.leases_release_held}")
    if c.logical_requests != c.hits + c.misses:
        out.append(f"logical requests {c.logical_requests} != hits {c.hits} + misses {c.misses}")
    if c.retention in ("", "windows") and c.window_bound_artifacts \
            and c.max_retained_artifacts > c.window_bound_artifacts + c.kept_fill_artifacts:
        out.append(f"max retained artifacts {c.max_retained_artifacts} exceeded the window bound "
                   f"{c.window_bound_artifacts}" + (f" + the {c.kept_fill_artifacts} artifacts of a kept fill"
                                                    if c.kept_fill_artifacts else ""))
    if c.budget_exceeded_bytes > 0:
        out.append(f"retained bytes exceeded the disk budget by {c.budget_exceeded_bytes} while the live windows "
                   "fitted it")
    if c.recaptures > c.captures:
        out.append(f"recaptures {c.recaptures} > captures {c.captures}")
    if c.distinct_fingerprints_captured > c.captures:
        out.append("more distinct fingerprints than captures")
    return out
