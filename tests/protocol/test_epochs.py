"""Epochs with a held-out split: the plan's epoch order (artcache.plan.EpochOrder), and a real
consumer that trains several passes over the plan with --eval-samples: the journal shows the held-out samples
never in its training requests, every epoch a reshuffle of the training part (the same for every consumer),
the epoch of each step, and a later epoch reading artifacts the root still holds (0 recaptures)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from artcache import journal as J
from artcache.layout import CacheLayout
from artcache.plan import EpochOrder
from tests.protocol.test_consumer_resume import Proc, consume_args
from tests.support import TINY_SHAREGPT
from tests.support.procs import wait_until

DATA = TINY_SHAREGPT


def test_epoch_0_is_plan_order_and_later_epochs_reshuffle_the_training_part():
    order = EpochOrder(50, 40, seed=3)
    assert order.samples(0, 40).tolist() == list(range(40))
    epochs = [order.samples(40 * e, 40 * (e + 1)) for e in range(1, 4)]
    for ep in epochs:
        assert sorted(ep.tolist()) == list(range(40))  # a permutation of the training part: no held-out sample
    assert len({tuple(ep.tolist()) for ep in epochs}) == 3  # reshuffled every epoch
    assert [order.sample(p) for p in range(40, 80)] == epochs[0].tolist()
    # deterministic: another consumer (or a resume) gets the same order
    assert EpochOrder(50, 40, seed=3).samples(0, 200).tolist() == order.samples(0, 200).tolist()
    assert EpochOrder(50, 40, seed=4).samples(40, 80).tolist() != epochs[0].tolist()
    # a consumer with another split sees the same relative order (the plan-wide permutation, filtered)
    other = EpochOrder(50, 30, seed=3).samples(30, 60).tolist()
    assert other == [s for s in EpochOrder(50, 50, seed=3).samples(50, 100).tolist() if s < 30]
    with pytest.raises(ValueError):
        EpochOrder(50, 51, 0)
    with pytest.raises(IndexError):
        order.sample(-1)


def test_next_positions():
    order = EpochOrder(20, 16, seed=1)
    nxt = order.next_positions(np.arange(20), cursor=10, end=40)
    for s in range(20):
        hits = [p for p in range(10, 40) if order.sample(p) == s]
        assert nxt[s] == (hits[0] if hits else np.inf), s
    assert np.isinf(order.next_positions(np.array([3]), cursor=10, end=16)).all()  # epoch 0 passed it, run ends


def test_plan_records_its_epoch_order(tmp_path, smollm2_tokenizer):
    from artcache.plan import EPOCH_ORDER_VERSION, PlanSpec, build_plan

    plan = build_plan(PlanSpec(dataset=str(DATA), seed=7, max_samples=10, max_length=64), smollm2_tokenizer,
                      target_vocab_size=49152)
    assert plan.provenance["epoch_order"] == {"version": EPOCH_ORDER_VERSION, "seed": 7}
    assert plan.epoch_seed == 7 and plan.order(6).samples(0, 12).tolist()[:6] == list(range(6))
    plan.save(tmp_path)
    from artcache.plan import Plan

    again = Plan.load(tmp_path / plan.plan_id)
    assert again.order(6).samples(0, 30).tolist() == plan.order(6).samples(0, 30).tolist()


EPOCHS, BATCH, EVAL = 3, 2, 4


def test_regression_held_out_split_is_never_trained_on_across_epochs(tmp_path, tiny_target):
    """``--steps 1500 × --batch-size 8 = 12000 positions would train on the held-out split`` — a
    consumer with a held-out split could not train past one pass. Now ``--epochs 3 --eval-samples 4`` walks the
    training part three times (each later epoch reshuffled) and the journal's training requests never hold a
    held-out sample; held-out reads are marked and have no position; each step records its epoch; a later epoch
    reads the artifacts the root still holds (its fingerprint is its sample's): nothing is captured twice."""
    from artcache.plan import Plan
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.settings import load_settings

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=16,
                                max_length=64, layer_ids=[1, 2, 3]))
    layout = CacheLayout(cache)
    plan = Plan.load(layout.plan_dir(load_settings(layout).plan_id))
    n = len(plan)
    train_len = n - EVAL
    args = consume_args(cache, tmp_path, "d", 1, "--draft-layers", "3", "--eval-samples", str(EVAL),
                        "--eval-interval", str(train_len // BATCH))
    i = args.index("--steps")
    del args[i:i + 2]  # --epochs instead
    cons = Proc("d", [*args, "--epochs", str(EPOCHS)], tmp_path)
    procs = [cons]
    try:
        from artcache import registry

        wait_until(lambda: (r := registry.read(layout, "d")) is not None and r.state == "running",
                   "the consumer to register", procs)
        prod = Proc("producer", ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(DATA),
                                 "--max-samples", "16", "--max-length", "64", "--layer-ids", "1,2,3", "--threads", "1",
                                 "--exit-when-done", "--done-grace", "1", "--disk-budget", "auto"], tmp_path)
        procs.append(prod)
        cons.expect(0)
        prod.expect(0)
    finally:
        for p in procs:
            p.kill()

    steps = EPOCHS * train_len // BATCH
    evs = J.read_events(layout.journal).events
    held_out = set(range(train_len, n))
    requests = [e for e in evs if isinstance(e, J.Request) and e.consumer == "d"]
    train = [e for e in requests if not e.held_out]
    assert [e.position for e in train] == list(range(steps * BATCH))
    assert not {e.sample for e in train} & held_out  # the held-out split is never trained on
    order = plan.order(train_len)
    assert [e.sample for e in train] == [order.sample(e.position) for e in train]
    by_epoch = {}
    for e in train:
        by_epoch.setdefault(e.epoch, []).append(e.sample)
    assert sorted(by_epoch) == list(range(EPOCHS)) and by_epoch[0] == list(range(train_len))
    for ep in range(1, EPOCHS):  # every later epoch: the whole training part again, in a new order
        assert sorted(by_epoch[ep][:train_len]) == list(range(train_len)) and by_epoch[ep] != by_epoch[0]
    held = [e for e in requests if e.held_out]
    assert held and all(e.position == -1 and e.sample in held_out for e in held)
    # steps say their epoch (the epoch of their last position)
    st = [e for e in evs if isinstance(e, J.Step) and e.consumer == "d"]
    assert [s.epoch for s in st] == [(s.cursor - 1) // train_len for s in st] and st[-1].epoch == EPOCHS - 1
    # every sample captured once: later epochs read what the (auto) budget kept (retention by need)
    captured = Counter(e.fp for e in evs if isinstance(e, J.Capture))
    assert set(captured.values()) == {1} and len(captured) == n
    summary = json.loads([ln for ln in cons.text().splitlines() if ln.startswith("{")][-1])
    assert summary["epoch"] == EPOCHS - 1 and summary["epoch_len"] == train_len and summary["steps"] == steps
    assert summary["draft"] == "dflash" and summary["batch_size"] == BATCH  # issue 20: results quote both
    from artcache.accounting import account

    acc = account(layout)
    assert acc.violations == [] and acc.cache.distinct_positions_consumed == steps * BATCH
    assert acc.cache.captures_per_consumed_position == pytest.approx(n / (steps * BATCH))
