"""Retention by future need: artcache.eviction.decide — the guarantee, Belady's order and its
reasons, the budget, prefetch in order of need, --fill — and RateEstimator; unit tests of the pure function."""

from __future__ import annotations

import math

import numpy as np
import pytest

from artcache.eviction import (
    NEEDED_LATER,
    OUTSIDE_WINDOWS,
    UNNEEDED,
    RateEstimator,
    Reader,
    decide,
    need_times,
)
from artcache.plan import EpochOrder

N = 1_000
ORDER = EpochOrder(N, N, 0)


def reader(name: str, cursor: int, rate: float = 1.0, *, lookbehind: int = 0, lookahead: int = 8, end: float = N,
           batch: int = 1, demand=(), order=ORDER, pinned=range(0)) -> Reader:
    return Reader(name, cursor, lookbehind, lookahead, end, order, rate, pinned, tuple(demand), (), batch)


def published(*ranges: range, size: int = 10) -> np.ndarray:
    sizes = np.zeros(N, dtype=np.int64)
    for r in ranges:
        sizes[list(r)] = size
    return sizes


def test_everything_fits_nothing_is_evicted_and_every_window_position_is_queued():
    sizes = published(range(0, 100))
    d = decide([reader("a", 95)], sizes=sizes, budget=math.inf, est_size=10)
    assert d.evict == {} and not d.binding and d.retained_bytes == 1000
    assert d.capture_samples.tolist() == [100, 101, 102, 103]  # 95..103 minus what is published


def test_belady_order_and_reasons():
    """Budget for 60 of the 100 published plus nothing to capture: what nobody reads again goes first (highest
    plan index first), then what is needed furthest in the future."""
    sizes = published(range(0, 100))
    fast, slow = reader("fast", 90, rate=3.0, lookahead=9), reader("slow", 30, rate=1.0, lookahead=9)
    d = decide([fast, slow], sizes=sizes, budget=600, est_size=10, explain=True)
    # samples 0..29 are behind both cursors: unneeded; 30..99 are needed by slow at (s - 30) / 1 s, and
    # 90..99 by fast sooner (its window, guaranteed anyway)
    reasons = list(d.evict.items())
    assert [r for _, r in reasons[:30]] == [UNNEEDED] * 30
    assert [s for s, _ in reasons[:30]] == list(range(29, -1, -1))  # highest index first
    assert all(r == NEEDED_LATER for _, r in reasons[30:])
    assert [s for s, _ in reasons[30:]] == list(range(89, 79, -1))  # slow reaches these last
    assert d.retained_bytes == 600 and d.binding and not d.windows_exceed_budget
    assert d.kept == {"window": 20, "leased": 0, "needed": 40, "unneeded": 0}


def test_unneeded_is_kept_while_it_fits():
    sizes = published(range(0, 50))
    d = decide([reader("a", 45)], sizes=sizes, budget=560, est_size=10, explain=True)
    assert d.evict == {} and d.capture_samples.tolist() == [50, 51, 52, 53]
    assert d.kept["unneeded"] == 45  # behind the only cursor: kept, for a consumer that starts later


def test_the_guarantee_beats_the_budget():
    """Windows, pinned ranges and leases are never evicted, even over the budget (and the decision says so)."""
    sizes = published(range(0, 40), range(500, 504))
    a = reader("a", 20, lookbehind=4, lookahead=8, pinned=range(500, 504))
    d = decide([a], sizes=sizes, budget=100, est_size=10, leased=[3])
    guaranteed = set(range(16, 29)) | set(range(500, 504)) | {3}
    assert not guaranteed & set(d.evict)
    assert set(d.evict) == set(range(0, 40)) - guaranteed
    assert d.windows_exceed_budget and d.guaranteed_bytes == 10 * len(guaranteed)
    assert d.capture_samples.tolist() == []  # prefetch stops at the budget


def test_demand_is_captured_over_the_budget_and_prefetch_is_not():
    sizes = published(range(0, 10))
    a = reader("a", 10, lookahead=20, demand=[10])
    d = decide([a], sizes=sizes, budget=100, est_size=10)
    # 0..9 are behind the cursor: unneeded, they make room for the demand and the next positions (the reader's
    # next two batches are urgent; the rest of the lookahead may only take free room or what nobody needs)
    assert d.capture_samples[0] == 10 and d.head(1)[0].demand
    assert sum(sizes[s] for s in range(10) if s not in d.evict) + 10 * len(d.capture_samples) <= 100
    full = published(range(10, 20))  # the window itself is full
    d = decide([reader("a", 20, lookbehind=10, lookahead=20, demand=[20])], sizes=full, budget=100, est_size=10)
    assert d.capture_samples.tolist() == [20] and d.windows_exceed_budget  # only the demand


def test_a_prefetch_never_evicts_what_is_needed_sooner():
    """The budget is full of what the slow consumer reads in the next 10 s; the fast one's lookahead beyond
    its next two batches is needed later than that: not captured; its next two batches are."""
    sizes = published(range(100, 110))
    slow = reader("slow", 100, rate=1.0, lookahead=9)
    fast = reader("fast", 500, rate=1.0, lookahead=50, batch=2)
    d = decide([slow, fast], sizes=sizes, budget=140, est_size=10)
    assert d.evict == {}
    assert sorted(d.capture_samples.tolist()) == [500, 501, 502, 503]
    assert d.binding and d.left_out == 47


def test_capture_queue_in_order_of_need():
    d = decide([reader("a", 0, rate=2.0, lookahead=5), reader("b", 100, rate=1.0, lookahead=3)],
               sizes=published(), budget=math.inf, est_size=10)
    # need times: a 0, .5, 1, 1.5, 2, 2.5; b 0, 1, 2, 3
    assert d.capture_samples.tolist() == [0, 100, 1, 2, 101, 3, 4, 102, 5, 103]
    w = d.head(3)
    assert [x.priority for x in w] == [(1, 0.0), (1, 0.0), (1, 0.5)] and w[0].consumers == {"a"}


def test_need_across_epochs():
    """A sample behind the cursor is needed again in the next epoch (inside the run); past the run's end never."""
    order = EpochOrder(100, 100, 7)
    r = reader("a", 50, rate=2.0, end=200, order=order)
    t = need_times([r], np.array([60, 10]))
    assert t[0] == pytest.approx(5.0)
    assert t[1] == pytest.approx((100 + order._epoch(1)[1][10] - 50) / 2.0)
    assert math.isinf(need_times([reader("a", 50, end=100, order=order)], np.array([10]))[0])


def test_fill_queues_the_plan_after_what_consumers_need_and_stops_at_the_budget():
    sizes = published(range(0, 5))
    d = decide([reader("a", 500, lookahead=2)], sizes=sizes, budget=math.inf, est_size=10, fill=True,
               max_queue=10)
    assert d.capture_samples.tolist() == [500, 501, 502, 5, 6, 7, 8, 9, 10, 11]
    d = decide([], sizes=sizes, budget=100, est_size=10, fill=True)
    assert d.capture_samples.tolist() == [5, 6, 7, 8, 9] and d.binding  # 5 more fit; the plan does not
    assert decide([], sizes=published(range(N)), budget=math.inf, est_size=10, fill=True).capture_samples.size == 0


def test_windows_policy_is_the_old_rule():
    sizes = published(range(0, 100))
    d = decide([reader("a", 50, lookbehind=2, lookahead=4)], sizes=sizes, budget=math.inf, est_size=10,
               policy="windows", leased=[7])
    assert set(d.evict) == set(range(100)) - set(range(48, 55)) - {7}
    assert set(d.evict.values()) == {OUTSIDE_WINDOWS}


def test_duplicate_samples_share_one_artifact():
    canon = np.arange(N)
    canon[600] = 5  # sample 600 has sample 5's fingerprint
    sizes = published(range(5, 6))
    d = decide([reader("a", 598, lookahead=4)], sizes=sizes, budget=math.inf, est_size=10, canon=canon)
    assert 600 not in d.capture_samples.tolist() and 5 not in d.capture_samples.tolist()
    d = decide([reader("a", 598, lookahead=4)], sizes=sizes, budget=10, est_size=10, canon=canon)
    assert 5 not in d.evict  # inside the window through its duplicate


def test_queue_limit_and_inflight_and_blocked():
    d = decide([reader("a", 0, lookahead=20)], sizes=published(), budget=math.inf, est_size=10, max_queue=5,
               inflight=[0, 1], blocked=[2])
    assert d.capture_samples.tolist() == [3, 4, 5, 6, 7]
    assert decide([reader("a", 0, lookahead=20)], sizes=published(), budget=25, est_size=10,
                  inflight=[0, 1]).capture_samples.size == 0  # in-flight bytes count


def test_rate_estimator():
    est = RateEstimator(window_s=10.0, min_span_s=1.0, prior=3.0)
    assert est.rate("a") == 3.0  # nothing known: the prior
    for t in range(0, 21):
        est.observe("a", 1, 4 * t, float(t))
    assert est.rate("a") == pytest.approx(4.0)
    est.observe("b", 1, 0, 20.0)
    assert est.rate("b") == pytest.approx(4.0)  # not measured yet: as the others
    for t in range(21, 40):  # a stops (blocked, evaluating): its rate falls with the window
        est.observe("a", 1, 80, float(t))
    assert est.rate("a") < 0.1
    est.observe("a", 2, 0, 40.0)  # re-registered: measured afresh
    assert est.rate("a") != pytest.approx(0.0)
    est.forget(["b"])
    assert est.rate("a") == pytest.approx(3.0)
