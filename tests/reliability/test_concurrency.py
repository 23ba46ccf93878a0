"""Many processes hammering the same fingerprints (reliability lane).

- 8 producer-like workers capture-or-skip the same positions (striped flock, re-check, publish) while
  reading others: exactly one capture per fingerprint, zero torn reads.
- The same with flock made a no-op in every process (a filesystem where locks silently do nothing), plus
  4 readers: duplicate captures are allowed (and counted), torn reads are not (unique temp file + rename +
  content hash).
- Eviction racing with lease acquisition: an evictor evicting everything unleased, a republisher, and 6
  consumers reading through ``CacheClient`` (lease first, then read; a miss becomes a demand): every
  acquire returns the whole artifact of the requested sample, never an error or a hang.

Workers live in tests/support/crash_child.py and start from a forkserver. Figures go to the lane's summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from artcache import store
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
from artcache.settings import init_settings
from tests.support import crash_child as K
from tests.support.mooncake_store import PAYLOAD_BACKENDS, root_settings
from tests.support.reliability_figures import record

DEADLINE_S = 180.0  # only bounds a hang
N_POS = 40  # every sample of the fake plan
N_LEASE_OPS = 100  # acquires per lease reader


@pytest.fixture(scope="module")
def ctx():
    return K.forkserver_context()


@pytest.fixture(params=PAYLOAD_BACKENDS)
def backend(request) -> str:
    return request.param


def _root(tmp_path: Path, backend: str = "posix", request=None) -> CacheLayout:
    """A fresh root with crash_child's settings; ``mooncake``: its payloads in the session's Mooncake store."""
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    init_settings(layout, root_settings(backend, request))
    return layout


def _run(ctx, procs) -> None:
    for p in procs:
        p.start()


def _join(procs) -> None:
    for p in procs:
        p.join(DEADLINE_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"{len(hung)} worker(s) hung for {DEADLINE_S:.0f}s"
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _results(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def _all_verify(layout: CacheLayout) -> int:
    objects = store.list_objects(layout)
    for fp in objects:
        assert store.verify(layout, fp, K.CONTRACT) is None
    assert list(layout.tmp.iterdir()) == [] and list(layout.quarantine.iterdir()) == []
    return len(objects)


@pytest.mark.parametrize("noop_locks", [False, True], ids=["flock", "flock-no-op"])
def test_racing_producers_and_readers(tmp_path, ctx, noop_locks, backend, request):
    layout = _root(tmp_path, backend, request)
    n_workers, n_readers = 8, 4 if noop_locks else 0
    barrier = ctx.Barrier(n_workers + n_readers)
    stop = ctx.Event()
    outs = [tmp_path / f"w{k}.json" for k in range(n_workers)]
    routs = [tmp_path / f"r{k}.json" for k in range(n_readers)]
    workers = [ctx.Process(target=K.race_worker, args=(str(layout.root), N_POS, str(o), k, noop_locks, barrier))
               for k, o in enumerate(outs)]
    readers = [ctx.Process(target=K.reader_worker, args=(str(layout.root), N_POS, str(o), 100 + k, stop, barrier))
               for k, o in enumerate(routs)]
    _run(ctx, workers + readers)
    try:
        _join(workers)
    finally:
        stop.set()  # the readers stop also when a worker failed (else they outlive the test)
    _join(readers)
    res = _results(outs + routs)
    captured = [fp for r in res for fp in r.get("captured", [])]
    fp_of = PlanFingerprints(K.CONTRACT, K.FakePlan())
    assert set(captured) == {fp_of(i) for i in range(N_POS)}, "every fingerprint captured"
    duplicates = len(captured) - len(set(captured))
    torn = sum(r["counts"]["torn"] for r in res)
    ops = sum(r["counts"]["ops"] for r in res)
    reads = sum(r["counts"].get("reads_ok", 0) for r in res)
    assert torn == 0, f"{torn} torn or wrong reads"
    assert all(r["counts"].get("pending", 0) == 0 for r in res)
    assert reads > 0
    if not noop_locks:
        assert duplicates == 0, f"{duplicates} duplicate captures while flock works"
    assert _all_verify(layout) == N_POS
    label = "flock no-op (dups allowed)" if noop_locks else "flock working"
    label += ", mooncake payloads" if backend == "mooncake" else ""
    record("concurrency", f"{n_workers} producers + {n_readers} readers, {label}",
           processes=n_workers + n_readers, operations=ops, reads=reads, torn_reads=torn,
           duplicate_captures=duplicates)


def test_eviction_races_lease_acquisition(tmp_path, ctx, backend, request):
    layout = _root(tmp_path, backend, request)
    # start with everything published, so readers race the evictor from the first read
    fp_of = PlanFingerprints(K.CONTRACT, K.FakePlan())
    plan = K.FakePlan()
    for i in range(N_POS):
        store.publish(layout, fp_of(i), K.CONTRACT, K.fake_capture(plan.sample(i)), durable=False)
    n_readers = 6
    cids = [f"r{k}" for k in range(n_readers)]
    barrier = ctx.Barrier(n_readers + 2)
    stop = ctx.Event()
    outs = {name: tmp_path / f"{name}.json" for name in ["evictor", "republisher", *cids]}
    bg = [ctx.Process(target=K.evictor_worker, args=(str(layout.root), N_POS, str(outs["evictor"]), cids, stop,
                                                      barrier)),
          ctx.Process(target=K.republisher_worker, args=(str(layout.root), N_POS, str(outs["republisher"]), 7, stop,
                                                          barrier))]
    readers = [ctx.Process(target=K.lease_reader_worker,
                           args=(str(layout.root), N_POS, str(outs[c]), c, 50 + k, N_LEASE_OPS, barrier))
               for k, c in enumerate(cids)]
    _run(ctx, bg + readers)
    try:
        _join(readers)
    finally:
        stop.set()
    _join(bg)
    res = {name: json.loads(path.read_text())["counts"] for name, path in outs.items()}
    rs = [res[c] for c in cids]
    errors = sum(r["errors"] for r in rs)
    torn = sum(r["torn"] for r in rs)
    assert errors == 0, [r.get("error_samples") for r in rs]
    assert torn == 0
    assert sum(r["reads_ok"] for r in rs) == n_readers * N_LEASE_OPS
    assert res["evictor"]["evicted"] > 0, "the evictor never evicted anything: no race was exercised"
    assert list(layout.quarantine.iterdir()) == []
    ops = sum(r["ops"] for r in res.values())
    demands = sum(r["demands"] for r in rs)
    where = ", mooncake payloads" if backend == "mooncake" else ""
    record("concurrency", f"evictor + republisher + {n_readers} lease readers{where}", processes=n_readers + 2,
           operations=ops, reads=sum(r["reads_ok"] for r in rs), torn_reads=torn, errors=errors,
           misses_to_demand=demands, evictions=res["evictor"]["evicted"])
