"""A consumer that is a torch.distributed group of ranks (``artcache consume --nproc N``, gloo on the CPU), and
gradient accumulation (``--grad-accum K``).

The ``distributed`` lane (``pytest -m distributed``; .ci/run runs it) trains each draft on a tiny random target
whose root holds every position already (no producer): 2 ranks × batch b, 1 rank × batch b with ``--grad-accum 2``
and 1 rank × batch 2b walk the same plan with the same anchors (drawn per position), so their loss curves and
final weights must agree to float rounding. A rank killed with SIGKILL stops its group, which exits nonzero
naming it; ``--resume`` continues from the recorded checkpoint with the losses of an uninterrupted run. The other
tests here (no marker) are the pieces, in the default lane.
"""

from __future__ import annotations

import os

import pytest
import torch

from artcache import registry
from artcache.errors import ConfigError
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer.group import GroupHandle, micro_batches, sums_from_vector, sums_vector
from artcache.trainers.dflash.anchors import position_seed, sample_anchors
from artcache.trainers.draft import DraftBatch, MetricSums

# ---- the pieces (default lane) -----------------------------------------------------------------------------

def test_anchor_draws_depend_on_the_position_not_the_batch():
    """A row's anchors are a function of (seed, run position, its mask): the same in a batch of 4 as in a batch of
    2 of other rows or padded to another length, so ranks splitting a global batch draw what one process draws."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 20, dtype=torch.bool)
    for i, n in enumerate((20, 17, 12, 20)):
        mask[i, 2:n] = True
    whole, ok_whole = sample_anchors(mask, 5, g, positions=(8, 9, 10, 11), seed=3)
    half, ok_half = sample_anchors(mask[2:, :20], 5, g, positions=(10, 11), seed=3)
    padded, ok_padded = sample_anchors(torch.cat((mask[2:], torch.zeros(2, 6, dtype=torch.bool)), 1), 5, g,
                                       positions=(10, 11), seed=3)
    assert torch.equal(whole[2:], half) and torch.equal(ok_whole[2:], ok_half)
    assert torch.equal(half, padded) and torch.equal(ok_half, ok_padded)
    other, _ = sample_anchors(mask[2:], 5, g, positions=(12, 13), seed=3)  # another position: another draw
    assert not torch.equal(other, half)
    assert position_seed(3, 10) != position_seed(4, 10) and position_seed(3, 10) != position_seed(3, 11)
    assert 0 <= position_seed(2**40, 2**40) < 2**63


def test_micro_batches_split_rows_and_cut_padding():
    """``--grad-accum K`` splits a collated batch into K micro-batches of consecutive rows, each cut to its own
    longest sample (what it would have been collated alone)."""
    b, t = 4, 10
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate((6, 4, 10, 3)):
        valid[i, :n] = True
    batch = DraftBatch(torch.randn(b, t, 2, 3), torch.arange(b * t).reshape(b, t), valid.clone(), valid,
                       positions=(4, 5, 6, 7))
    first, second = micro_batches(batch, 2)
    assert first.positions == (4, 5) and second.positions == (6, 7)
    assert first.hidden.shape == (2, 6, 2, 3) and second.hidden.shape == (2, 10, 2, 3)
    assert torch.equal(first.input_ids, batch.input_ids[:2, :6]) and torch.equal(second.valid, valid[2:])
    assert micro_batches(batch, 1) == [batch]


def test_metric_sums_round_trip_through_one_vector():
    s = MetricSums()
    s.add("loss", 3.5, 7)
    s.add("count", 2)
    vec, names = sums_vector(s, torch.device("cpu"))
    back = sums_from_vector(vec * 2, names)  # two ranks' equal sums, all-reduced
    assert back.num == {"count": 4.0, "loss": 7.0} and back.den == {"loss": 14.0}


def test_group_ranks_write_only_their_own_demand(layout):
    """Each rank of a group replaces only its own entries of the registration's demand list: rank 1 waiting for
    position 5 does not erase rank 0's wait for position 1 (one registration, several writers)."""
    reg = registry.register(layout, registry.Registration(consumer_id="g", draft="dflash", lookahead=8,
                                                          pid=os.getpid()))
    r0, r1 = GroupHandle(layout, reg), GroupHandle(layout, reg)
    r0.set_demand([1])
    r1.set_demand([5, 6])
    assert registry.read(layout, "g").demand == [1, 5, 6]
    r1.set_demand([6])
    r0.set_demand([])
    assert registry.read(layout, "g").demand == [6]


def test_regression_eagle3_global_denominator_below_one_is_not_raised_to_one():
    """Bug: a rank of a 2-rank group divides EAGLE-3's TTT-step sums by the global kept count / 2, which is 0.5 when
    one position was kept in the whole global batch; the loss clamped that to 1, halving the step's gradient on
    every rank (a 2-rank group's weights drifted 1e-3 from one process's on the same batches)."""
    from artcache.trainers.eagle3 import eagle3_loss
    from tests.unit.test_fast_consumer import _batch, _eagle3

    draft = _eagle3()
    batch = _batch(3, 18, 4, 3)
    aux, last = batch.hidden[:, :, :3], batch.hidden[:, :, 3]
    own, stats = eagle3_loss(draft.model, aux, last, batch.input_ids, batch.loss_mask, batch.valid)
    kept = stats.kept.double()
    assert bool((kept > 0).all())
    half, _ = eagle3_loss(draft.model, aux, last, batch.input_ids, batch.loss_mask, batch.valid,
                          denominators=kept / (2 * kept))  # every step's denominator 0.5
    expect = sum(draft.model.cfg.loss_decay ** i * float(stats.loss_sum[i]) / 0.5 for i in range(len(kept)))
    assert abs(float(half) - expect) <= 1e-5 * expect and float(half) > float(own)


def test_config_refuses_a_window_smaller_than_the_global_batch(tmp_path):
    """The lookahead must hold one global batch: --nproc × --grad-accum × --batch-size positions."""
    cfg = ConsumerConfig(cache=str(tmp_path), batch_size=4, nproc=2, grad_accum=2, lookahead=8)
    with pytest.raises(ConfigError, match=r"16 positions: --nproc 2 x --grad-accum 2 x --batch-size 4"):
        cfg.validate()
    ConsumerConfig(cache=str(tmp_path), batch_size=4, nproc=2, grad_accum=2, lookahead=16).validate()
    with pytest.raises(ConfigError, match="--reader process and --nproc 2"):
        ConsumerConfig(cache=str(tmp_path), nproc=2, lookahead=16, reader="process").validate()


# ---- the group lane: real processes on gloo ----------------------------------------------------------------


# ---- context parallelism (--cp) ----------------------------------------------------------------------------

def test_cp_composes_with_nproc_and_refuses_what_it_does_not_support(tmp_path):
    """--nproc is the world size (data-parallel ranks × --cp): the global batch counts data-parallel ranks only;
    a --nproc it does not divide, or packing is refused in one line; DSpark and EAGLE-3 take it."""
    cfg = ConsumerConfig(cache=str(tmp_path), batch_size=4, nproc=4, cp=2, lookahead=16)
    cfg.validate()
    ConsumerConfig(cache=str(tmp_path), draft="dspark", batch_size=4, nproc=2, cp=2, lookahead=16).validate()
    ConsumerConfig(cache=str(tmp_path), draft="eagle3", batch_size=4, nproc=2, cp=2, lookahead=16).validate()
    assert cfg.global_batch == 8
    assert ConsumerConfig(cache=str(tmp_path), batch_size=4, nproc=2, cp=2, lookahead=16).global_batch == 4
    for kwargs, match in [({"draft": "eagle3", "pack_tokens": 64}, "--cp 2 and --pack-tokens 64 exclude each other"),
                          ({"draft": "dspark", "pack_tokens": 64}, "--cp 2 and --pack-tokens 64 exclude each other"),
                          ({"nproc": 3}, "--cp 2 does not divide --nproc 3"),
                          ({"nproc": 1}, "--cp 2 does not divide --nproc 1"),
                          ({"pack_tokens": 64}, "--cp 2 and --pack-tokens 64 exclude each other")]:
        with pytest.raises(ConfigError, match=match) as err:
            ConsumerConfig(cache=str(tmp_path), **{"nproc": 2, "cp": 2, "lookahead": 16, **kwargs}).validate()
        assert "\n" not in str(err.value)
