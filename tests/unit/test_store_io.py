"""The store's I/O mechanics: the one-pass publish (hash beside the write, header last, writeback
started per chunk), the chunked read that hashes while it reads into recycled buffers, their equivalence
with the earlier path, their failure cleanliness, and the GPU capture batch's hand-off to the publisher."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

from artcache import fsio, store
from artcache.contract import CaptureContract
from artcache.errors import IntegrityError, PublishError
from artcache.fingerprint import fingerprint
from artcache.hashing import StreamDigest, digest_bytes
from artcache.layout import CacheLayout

C = CaptureContract(target_name="tiny-target", target_revision="rev-0001", target_config_hash="cfg01",
                    target_weights_digest="w01", layer_ids=(1, 3), max_length=512,
                    tokenizer_digest="tok01", template_digest="tpl01")
#: small chunks so a test artifact spans many: every chunk boundary, the hash thread, the header-last write
SMALL = {"chunk_bytes": 1000}
#: chunks larger than the artifact's last stretch, read in small tail pieces (each hashed as it lands)
TAIL = {"chunk_bytes": 16000, "tail_bytes": 700}


def tensors(t: int = 300, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(t, 2, 64, generator=g).to(torch.bfloat16),
            "input_ids": torch.randint(0, 50000, (t,), generator=g, dtype=torch.int32),
            "loss_mask": torch.randint(0, 2, (t,), generator=g).to(torch.uint8)}


def fp_for(ts) -> str:
    return fingerprint(C, ts["input_ids"], ts["loss_mask"])


@pytest.fixture()
def layout(tmp_path) -> CacheLayout:
    lay = CacheLayout(tmp_path / "root")
    lay.create()
    return lay


def test_stream_digest_equals_the_one_shot_hash_inline_and_on_a_thread():
    data = os.urandom(100_003)
    for background in (False, True):
        with StreamDigest(background=background) as d:
            for i in range(0, len(data), 7777):
                d.update(memoryview(data)[i:i + 7777])
            assert d.hexdigest() == digest_bytes(data)
        with pytest.raises(RuntimeError):
            d.update(b"x")


def test_stream_digest_hands_the_threads_error_to_hexdigest():
    d = StreamDigest(background=True)
    d.update(object())  # not a buffer: xxhash raises TypeError on the helper thread
    with pytest.raises(TypeError):
        d.hexdigest()
    d.close()  # idempotent


@pytest.mark.parametrize("variant", [{}, SMALL, {**SMALL, "hash_thread": False}, {**SMALL, "writeback": False},
                                     {**SMALL, "fallocate": True}, {"stream": False}, TAIL,
                                     {**TAIL, "hash_thread": False}],
                         ids=["default", "small-chunks", "inline-hash", "no-writeback", "fallocate", "legacy", "tail",
                              "tail-inline"])
def test_every_io_variant_writes_the_bytes_of_encode_and_reads_them_back(layout, variant):
    ts = tensors()
    fp = fp_for(ts)
    header, chunks = store._encode(fp, C, ts)
    want = header + b"".join(bytes(c) for c in chunks)
    with store.io_settings(**variant):
        n = store.publish(layout, fp, C, ts, verify_tokens=True)
        assert n == len(want) and layout.object_path(fp).read_bytes() == want
        art = store.read(layout, fp, C, verify_tokens=True)
        assert torch.equal(art.hidden_states, ts["hidden_states"]) and art.nbytes == n
        assert store.verify(layout, fp, C) is None
    assert list(layout.tmp.iterdir()) == []


@pytest.mark.parametrize("variant", [{}, SMALL, {**SMALL, "hash_thread": False}, TAIL],
                         ids=["default", "small", "inline", "tail"])
def test_a_flipped_byte_in_any_chunk_fails_the_streamed_hash(layout, variant):
    ts = tensors()
    fp = fp_for(ts)
    with store.io_settings(**variant):
        store.publish(layout, fp, C, ts)
        path = layout.object_path(fp)
        good = path.read_bytes()
        for pos in (len(good) - 1, len(good) // 2, len(good) - 77_000):
            bad = bytearray(good)
            bad[pos] ^= 0x10
            path.write_bytes(bytes(bad))
            assert store.verify(layout, fp, C) == f"artifact {fp} failed its content hash"
        path.write_bytes(good[:-3000])  # truncated inside the data section
        assert "does not fit" in store.verify(layout, fp, C) or "hash" in store.verify(layout, fp, C)
        with pytest.raises(IntegrityError):
            store.read(layout, fp, C)
    assert not store.exists(layout, fp)


def test_a_failed_header_write_leaves_nothing(layout, monkeypatch):
    """The header is written last (it carries the hash): its failure must clean up like any write's."""
    ts = tensors()
    fp = fp_for(ts)

    def pwrite(fd, data, offset):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(PublishError) as ei:
        store.publish(layout, fp, C, ts)
    monkeypatch.undo()
    assert ei.value.retryable and not store.exists(layout, fp) and list(layout.tmp.iterdir()) == []


def test_start_writeback_is_a_harmless_hint(tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 10000)
        assert fsio.start_writeback(fd, 0, 10000) in (True, False)
        assert fsio.start_writeback(fd, 0, 10000) is (fsio._SYNC_FILE_RANGE is not None)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"x" * 10000


def test_read_buffers_come_back_when_the_last_tensor_is_freed_and_are_reused():
    pool = store.ReadBuffers(max_free_bytes=1 << 20)
    a = pool.take(100_000)
    addr = a.ctypes.data
    t = torch.frombuffer(a, dtype=torch.uint8)[10:20].view(2, 5)
    del a
    gc.collect()
    assert pool.free_bytes() == 0  # a tensor still uses it
    del t
    gc.collect()
    assert pool.free_bytes() >= 100_000
    b = pool.take(90_000)  # fits: the same pages again
    assert b.ctypes.data == addr and b.nbytes == 90_000 and pool.free_bytes() == 0
    c = pool.take(10)  # too small to take a 100 kB buffer: a new one
    assert c.ctypes.data != addr
    del b, c
    gc.collect()
    assert pool.free_bytes() <= 1 << 20
    for _ in range(30):  # the free list is capped
        pool.take(200_000)
    gc.collect()
    assert pool.free_bytes() <= 1 << 20


def test_reads_recycle_their_buffers_and_never_share_a_live_one(layout):
    ts, other = tensors(seed=1), tensors(seed=2)
    store.publish(layout, fp_for(ts), C, ts)
    store.publish(layout, fp_for(other), C, other)
    first = store.read(layout, fp_for(ts), C)
    second = store.read(layout, fp_for(other), C)  # the first is alive: another buffer
    assert torch.equal(first.hidden_states, ts["hidden_states"])
    assert torch.equal(second.hidden_states, other["hidden_states"])
    addr = first.hidden_states.data_ptr()
    del first
    gc.collect()
    again = store.read(layout, fp_for(other), C)
    assert torch.equal(again.hidden_states, other["hidden_states"]) and torch.equal(
        second.hidden_states, other["hidden_states"])
    assert again.hidden_states.data_ptr() != second.hidden_states.data_ptr()
    del addr


def test_host_scan_finds_a_nan_in_any_chunk(layout):
    ts = tensors(t=512)
    fp = fp_for(ts)
    flat = ts["hidden_states"].view(-1)
    for pos in (0, flat.numel() // 3, flat.numel() - 1):
        bad = {**ts, "hidden_states": ts["hidden_states"].clone()}
        bad["hidden_states"].view(-1)[pos] = float("inf")
        with pytest.raises(IntegrityError, match="NaN or Inf"):
            store.publish(layout, fp, C, bad)
    assert not store.exists(layout, fp) and list(layout.tmp.iterdir()) == []


# ---- the capture batch's hand-off to the publisher -----------------------------------------------------

class _Batch(list):
    """A capture batch whose host copies 'failed' (what a CUDA error in the D2H copy looks like)."""

    def ready(self):
        raise RuntimeError("CUDA error: unspecified launch failure")


class _AsyncBackend:
    def __init__(self, fail: bool):
        self.fail = fail

    def capture(self, samples):
        from artcache.backends.hf import CapturedBatch

        out = [{"hidden_states": torch.randn(8, 1, 16).to(torch.bfloat16), "input_ids": s.input_ids,
                "loss_mask": s.loss_mask} for s in samples]
        return _Batch(out) if self.fail else CapturedBatch(out, [True] * len(out))

    def close(self):
        pass


@pytest.mark.parametrize("fail", [False, True], ids=["ready", "copy-failed"])
def test_producer_publishes_after_ready_and_fails_the_batch_when_ready_raises(tmp_path, fake_plan,
                                                                              small_contract, fail):
    from artcache import journal as J
    from artcache import registry
    from artcache.producer import Producer, ProducerConfig
    from artcache.settings import RootSettings

    contract = small_contract
    layout = CacheLayout(tmp_path)
    layout.create()
    settings = RootSettings(plan_id="0" * 40, contract=contract, target_path="/nowhere")
    registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", lookahead=1, end=2,
                                                    pid=os.getpid()))
    journal = J.JournalWriter(layout.journal_path("producer", "p"))
    producer = Producer(layout, settings, fake_plan, _AsyncBackend(fail), ProducerConfig(cache=str(tmp_path)),
                        journal)
    try:
        assert producer.tick()
    finally:
        producer.drain()
        journal.close()
    evs = J.read_events(layout.journal).events
    pubs = [e for e in evs if isinstance(e, J.Publish)]
    fails = [e for e in evs if isinstance(e, J.CaptureFailure)]
    if fail:
        assert not pubs and len(fails) == 2 and "launch failure" in fails[0].error
        assert producer.stats.failures == 2 and not store.list_objects(layout)
    else:
        assert len(pubs) == 2 and not fails and len(store.list_objects(layout)) == 2
    assert not producer._inflight  # the locks and in-flight marks were released either way


def test_a_read_takes_its_last_chunk_in_tail_pieces(layout, monkeypatch):
    """The final chunk is read ``tail_bytes`` at a time, so only the last small piece's hash is left after
    the read (read + verify 0.86 of the page-cache read on a local disk, the gap that tail)."""
    ts = tensors(t=500)
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    size = layout.object_path(fp).stat().st_size
    sizes: list[int] = []
    real_fdopen = os.fdopen

    class Recording:
        def __init__(self, f):
            self.f = f

        def readinto(self, view):
            sizes.append(len(view))
            return self.f.readinto(view)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Recording(real_fdopen(*a, **k)))
    with store.io_settings(chunk_bytes=32768, tail_bytes=4096):
        art = store.read(layout, fp, C, verify_tokens=True)
    assert torch.equal(art.hidden_states, ts["hidden_states"])
    full = -(-size // 32768) - 1  # the chunks before the last
    assert full >= 2 and sizes[:full] == [32768] * full
    assert max(sizes[full:]) <= 4096 and sum(sizes) == size  # the last chunk in tail pieces


@pytest.mark.parametrize("name", ["hidden_states", "input_ids", "loss_mask"])
def test_regression_a_header_that_loses_a_tensor_names_the_artifact(layout, name):
    """A flipped byte in a tensor's name in the header (the content hash covers the data only) is caught by the
    capture's structure check, whose message named the tensor but not the artifact: 214 of the 3392 single-bit
    flips of a 64-token artifact's header read ``capture lacks tensor 'input_ids'`` from store.read/verify."""
    ts = tensors(t=64)
    fp = fp_for(ts)
    store.publish(layout, fp, C, ts)
    path = layout.object_path(fp)
    good = path.read_bytes()
    key = f'"{name}":'.encode()
    assert good.count(key) == 1
    at = good.index(key) + 1
    path.write_bytes(good[:at] + bytes([good[at] ^ 0x01]) + good[at + 1:])
    bad = store.verify(layout, fp, C)
    assert bad is not None and fp in bad and name in bad
    with pytest.raises(IntegrityError, match=fp):
        store.read(layout, fp, C, verify_tokens=True)
    assert not store.exists(layout, fp)  # quarantined: the next request is a demand miss


def test_regression_a_consistent_header_edit_is_refused_as_off_the_writers_layout():
    """The content hash covers the data section, not the header that carries it, so a
    header whose entries were changed consistently (two same-sized tensors' offsets swapped: an fp8 capture of one
    layer has float32 scales [T, 1] and int32 input_ids [T], 4T bytes each) read as valid, each tensor over the
    other's bytes. The offsets must now be the writer's layout (by item size, then name, back to back)."""
    t = 8
    data = bytes(range(256))[: 4 * t * 2 + t]  # scales, then input_ids, then loss_mask
    good = {"hidden_scales": {"dtype": "F32", "shape": [t, 1], "data_offsets": [0, 4 * t]},
            "input_ids": {"dtype": "I32", "shape": [t], "data_offsets": [4 * t, 8 * t]},
            "loss_mask": {"dtype": "U8", "shape": [t], "data_offsets": [8 * t, 9 * t]}}
    buf = bytearray(data)
    got = store._tensors_from_buffer(buf, good, 0, "fp-x")
    assert got["input_ids"].shape == (t,) and bytes(got["loss_mask"].numpy()) == data[8 * t:]
    swapped = {**good, "hidden_scales": {**good["hidden_scales"], "data_offsets": [4 * t, 8 * t]},
               "input_ids": {**good["input_ids"], "data_offsets": [0, 4 * t]}}
    with pytest.raises(IntegrityError, match="fp-x.*'hidden_scales' begins at data offset 32, not 0"):
        store._tensors_from_buffer(buf, swapped, 0, "fp-x")
    short = {k: v for k, v in good.items() if k != "loss_mask"}  # a tensor dropped: bytes left undescribed
    with pytest.raises(IntegrityError, match="end at data offset 64 of 72"):
        store._tensors_from_buffer(buf, short, 0, "fp-x")
