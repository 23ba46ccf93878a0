"""Corruption injection (reliability lane): every corrupted artifact is detected, quarantined, counted and
recaptured; validation happens before publication too.

A producer (the real ``Producer`` loop on the fake plan and backend of tests/support/crash_child.py) runs in a
thread; a consumer reads through ``CacheClient``. Per injection: corrupt a published artifact in place, then
acquire its position: the read fails its check, the file goes to ``quarantine/`` (journal ``quarantine``),
the position becomes a demand, the producer recaptures it (``capture`` with ``recapture``) and the acquire
returns the whole, verified artifact. Kinds: a flipped byte in the data or the header, a truncated file,
wrong shapes with a valid content hash, NaN rows, and token ids that do not match the request (another
sample's capture under this fingerprint, with a valid hash). NaN rows whose content hash was recomputed
(a writer that skipped validation) are not re-scanned by a read; ``artcache fsck`` finds those. The seed is
logged (``ARTCACHE_CORRUPT_SEED`` replays).
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time

import pytest
import torch
import xxhash

from artcache import journal as J
from artcache import registry, store
from artcache.client import CacheClient
from artcache.errors import IntegrityError
from artcache.fsck import fsck
from artcache.layout import CacheLayout
from artcache.producer import Producer, ProducerConfig
from artcache.scheduler import SchedulerLimits
from artcache.settings import init_settings
from tests.support import crash_child as K
from tests.support.reliability_figures import record

PER_KIND = 25


def _split(raw: bytes) -> tuple[dict, int]:
    (hlen,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + hlen]), 8 + hlen


def _rebuild(header: dict, data: bytes) -> bytes:
    """An artifact from a header and data section, with the content hash recomputed over ``data``."""
    header = json.loads(json.dumps(header))
    header["__metadata__"]["content_hash"] = xxhash.xxh3_128_hexdigest(data)
    hjson = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson + data


def _nan_rows(raw: bytes, rng: random.Random, rehash: bool) -> bytes:
    header, start = _split(raw)
    hs = header["hidden_states"]
    t, m, h = hs["shape"]
    begin = start + hs["data_offsets"][0]
    data = bytearray(raw)
    row = rng.randrange(t)
    nan = struct.pack("<H", 0x7FC0)  # bf16 quiet NaN
    for k in range(m * h):
        off = begin + (row * m * h + k) * 2
        data[off:off + 2] = nan
    if not rehash:
        return bytes(data)
    return _rebuild(header, bytes(data[start:]))


def _wrong_shape(raw: bytes, rng: random.Random) -> bytes:
    """Shapes changed with the same byte counts, so offsets fit and the content hash still matches."""
    header, start = _split(raw)
    header = json.loads(json.dumps(header))
    t, m, h = header["hidden_states"]["shape"]
    if rng.random() < 0.5:
        header["hidden_states"]["shape"] = [h, m, t]
    else:
        header["input_ids"]["shape"] = [1, t]
    return _rebuild(header, raw[start:])


def _other_sample(layout, fp: str, pos: int, rng: random.Random) -> bytes:
    """Another sample's capture published under this fingerprint (hash valid, token ids wrong)."""
    plan = K.FakePlan()
    other = (pos + rng.randrange(1, len(plan))) % len(plan)
    header, chunks = store._encode(fp, K.CONTRACT, K.fake_capture(plan.sample(other)))
    return header + b"".join(bytes(c) for c in chunks)


def corrupt(kind: str, layout, fp: str, pos: int, rng: random.Random) -> None:
    path = layout.object_path(fp)
    raw = path.read_bytes()
    _, start = _split(raw)
    if kind == "flipped byte (data)":
        b = bytearray(raw)
        b[rng.randrange(start, len(raw))] ^= rng.randrange(1, 256)
        out = bytes(b)
    elif kind == "flipped byte (header)":
        b = bytearray(raw)
        b[rng.randrange(0, start)] ^= 1 << rng.randrange(8)
        out = bytes(b)
    elif kind == "truncated":
        out = raw[: rng.randrange(0, len(raw))]
    elif kind == "wrong shapes (hash valid)":
        out = _wrong_shape(raw, rng)
    elif kind == "NaN rows":
        out = _nan_rows(raw, rng, rehash=False)
    elif kind == "NaN rows (hash recomputed)":
        out = _nan_rows(raw, rng, rehash=True)
    elif kind == "token ids not the request":
        out = _other_sample(layout, fp, pos, rng)
    else:
        raise AssertionError(kind)
    assert out != raw
    path.write_bytes(out)


READ_KINDS = ["flipped byte (data)", "flipped byte (header)", "truncated", "wrong shapes (hash valid)", "NaN rows",
              "token ids not the request"]


@pytest.fixture()
def world(tmp_path):
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    settings = init_settings(layout, K.settings())
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="d", lookahead=K.N_SAMPLES,
                                                          pid=os.getpid()))
    cj = J.JournalWriter(layout.journal_path("consumer", "c"))
    client = CacheClient(layout, settings, K.FakePlan(), registry.ConsumerHandle(layout, reg), cj,
                         demand_timeout_s=60.0)
    pj = J.JournalWriter(layout.journal_path("producer", "p"))
    cfg = ProducerConfig(cache=str(layout.root), heartbeat_timeout_s=1e9, poll_interval_s=0.0,
                         limits=SchedulerLimits(max_queue=64, max_batch_samples=4, max_batch_tokens=128))
    producer = Producer(layout, settings, K.FakePlan(), K.FakeBackend(), cfg, pj)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if not producer.tick():
                time.sleep(0.002)

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    yield layout, client
    stop.set()
    th.join()
    producer.drain()
    pj.close()
    cj.close()


def _quarantined(layout) -> int:
    return len(os.listdir(layout.quarantine))


def test_every_corruption_is_detected_quarantined_and_recaptured(world):
    layout, client = world
    seed = int(os.environ.get("ARTCACHE_CORRUPT_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"corruption seed={seed} (replay with ARTCACHE_CORRUPT_SEED={seed})")
    rng = random.Random(seed)
    plan = K.FakePlan()
    stats = {k: {"injected": 0, "detected": 0, "quarantined": 0, "recaptured": 0}
             for k in [*READ_KINDS, "NaN rows (hash recomputed)"]}
    for i in range(PER_KIND * len(stats)):
        kind = list(stats)[i % len(stats)]
        pos = rng.randrange(len(plan))
        client.release(client.acquire(pos))  # published (captured on demand if it was not)
        fp = client.fp_of(pos)
        q0 = _quarantined(layout)
        corrupt(kind, layout, fp, pos, rng)
        stats[kind]["injected"] += 1
        if kind == "NaN rows (hash recomputed)":  # a read trusts the hash; fsck re-scans values
            rep = fsck(layout.root, fix=True)
            found = [p for p in rep.problems if p.kind == "bad-artifact" and fp in p.path]
            assert found and found[0].fixed, (kind, rep.problems)
            assert "NaN" in found[0].detail
            stats[kind]["detected"] += 1
        else:
            try:
                store.read(layout, fp, client.contract, verify_tokens=True)
            except IntegrityError:
                stats[kind]["detected"] += 1
            else:
                pytest.fail(f"{kind} at position {pos} was not detected (seed={seed})")
        stats[kind]["quarantined"] += _quarantined(layout) - q0
        item = client.acquire(pos)  # a demand (unless the producer already recaptured it): whole and verified
        assert torch.equal(item.artifact.input_ids, plan.sample(pos).input_ids)
        assert torch.equal(item.artifact.hidden_states, K.fake_capture(plan.sample(pos))["hidden_states"])
        client.release(item)
        assert store.verify(layout, fp, client.contract) is None
        stats[kind]["recaptured"] += 1
    for kind, s in stats.items():
        assert s["detected"] == s["injected"] == s["quarantined"] == s["recaptured"], (kind, s)
        record("corruption", f"{kind}" + (" [fsck]" if "recomputed" in kind else " [read]") + f" seed {seed}", **s)
    evs = J.read_events(layout.journal).events
    recaptures = sum(1 for e in evs if isinstance(e, J.Capture) and e.recapture)
    assert recaptures >= PER_KIND * len(stats)


def test_validation_before_publication(tmp_path):
    """Captures with NaN rows, wrong shapes or another sample's token ids are refused before publication."""
    layout = CacheLayout(tmp_path / "root")
    layout.create()
    plan = K.FakePlan()
    rng = random.Random(0)
    n = 0
    for pos in range(len(plan)):
        s = plan.sample(pos)
        fp = client_fp(pos)
        good = K.fake_capture(s)
        nan = dict(good, hidden_states=good["hidden_states"].clone())
        nan["hidden_states"][rng.randrange(len(s.input_ids))] = float("nan")
        shape = dict(good, hidden_states=good["hidden_states"].reshape(-1, 1, K.HIDDEN))
        other = K.fake_capture(plan.sample((pos + 1) % len(plan)))
        for bad in (nan, shape, other):
            with pytest.raises(IntegrityError):
                store.publish(layout, fp, K.CONTRACT, bad, verify_tokens=True)
            n += 1
    assert store.list_objects(layout) == {} and os.listdir(layout.tmp) == []
    record("corruption", "refused before publication (NaN / shapes / tokens)", injected=n, detected=n)


def client_fp(pos: int) -> str:
    from artcache.fingerprint import PlanFingerprints

    return PlanFingerprints(K.CONTRACT, K.FakePlan())(pos)
