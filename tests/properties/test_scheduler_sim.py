"""Issues 4 and 21 in numbers: a deterministic discrete-event simulation (bench/sim.py) of one producer and N
consumers over the real retention policy (eviction.decide / RateEstimator, scheduler.next_batch, EpochOrder).

Each consumer advances at its own rate; producer work is shared where windows overlap; under the windows
rule (``policy="windows"``, the rule before retention by need) retained artifacts and the producer's queue
stay bounded by the windows however long the run and a lagging consumer is served by recapture without
slowing the others; demand is captured before prefetch; a consumer killed mid-run is fenced within its
lease time (the heartbeat timeout) and its window stops counting. Retention by need: see
test_retention_sim.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from artcache.bench.sim import (
    ConsumerSpec,
    ProducerSpec,
    SimDeadlock,
    default_producer,
    diverge_consumers,
    diverge_producer,
    killed_consumer,
    lagging_consumer,
    main,
    overlap_consumers,
    saturated_consumers,
    saturated_producer,
    simulate,
    solo_rates,
)
from artcache.errors import ConfigError
from artcache.scheduler import SchedulerLimits, check_deadlock

N = 10_000


def windows(prod):
    """The same producer under the windows-only rule."""
    return replace(prod, policy="windows")


@pytest.fixture(scope="module")
def overlap():
    return simulate(overlap_consumers(), windows(default_producer()), N)


@pytest.fixture(scope="module")
def lagging():
    return simulate([*overlap_consumers(), lagging_consumer()], windows(default_producer()), N)


def test_every_consumer_completes_at_its_own_rate(overlap):
    specs = {c.name: c for c in overlap_consumers()}
    rates = {name: r.rate for name, r in overlap.consumers.items()}
    # three different speeds, each within 1 % of its compute-bound rate: nobody walks at another's pace
    assert rates["fast"] > rates["mid"] > rates["slow"]
    for name, r in overlap.consumers.items():
        assert r.finish_s is not None and r.positions == N
        assert r.rate == pytest.approx(specs[name].compute_rate, rel=0.01)


def test_a_captures_per_distinct_position(overlap):
    assert overlap.positions == N
    assert overlap.captures_per_position <= 1.05
    assert overlap.distinct_fps_captured == N
    assert overlap.recaptures == 0


def test_b_fastest_rate_matches_solo_with_spare_capacity(overlap):
    prod = default_producer()
    fast = max(overlap_consumers(), key=lambda c: c.compute_rate)
    # the producer has spare capacity: more samples/s than the fastest consumer needs, and idle time
    assert prod.capacity > 1.5 * fast.compute_rate
    assert overlap.utilization < 0.8
    solo = solo_rates([fast], windows(prod), N)[fast.name]
    assert overlap.consumers[fast.name].rate == pytest.approx(solo, rel=0.10)
    assert overlap.consumers[fast.name].rate >= 0.99 * solo


def test_c_retained_never_exceeds_window_bound(overlap, lagging):
    for res in (overlap, lagging):
        assert res.window_violations == [] and res.budget_violations == []
        # after every pass's eviction nothing outside the union of the live windows is left
        assert res.max_retained <= res.max_union < res.window_bound_all
        assert all(retained <= union for _, retained, union in res.retained_log)
        assert 0 < res.max_retained <= res.window_bound_all
        assert res.final_retained == 0  # nothing is left once every consumer completed
        assert res.evictions == res.captures


def test_d_queue_and_retained_do_not_grow_with_run_length():
    """80 / 60 / 40 positions/s plus the lagging consumer: their windows part within the first 2,000
    positions, after which the run is in steady state (a run whose windows still overlap retains the
    union, which grows with the gap between cursors until the windows part: bounded all the same)."""
    consumers, prod = diverge_consumers(), windows(diverge_producer())
    short, long = (simulate(consumers, prod, n) for n in (2_000, 10_000))
    assert (short.max_queue, short.max_retained) == (long.max_queue, long.max_retained)
    for res in (short, long):
        assert res.max_queue <= prod.limits.max_queue
        assert res.max_retained <= res.window_bound_all
        assert res.window_violations == []
        # producer work is per position, at most once per consumer whose window is its own
        assert res.captures <= len(consumers) * res.positions
    # the windows part: retained reaches exactly Σ window sizes, and no more
    assert long.max_retained == long.window_bound_all


def test_e_lagging_consumer_recaptures_completes_and_does_not_slow_others(overlap, lagging):
    lag = lagging.consumers["lag"]
    assert lag.finish_s is not None and lag.positions == N  # served: it completes
    assert lag.rate == pytest.approx(lagging_consumer().compute_rate, rel=0.02)
    # it starts 30 s late with a 0:32 window: what it reads was evicted, so it is recaptured, counted
    assert lagging.recaptures >= 0.9 * N
    assert lagging.captures == overlap.captures + lagging.recaptures
    for name, r in overlap.consumers.items():
        assert lagging.consumers[name].rate == pytest.approx(r.rate, rel=0.01), name


def test_g_killed_consumer_fenced_within_lease_time_and_its_window_stops_counting(overlap):
    prod, spec = windows(default_producer()), killed_consumer()
    res = simulate([*overlap_consumers(), spec], prod, N)
    victim = res.consumers["victim"]
    batch_s = prod.fixed_s + prod.per_sample_s * prod.limits.max_batch_samples
    assert victim.finish_s is None and victim.fenced_s is not None and 0 < victim.positions < N
    assert victim.last_heartbeat_s <= spec.killed_s < victim.last_heartbeat_s + spec.heartbeat_s
    # fenced at the first producer pass after its heartbeat timed out: not earlier, and at most one
    # capture batch later (the pass waits for the batch in flight)
    timeout = prod.heartbeat_timeout_s
    assert timeout < victim.fenced_s - victim.last_heartbeat_s <= timeout + batch_s
    assert victim.fenced_s - spec.killed_s <= timeout + batch_s
    # the batch it was reading when it died held leases: the producer expired them
    assert 0 < res.leases_expired <= spec.batch_size
    # its window stops counting: the fencing pass evicts what only its window retained (its window was
    # its own: the others were thousands of positions ahead)
    before = [r for t, r, _ in res.retained_log if t < victim.fenced_s][-1]
    after = [r for t, r, _ in res.retained_log if t >= victim.fenced_s][0]
    assert before - after >= 0.9 * (spec.lookbehind + spec.lookahead + 1)
    assert res.window_violations == [] and res.budget_violations == [] and res.final_retained == 0
    # and the others never noticed: their rates are those of the run without it
    for name, r in overlap.consumers.items():
        assert res.consumers[name].rate == pytest.approx(r.rate, rel=0.01), name


def test_a_live_consumer_is_never_fenced(overlap, lagging):
    for res in (overlap, lagging):
        assert all(r.fenced_s is None and r.finish_s is not None for r in res.consumers.values())
        assert res.leases_expired == 0
    # a heartbeat period longer than the timeout: the producer fences even a live consumer (the setting is
    # wrong, and the simulation shows it)
    slow_beat = [ConsumerSpec("x", 0.1, 8, 0, 64, heartbeat_s=40.0)]
    res = simulate(slow_beat, default_producer(), 4_000)  # 50 s at 80 positions/s: one beat, at 0 s
    assert res.consumers["x"].fenced_s == pytest.approx(30.0, abs=0.1) and res.consumers["x"].finish_s is None


def test_f_demand_before_prefetch():
    prod = windows(saturated_producer())  # the late consumer's positions were evicted: it demands them
    res = simulate(saturated_consumers(), prod, 2_000)
    # the producer is the bottleneck: consumers block often while the greedy lookahead is pending
    assert res.utilization > 0.99
    assert res.demand_with_prefetch_pending >= 100
    # every pass that found a blocked consumer put its demanded position first in the next batch
    assert res.demand_not_first == []
    # so a demanded position waits at most the batch in flight plus the next one
    batch_s = prod.fixed_s + prod.per_sample_s * prod.limits.max_batch_samples
    for r in res.consumers.values():
        assert r.finish_s is not None
        assert r.max_demand_wait_s <= 2 * batch_s + 1e-9


def test_plan_epochs_fingerprints():
    """Positions past the plan walk its later epochs (reshuffled): under the windows rule most of every epoch
    is captured again (it was evicted); retained by need each sample is captured once for all four epochs."""
    cons = [ConsumerSpec("x", 0.1, 8, 64, 128), ConsumerSpec("y", 0.1, 8, 64, 128)]
    res = simulate(cons, windows(default_producer()), 1_000, plan_len=250)
    assert res.distinct_fps_captured == 250 and res.positions == 1_000
    # each epoch re-captures the evicted sample (but for those the reshuffle puts inside a window again)
    assert 600 < res.captures <= 1_000 and res.recaptures == res.captures - 250
    res = simulate(cons, default_producer(), 1_000, plan_len=250)
    assert res.captures == 250 and res.recaptures == 0 and res.captures_per_position == 0.25


# ---- check_deadlock ------------------------------------------------------------------------------
def test_check_deadlock_rejects_lookahead_below_batch():
    lim = SchedulerLimits()
    check_deadlock(lim, batch_size=8, lookahead=8, max_length=512)
    with pytest.raises(ConfigError, match=r"lookahead 4 is smaller than the batch size 8.*>= 8"):
        check_deadlock(lim, batch_size=8, lookahead=4, max_length=512)
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        check_deadlock(SchedulerLimits(max_batch_tokens=256), batch_size=1, lookahead=1, max_length=512)
    with pytest.raises(ConfigError, match="batch size"):
        check_deadlock(lim, batch_size=0, lookahead=4, max_length=512)


def test_rejected_setting_really_deadlocks_in_the_simulation():
    bad = [ConsumerSpec("x", 0.1, batch_size=8, lookbehind=0, lookahead=4)]
    with pytest.raises(ConfigError, match="lookahead"):
        simulate(bad, default_producer(), 100)
    with pytest.raises(SimDeadlock, match="did not finish"):
        simulate(bad, default_producer(), 100, check=False)
    ok = [ConsumerSpec("x", 0.1, batch_size=8, lookbehind=0, lookahead=8)]
    assert simulate(ok, default_producer(), 100).consumers["x"].finish_s is not None


def test_simulation_is_deterministic():
    cons = [*overlap_consumers(), lagging_consumer(start_s=3.0)]
    a, b = (simulate(cons, ProducerSpec().with_budget(600), 1_500) for _ in range(2))
    assert a == b and a.binding


def test_cli_prints_table(capsys):
    assert main(["--scenario", "overlap", "--positions", "500", "--solo"]) == 0
    out = capsys.readouterr().out
    assert "| fast |" in out and "captures per position" in out and "rate / solo" in out
    assert main(["--consumer", "x:0.1:8:0:4", "--positions", "50"]) == 2
    assert "lookahead 4 is smaller" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--scenario", "overlap", "--positions", "0"],
    ["--scenario", "hetero", "--positions", "-3"],
    ["--consumer", "x:0.1:8:0:4", "--positions", "0"],  # the positions error, not the consumer's window advice
])
def test_regression_sim_positions_below_one(argv, capsys):
    """``bench.sim --positions`` below 1 said "epoch_len 0 must be in [1, 0]" (or gave a consumer's window advice):
    it is one line naming the value and the accepted range, exit 2, checked before scenarios and windows."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    value = argv[argv.index("--positions") + 1]
    assert captured.err == f"error: --positions {value} is invalid: accepted an integer >= 1\n"
    assert captured.out == ""


def test_regression_sim_window_advice_names_no_missing_flag(capsys):
    """The simulator's deadlock advice told the user to change ``--window``, a flag the simulator does not have; it
    now names the lookahead and the batch size only, in one line."""
    assert main(["--consumer", "x:0.1:8:0:4", "--positions", "50"]) == 2
    err = capsys.readouterr().err
    assert "lookahead 4 is smaller than the batch size 8" in err and "--window" not in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(("spec", "line"), [
    ("x:0:8:0:64", "STEP_S 0.0 is invalid: accepted finite seconds > 0"),  # was ZeroDivisionError
    ("x:inf:8:0:64", "STEP_S inf is invalid: accepted finite seconds > 0"),  # was OverflowError
    ("x:-1:8:0:64", "STEP_S -1.0 is invalid: accepted finite seconds > 0"),  # was simulated
    ("x:0.1:8:-1:64", "LOOKBEHIND -1 is invalid: accepted an integer >= 0 and <= 16777216"),  # was a deadlock
    ("x:0.1:8:0:64:-3", "START_S -3.0 is invalid: accepted finite seconds >= 0"),
    ("x:0.1:8:0:64:0:0", "END 0 is invalid: accepted an integer >= 1"),  # was a consumer reading nothing
    ("x:0.1:8:0:64:nan", "START_S nan is invalid: accepted finite seconds >= 0"),  # was 'cannot convert ... NaN'
    ("x:0.1:8:0:64:0:1.5", "END '1.5' is not an integer >= 1; expected NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD"),
    (":0.1:8:0:64", "expected NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]] (a non-empty NAME)"),
    ("x:0.1", "expected NAME:STEP_S:BATCH:LOOKBEHIND:LOOKAHEAD[:START_S[:END]]"),  # was argparse's usage too
])
def test_regression_sim_consumer_fields_outside_their_range(spec, line, capsys):
    """A --consumer's fields were not range-checked: STEP_S 0 or inf gave a Python traceback,
    a negative STEP_S or START_S, an END of 0 and an empty NAME were simulated, a negative LOOKBEHIND was
    reported as a deadlock. Each is one line naming the spec, the field, its value and what is accepted
    (bench.sim.CONSUMER_FIELDS), exit 2, nothing printed on stdout."""
    assert main(["--consumer", spec, "--positions", "50"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: --consumer {spec!r}: ") and line in captured.err, captured.err
    assert len(captured.err.splitlines()) == 1 and captured.out == ""


@pytest.mark.parametrize(("flag", "value", "shown", "accepted"), [
    ("--plan-len", "-5", "-5", "an integer >= 1"),  # was "epoch_len -5 must be in [1, -5]"
    ("--plan-len", "0", "0", "an integer >= 1"),  # was the run's length, silently
    ("--fixed-s", "-1", "-1.0", "finite seconds >= 0"), ("--per-sample-s", "nan", "nan", "finite seconds >= 0"),
    ("--sample-tokens", "0", "0", "an integer >= 1"), ("--budget-lead", "-1", "-1.0", "a finite number > 0"),
])
def test_regression_sim_flags_outside_their_range(flag, value, shown, accepted, capsys):
    """--plan-len -5 said "epoch_len -5 must be in [1, -5]" (the message --positions had before its
    fix), a negative latency was simulated. Each flag's range is declared (bench.sim.RANGES): one line."""
    assert main(["--consumer", "x:0.1:8:0:64", "--positions", "50", flag, value]) == 2
    assert capsys.readouterr().err == f"error: {flag} {shown} is invalid: accepted {accepted}\n"
