"""The publish / read / lease / evict protocols across real processes on a real filesystem.

Workers run in 'spawn' processes (no inherited state, like independent producers and consumers).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock, Timeout

from artcache import leases, store
from artcache.contract import CaptureContract
from artcache.errors import ArtifactMissing, IntegrityError
from artcache.eviction import evict_pass
from artcache.layout import CacheLayout

C = CaptureContract(target_name="t", target_revision="r", target_config_hash="c", target_weights_digest="w",
                    layer_ids=(2, 5), max_length=64, tokenizer_digest="k", template_digest="m")
CTX = mp.get_context("spawn")
DEADLINE_S = 120.0


def fp_of(i: int) -> str:
    return f"{i:040x}"


def capture(fp: str, t: int = 48, h: int = 128) -> dict[str, torch.Tensor]:
    """A deterministic fake capture for ``fp`` (same fp ⇒ same tensors, like a frozen target)."""
    g = torch.Generator().manual_seed(int(fp[-8:], 16))
    return {"hidden_states": torch.randn(t, len(C.layer_ids), h, generator=g).to(torch.bfloat16),
            "input_ids": torch.randint(0, 1000, (t,), generator=g, dtype=torch.int32),
            "loss_mask": torch.ones(t, dtype=torch.uint8)}


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _join_all(procs, timeout=DEADLINE_S) -> None:
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * len(procs)


# ---- (1) coalescing: N producers race on the same fingerprints ----------------------------------
def _race_worker(root: str, fps: list[str], counter: str, barrier, seed: int) -> None:
    layout = CacheLayout(Path(root))
    order = list(fps)
    if seed % 2:
        order.reverse()
    pending = order
    barrier.wait()
    t_end = time.monotonic() + DEADLINE_S
    while pending:
        if time.monotonic() > t_end:
            raise RuntimeError(f"worker {seed}: still pending {len(pending)}")
        still = []
        for fp in pending:
            if store.exists(layout, fp):
                continue
            lock = FileLock(layout.fingerprint_lock(fp), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                still.append(fp)  # someone else is capturing it; look again later
                continue
            try:
                if store.exists(layout, fp):  # published while we took the lock
                    continue
                tensors = capture(fp)
                store.publish(layout, fp, C, tensors, durable=False)
                _append(counter, f"{fp} {os.getpid()}\n")
            finally:
                lock.release()
        pending = still
        if pending:
            time.sleep(0.001)


@pytest.mark.parametrize("n_procs", [4])
def test_racing_producers_publish_each_fingerprint_once(tmp_path, n_procs):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    fps = [fp_of(i) for i in range(60)]
    counter = str(tmp_path / "published.txt")
    barrier = CTX.Barrier(n_procs)
    procs = [CTX.Process(target=_race_worker, args=(str(layout.root), fps, counter, barrier, k))
             for k in range(n_procs)]
    for p in procs:
        p.start()
    _join_all(procs)
    lines = Path(counter).read_text().splitlines()
    published = [line.split()[0] for line in lines]
    assert sorted(published) == sorted(fps), "each fingerprint published exactly once"
    assert len({line.split()[1] for line in lines}) >= 1
    for fp in fps:
        art = store.read(layout, fp, C)
        assert torch.equal(art.hidden_states, capture(fp)["hidden_states"])
    assert list(layout.tmp.iterdir()) == []
    # lock files are created once and never deleted
    assert len(list(layout.locks.iterdir())) == len({layout.fingerprint_lock(fp) for fp in fps})


# ---- (2) without locks: still no torn read ------------------------------------------------------
def _writer(root: str, fps: list[str], rounds: int, seed: int, start) -> None:
    layout = CacheLayout(Path(root))
    rnd = random.Random(seed)
    start.wait()
    for _ in range(rounds):
        order = list(fps)
        rnd.shuffle(order)
        for fp in order:
            store.publish(layout, fp, C, capture(fp), durable=False)  # no lock, no exists() check


def _remover(root: str, fps: list[str], rounds: int, seed: int, start) -> None:
    layout = CacheLayout(Path(root))
    rnd = random.Random(seed)
    start.wait()
    for _ in range(rounds * len(fps)):
        store.remove(layout, rnd.choice(fps))


def _reader(root: str, fps: list[str], done, start, out: str, min_passes: int) -> None:
    layout = CacheLayout(Path(root))
    want = {fp: capture(fp)["hidden_states"] for fp in fps}
    ok = missing = integrity = wrong = passes = 0
    start.wait()
    t_end = time.monotonic() + DEADLINE_S
    while (not done.is_set() or passes < min_passes) and time.monotonic() < t_end:
        for fp in fps:
            try:
                art = store.read(layout, fp, C)
            except ArtifactMissing:
                missing += 1
                continue
            except IntegrityError:
                integrity += 1
                continue
            ok += 1
            wrong += not torch.equal(art.hidden_states, want[fp])
        passes += 1
    Path(out).write_text(f"{ok} {missing} {integrity} {wrong}")


def test_no_torn_read_without_locks(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    fps = [fp_of(i) for i in range(12)]
    start = CTX.Barrier(6)
    done = CTX.Event()
    writers = [CTX.Process(target=_writer, args=(str(layout.root), fps, 15, k, start)) for k in range(3)]
    writers.append(CTX.Process(target=_remover, args=(str(layout.root), fps, 15, 99, start)))
    outs = [str(tmp_path / f"reader{k}.txt") for k in range(2)]
    readers = [CTX.Process(target=_reader, args=(str(layout.root), fps, done, start, out, 3)) for out in outs]
    for p in writers + readers:
        p.start()
    _join_all(writers)
    done.set()
    _join_all(readers)
    totals = [0, 0, 0, 0]
    for out in outs:
        for i, v in enumerate(map(int, Path(out).read_text().split())):
            totals[i] += v
    ok, missing, integrity, wrong = totals
    assert integrity == 0, f"{integrity} torn/invalid reads"
    assert wrong == 0
    assert ok > 0
    assert list(layout.quarantine.iterdir()) == []
    assert list(layout.tmp.iterdir()) == []


# ---- (3) a lease held in another process blocks eviction until released --------------------------
def _lease_holder(root: str, fp: str, ready, release, released, exit_now, crash: bool) -> None:
    layout = CacheLayout(Path(root))
    name = leases.acquire(layout, fp, "reader1")
    art = store.read(layout, fp, C)
    assert torch.equal(art.hidden_states, capture(fp)["hidden_states"])
    ready.set()
    if crash:
        exit_now.wait(DEADLINE_S)
        os._exit(0)  # dies holding the lease
    release.wait(DEADLINE_S)
    assert leases.release(layout, name)
    released.set()
    exit_now.wait(DEADLINE_S)  # stay alive: the lease went away because it was released, not expired


def _start_holder(layout: CacheLayout, fp: str, crash: bool):
    ev = [CTX.Event() for _ in range(4)]
    p = CTX.Process(target=_lease_holder, args=(str(layout.root), fp, *ev, crash))
    p.start()
    assert ev[0].wait(DEADLINE_S), "lease holder did not start"
    return p, ev


def test_lease_in_other_process_blocks_eviction_until_released(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    fp, other = fp_of(1), fp_of(2)
    for f in (fp, other):
        store.publish(layout, f, C, capture(f))
    p, (ready, release, released, exit_now) = _start_holder(layout, fp, crash=False)
    try:
        for _ in range(3):
            res = evict_pass(layout, list(store.list_objects(layout)), {"reader1"})
            assert store.exists(layout, fp), "evicted while a live lease was held"
            assert res.held_by_lease == {fp} and res.expired_leases == []
        assert not store.exists(layout, other)  # the unleased one went
        release.set()
        assert released.wait(DEADLINE_S)
        res = evict_pass(layout, list(store.list_objects(layout)), {"reader1"})
        assert set(res.evicted) == {fp} and res.expired_leases == []
        assert not store.exists(layout, fp)
    finally:
        exit_now.set()
        _join_all([p])


def test_lease_of_crashed_reader_expires(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    fp = fp_of(3)
    store.publish(layout, fp, C, capture(fp))
    p, (ready, release, released, exit_now) = _start_holder(layout, fp, crash=True)
    res = evict_pass(layout, list(store.list_objects(layout)), {"reader1"})
    assert res.held_by_lease == {fp} and store.exists(layout, fp)
    exit_now.set()
    _join_all([p])
    res = evict_pass(layout, list(store.list_objects(layout)), {"reader1"})
    assert [reason for _, reason in res.expired_leases] == ["holder-dead"]
    assert set(res.evicted) == {fp}
    assert list(layout.leases.iterdir()) == []
