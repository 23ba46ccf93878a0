"""The capture queue (artcache.eviction.decide, no budget) and the scheduler: demand before prefetch,
interleaving by need (distance / rate: equal rates here), dedup, limits, batch packing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from artcache.errors import ConfigError
from artcache.eviction import Reader, decide
from artcache.plan import EpochOrder
from artcache.registry import Registration
from artcache.scheduler import SchedulerLimits, Want, next_batch, window_bound


def fp_of(p: int) -> str:
    return f"{p:040x}"


def wanted(regs, published: set[str], max_queue: int, plan_len: int = 20_000, rates=None) -> list[Want]:
    """The capture queue :func:`decide` gives for ``regs`` over a plan of ``plan_len`` distinct samples with
    ``published`` published, no budget; every consumer reads at rate 1 unless ``rates`` says otherwise."""
    sizes = np.zeros(plan_len, dtype=np.int64)
    for fp in published:
        sizes[int(fp, 16)] = 1
    order = EpochOrder(plan_len, plan_len, 0)
    readers = [Reader.of(r, order, (rates or {}).get(r.consumer_id, 1.0)) for r in regs]
    return decide(readers, sizes=sizes, budget=math.inf, est_size=1, fp_of=fp_of, max_queue=max_queue).capture


def pos(w: Want) -> int:
    return int(w.fp, 16)


def reg(cid: str, cursor: int, lookahead: int, lookbehind: int = 0, demand=()) -> Registration:
    return Registration(consumer_id=cid, draft="d", cursor=cursor, lookahead=lookahead, lookbehind=lookbehind,
                        demand=list(demand))


def test_demand_before_prefetch():
    regs = [reg("a", 10, 5, demand=[14, 12]), reg("b", 100, 3, demand=[101])]
    q = wanted(regs, set(), 100)
    demand = [w for w in q if w.demand]
    assert {pos(w) for w in demand} == {12, 14, 101}
    # every demand entry precedes every prefetch entry
    first_prefetch = next(i for i, w in enumerate(q) if not w.demand)
    assert all(w.demand for w in q[:first_prefetch]) and not any(w.demand for w in q[first_prefetch:])
    assert first_prefetch == 3
    # demand sorted by distance from its cursor: 101 (1), 12 (2), 14 (4)
    assert [pos(w) for w in demand] == [101, 12, 14]
    # a demand position is not queued a second time as prefetch
    assert len({w.fp for w in q}) == len(q)


def test_demand_outside_window_ignored():
    regs = [reg("a", 10, 5, demand=[9, 16, 3])]
    q = wanted(regs, set(), 100)
    assert not any(w.demand for w in q)
    assert [pos(w) for w in q] == list(range(10, 16))


def test_prefetch_interleaves_consumers_by_distance():
    regs = [reg("a", 0, 3), reg("b", 100, 3), reg("c", 200, 1)]
    q = wanted(regs, set(), 100)
    assert [pos(w) for w in q] == [0, 100, 200, 1, 101, 201, 2, 102, 3, 103]
    assert all(w.priority == (1, pos(w) % 100) for w in q)
    assert all(w.positions == {pos(w)} for w in q)


def test_published_skipped():
    regs = [reg("a", 0, 5, demand=[2])]
    published = {fp_of(p) for p in (0, 2, 3)}
    q = wanted(regs, published, 100)
    assert [pos(w) for w in q] == [1, 4, 5]
    assert not any(w.demand for w in q)


def test_everything_published_gives_empty_queue():
    regs = [reg("a", 0, 5), reg("b", 3, 5)]
    assert wanted(regs, {fp_of(p) for p in range(9)}, 100) == []
    assert wanted([], set(), 100) == []


def test_duplicates_across_consumers_merge():
    regs = [reg("a", 0, 4), reg("b", 2, 4, demand=[3])]
    q = wanted(regs, set(), 100)
    assert len({w.fp for w in q}) == len(q)
    by = {pos(w): w for w in q}
    assert set(by) == set(range(0, 7))
    assert by[3].consumers == {"a", "b"} and by[3].demand and by[3].priority == (0, 1)
    assert by[2].consumers == {"a", "b"} and by[2].priority == (1, 0)  # b's distance 0 wins over a's 2
    assert by[0].consumers == {"a"} and by[6].consumers == {"b"}
    assert q[0] is by[3]


def test_merge_keeps_best_priority_and_all_positions():
    # a plan of 10 samples walked past its end: positions 10.. read epoch 1, reshuffled; a sample read at two
    # positions (by two consumers) is one entry holding both positions, with the better priority
    order = EpochOrder(10, 10, 0)
    regs = [reg("a", 8, 4)]  # positions 8..12: samples 8, 9 and the first three of epoch 1
    q = wanted(regs, set(), 100, plan_len=10)
    assert sorted(w.sample for w in q) == sorted({8, 9, *order.samples(10, 13).tolist()})
    b_pos = int(np.flatnonzero(order.samples(10, 20) == 0)[0]) + 10  # where epoch 1 reads sample 0
    regs = [reg("a", 0, 2), reg("b", b_pos, 2)]
    q = wanted(regs, set(), 100, plan_len=10)
    by = {w.sample: w for w in q}
    assert by[0].positions == {0, b_pos} and by[0].consumers == {"a", "b"}
    assert by[0].priority == (1, 0)
    assert len({w.fp for w in q}) == len(q)


def test_need_order_follows_rates():
    """The queue interleaves consumers by need time (distance / rate), not by distance: a consumer three
    times as fast gets three positions for each of the slow one's."""
    regs = [reg("fast", 0, 8), reg("slow", 100, 8)]
    q = wanted(regs, set(), 100, rates={"fast": 3.0, "slow": 1.0})
    assert [w.sample for w in q][:8] == [0, 100, 1, 2, 3, 101, 4, 5]
    assert q[2].priority == (1, pytest.approx(1 / 3))


@pytest.mark.parametrize("max_queue", [1, 2, 5, 7, 1000])
def test_max_queue_honoured(max_queue):
    regs = [reg("a", 0, 50, demand=[3, 7]), reg("b", 1000, 50)]
    q = wanted(regs, set(), max_queue)
    assert len(q) == min(max_queue, 102)
    # the highest-priority entries are the ones kept
    full = wanted(regs, set(), 10_000)
    assert [w.fp for w in q] == [w.fp for w in full[:max_queue]]


def test_max_queue_keeps_demand_even_when_prefetch_is_huge():
    regs = [reg("a", 0, 10_000, demand=[9_999])]
    q = wanted(regs, set(), 3)
    assert [pos(w) for w in q] == [9_999, 0, 1]


# ---- next_batch ----------------------------------------------------------------------------------
def mk_queue(n: int) -> list[Want]:
    return [Want(fp_of(p), p, (1, p)) for p in range(n)]


def test_next_batch_sample_limit():
    q = mk_queue(20)
    b = next_batch(q, lambda p: 10, SchedulerLimits(max_batch_samples=8, max_batch_tokens=10_000))
    assert b == q[:8]


def test_next_batch_padded_token_limit():
    lengths = {0: 100, 1: 50, 2: 300, 3: 10, 4: 10}
    q = mk_queue(5)
    lim = SchedulerLimits(max_batch_samples=8, max_batch_tokens=600)
    # 100, 100*2=200, then 300*3=900 > 600: stop (strict priority order, no skipping)
    assert next_batch(q, lengths.__getitem__, lim) == q[:2]
    lim = SchedulerLimits(max_batch_samples=8, max_batch_tokens=900)
    assert next_batch(q, lengths.__getitem__, lim) == q[:3]
    lim = SchedulerLimits(max_batch_samples=8, max_batch_tokens=1500)
    assert next_batch(q, lengths.__getitem__, lim) == q[:5]  # 300*5 = 1500 fits exactly


def test_next_batch_padded_tokens_never_exceeded():
    import random

    rnd = random.Random(0)
    for _ in range(200):
        n = rnd.randint(1, 30)
        lengths = [rnd.randint(1, 64) for _ in range(n)]
        lim = SchedulerLimits(max_batch_samples=rnd.randint(1, 10), max_batch_tokens=rnd.randint(64, 400))
        q = mk_queue(n)
        b = next_batch(q, lengths.__getitem__, lim)
        assert b == q[:len(b)] and len(b) >= 1
        assert len(b) <= lim.max_batch_samples
        assert max(lengths[w.sample] for w in b) * len(b) <= lim.max_batch_tokens
        if len(b) < n:  # could not take one more
            more = b + [q[len(b)]]
            assert (len(more) > lim.max_batch_samples
                    or max(lengths[w.sample] for w in more) * len(more) > lim.max_batch_tokens)


def test_next_batch_always_takes_first():
    q = mk_queue(3)
    lim = SchedulerLimits(max_batch_samples=1, max_batch_tokens=1)
    assert next_batch(q, lambda p: 5000, lim) == q[:1]


def test_next_batch_empty_queue():
    assert next_batch([], lambda p: 1, SchedulerLimits()) == []


# ---- limits --------------------------------------------------------------------------------------
def test_limits_validate():
    SchedulerLimits(max_batch_tokens=512).validate(512)
    with pytest.raises(ConfigError, match=r"^max_batch_tokens 511 is invalid: accepted an integer >= 512, the plan's"):
        SchedulerLimits(max_batch_tokens=511).validate(512)
    for field in ("max_queue", "max_batch_samples", "max_batch_tokens"):
        with pytest.raises(ConfigError, match=rf"^{field} 0 is invalid: accepted an integer >= 1$"):
            SchedulerLimits(**{field: 0}).validate(1)


def test_regression_limits_ranges_are_declared_and_named_the_callers_way():
    """Issue 19: SchedulerLimits.validate kept its own hand check and message form (``--batch-samples 0
    (max_batch_samples) is not accepted: an integer >= 1``). The ranges are declared on the fields now, and the
    caller names them: the producer by its flag, a run config by its capture.* path."""
    import msgspec.inspect as mi

    assert all(f.type.ge == (0 if f.name == "prefill_chunk" else 1) for f in mi.type_info(SchedulerLimits).fields)
    with pytest.raises(ConfigError, match=r"^--batch-samples 0 is invalid: accepted an integer >= 1$"):
        SchedulerLimits(max_batch_samples=0).validate(1, {"max_batch_samples": "--batch-samples"}.get)
    with pytest.raises(ConfigError, match=r"^capture\.batch_tokens 8 is invalid: accepted an integer >= 16"):
        SchedulerLimits(max_batch_tokens=8).validate(16, lambda f: "capture." + f.removeprefix("max_"))


def test_window_bound():
    regs = [reg("a", 10, 3, lookbehind=2), reg("b", 12, 2, lookbehind=5), reg("c", 1, 1, lookbehind=5)]
    assert window_bound(regs, None) == 6 + 8 + 7
    assert window_bound(regs, 100) == 6 + 8 + 7 and window_bound(regs, 20) == 20  # at most the plan's samples
    assert window_bound([], 10) == 0


# ---- pinned (held-out evaluation) ranges -----------------------------------------------------------
def test_pinned_range_retained_prefetched_last_and_demandable():
    a = Registration(consumer_id="a", draft="d", cursor=0, lookahead=3, end=8, pinned=(30, 33), demand=[31, 40])
    b = reg("b", 5, 2)
    q = wanted([a, b], set(), 100)
    # demand for a pinned position is served first; one outside window and pinned range (40) is ignored
    assert pos(q[0]) == 31 and q[0].demand and 40 not in {pos(w) for w in q}
    # pinned positions come after every window position of every consumer
    order = [pos(w) for w in q]
    assert order[1:] == [0, 5, 1, 6, 2, 7, 3, 30, 32]
    assert [w.priority[0] for w in q[-2:]] == [2, 2]
    assert window_bound([a, b], None) == (4 + 3) + 3
    # a published pinned position is not wanted; the queue limit counts pinned ones too
    assert 30 not in {pos(w) for w in wanted([a], {fp_of(30)}, 100)}
    assert len(wanted([a, b], set(), 8)) == 8


def test_empty_pinned_range_changes_nothing():
    r = reg("a", 10, 3, lookbehind=2)
    assert r.pinned_range() == range(0) and r.retain_bound() == r.window_size()
    assert r.retained_positions() == set(range(8, 14))
    assert r.may_read(13) and not r.may_read(14) and not r.may_read(9)
