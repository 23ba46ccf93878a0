"""Window / lease / eviction properties: a hypothesis state machine plus a long deterministic stream.

The model: positions map injectively to fingerprints (a plan walked in plan order); a fake producer
publishes positions inside live windows (tiny tensors, real store.publish); eviction passes evict what
:func:`artcache.eviction.decide` names, as Producer.evict does (registrations in state ``running``;
windows incl. lookbehind), under a drawn disk budget: nothing inside a live window or leased is ever
evicted, and the retained bytes fit the budget unless the windows alone exceed it.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from artcache import leases, registry, store
from artcache.contract import CaptureContract
from artcache.errors import ConsumerFenced
from artcache.eviction import Reader, decide, evict_pass
from artcache.layout import CacheLayout
from artcache.plan import EpochOrder
from artcache.registry import ConsumerHandle, Registration

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(0,), max_length=4, tokenizer_digest="k", template_digest="m")
IDS = ("c0", "c1", "c2")
PLAN = 20_000  # positions (= samples) of the model's plan


def fp_of(p: int) -> str:
    return f"{p:040x}"


def pos_of(fp: str) -> int:
    return int(fp, 16)


def publish(layout: CacheLayout, p: int) -> int:
    ts = {"hidden_states": torch.tensor([[[float(p % 97)]]], dtype=torch.bfloat16),
          "input_ids": torch.tensor([p % 50_000], dtype=torch.int32),
          "loss_mask": torch.ones(1, dtype=torch.uint8)}
    return store.publish(layout, fp_of(p), C, ts, durable=False)


def live_regs(layout: CacheLayout) -> list[Registration]:
    return [r for r in registry.read_all(layout) if r.state == "running"]


def window_set(regs: list[Registration]) -> set[str]:
    """Fingerprints of every position in the union of live windows and pinned (held-out) ranges: what no
    eviction may touch."""
    out = set()
    for r in regs:
        out.update(fp_of(p) for p in r.retained_positions())
    return out


def decision(layout: CacheLayout, regs: list[Registration], budget: float, leased: set[str], policy: str = "need"):
    """The decision Producer.evict takes for ``regs`` over what ``objects/`` holds (every consumer at rate 1)."""
    sizes = np.zeros(PLAN, dtype=np.int64)
    for fp, n in store.list_objects(layout).items():
        sizes[pos_of(fp)] = n
    est = int(sizes.max()) or 200
    order = EpochOrder(PLAN, PLAN, 0)
    readers = [Reader.of(r, order, 1.0) for r in regs]
    return decide(readers, sizes=sizes, budget=budget, est_size=est, leased=[pos_of(fp) for fp in leased],
                  policy=policy)


class WindowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="artcache-sm-")
        self.layout = CacheLayout(Path(self.dir) / "root")
        self.layout.create()
        self.handles: dict[str, ConsumerHandle] = {}  # live handles by consumer id
        self.fenced: list[ConsumerHandle] = []
        self.held: dict[str, tuple[str, str]] = {}  # lease name -> (consumer, fp)
        self.published: set[str] = set()  # model of objects/
        self.evictions = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- registrations -------------------------------------------------------------------------
    @rule(cid=st.sampled_from(IDS), lookbehind=st.integers(0, 3), lookahead=st.integers(0, 6),
          cursor=st.integers(0, 30), pinned=st.sampled_from([(0, 0), (40, 43), (41, 45)]))
    def register(self, cid, lookbehind, lookahead, cursor, pinned):
        old = self.handles.pop(cid, None)
        reg = registry.register(self.layout, Registration(
            consumer_id=cid, draft="d", cursor=cursor, lookbehind=lookbehind, lookahead=lookahead,
            pid=os.getpid(), pinned=pinned))
        if old is not None:
            assert reg.generation == old.generation + 1
            self.fenced.append(old)  # a re-registration fences the previous incarnation
        self.handles[cid] = ConsumerHandle(self.layout, reg)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), step=st.integers(0, 5))
    def commit(self, data, step):
        cid = data.draw(st.sampled_from(sorted(self.handles)))
        h = self.handles[cid]
        new = h.commit_cursor(h.current.cursor + step)
        assert registry.read(self.layout, cid).cursor == new.cursor

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), state=st.sampled_from(["failed", "expired", "cancelled"]))
    def fence(self, data, state):
        cid = data.draw(st.sampled_from(sorted(self.handles)))
        h = self.handles.pop(cid)
        assert registry.fence(self.layout, cid, state, "test") is not None
        self.fenced.append(h)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def finish(self, data):
        cid = data.draw(st.sampled_from(sorted(self.handles)))
        h = self.handles.pop(cid)
        assert h.finish("completed").state == "completed"
        self.fenced.append(h)

    # -- leases --------------------------------------------------------------------------------
    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def acquire(self, data):
        cid = data.draw(st.sampled_from(sorted(self.handles)))
        r = self.handles[cid].current
        readable = [p for p in range(r.cursor, r.cursor + r.lookahead + 1) if r.may_read(p)] + list(r.pinned_range())
        p = data.draw(st.sampled_from(readable)) if readable else r.cursor
        name = leases.acquire(self.layout, fp_of(p), cid)
        self.held[name] = (cid, fp_of(p))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        name = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[name]
        assert leases.release(self.layout, name) is True

    # -- producer ------------------------------------------------------------------------------
    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def produce(self, data):
        cid = data.draw(st.sampled_from(sorted(self.handles)))
        r = self.handles[cid].current
        lo, hi = r.window()
        p = data.draw(st.integers(lo, hi) | st.sampled_from(list(r.pinned_range()) or [lo]))
        publish(self.layout, p)
        self.published.add(fp_of(p))

    @rule(budget=st.sampled_from([math.inf, 0, 2, 6, 12]))
    def evict(self, budget):
        regs = live_regs(self.layout)
        live_ids = {r.consumer_id for r in regs}
        assert live_ids == set(self.handles)
        before_objects = store.list_objects(self.layout)
        before = set(before_objects)
        assert before == self.published
        size = max(before_objects.values(), default=1)
        budget_bytes = budget * size  # in artifacts of this (constant) size
        live_leased = {fp for cid, fp in self.held.values() if cid in live_ids}
        dec = decision(self.layout, regs, budget_bytes, live_leased)
        res = evict_pass(self.layout, [fp_of(i) for i in dec.evict], live_ids)
        after = set(store.list_objects(self.layout))
        evicted = before - after
        self.evictions += len(evicted)
        assert set(res.evicted) == evicted
        assert {fp_of(i) for i in dec.evict} == evicted  # nothing it named was held by a live lease
        # nothing inside a live window is evicted; every live-leased artifact survives
        assert not evicted & window_set(regs)
        assert not evicted & live_leased
        # the retained bytes fit the budget, unless the live windows and leases alone exceed it
        kept = sum(before_objects[fp] for fp in after)
        assert kept <= budget_bytes or dec.windows_exceed_budget
        if dec.windows_exceed_budget:  # then only the guarantee is left
            assert after <= window_set(regs) | live_leased
        if math.isinf(budget):
            assert not evicted  # no budget: nothing goes
        # leases of fenced/finished consumers were expired (their holder pid is alive: reason is the fence)
        dead = {name for name, (cid, fp) in self.held.items() if cid not in live_ids}
        assert {lease.name for lease, _ in res.expired_leases} == dead
        assert all(reason == "consumer-fenced" for _, reason in res.expired_leases)
        for name in dead:
            del self.held[name]
        self.published = after

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def disk_matches_model(self):
        assert set(store.list_objects(self.layout)) == self.published
        assert set(os.listdir(self.layout.leases)) == set(self.held)

    @invariant()
    def fenced_handles_cannot_write(self):
        for h in self.fenced:
            with pytest.raises(ConsumerFenced):
                h.commit_cursor(h.current.cursor + 1)
        # and the live handles' registrations are the ones on disk
        for cid, h in self.handles.items():
            r = registry.read(self.layout, cid)
            assert r.state == "running" and r.generation == h.generation


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


# ---- long stream ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,n_positions", [("windows", 1_000), ("need", 1_000)])
def test_long_stream_retained_bounded(tmp_path, policy, n_positions):
    """3 consumers at different speeds walk the positions; the producer keeps every live lookahead
    published; eviction after every tick. ``windows``: retained artifacts never exceed Σ live window sizes
    (and everything is gone at the end); ``need`` with a budget of 120 artifacts: never above the budget (this
    fake producer publishes every lookahead whatever the budget; eviction alone brings it back under)."""
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    spec = {"fast": (13, 4, 32), "mid": (8, 8, 16), "slow": (5, 0, 24)}  # speed, lookbehind, lookahead
    handles = {}
    for cid, (_, lb, la) in spec.items():
        handles[cid] = ConsumerHandle(layout, registry.register(layout, Registration(
            consumer_id=cid, draft="d", lookbehind=lb, lookahead=la, pid=os.getpid(), end=n_positions)))
    published: set[int] = set()
    captures = 0
    max_retained = max_bytes = 0
    ticks = 0
    size = publish(layout, 0)
    store.remove(layout, fp_of(0))
    budget = 120 * size if policy == "need" else math.inf  # above Σ window sizes (87), below the lead
    while handles:
        ticks += 1
        regs = [h.current for h in handles.values()]
        # producer: publish every unpublished position inside a lookahead (the scheduler's want set)
        for r in regs:
            for p in range(r.cursor, min(r.cursor + r.lookahead, n_positions - 1) + 1):
                if p not in published:
                    publish(layout, p)
                    published.add(p)
                    captures += 1
        if policy == "windows":
            bound = sum(r.window_size() for r in regs)
            assert len(published) <= bound, f"tick {ticks}: {len(published)} published > window bound {bound}"
        # consumers: lease their batch, read it, commit, release
        for cid in list(handles):
            h = handles[cid]
            speed = spec[cid][0]
            batch = range(h.current.cursor, min(h.current.cursor + speed, n_positions))
            names = [leases.acquire(layout, fp_of(p), cid) for p in batch]
            for p in batch:
                assert store.read(layout, fp_of(p), C).input_ids.item() == p % 50_000
            h.commit_cursor(batch.stop)
            for name in names:
                leases.release(layout, name)
            if batch.stop >= n_positions:
                h.finish("completed")
                del handles[cid]
        regs = live_regs(layout)
        dec = decision(layout, regs, budget, set(), policy)
        res = evict_pass(layout, [fp_of(i) for i in dec.evict], {r.consumer_id for r in regs})
        published -= {pos_of(fp) for fp in res.evicted}
        on_disk = store.list_objects(layout)
        assert {pos_of(fp) for fp in on_disk} == published
        if policy == "windows":
            assert len(on_disk) <= sum(r.window_size() for r in regs)
        else:
            assert sum(on_disk.values()) <= budget and not dec.windows_exceed_budget
        max_retained = max(max_retained, len(on_disk))
        max_bytes = max(max_bytes, sum(on_disk.values()))
    assert os.listdir(layout.leases) == []
    bound = sum(lb + la + 1 for _, lb, la in spec.values())
    if policy == "windows":
        assert store.list_objects(layout) == {}
        assert 0 < max_retained <= bound
        # the slow consumer re-needs what the fast ones moved past: recaptures happen, and are bounded
        assert n_positions < captures <= 3 * n_positions
    else:
        assert budget - 2 * size < max_bytes <= budget  # the budget fills, and holds
        assert n_positions < captures <= 3 * n_positions
