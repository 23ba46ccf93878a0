"""Retention by future need under a disk budget, and the eviction pass that carries it out.

:func:`decide` is the one retention policy. It is pure (no I/O, no clock) and called by the producer
(every scheduling pass), ``artcache.bench.sim`` (every simulated pass) and ``artcache inspect`` (the
decision the root's state implies now). It works on plan sample indices and returns, with a reason
for each:

* what must stay: every published sample inside a live window ``[cursor - lookbehind, cursor +
  lookahead]`` (clipped at the consumer's end) or a pinned held-out range, and every leased one —
  the hard guarantee, whatever the budget;
* what to capture next, in order of need: demand misses first (always, even over the budget), then
  the unpublished positions of the live lookaheads by *need time* (how many seconds until a consumer
  reads it: distance from its cursor / its rate), then pinned ranges, then (``fill``) the rest of the
  plan in plan order;
* what to evict: beyond the guarantee everything published is kept while the retained bytes fit
  ``budget``. When they do not, items are ranked by need time — the time until the first live
  consumer reads the sample again, from its known cursor, rate and end (Belady's rule: what is needed
  furthest in the future goes first); samples no live consumer will read again rank last, among them
  the highest plan index first (a consumer that starts later walks the plan from its beginning) — and
  the longest prefix of that ranking that fits beside the guaranteed bytes and the demand is kept or
  captured. Evicted: ``unneeded`` (outside every window, no live consumer reads it again) or
  ``needed-later`` (needed, but later than everything kept). A capture never makes room by evicting
  something needed sooner than itself, and prefetch stops at the budget.

:func:`evict_pass` removes the chosen artifacts from ``objects/`` (re-checking leases), and
:class:`RateEstimator` gives each consumer's rate from its committed cursors.

Decision order per artifact in :func:`evict_pass` (cf. python-diskcache's culling and Bazel's
re-check before delete): expired leases are removed first; kept if a live lease remains; else
renamed aside and unlinked (:func:`artcache.store.remove`). A lease taken between the check and the
rename is harmless: the reader either opened the file already (POSIX keeps the bytes) or sees a miss
that becomes a demand.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from artcache import leases as leases_mod
from artcache import store
from artcache.fsio import is_retryable
from artcache.layout import CacheLayout
from artcache.liveness import HeartbeatWatch, ProcessIdentity
from artcache.plan import EpochOrder
from artcache.registry import Registration
from artcache.scheduler import Want

log = logging.getLogger("artcache.eviction")

#: eviction reasons (journal ``evict.reason``)
UNNEEDED = "unneeded"
NEEDED_LATER = "needed-later"
OUTSIDE_WINDOWS = "outside-windows"  # the ``windows`` policy: the rule before retention by need
REASONS = (UNNEEDED, NEEDED_LATER, OUTSIDE_WINDOWS)

Policy = Literal["need", "windows"]
POLICIES = ("need", "windows")
#: ``--disk-budget auto``: retention by need inside the budget the producer derives from the free space
AUTO_BUDGET = "auto"


def retention_rule(disk_budget: int | str = 0, retention: str = "", fill: bool = False) -> Policy:
    """The retention rule a producer runs under, from its settings: the one place it is decided (the producer,
    ``artcache run``'s producer and ``bench/sim.py``'s :meth:`ProducerSpec.of_settings` call it).

    * no disk budget (``disk_budget`` 0) and no ``fill``: ``windows`` — only the live windows, pinned held-out
      ranges and leases are kept, so disk use is bounded by the windows, not by the length of the run;
    * a disk budget (bytes, or :data:`AUTO_BUDGET`: derived from the free space at start), or ``fill`` (its
      budget is ``auto`` unless given): ``need`` — beyond the windows, what a live consumer will still read is
      kept while it fits the budget.

    ``retention`` (``--retention``, ``""``: follow the budget) may only repeat what the budget says.

    Raises:
        ConfigError: ``retention`` not one of :data:`POLICIES`; ``need`` without a budget; ``windows`` with a
            budget or with ``fill`` (the windows rule keeps no fill).
    """
    from artcache.errors import ConfigError

    if retention not in ("", *POLICIES):
        raise ConfigError(f"--retention {retention!r} is not accepted: use one of {', '.join(POLICIES)} (or leave "
                          "it out: the rule follows --disk-budget)")
    budgeted = bool(disk_budget) or fill
    if retention == "need" and not budgeted:
        raise ConfigError("--retention need keeps what consumers will read again inside a disk budget: give "
                          "--disk-budget BYTES (or auto: 90% of the free space); without one the producer keeps the "
                          "live windows only")
    if retention == "windows" and disk_budget:
        raise ConfigError(f"--retention windows keeps only the live windows, so --disk-budget {disk_budget} would "
                          "not be used: leave out one of them (a budget means retention by need)")
    if retention == "windows" and fill:
        raise ConfigError("--retention windows keeps only the live windows, so it cannot keep a --fill: leave out "
                          "one of them")
    return "need" if budgeted else "windows"

# capture classes (Want.priority[0])
DEMAND, WINDOW, PINNED, FILL = 0, 1, 2, 3


@dataclass(frozen=True)
class Reader:
    """A live consumer as retention sees it.

    Attributes:
        consumer_id: its id. cursor: committed position. lookbehind, lookahead: its window (positions).
        end: exclusive end of its run in positions (``math.inf``: unbounded).
        order: its :class:`~artcache.plan.EpochOrder` (position → sample).
        rate: positions per second it reads (> 0; :class:`RateEstimator`).
        pinned: sample indices of its held-out split (retained, captured after its window).
        demand: positions it is blocked on. pinned_demand: held-out sample indices it is blocked on.
        batch_size: positions per optimizer step; its next two batches ``[cursor, cursor + 2 ×
            batch_size)`` are *urgent* (the reader is acquiring them now).
    """

    consumer_id: str
    cursor: int
    lookbehind: int
    lookahead: int
    end: float
    order: EpochOrder
    rate: float
    pinned: range = range(0)
    demand: tuple[int, ...] = ()
    pinned_demand: tuple[int, ...] = ()
    batch_size: int = 1

    @classmethod
    def of(cls, reg: Registration, order: EpochOrder, rate: float) -> Reader:
        pinned = reg.pinned_range()
        demand, pinned_demand = [], list(reg.pinned_demand)
        lo, hi = reg.readable()
        for p in reg.demand:
            if lo <= p <= hi:
                demand.append(p)
            elif p in pinned:  # a held-out read announced as a position (epoch 0: position = sample)
                pinned_demand.append(p)
        return cls(reg.consumer_id, reg.cursor, reg.lookbehind, reg.lookahead,
                   reg.end if reg.end >= 0 else math.inf, order, max(rate, 1e-9), pinned,
                   tuple(demand), tuple(pinned_demand), reg.batch_size)

    def window(self) -> tuple[int, int]:
        """Inclusive window ``[lo, hi]`` of positions (``hi < lo`` past the end), as Registration.window."""
        hi = self.cursor + self.lookahead
        if self.end != math.inf:
            hi = min(hi, int(self.end) - 1)
        return max(0, self.cursor - self.lookbehind), hi


@dataclass
class RetentionDecision:
    """What :func:`decide` chose. Indices are (canonical) plan sample indices; bytes are bytes.

    Attributes:
        evict: sample → reason (:data:`REASONS`), furthest need first.
        capture_samples: int64, the capture queue's samples in order, at most ``max_queue`` long,
            inside the budget except for demand; :meth:`head` / :attr:`capture` give them as
            :class:`~artcache.scheduler.Want` entries.
        retained_bytes: published bytes after the evictions (plus bytes in flight).
        guaranteed_bytes: bytes the windows, pinned ranges, leases and captures in flight hold.
        budget: the budget it worked to. binding: something needed (or, with ``fill``, a plan sample)
            was evicted or left uncaptured because of the budget. windows_exceed_budget: the guarantee
            and the demand alone exceed the budget (the guarantee wins; nothing else is kept).
        left_out: capture candidates the budget left out.
        kept: reason → number of published samples kept (``window``, ``leased``, ``needed``,
            ``unneeded``), filled only with ``explain=True``.
    """

    evict: dict[int, str] = field(default_factory=dict)
    capture_samples: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    retained_bytes: int = 0
    guaranteed_bytes: int = 0
    budget: float = math.inf
    binding: bool = False
    windows_exceed_budget: bool = False
    left_out: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    _make: Callable[[int], list[Want]] | None = field(default=None, repr=False)

    def head(self, k: int) -> list[Want]:
        """The first ``k`` entries of the capture queue, each with the consumers and positions that
        asked for its sample (built only for these ``k``: a batch takes a few)."""
        return self._make(k) if self._make is not None else []

    @property
    def capture(self) -> list[Want]:
        """The whole capture queue as :class:`~artcache.scheduler.Want` entries."""
        return self.head(len(self.capture_samples))


def _as_index(x: Iterable[int] | np.ndarray | None) -> np.ndarray:
    if x is None:
        return np.empty(0, dtype=np.int64)
    if isinstance(x, np.ndarray):
        return x.astype(np.int64, copy=False)
    return np.fromiter(x, dtype=np.int64)


def need_times(readers: Sequence[Reader], samples: np.ndarray) -> np.ndarray:
    """float64 [len(samples)]: seconds until the first of ``readers`` reads each sample again (from its
    cursor, at its rate, before its end; ``inf``: none will). A sample that is a duplicate of another
    (same fingerprint) is ranked by its canonical index's reads only."""
    out = np.full(len(samples), np.inf)
    for r in readers:
        if len(samples):
            pos = r.order.next_positions(samples, r.cursor, r.end)
            np.minimum(out, (pos - r.cursor) / r.rate, out=out)
    return out


@dataclass
class _Rows:
    """Capture candidates, one row per (sample, reader, position): ``s`` sample, ``c`` class, ``k`` need
    (seconds), ``p`` position (held-out: ``-1 - sample``), ``r`` reader index, ``u`` urgent."""

    s: list = field(default_factory=list)
    c: list = field(default_factory=list)
    k: list = field(default_factory=list)
    p: list = field(default_factory=list)
    r: list = field(default_factory=list)
    u: list = field(default_factory=list)

    def add(self, samples, cls: int, need, pos, reader: int, urgent) -> None:
        m = len(samples)
        self.s.append(np.asarray(samples, dtype=np.int64))
        self.c.append(np.full(m, cls))
        self.k.append(np.broadcast_to(np.asarray(need, dtype=np.float64), (m,)))
        self.p.append(np.asarray(pos, dtype=np.int64))
        self.r.append(np.full(m, reader))
        self.u.append(np.broadcast_to(np.asarray(urgent, dtype=bool), (m,)))

    def arrays(self) -> tuple[np.ndarray, ...]:
        if not self.s:
            e = np.empty(0, dtype=np.int64)
            return e, e, np.empty(0), e, e, np.empty(0, dtype=bool)
        return tuple(np.concatenate(x) for x in (self.s, self.c, self.k, self.p, self.r, self.u))


def _two_epochs_end(order: EpochOrder, start: int) -> int:
    """Last position of the epoch after ``start``'s: ``[start, this]`` holds every sample's first read at
    or after ``start`` (a whole epoch lies inside it), so a window wider than that adds no sample. Per-pass
    work is bounded by the plan, not by the window width (``--window 0:2000000`` on a
    300-sample plan)."""
    return (start // order.epoch_len + 2) * order.epoch_len - 1


def _guarantee(readers: Sequence[Reader], n: int, cn: Callable, urgent_s: float) -> tuple[np.ndarray, _Rows]:
    """(bool [n]: samples in a live window or pinned range, the capture candidate rows of every reader)."""
    guard = np.zeros(n, dtype=bool)
    rows = _Rows()
    for ri, r in enumerate(readers):
        lo, hi = r.window()
        if hi >= lo:
            guard[cn(r.order.samples(lo, min(hi, _two_epochs_end(r.order, lo)) + 1))] = True
        if len(r.pinned):
            pinned = cn(np.arange(r.pinned.start, r.pinned.stop, dtype=np.int64))
            guard[pinned] = True
            # after the reader's window, in split order
            rows.add(pinned, PINNED, (r.lookahead + 1) / r.rate + np.arange(len(pinned)) * 1e-9,
                     -1 - np.arange(r.pinned.start, r.pinned.stop), ri, False)
        start = max(lo, r.cursor)
        top = min(hi, _two_epochs_end(r.order, start))
        if top >= start:
            pos = np.arange(start, top + 1, dtype=np.int64)
            need = (pos - r.cursor) / r.rate
            rows.add(cn(r.order.samples(start, top + 1)), WINDOW, need, pos, ri,
                     (pos < r.cursor + 2 * r.batch_size) | (need <= urgent_s))
        dem = [p for p in r.demand if start <= p <= hi]
        if dem:
            pos = np.asarray(dem, dtype=np.int64)
            rows.add(cn(np.asarray([r.order.sample(p) for p in dem], dtype=np.int64)), DEMAND,
                     (pos - r.cursor) / r.rate, pos, ri, True)
        pdem = [s for s in r.pinned_demand if s in r.pinned]
        if pdem:
            rows.add(cn(np.asarray(pdem, dtype=np.int64)), DEMAND, np.arange(len(pdem)) * 1e-9,
                     -1 - np.asarray(pdem, dtype=np.int64), ri, True)
    return guard, rows


class _Queue:
    """The unique candidates (the best row of each sample, in priority order) and the Want entries of a
    selection of them."""

    def __init__(self, rows: _Rows, skip: np.ndarray, n: int, readers: Sequence[Reader], fp_of) -> None:
        cs, cc, ck, cp, cr, cu = rows.arrays()
        keep = ~skip[cs]
        cs, cc, ck, cp, cr, cu = (a[keep] for a in (cs, cc, ck, cp, cr, cu))
        order = np.lexsort((ck, cc))  # by class, then need time
        self.cs, self.cc, self.ck, self.cp, self.cr = (a[order] for a in (cs, cc, ck, cp, cr))
        cu = cu[order]
        self.uniq = np.sort(np.unique(self.cs, return_index=True)[1]) if len(self.cs) else np.empty(0, np.int64)
        self.samples, self.cls, self.need = self.cs[self.uniq], self.cc[self.uniq], self.ck[self.uniq]
        urgent = np.zeros(n, dtype=bool)  # urgent if any reader needs it within its next two batches
        urgent[self.cs[cu]] = True
        self.urgent = urgent[self.samples]
        self.queued = np.zeros(n, dtype=bool)
        self.queued[self.samples] = True
        self.ids = [r.consumer_id for r in readers]
        self.fp_of = fp_of

    def set(self, res: RetentionDecision, sel: np.ndarray, fill: np.ndarray, max_queue: int) -> None:
        """The decision's queue: unique candidates ``sel`` (indices into them), then ``fill`` samples."""
        sel = sel[:max_queue]
        fill = fill[:max_queue - len(sel)]
        res.capture_samples = np.concatenate([self.samples[sel], fill]).astype(np.int64)

        def make(k: int) -> list[Want]:
            out = [Want(self.fp_of(int(self.cs[i])), int(self.cs[i]), (int(self.cc[i]), float(self.ck[i])))
                   for i in self.uniq[sel[:k]].tolist()]
            if out:  # every reader and position that asked for each chosen sample
                pick = {w.sample: w for w in out}
                rows = np.flatnonzero(np.isin(self.cs, list(pick)))
                for s, p, r in zip(self.cs[rows].tolist(), self.cp[rows].tolist(), self.cr[rows].tolist(), strict=True):
                    pick[s].consumers.add(self.ids[r])
                    if p >= 0:
                        pick[s].positions.add(p)
            out += [Want(self.fp_of(int(f)), int(f), (FILL, float(f))) for f in fill[:max(0, k - len(out))].tolist()]
            return out

        res._make = make


def decide(readers: Sequence[Reader], *, sizes: np.ndarray, budget: float,
           est_size: np.ndarray | int, fp_of: Callable[[int], str] = str,
           leased: Iterable[int] | np.ndarray | None = None, inflight: Iterable[int] | np.ndarray | None = None,
           blocked: Iterable[int] | np.ndarray | None = None, canon: np.ndarray | None = None,
           max_queue: int = 1024, fill: bool = False, policy: Policy = "need", urgent_s: float = 0.0,
           explain: bool = False, keep: Iterable[int] | np.ndarray | None = None) -> RetentionDecision:
    """The retain set, the evictions and the capture queue for one pass (see the module docstring).

    Args:
        readers: the live consumers (:meth:`Reader.of`).
        sizes: int64 [plan_len]: bytes on disk of each published (canonical) sample, 0 if unpublished.
        budget: disk budget in bytes (``math.inf``: none).
        est_size: int64 [plan_len] (or one int): bytes an unpublished sample will take once captured.
        fp_of: canonical sample index → the ``fp`` put in each :class:`~artcache.scheduler.Want`.
        leased: samples a live lease holds (never evicted). inflight: captured, being published
            (their estimated bytes count; never queued again). blocked: never queued (given up).
        canon: int64 [plan_len], sample → the first sample with the same fingerprint (None: all distinct).
        max_queue: longest capture queue returned. fill: queue every unpublished sample of the plan
            (after everything a consumer needs; ``artcache producer --fill``).
        policy: ``need`` (this retention) or ``windows`` (keep only windows, pinned ranges and leases,
            no budget: the windows-only rule, kept as the baseline the bench and simulator compare).
        urgent_s: a window position needed within this many seconds is *urgent* like a reader's next
            two batches (the producer passes its idle poll plus two capture batches: what it could
            not capture in time if it waited).
        explain: also count what is kept by reason (``RetentionDecision.kept``; inspect).
        keep: samples kept whatever the policy and the budget, like leased ones: a filled root's
            artifacts (``artcache producer --fill``; the producer passes them unless ``--evict-fill``).

    Returns:
        A :class:`RetentionDecision`. Cost: numpy over the live windows, plus over the published
        samples when the budget binds (and, with ``fill``, over the plan).
    """
    n = len(sizes)
    est = np.full(n, int(est_size), dtype=np.int64) if np.isscalar(est_size) else np.asarray(est_size)
    published = sizes > 0
    guard, rows = _guarantee(readers, n, (lambda a: a) if canon is None else canon.__getitem__, urgent_s)
    leased_i, inflight_i, blocked_i = _as_index(leased), _as_index(inflight), _as_index(blocked)
    guard[leased_i] = True
    keep_i = _as_index(keep)
    guard[keep_i] = True
    skip = published.copy()
    skip[inflight_i] = True
    skip[blocked_i] = True
    inflight_bytes = int(est[inflight_i[~published[inflight_i]]].sum()) if len(inflight_i) else 0
    q = _Queue(rows, skip, n, readers, fp_of)
    fill_s = np.empty(0, dtype=np.int64)
    if fill:
        todo = ~skip & ~q.queued
        if canon is not None:
            todo &= canon == np.arange(n)
        fill_s = np.flatnonzero(todo)
    res = RetentionDecision(budget=budget)
    used = int(sizes.sum()) + inflight_bytes
    res.guaranteed_bytes = int(sizes[guard & published].sum()) + inflight_bytes
    gone = np.empty(0, dtype=np.int64)
    is_dem = q.cls == DEMAND
    dem_bytes = int(est[q.samples[is_dem]].sum())
    rest = np.flatnonzero(~is_dem)
    if policy == "windows":
        gone = np.flatnonzero(published & ~guard)
        res.evict = {int(s): OUTSIDE_WINDOWS for s in gone.tolist()}
        q.set(res, np.arange(len(q.samples)), fill_s, max_queue)
    elif used + dem_bytes + int(est[q.samples[rest]].sum()) + int(est[fill_s].sum()) <= budget:
        q.set(res, np.arange(len(q.samples)), fill_s, max_queue)  # everything fits: keep all, queue all
    else:
        gone = _within_budget(res, readers, q, sizes, est, published & ~guard, rest, is_dem, fill_s,
                              budget - res.guaranteed_bytes - dem_bytes, max_queue, fill)
    res.retained_bytes = used - int(sizes[gone].sum())
    if explain:
        res.kept = _explain(readers, sizes, guard, leased_i, gone, keep_i)
    return res


def _within_budget(res: RetentionDecision, readers, q: _Queue, sizes, est, free_mask, rest, is_dem, fill_s,
                   room: float, max_queue: int, fill: bool) -> np.ndarray:
    """The budget binds: rank what may go (published, evictable) and what may come (non-demand candidates,
    fill) by need time — Belady — and keep / capture the longest prefix that fits ``room``; set the
    decision's evictions, queue and flags. Returns the evicted samples.

    A candidate outside every reader's next two batches ranks after every published sample that is still
    needed: prefetch fills free room and what nobody needs, and evicts something needed only for a read
    that is imminent (making room early would throw away what the slowest consumer is about to free)."""
    free = np.flatnonzero(free_mask)
    need_free = need_times(readers, free)
    cand_k = q.need[rest].copy()
    lazy = ~q.urgent[rest]
    if lazy.any():
        finite = need_free[np.isfinite(need_free)]
        cand_k[lazy] += float(finite.max()) + 1.0 if len(finite) else 0.0
    keys = np.concatenate([need_free, cand_k, np.full(len(fill_s), np.inf)])
    ties = np.concatenate([free, q.samples[rest], fill_s]).astype(np.float64)
    nbytes = np.concatenate([sizes[free], est[q.samples[rest]], est[fill_s]]).astype(np.int64)
    taken = _longest_fitting_prefix(keys, ties, nbytes, room)
    res.windows_exceed_budget = room < 0
    nf, nr = len(free), len(rest)
    gone_mask = ~taken[:nf]
    gone, gone_need = free[gone_mask], need_free[gone_mask]
    by_far = np.lexsort((-gone.astype(np.float64), -gone_need))  # furthest need first, unneeded first
    why = np.where(np.isinf(gone_need[by_far]), UNNEEDED, NEEDED_LATER)
    res.evict = dict(zip(gone[by_far].tolist(), why.tolist(), strict=True))
    cap = np.sort(np.concatenate([np.flatnonzero(is_dem), rest[taken[nf:nf + nr]]]))  # already in priority order
    q.set(res, cap, fill_s[taken[nf + nr:]] if fill else fill_s[:0], max_queue)
    left = ~taken[nf:]
    res.left_out = int(left.sum())
    res.binding = bool(np.isfinite(gone_need).any() or left[:nr].any() or (fill and left[nr:].any()))
    return gone


def _longest_fitting_prefix(keys: np.ndarray, ties: np.ndarray, nbytes: np.ndarray, room: float) -> np.ndarray:
    """bool [len(keys)]: the longest prefix of the ranking by (key, tie) whose bytes fit ``room``.

    Found as the shortest suffix to drop (what exceeds the room), with a partial partition of the
    ranking: only the dropped items and those beside the cut are sorted."""
    n = len(keys)
    taken = np.ones(n, dtype=bool)
    excess = int(nbytes.sum()) - room
    if excess <= 0:
        return taken
    if room < 0 or n == 0:
        return ~taken
    finite = np.isfinite(keys)
    top = float(keys[finite].max()) + 1.0 if finite.any() else 0.0
    order_key = np.where(finite, keys, top + ties)  # unneeded: after every need, by plan index
    m = min(n, int(math.ceil(excess / max(1, int(nbytes.min())))) + 1)
    part = np.argpartition(order_key, n - m)[n - m:] if m < n else np.arange(n)
    tail = part[np.lexsort((ties[part], order_key[part]))][::-1]  # furthest first
    cum = np.cumsum(nbytes[tail])
    drop = int(np.searchsorted(cum, excess, side="left")) + 1  # shortest suffix with bytes >= excess
    taken[tail[:drop]] = False
    return taken


def _explain(readers, sizes, guard, leased_i, gone, keep_i) -> dict[str, int]:
    published = sizes > 0
    kept = published.copy()
    kept[gone] = False
    lease = np.zeros(len(sizes), dtype=bool)
    lease[leased_i] = True
    filled = np.zeros(len(sizes), dtype=bool)
    filled[keep_i] = True
    filled &= ~lease
    window = guard & ~lease & ~filled
    rest = np.flatnonzero(kept & ~guard)
    need = need_times(readers, rest)
    out = {"window": int((kept & window).sum()), "leased": int((kept & lease).sum()),
           "needed": int(np.isfinite(need).sum()), "unneeded": int(np.isinf(need).sum())}
    if len(keep_i):
        out["filled"] = int((kept & filled).sum())
    return out


class RateEstimator:
    """Each consumer's reading rate (positions per second) from its committed cursors over time.

    ``observe(consumer_id, generation, cursor, t)`` records one observation; :meth:`rate` is the
    cursor's advance over the last ``window_s`` seconds (at least ``min_span_s`` of them) divided by
    that time. A consumer not measured yet (or re-registered: new generation) gets the median rate
    of those that are, else ``prior`` — a new consumer is assumed as fast as the others. A consumer
    that stops committing (blocked, evaluating) slows down in the estimate, so what only it needs
    moves back in the need order.
    """

    def __init__(self, window_s: float = 30.0, min_span_s: float = 1.0, prior: float = 1.0) -> None:
        self.window_s, self.min_span_s, self.prior = window_s, min_span_s, prior
        self._obs: dict[str, tuple[int, deque]] = {}

    def observe(self, consumer_id: str, generation: int, cursor: int, t: float) -> None:
        gen, obs = self._obs.get(consumer_id, (None, None))
        if gen != generation or obs is None:
            obs = deque()
            self._obs[consumer_id] = (generation, obs)
        if obs and obs[-1][1] == cursor and len(obs) > 1 and obs[-2][1] == cursor:
            obs[-1] = (t, cursor)  # a run of equal cursors: keep its first and last observation
        else:
            obs.append((t, cursor))
        while len(obs) > 2 and t - obs[1][0] >= self.window_s:
            obs.popleft()

    def _measured(self, consumer_id: str) -> float | None:
        _, obs = self._obs.get(consumer_id, (None, None))
        if not obs or len(obs) < 2:
            return None
        (t0, c0), (t1, c1) = obs[0], obs[-1]
        if t1 - t0 < self.min_span_s or c1 <= c0 and t1 - t0 < self.window_s:
            return None
        return max(c1 - c0, 0) / (t1 - t0)

    def rate(self, consumer_id: str) -> float:
        own = self._measured(consumer_id)
        if own is not None and own > 0:
            return own
        known = sorted(r for c in self._obs if c != consumer_id and (r := self._measured(c)))
        base = known[len(known) // 2] if known else self.prior
        return base if own is None else max(base * 1e-3, 1e-6)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop consumers not in ``keep`` (no longer live)."""
        keep = set(keep)
        for c in [c for c in self._obs if c not in keep]:
            del self._obs[c]


@dataclass
class EvictionResult:
    evicted: dict[str, int] = field(default_factory=dict)  # fp -> bytes
    expired_leases: list[tuple[leases_mod.LeaseInfo, str]] = field(default_factory=list)
    held_by_lease: set[str] = field(default_factory=set)
    retained: dict[str, int] = field(default_factory=dict)  # fp -> bytes after the pass
    deferred: dict[str, int] = field(default_factory=dict)  # fp -> errno of a transient failure (next pass)


def expire_leases(layout: CacheLayout, live_consumers: Mapping[str, ProcessIdentity | None] | set[str], *,
                  lease_ttl_s: float = 600.0, leases: dict | None = None,
                  lease_watch: HeartbeatWatch | None = None,
                  ) -> tuple[dict[str, list], list[tuple[leases_mod.LeaseInfo, str]]]:
    """Remove expired leases (:func:`artcache.leases.expired_reason`); return (fp → live leases, expired).

    ``live_consumers`` maps running consumers' ids to their registrations' process identities;
    ``lease_watch`` times leases whose holder cannot be checked from here (another host) on this
    process's monotonic clock (see :func:`artcache.leases.expired_reason`).
    """
    leases = leases_mod.scan(layout) if leases is None else leases
    live: dict[str, list] = {}
    expired = []
    for fp, infos in leases.items():
        for lease in infos:
            reason = leases_mod.expired_reason(lease, live_consumers, lease_ttl_s, lease_watch)
            if reason is None:
                live.setdefault(fp, []).append(lease)
            elif leases_mod.release(layout, lease.name):
                expired.append((lease, reason))
    return live, expired


def evict_pass(layout: CacheLayout, evict: Iterable[str],
               live_consumers: Mapping[str, ProcessIdentity | None] | set[str], *,
               lease_ttl_s: float = 600.0, objects: dict[str, int] | None = None,
               live_leases: dict[str, list] | None = None,
               lease_watch: HeartbeatWatch | None = None) -> EvictionResult:
    """Remove the artifacts ``evict`` names from ``objects/`` unless a live lease holds one.

    Args:
        evict: fingerprints chosen by :func:`decide` (others are never touched).
        live_consumers: ids of running, heart-beating consumers (their leases are live), mapped to their
            registrations' process identities (see :func:`artcache.leases.expired_reason`).
        lease_ttl_s: how long a lease whose holder cannot be checked from here must have been seen (by
            ``lease_watch``, on this process's monotonic clock) before it is expired.
        objects: a fresh :func:`store.list_objects` result, to avoid listing twice.
        live_leases: :func:`expire_leases`'s first result, when the caller expired leases already;
            otherwise expired leases are removed here (``EvictionResult.expired_leases``).

    A transient error removing an artifact (ESTALE, EBUSY, EIO, ...: :func:`artcache.fsio.is_retryable`)
    keeps it for this pass (``deferred``); the next pass retries it.
    """
    res = EvictionResult()
    # a remote payload store's housekeeping (deferred removals; payloads it lost become misses, counted as
    # evictions): a no-op for a POSIX root
    res.evicted.update(store.maintain(layout))
    objects = store.list_objects(layout) if objects is None else objects
    objects = {fp: n for fp, n in objects.items() if fp not in res.evicted}
    if live_leases is None:
        live_leases, res.expired_leases = expire_leases(layout, live_consumers, lease_ttl_s=lease_ttl_s,
                                                        lease_watch=lease_watch)
    res.retained = dict(objects)
    for fp in evict:
        if fp not in objects:
            continue
        if live_leases.get(fp):
            res.held_by_lease.add(fp)
            continue
        try:
            freed = store.remove(layout, fp)
        except OSError as exc:
            if not is_retryable(exc):
                raise
            log.warning("evicting %s failed (%s); retried on the next pass", fp, exc.strerror or exc)
            res.deferred[fp] = exc.errno or 0
            continue
        res.retained.pop(fp, None)
        if freed:
            res.evicted[fp] = freed
    return res
