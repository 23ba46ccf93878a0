"""Retention by need over long simulated streams, more examples and the floor-budget regressions (the fast parts:
tests/properties/test_retention_sim.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings

from artcache import eviction
from artcache.bench.sim import (
    ConsumerSpec,
    ProducerSpec,
    offline_optimum,
    simulate,
)
from artcache.scheduler import SchedulerLimits
from tests.properties.test_retention_sim import TOL_STAGGERED, TOL_TOGETHER, streams
from tests.properties.test_retention_sim import (
    test_property_budget_window_and_offline_optimum_over_100k_positions as budget_property,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_property_over_100k_positions_more_examples(stream):
    """The same property, 20 random examples (the reliability lane)."""
    budget_property.hypothesis.inner_test(stream)


def _floor_stream(rates):
    """Reliability-lane floor-budget stream: consumers at ``rates`` positions/s with batches 32 / 48 / 96,
    lookbehind 0, lookahead 1024, all starting at 0, none stopping, a 25,000-sample plan, and the budget 3139 =
    the floor (the three windows + one capture batch)."""
    cons = [ConsumerSpec(f"c{i}", b / r, b, 0, 1024) for i, (r, b) in enumerate(zip(rates, (32, 48, 96), strict=True))]
    prod = ProducerSpec(fixed_s=0.002, per_sample_s=0.0001, poll_s=0.05,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=64, max_batch_tokens=64 * 256))
    return cons, prod.with_budget(3139)


def test_regression_epoch_bound_changes_nothing_on_the_floor_budget_stream(monkeypatch):
    """Hypothesis's falsifying stream for the 0.02 bound as it was then
    (1500 / 1000 / 3000 positions/s, the floor budget 3139) gives 1.83362 captures per position against MIN's
    1.80928 for 3075 (the budget less one batch), 0.024 over. decide()'s per-pass bound of e3a6d61 (look at most
    to the end of the epoch after the cursor's) is not the cause: without it the run is the same, capture for
    capture (the window, 1025 positions, never reaches past the next epoch). The fair bound, Belady under the
    same window pins with the same budget, needs 1.83109: the policy is 0.0025 over it (MIN, same budget: 1.79456)."""
    cons, prod = _floor_stream((1500, 1000, 3000))
    bounded = simulate(cons, prod, 100_000, plan_len=25_000)
    monkeypatch.setattr(eviction, "_two_epochs_end", lambda order, start: 1 << 62)
    unbounded = simulate(cons, prod, 100_000, plan_len=25_000)
    assert bounded.captures == unbounded.captures == 183_362
    assert bounded.trace == unbounded.trace
    assert offline_optimum(bounded.trace, 3139 - 64) == 180_928
    assert offline_optimum(bounded.trace, 3139) == 179_456
    assert offline_optimum(bounded.trace, 3139, pins=bounded.pins) == 183_109


def test_regression_second_floor_budget_stream_against_the_pinned_optimum():
    """The second floor-budget stream of docs/scheduler.md (1500 / 2250 / 4500 positions/s), 0.029 over MIN for
    the budget less one batch (1.99355 against 1.96407): within 0.02 of Belady under the same window pins with the
    same budget (1.98364, +0.0099); MIN for the same budget, 1.95063, stays the lower bound."""
    cons, prod = _floor_stream((1500, 2250, 4500))
    res = simulate(cons, prod, 100_000, plan_len=25_000)
    assert res.positions == 100_000 and res.captures == 199_355 and res.binding
    assert offline_optimum(res.trace, 3139 - 64) == 196_407
    assert offline_optimum(res.trace, 3139) == 195_063
    fair = offline_optimum(res.trace, 3139, pins=res.pins)
    assert fair == 198_364 and res.captures_per_position <= fair / res.positions + 0.02


def test_regression_staggered_starts_stream_of_ci_2026_12_02():
    """A falsifying stream (speeds 1500 / 1000 / 3000 positions/s, batches 32 /
    96 / 48, starts 0 / 3 / 6.18 s, budget 5729 = 1.83x the floor, a 25,000-sample plan): 1.29067 captures per
    position against 1.26730 for Belady under the same pins in the same room (1.26727 with the batch in capture
    given back to it), 0.0234 over, past the 0.02 the property then asserted for every stream. All three starting
    at once: 0.004 over. Registering at 0 and reading from 3 / 6.18 s (``load_s``: the consumer loads its draft while
    registered) gives the policy the newcomers' windows early: 1.25776, 0.003 over its own pinned optimum."""
    rates, batches, starts = (1500, 1000, 3000), (32, 96, 48), (0.0, 3.0, 6.184952067248414)
    cons = [ConsumerSpec(f"c{i}", b / r, b, 0, 1024, start_s=t)
            for i, (r, b, t) in enumerate(zip(rates, batches, starts, strict=True))]
    prod = ProducerSpec(fixed_s=0.002, per_sample_s=0.0001, poll_s=0.05,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=64, max_batch_tokens=64 * 256))
    prod = prod.with_budget(5729)
    late = simulate(cons, prod, 100_000, plan_len=25_000)
    assert late.captures == 129_067 and late.budget_violations == late.window_violations == []
    fair = offline_optimum(late.trace, 5729, pins=late.pins, reserved=late.in_flight)
    assert offline_optimum(late.trace, 5729, pins=late.pins) == 126_727 and fair == 126_730
    assert TOL_TOGETHER < late.captures_per_position - fair / late.positions < TOL_STAGGERED
    early = simulate([cons[0]] + [replace(c, start_s=0.0, load_s=c.start_s) for c in cons[1:]], prod, 100_000,
                     plan_len=25_000)
    assert early.captures == 125_776 and early.budget_violations == early.window_violations == []
    assert early.captures_per_position - offline_optimum(early.trace, 5729, pins=early.pins,
                                                         reserved=early.in_flight) / early.positions < 0.005
    assert {r.name: r.start_s for r in early.consumers.values()} == {"c0": 0.0, "c1": 0.0, "c2": 0.0}
