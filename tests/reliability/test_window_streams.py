"""A hypothesis state machine of registrations, cursor commits, lease acquire/release, holder death, fencing
(completed / cancelled / failed / expired) and eviction over long position streams: 10k and 100k positions
(reliability lane; the default lane's small-cursor machine is in tests/properties/test_window_properties.py).

Invariants after every eviction pass (retain computed as the producer does it, from the running
registrations' retained positions):

- nothing inside a live window is evicted, and no artifact a live consumer's live holder has leased;
- what stays on disk is inside the union of live windows or leased by a live holder;
- leases of dead holders and of fenced consumers are expired by the pass (unless their artifact is inside a
  live window, where the pass does not look at leases);

and at every step a fenced consumer's worker cannot acquire (``CacheClient.acquire`` raises
``ConsumerFenced`` and leaves no lease). Examples run per stream length go to the lane's summary.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from artcache import journal as J
from artcache import leases, registry, store
from artcache.client import CacheClient
from artcache.contract import CaptureContract
from artcache.errors import ConsumerFenced
from artcache.eviction import evict_pass
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout, host_id
from artcache.registry import ConsumerHandle, Registration
from artcache.settings import RootSettings
from tests.support.reliability_figures import record

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(0,), max_length=4, tokenizer_digest="k", template_digest="m")
SETTINGS = RootSettings(plan_id="0" * 40, contract=C, target_path="/nowhere")
IDS = ("c0", "c1", "c2")
with open("/proc/sys/kernel/pid_max") as _f:
    DEAD_PID = int(_f.read()) + 1000  # above pid_max: never a live process
EXAMPLES = {10_000: 0, 100_000: 0}
STEPS = {10_000: 0, 100_000: 0}


@dataclass
class _Sample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class StreamPlan:
    """``n`` distinct two-token samples (no wrap-around inside the stream)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def order(self, epoch_len: int = 0):
        from artcache.plan import EpochOrder

        return EpochOrder(len(self), epoch_len or len(self), 0)

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> _Sample:
        return _Sample(torch.tensor([i % 50_000, i // 50_000], dtype=torch.int32), torch.ones(2, dtype=torch.uint8))


def make_machine(n: int):
    class StreamMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            EXAMPLES[n] += 1
            self.dir = tempfile.mkdtemp(prefix="artcache-stream-")
            self.layout = CacheLayout(Path(self.dir) / "root")
            self.layout.create()
            self.plan = StreamPlan(n)
            self.fp_of = PlanFingerprints(C, self.plan)
            self.handles: dict[str, ConsumerHandle] = {}
            self.fenced: list[ConsumerHandle] = []
            self.held: dict[str, tuple[str, str, bool]] = {}  # lease name -> (consumer, fp, holder alive)
            self.published: set[str] = set()
            self.journal = J.JournalWriter(self.layout.journal_path("consumer", "sm"))

        def teardown(self) -> None:
            self.journal.close()
            shutil.rmtree(self.dir, ignore_errors=True)

        def publish(self, p: int) -> None:
            s = self.plan.sample(p)
            ts = {"hidden_states": torch.full((2, 1, 1), float(p % 97), dtype=torch.bfloat16),
                  "input_ids": s.input_ids, "loss_mask": s.loss_mask}
            store.publish(self.layout, self.fp_of(p), C, ts, durable=False, verify_tokens=True)
            self.published.add(self.fp_of(p))

        # -- registrations ---------------------------------------------------------------------------
        @rule(cid=st.sampled_from(IDS), lookbehind=st.integers(0, 4), lookahead=st.integers(1, 16),
              cursor=st.integers(0, n - 1))
        def register(self, cid, lookbehind, lookahead, cursor):
            STEPS[n] += 1
            old = self.handles.pop(cid, None)
            reg = registry.register(self.layout, Registration(
                consumer_id=cid, draft="d", cursor=cursor, lookbehind=lookbehind, lookahead=lookahead,
                end=n, pid=os.getpid()))
            if old is not None:
                self.fenced.append(old)
            self.handles[cid] = ConsumerHandle(self.layout, reg)

        @precondition(lambda self: self.handles)
        @rule(data=st.data(), step=st.sampled_from([0, 1, 2, 5, 17, n // 100, n // 10]))
        def commit(self, data, step):
            STEPS[n] += 1
            cid = data.draw(st.sampled_from(sorted(self.handles)))
            h = self.handles[cid]
            new = min(h.current.cursor + step, n)
            h.commit_cursor(new)
            if new >= n:  # the end of the stream: the consumer completes
                h.finish("completed")
                self.fenced.append(self.handles.pop(cid))

        @precondition(lambda self: self.handles)
        @rule(data=st.data(), state=st.sampled_from(["failed", "expired", "cancelled", "completed"]))
        def fence(self, data, state):
            STEPS[n] += 1
            cid = data.draw(st.sampled_from(sorted(self.handles)))
            h = self.handles.pop(cid)
            if state == "completed":
                assert h.finish("completed").state == "completed"
            else:
                assert registry.fence(self.layout, cid, state, "test") is not None
            self.fenced.append(h)

        # -- producer and leases -------------------------------------------------------------------------
        @precondition(lambda self: self.handles)
        @rule(data=st.data())
        def produce(self, data):
            STEPS[n] += 1
            cid = data.draw(st.sampled_from(sorted(self.handles)))
            lo, hi = self.handles[cid].current.window()
            if hi >= lo:
                self.publish(data.draw(st.integers(lo, hi)))

        @precondition(lambda self: self.handles)
        @rule(data=st.data(), alive=st.booleans())
        def acquire(self, data, alive):
            """A live holder (this process) or one that died holding it (a lease file with a dead pid)."""
            STEPS[n] += 1
            cid = data.draw(st.sampled_from(sorted(self.handles)))
            lo, hi = self.handles[cid].current.readable()
            if hi < lo:
                return
            fp = self.fp_of(data.draw(st.integers(lo, hi)))
            if alive:
                name = leases.acquire(self.layout, fp, cid)
            else:
                name = f"{fp}~{cid}~{host_id()}-{DEAD_PID}-0~{os.urandom(4).hex()}"
                (self.layout.leases / name).touch()
            self.held[name] = (cid, fp, alive)

        @precondition(lambda self: any(alive for _, _, alive in self.held.values()))
        @rule(data=st.data())
        def release(self, data):
            STEPS[n] += 1
            name = data.draw(st.sampled_from(sorted(k for k, v in self.held.items() if v[2])))
            del self.held[name]
            assert leases.release(self.layout, name) is True

        @precondition(lambda self: self.fenced and self.published)
        @rule(data=st.data())
        def fenced_worker_acquires(self, data):
            STEPS[n] += 1
            h = data.draw(st.sampled_from(self.fenced))
            fp = data.draw(st.sampled_from(sorted(self.published)))
            client = CacheClient(self.layout, SETTINGS, self.plan, h, self.journal, demand_timeout_s=5)
            before = set(os.listdir(self.layout.leases))
            with pytest.raises(ConsumerFenced):
                client.acquire(self._position_of(fp))
            assert set(os.listdir(self.layout.leases)) == before

        def _position_of(self, fp: str) -> int:
            """The position of a published fingerprint (every published one went through ``fp_of``)."""
            for p, f in self.fp_of._cache.items():
                if f == fp:
                    return p
            raise AssertionError(fp)

        # -- eviction ----------------------------------------------------------------------------------------
        @rule()
        def evict(self):
            STEPS[n] += 1
            regs = [r for r in registry.read_all(self.layout) if r.state == "running"]
            live_ids = {r.consumer_id for r in regs}
            assert live_ids == set(self.handles)
            retain = {self.fp_of(p) for r in regs for p in r.retained_positions()}
            before = set(store.list_objects(self.layout))
            assert before == self.published
            live_leased = {fp for cid, fp, alive in self.held.values() if alive and cid in live_ids}
            res = evict_pass(self.layout, before - retain, live_ids)  # retention: the fingerprints to evict
            after = set(store.list_objects(self.layout))
            evicted = before - after
            assert set(res.evicted) == evicted
            assert not evicted & retain, "evicted inside a live window"
            assert not evicted & live_leased, "evicted what a live holder leased"
            assert after <= retain | live_leased
            # Since retention by need evict_pass expires every dead lease (expire_leases), also
            # one on a fingerprint inside a live window; the old pass skipped leases on retained ones.
            dead = {name for name, (cid, fp, alive) in self.held.items() if not alive or cid not in live_ids}
            assert {lease.name for lease, _ in res.expired_leases} == dead
            for lease, reason in res.expired_leases:
                cid, fp, alive = self.held[lease.name]
                assert reason == ("holder-dead" if not alive else "consumer-fenced"), (reason, alive, cid)
            for name in dead:
                del self.held[name]
            self.published = after

        @invariant()
        def disk_matches_model(self):
            assert set(os.listdir(self.layout.leases)) == set(self.held)
            for cid, h in self.handles.items():
                r = registry.read(self.layout, cid)
                assert r.state == "running" and r.generation == h.generation

    StreamMachine.__name__ = f"StreamMachine{n}"
    return StreamMachine


@pytest.mark.parametrize("n", [10_000, 100_000])
def test_window_lease_eviction_model_on_long_streams(n):
    machine = make_machine(n)
    case = machine.TestCase
    case.settings = settings(max_examples=40, stateful_step_count=35, deadline=None, database=None,
                             suppress_health_check=list(HealthCheck))
    runner = case("runTest")
    runner.runTest()
    assert EXAMPLES[n] >= 40
    record("hypothesis", f"{n:,}-position stream", examples=EXAMPLES[n], steps=STEPS[n])
