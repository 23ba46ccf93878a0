"""The producer's retention loop (issue 21) with the real Producer, registry, store and journal on a fake
backend: the disk budget is never exceeded while windows fit it, evictions are journaled with their
reasons, an evicted position a consumer reads again is recaptured on its demand (counted), the final
pass keeps what fits (the root persists), the default budget comes from the free space, and ``--fill``
captures the whole plan once and exits."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import pytest
import torch

from artcache import journal as J
from artcache import registry, store
from artcache.accounting import account
from artcache.contract import CaptureContract
from artcache.fsio import space_reserve
from artcache.layout import CacheLayout
from artcache.producer import BUDGET_FREE_FRACTION, Producer, ProducerConfig, default_budget
from artcache.scheduler import SchedulerLimits
from artcache.settings import RootSettings, init_settings

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(1,), max_length=64, tokenizer_digest="t", template_digest="t")
HIDDEN = 8
T = 8  # tokens per sample


@dataclass
class Sample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class Plan:
    """``n`` distinct samples of ``T`` tokens."""

    plan_id = "0" * 40

    def __init__(self, n: int) -> None:
        self.n = n

    def order(self, epoch_len: int = 0):
        from artcache.plan import EpochOrder

        return EpochOrder(self.n, epoch_len or self.n, 0)

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> Sample:
        return Sample(torch.arange(T, dtype=torch.int32) + 1000 * i, torch.ones(T, dtype=torch.uint8))


class Backend:
    def __init__(self) -> None:
        self.captured: list[int] = []

    def capture(self, samples):
        self.captured += [int(s.input_ids[0]) // 1000 for s in samples]
        return [{"hidden_states": torch.full((T, 1, HIDDEN), float(s.input_ids[0]), dtype=torch.bfloat16),
                 "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]


@pytest.fixture
def root(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    init_settings(layout, RootSettings(plan_id="0" * 40, contract=C, target_path="/nowhere"))
    return layout


def make(layout, n, **cfg) -> tuple[Producer, Backend, J.JournalWriter]:
    backend = Backend()
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    settings = RootSettings(plan_id="0" * 40, contract=C, target_path="/nowhere")
    cfg = ProducerConfig(cache=str(layout.root), limits=SchedulerLimits(max_batch_samples=4, max_batch_tokens=64),
                         max_length=64, **cfg)
    return Producer(layout, settings, Plan(n), backend, cfg, journal, hidden_size=HIDDEN), backend, journal


def artifact_bytes(layout) -> int:
    return max(store.list_objects(layout).values())


def register(layout, cid, cursor=0, lookahead=4, end=-1, lookbehind=0):
    return registry.ConsumerHandle(layout, registry.register(layout, registry.Registration(
        consumer_id=cid, draft="d", cursor=cursor, lookahead=lookahead, lookbehind=lookbehind, end=end,
        pid=os.getpid(), batch_size=1)))


def settle(producer: Producer, ticks: int = 200) -> None:
    """Tick until a pass finds nothing to capture (waiting for the publisher thread after each batch)."""
    for _ in range(ticks):
        worked = producer.tick()
        deadline = time.monotonic() + 30
        while (producer._inflight or not producer._publish_queue.empty()) and time.monotonic() < deadline:
            time.sleep(0.002)
        if not worked:
            break


def test_budget_is_never_exceeded_and_evictions_say_why(root):
    probe, _, j = make(root, 40)  # learn one artifact's size
    h = register(root, "probe", lookahead=0, end=1)
    settle(probe)
    probe.drain()
    j.close()
    size = artifact_bytes(root)
    h.finish("completed")
    store.remove(root, next(iter(store.list_objects(root))))
    shutil.rmtree(root.journal)
    root.journal.mkdir()

    budget = 12 * size
    producer, backend, journal = make(root, 40, disk_budget=budget)
    fast = register(root, "fast", lookahead=3, end=40)
    slow = register(root, "slow", lookahead=3, end=40)
    try:
        for step in range(40):
            settle(producer)
            on_disk = sum(store.list_objects(root).values())
            assert on_disk <= budget, f"step {step}: {on_disk} > {budget}"
            fast.commit_cursor(min(40, fast.current.cursor + 1))
            if step % 3 == 0:
                slow.commit_cursor(slow.current.cursor + 1)
        # the slow one (at 14 of 40) needs what the fast one passed: with room for 12, some of it went
        assert producer.stats.evictions_by_reason.get("needed-later", 0) > 0
        assert producer.stats.binding_passes > 0
        # the slow consumer now reads on: its evicted positions are recaptured on its demand, and counted
        for _ in range(26):
            settle(producer)
            slow.commit_cursor(slow.current.cursor + 1)
            assert sum(store.list_objects(root).values()) <= budget
    finally:
        producer.drain()
        journal.close()
    assert producer.stats.recaptures > 0
    assert sorted(set(backend.captured)) == list(range(40))
    evs = J.read_events(root.journal).events
    reasons = {e.reason for e in evs if isinstance(e, J.Evict)}
    assert reasons <= {"needed-later", "unneeded"} and "needed-later" in reasons
    acc = account(root)  # (ProducerStart, with the budget, is journaled by Producer.run: not called here)
    assert acc.violations == [] and acc.cache.budget_binding
    assert acc.cache.max_retained_bytes <= budget and acc.cache.recaptures == producer.stats.recaptures
    assert acc.cache.evictions_by_reason == producer.stats.evictions_by_reason


def test_final_pass_keeps_what_fits_and_a_later_run_captures_nothing(root):
    producer, backend, journal = make(root, 10)
    h = register(root, "a", lookahead=9, end=10)
    try:
        settle(producer)
        h.commit_cursor(10)
        h.finish("completed")
        producer.stop_event.set()
        producer.run()  # the stop path: drain, final pass
    finally:
        journal.close()
    assert len(store.list_objects(root)) == 10  # nothing needed any more, all of it fits: kept
    again, backend2, journal2 = make(root, 10)
    h2 = register(root, "b", lookahead=9, end=10)
    try:
        settle(again)
    finally:
        again.drain()
        journal2.close()
    assert backend2.captured == [] and h2.current.cursor == 0


def test_default_budget_comes_from_the_free_space(root):
    producer, _, journal = make(root, 4)
    journal.close()
    usage = shutil.disk_usage(root.objects)
    expect = int(BUDGET_FREE_FRACTION * max(0, usage.free - space_reserve(usage.total)))
    assert abs(producer.budget - expect) < 64 << 20  # the free space moves a little meanwhile
    assert "default" in producer.budget_note and "GiB free" in producer.budget_note
    budget, how = default_budget(root, retained=3 << 30)
    assert abs(budget - (3 << 30) - expect) < 64 << 20 and "3.00 GiB retained" in how


def test_regression_default_budget_uses_the_publication_reserve_on_a_small_filesystem(root, monkeypatch):
    """Break test item 3: the default budget kept a 1 GiB reserve free while publication keeps
    ``space_reserve`` (min(64 MiB, 5 %)), so on a 20 MiB filesystem the default budget was silently 0 and
    ``--retention need`` degraded to windows-only. Now both use the one reserve."""
    usage = shutil._ntuple_diskusage(total=20 << 20, used=1 << 20, free=19 << 20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    budget, how = default_budget(root, retained=0)
    assert budget == int(BUDGET_FREE_FRACTION * ((19 << 20) - space_reserve(20 << 20))) > 16 << 20
    assert f"{space_reserve(20 << 20)} B reserve" in how


def test_fill_captures_the_plan_once_in_plan_order_and_exits(root):
    producer, backend, journal = make(root, 30, fill=True)
    try:
        producer.run()
    finally:
        journal.close()
    assert producer.stats.fill_complete and sorted(backend.captured) == list(range(30))
    assert backend.captured == list(range(30))  # nobody registered: plan order
    stop = [e for e in J.read_events(root.journal).events if isinstance(e, J.ProducerStop)]
    assert stop[-1].reason == "plan filled"
    again, backend2, journal2 = make(root, 30, fill=True)
    try:
        again.run()
    finally:
        journal2.close()
    assert backend2.captured == [] and again.stats.fill_complete


def test_fill_serves_a_consumer_first_and_stops_at_a_budget_too_small(root):
    probe, _, j = make(root, 30, fill=True, disk_budget=1)
    h = register(root, "a", cursor=20, lookahead=2, end=30)
    try:
        probe.run()
    finally:
        j.close()
    # the budget holds less than one artifact: only the consumer's demand-free window is the guarantee, so
    # nothing fits beside it; fill stops and says so
    assert not probe.stats.fill_complete
    stop = [e for e in J.read_events(root.journal).events if isinstance(e, J.ProducerStop)]
    assert stop[-1].reason == "plan does not fit the budget"
    h.finish("completed")
    size_budget = 31 * 400  # comfortably more than 30 tiny artifacts
    producer, backend, journal = make(root, 30, fill=True, disk_budget=size_budget * 10)
    h = register(root, "b", cursor=20, lookahead=2, end=30)
    try:
        producer.run()
    finally:
        journal.close()
    assert producer.stats.fill_complete
    assert backend.captured[:3] == [20, 21, 22]  # what the live consumer reads first, then the plan
    assert sorted(backend.captured) == list(range(30))


def test_fill_on_a_filled_root_loads_no_target_and_captures_nothing(tmp_path, monkeypatch):
    """``run_producer --fill`` end to end on a tiny random target: the first run captures the whole plan;
    a second on the same root (same contract and plan) finds every sample published and returns before
    loading the target (the loader raises if called), journaling no capture."""
    import artcache.target
    from artcache.producer import run_producer

    cfg = ProducerConfig(cache=str(tmp_path / "root"), target="random:tiny-llama", dataset="synthetic",
                         max_samples=6, max_length=32, draft_layers=3, fill=True, poll_interval_s=0.0)
    assert run_producer(cfg).fill_complete
    layout = CacheLayout(tmp_path / "root")
    first = account(layout).cache
    assert first.captures == 6 and first.retained_artifacts == 6

    def no_target(*a, **k):
        raise AssertionError("a filled root must not load the target")

    monkeypatch.setattr(artcache.target, "load_target_model", no_target)
    assert run_producer(cfg).fill_complete
    assert account(layout).cache.captures == 6
