"""Light-weight child processes of the reliability lane: producer / consumer children for the random SIGKILL
trials (tests/reliability/test_crash_trials.py) and racing workers for tests/reliability/test_concurrency.py.

They run the real protocol code (``Producer.tick`` with its publisher thread, ``store.publish``, eviction,
``CacheClient.acquire`` with leases, ``ConsumerHandle.commit_cursor``) on a tiny fake plan with a fake capture
backend (deterministic tensors per sample), so one child lives for tens of milliseconds instead of the seconds
a real target takes to load. They are started from a ``forkserver`` that preloads this module (artcache and
torch are imported once). A child arms ``ARTCACHE_CRASH_AT`` semantics with :func:`artcache.crashpoints.reload`,
writes what it did to ``<root>/../trial-logs/<name>.log`` (one line per event, flushed) and exits 0, or dies.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from artcache import crashpoints, registry
from artcache import journal as J
from artcache.client import CacheClient
from artcache.contract import CaptureContract
from artcache.crashpoints import crash_point
from artcache.layout import CacheLayout, host_id
from artcache.producer import Producer, ProducerConfig
from artcache.scheduler import SchedulerLimits
from artcache.settings import RootSettings

CONTRACT = CaptureContract(target_name="fake", target_revision="r1", target_config_hash="cfg",
                           target_weights_digest="w1", layer_ids=(1, 3), max_length=32, tokenizer_digest="tok",
                           template_digest="tpl")
N_SAMPLES = 40
HIDDEN = 16
CONSUMER = "c"  #: the mini consumer's id
MOVER = "w"  #: a registration the test process owns and moves to make the producer capture and evict
BATCH = 2  #: positions per consumer step
CONSUMER_LOOKAHEAD = 4


@dataclass
class Sample:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor


class FakePlan:
    """``N_SAMPLES`` samples of 6–13 tokens with distinct ids (sample i starts at id 100·i)."""

    plan_id = "0" * 40

    def order(self, epoch_len: int = 0):
        from artcache.plan import EpochOrder

        return EpochOrder(len(self), epoch_len or len(self), 0)

    def __len__(self) -> int:
        return N_SAMPLES

    def sample(self, i: int) -> Sample:
        t = 6 + (i * 7) % 8
        ids = torch.arange(t, dtype=torch.int32) + 100 * i
        mask = torch.ones(t, dtype=torch.uint8)
        mask[:2] = 0
        return Sample(ids, mask)


def fake_capture(s: Sample) -> dict[str, torch.Tensor]:
    """What a frozen target would give for ``s``: a deterministic function of its token ids."""
    g = torch.Generator().manual_seed(int(s.input_ids[0]) * 31 + len(s.input_ids))
    return {"hidden_states": torch.randn(len(s.input_ids), len(CONTRACT.layer_ids), HIDDEN,
                                         generator=g).to(torch.bfloat16),
            "input_ids": s.input_ids.to(torch.int32), "loss_mask": s.loss_mask.to(torch.uint8)}


class FakeBackend:
    def capture(self, samples):
        return [fake_capture(s) for s in samples]


def settings() -> RootSettings:
    return RootSettings(plan_id=FakePlan.plan_id, contract=CONTRACT, target_path="/nowhere",
                        heartbeat_timeout_s=1e9)


class _Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def _run(fn, root: str, log_path: str, crash_at: str, **kw) -> None:
    """Child entry: arm the crash point, run ``fn``, exit 0 (or 1 with the traceback in the log)."""
    log = _Log(log_path)
    try:
        crashpoints.reload(crash_at or "")
        log(f"pid {os.getpid()} host {host_id()}")
        fn(CacheLayout(Path(root)), log, **kw)
        log("done")
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reads the log
        log("error " + traceback.format_exc().replace("\n", " | "))
        code = 1
    os._exit(code)


def producer_main(root: str, log_path: str, crash_at: str, ticks: int = 40) -> None:
    _run(_producer, root, log_path, crash_at, ticks=ticks)


def consumer_main(root: str, log_path: str, crash_at: str, steps: int = 4) -> None:
    _run(_consumer, root, log_path, crash_at, steps=steps)


def _producer(layout: CacheLayout, log, ticks: int) -> None:
    # the windows rule (as main's window-rule tests): the trials check retained <= the live windows' bound
    cfg = ProducerConfig(cache=str(layout.root), heartbeat_timeout_s=1e9, poll_interval_s=0.0, retention="windows",
                         limits=SchedulerLimits(max_queue=64, max_batch_samples=2, max_batch_tokens=64))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, settings(), FakePlan(), FakeBackend(), cfg, journal)
    # as Producer.run journals it (accounting checks the window bound only under the windows rule)
    producer._emit(J.ProducerStart(producer="p", pid=os.getpid(), contract_id=CONTRACT.contract_id,
                                   plan_id=FakePlan.plan_id, budget_bytes=producer.budget,
                                   policy=producer.cfg.retention))
    try:
        for _ in range(ticks):
            if producer.tick():
                continue
            # a pass that captured nothing is not the end (as in Producer.run): its listing can miss what the
            # publisher thread published meanwhile, and the batch it picked is then skipped as published. Stop
            # only once a pass, with nothing in flight, left nothing to capture.
            if producer.fill_done():
                break
            time.sleep(0.005)
        producer.drain()
        producer.evict(producer.live_registrations())  # settle: evict what left the windows meanwhile
    finally:
        producer.drain()
    log(f"captures {producer.stats.captures} publications {producer.stats.publications} "
        f"failures {producer.stats.failures}")
    producer._emit(J.ProducerStop(producer="p", reason="done"))
    journal.close()


def _consumer(layout: CacheLayout, log, steps: int) -> None:
    """Resume from the committed cursor in the registration (registry-level resume), then per step:
    lease and read BATCH positions, release, commit the cursor."""
    old = registry.read(layout, CONSUMER)
    start = old.cursor if old is not None else 0
    log(f"start {start}")
    reg = registry.register(layout, registry.Registration(
        consumer_id=CONSUMER, draft="mini", cursor=start, lookbehind=0, lookahead=CONSUMER_LOOKAHEAD,
        batch_size=BATCH, pid=os.getpid(), host=host_id()))
    handle = registry.ConsumerHandle(layout, reg)
    journal = J.JournalWriter(layout.journal_path("consumer", CONSUMER))
    journal.emit(J.ConsumerStart(consumer=CONSUMER, pid=os.getpid(), draft="mini", block_size=2, batch_size=BATCH,
                                 lookbehind=0, lookahead=CONSUMER_LOOKAHEAD, cursor=start))
    plan = FakePlan()
    client = CacheClient(layout, settings(), plan, handle, journal, demand_timeout_s=20.0)
    cursor = start
    for _ in range(steps):
        items = [client.acquire(p) for p in range(cursor, cursor + BATCH)]
        for it in items:  # the bytes are the requested sample's (read verified its token ids too)
            want = plan.sample(client.order.sample(it.position)).input_ids  # the epoch order the client reads
            if not torch.equal(it.artifact.input_ids, want):
                raise AssertionError(f"position {it.position}: wrong token ids")
        for it in items:
            client.release(it)
        crash_point("cursor.before-commit")
        handle.commit_cursor(cursor + BATCH)
        crash_point("cursor.after-commit")
        cursor += BATCH
        log(f"commit {cursor}")
        journal.emit(J.Step(consumer=CONSUMER, step=(cursor - start) // BATCH, cursor=cursor, loss=0.0, tau_sum=0.0,
                            blocks=0, acc_correct=[], acc_total=[], wait_s=0.0, step_s=0.0, lr=0.0))
    handle.finish("completed")
    journal.emit(J.ConsumerEnd(consumer=CONSUMER, state="completed", steps=steps, cursor=cursor))
    journal.close()


# ---- forkserver -------------------------------------------------------------------------------------------

def _noop() -> None:
    pass


def forkserver_context():
    """A forkserver context that has imported this module (so artcache and torch) once: children start in
    milliseconds. Python 3.11's forkserver does not apply the parent's sys.path before preloading, so the
    repository (which holds the ``tests`` package) goes on PYTHONPATH while the server starts."""
    import multiprocessing as mp

    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["tests.support.crash_child", "pytest"])  # pytest: children re-import __main__ (pytest)
    here = Path(__file__).resolve().parent
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here.parents[1])] + ([old] if old else []))
    try:
        p = c.Process(target=_noop)
        p.start()
        p.join()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return c


# ---- racing workers (tests/reliability/test_concurrency.py) ----------------------------------------------------------

class FileBarrier:
    """A start line across pid namespaces (tests/support/hosts.py): :meth:`wait` returns once ``path`` exists."""

    def __init__(self, path: str) -> None:
        self.path = path

    def wait(self) -> None:
        while not os.path.exists(self.path):
            import time

            time.sleep(0.002)


class FileEvent:
    """A stop flag across pid namespaces: set once ``path`` exists."""

    def __init__(self, path: str) -> None:
        self.path = path

    def is_set(self) -> bool:
        return os.path.exists(self.path)


def _noop_flock() -> None:
    """Make flock a no-op in this process: a filesystem where locks silently do nothing."""
    import fcntl

    fcntl.flock = lambda fd, op: None


def _read_one(layout: CacheLayout, fp_of, plan, pos: int, counts: dict) -> None:
    """Read ``pos``: a whole, verified artifact of the right sample, or a miss; anything else is torn."""
    from artcache import store
    from artcache.errors import ArtifactMissing, IntegrityError

    try:
        art = store.read(layout, fp_of(pos), CONTRACT, verify_tokens=True)
    except ArtifactMissing:
        counts["misses"] += 1
        return
    except IntegrityError:
        counts["torn"] += 1
        return
    want = fake_capture(plan.sample(pos % len(plan)))
    ok = torch.equal(art.hidden_states, want["hidden_states"]) and torch.equal(art.input_ids, want["input_ids"])
    counts["reads_ok" if ok else "torn"] += 1


def race_worker(root: str, n_pos: int, out: str, seed: int, noop_locks: bool, barrier) -> None:
    """Capture-or-skip every position like a producer (striped lock, re-check, publish); read another
    position after each attempt. Writes its counts and the fingerprints it captured to ``out`` (JSON)."""
    import json
    import random
    import time

    from artcache import store
    from artcache.fingerprint import PlanFingerprints
    from artcache.locking import Timeout, cache_lock

    if noop_locks:
        _noop_flock()
    layout, plan = CacheLayout(Path(root)), FakePlan()
    fp_of = PlanFingerprints(CONTRACT, plan)
    rnd = random.Random(seed)
    counts = {"ops": 0, "reads_ok": 0, "misses": 0, "torn": 0, "lock_busy": 0, "skipped": 0}
    captured: list[str] = []
    pending = list(range(n_pos))
    rnd.shuffle(pending)
    barrier.wait()
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        still = []
        for pos in pending:
            fp = fp_of(pos)
            counts["ops"] += 1
            if store.exists(layout, fp):
                counts["skipped"] += 1
                continue
            lock = cache_lock(layout.fingerprint_lock(fp), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                counts["lock_busy"] += 1
                still.append(pos)
                continue
            try:
                if store.exists(layout, fp):
                    counts["skipped"] += 1
                else:
                    store.publish(layout, fp, CONTRACT, fake_capture(plan.sample(pos % len(plan))), durable=False,
                                  verify_tokens=True)
                    captured.append(fp)
            finally:
                lock.release()
            _read_one(layout, fp_of, plan, rnd.randrange(n_pos), counts)
        pending = still
    counts["pending"] = len(pending)
    Path(out).write_text(json.dumps({"counts": counts, "captured": captured}))
    os._exit(0)


def reader_worker(root: str, n_pos: int, out: str, seed: int, stop, barrier) -> None:
    """Read random positions until ``stop`` is set (and at least 200 reads)."""
    import json
    import random

    from artcache.fingerprint import PlanFingerprints

    layout, plan = CacheLayout(Path(root)), FakePlan()
    fp_of = PlanFingerprints(CONTRACT, plan)
    rnd = random.Random(seed)
    counts = {"ops": 0, "reads_ok": 0, "misses": 0, "torn": 0}
    barrier.wait()
    while not stop.is_set() or counts["ops"] < 200:
        counts["ops"] += 1
        _read_one(layout, fp_of, plan, rnd.randrange(n_pos), counts)
    Path(out).write_text(json.dumps({"counts": counts}))
    os._exit(0)


def republisher_worker(root: str, n_pos: int, out: str, seed: int, stop, barrier) -> None:
    """Publish every position again and again (no lock) until ``stop``: races the evictor."""
    import json
    import random

    from artcache import store
    from artcache.fingerprint import PlanFingerprints

    layout, plan = CacheLayout(Path(root)), FakePlan()
    fp_of = PlanFingerprints(CONTRACT, plan)
    rnd = random.Random(seed)
    n = 0
    barrier.wait()
    while not stop.is_set():
        pos = rnd.randrange(n_pos)
        store.publish(layout, fp_of(pos), CONTRACT, fake_capture(plan.sample(pos % len(plan))), durable=False)
        n += 1
    Path(out).write_text(json.dumps({"counts": {"ops": n}}))
    os._exit(0)


def evictor_worker(root: str, n_pos: int, out: str, readers: list[str], stop, barrier) -> None:
    """Evict everything not leased by a live reader, again and again, until ``stop``."""
    import json

    from artcache import store
    from artcache.eviction import evict_pass

    layout = CacheLayout(Path(root))
    passes = evicted = 0
    barrier.wait()
    while not stop.is_set():
        objects = store.list_objects(layout)  # evict_pass removes only what it is given: offer it everything
        res = evict_pass(layout, set(objects), set(readers), objects=objects)  # (leases kept)
        passes += 1
        evicted += len(res.evicted)
    Path(out).write_text(json.dumps({"counts": {"ops": passes, "evicted": evicted}}))
    os._exit(0)


def lease_reader_worker(root: str, n_pos: int, out: str, cid: str, seed: int, n_ops: int, barrier) -> None:
    """A consumer's reads through CacheClient (lease, read, verify; a miss waits as a demand) racing the
    evictor: every acquire must return the whole artifact of the requested sample, or raise nothing."""
    import json
    import random
    import time

    from artcache import registry
    from artcache.client import CacheClient

    layout, plan = CacheLayout(Path(root)), FakePlan()
    reg = registry.register(layout, registry.Registration(consumer_id=cid, draft="r", lookahead=n_pos,
                                                          pid=os.getpid(), host=host_id()))
    handle = registry.ConsumerHandle(layout, reg)
    journal = J.JournalWriter(layout.journal_path("consumer", cid))
    client = CacheClient(layout, settings(), plan, handle, journal, demand_timeout_s=60.0)
    rnd = random.Random(seed)
    counts = {"ops": 0, "reads_ok": 0, "demands": 0, "torn": 0, "errors": 0, "max_wait_s": 0.0}
    barrier.wait()
    for _ in range(n_ops):
        pos = rnd.randrange(n_pos)
        t0 = time.monotonic()
        try:
            item = client.acquire(pos)
        except Exception as exc:  # noqa: BLE001 - any error is a failure of the protocol; counted, reported
            counts["errors"] += 1
            counts.setdefault("error_samples", []).append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        counts["ops"] += 1
        counts["max_wait_s"] = max(counts["max_wait_s"], time.monotonic() - t0)
        want = fake_capture(plan.sample(client.order.sample(pos)))  # the epoch order the client reads
        ok = torch.equal(item.artifact.hidden_states, want["hidden_states"])
        counts["reads_ok" if ok else "torn"] += 1
        client.release(item)
    for ev in J.read_events(layout.journal).events:
        if isinstance(ev, J.Request) and ev.consumer == cid and not ev.hit:
            counts["demands"] += 1
    handle.finish("completed")
    journal.close()
    Path(out).write_text(json.dumps({"counts": counts}))
    os._exit(0)


def fsck_summary(root: str, observe_s: float | None = None) -> dict:
    """``fsck --fix`` of ``root`` from this process (tests/support/hosts.py runs it on another host): what it found
    and fixed, as JSON-able lists, and this process's host id."""
    from artcache.fsck import fsck

    rep = fsck(root, fix=True, observe_s=observe_s)
    return {"host": host_id(), "problems": [{"kind": p.kind, "path": p.path, "detail": p.detail, "fixed": p.fixed}
                                            for p in rep.problems], "notes": rep.notes}
