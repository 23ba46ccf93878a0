"""EAGLE-3's chunked training-time-test attention: per-chunk masks equal the dense mask's visible columns, the
chunked path's loss and gradients equal the dense path's (padding, holes, packing, the sync-free loss), and no
mask or saved tensor grows with steps·T²."""

from __future__ import annotations

import pytest
import torch

import artcache.trainers.eagle3.model as e3model
from artcache.errors import ConfigError
from artcache.trainers.eagle3.loss import eagle3_loss
from artcache.trainers.eagle3.model import build_ttt_mask, default_attn_chunk, ttt_chunk_mask
from tests.unit.test_packing import (
    LENGTHS,
    _one_thread,  # noqa: F401  (autouse: one torch thread)
    assert_close_grads,
    documents,
    eagle3_model,
    grads,
    packed,
    rel,
    unpacked,
)


@pytest.mark.parametrize("chunk", [1, 3, 4, 11])
def test_chunk_mask_is_the_dense_mask_restricted_to_its_keys(chunk):
    """Rows [a, e) of step i: the chunk mask is the dense mask's columns of step-0 keys [0, e) and of positions
    [a, e) of steps 1..i, element for element, and every other column of the dense rows is False."""
    T, S = 11, 4
    g = torch.Generator().manual_seed(0)
    key_valid = torch.rand(2, T, generator=g) > 0.3
    docs = torch.tensor([[0] * 4 + [1] * 5 + [-1] * 2, [0] * 11])
    for kw in ({}, {"key_valid": key_valid}, {"doc_ids": docs}, {"doc_ids": docs, "key_valid": key_valid}):
        dense = build_ttt_mask(T, S, **kw)
        for i in range(S):
            for a in range(0, T, chunk):
                e = min(a + chunk, T)
                cols = list(range(e)) + [k * T + p for k in range(1, i + 1) for p in range(a, e)]
                got = ttt_chunk_mask(a, e, i, **kw)
                ref = dense[:, :, a:e][..., cols]
                assert got.shape[-2:] == (e - a, e + i * (e - a)) and got.dtype == torch.bool
                assert torch.equal(got.expand_as(ref) if got.shape[0] < ref.shape[0] else got, ref), (kw, i, a)
                rest = sorted(set(range((i + 1) * T)) - set(cols))
                assert not dense[:, :, a:e][..., rest].any()


def test_chunk_mask_refuses_a_bad_range():
    with pytest.raises(ConfigError, match="start"):
        ttt_chunk_mask(4, 4, 0)
    with pytest.raises(ConfigError, match="step"):
        ttt_chunk_mask(0, 4, -1)


def _holes(docs):
    """The unpacked batch with invalid positions inside the rows (not a right-padded prefix): the key mask is used."""
    hid, ids, lm, valid = unpacked(docs)
    valid = valid.clone()
    valid[0, 3] = valid[1, 1] = valid[2, 10] = False
    return hid, ids, lm, valid


def _batch(case):
    docs = documents(LENGTHS, 4, seed=3)
    if case == "padded":
        return (*unpacked(docs), {})
    if case == "holes":
        return (*_holes(docs), {})
    hid, ids, lm, valid, doc_ids, pos, _ = packed(docs, pack_tokens=40)
    return hid, ids, lm, valid, {"doc_ids": doc_ids, "position_ids": pos}


def _step(model, hid, ids, lm, valid, extra, **kw):
    model.zero_grad()
    loss, stats = eagle3_loss(model, hid[:, :, :3], hid[:, :, 3], ids, lm, valid, **extra, **kw)
    loss.backward()
    return loss.detach(), stats, grads(model)


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("case", ["padded", "holes", "packed"])
def test_chunked_ttt_attention_equals_dense(case, sync_free):
    """float64: loss, every gradient and the stats of the chunked attention equal the dense mask's, for chunks of
    1, 7 (not dividing T), 8 and T - 1 positions."""
    model = eagle3_model()
    hid, ids, lm, valid, extra = _batch(case)
    T = ids.shape[1]
    d_loss, d_stats, d_grads = _step(model, hid, ids, lm, valid, extra, sync_free=sync_free, attn_chunk=T)
    assert int(d_stats.kept.sum()) > 0
    for chunk in (1, 7, 8, T - 1):
        assert T % 7
        c_loss, c_stats, c_grads = _step(model, hid, ids, lm, valid, extra, sync_free=sync_free, attn_chunk=chunk)
        assert rel(c_loss, d_loss) <= 1e-5, chunk
        assert_close_grads(c_grads, d_grads)
        assert torch.equal(c_stats.kept, d_stats.kept) and torch.equal(c_stats.total, d_stats.total)
        assert torch.allclose(c_stats.loss_sum, d_stats.loss_sum, rtol=1e-5, atol=0)


def test_chunked_forward_without_grad_equals_dense():
    """Without autograd (evaluation) the chunks run plainly and give the dense path's outputs."""
    model = eagle3_model()
    hid, ids, lm, valid, extra = _batch("holes")
    with torch.no_grad():
        dense = model(hid[:, :, :3], ids, valid, attn_chunk=ids.shape[1])
        chunked = model(hid[:, :, :3], ids, valid, attn_chunk=5)
    for a, b in zip(dense, chunked, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_attn_chunk_must_be_a_positive_int():
    model = eagle3_model()
    hid, ids, lm, valid, extra = _batch("padded")
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ConfigError, match="attn_chunk"):
            model(hid[:, :, :3], ids, valid, attn_chunk=bad)


def _record(monkeypatch):
    """Count every chunk mask built (its numel) and refuse the dense mask."""
    sizes = []
    real = e3model.ttt_chunk_mask

    def spy(*args, **kw):
        out = real(*args, **kw)
        sizes.append(out.numel())
        return out

    def dense(*args, **kw):
        raise AssertionError("the dense TTT mask was built")

    monkeypatch.setattr(e3model, "ttt_chunk_mask", spy)
    monkeypatch.setattr(e3model, "build_ttt_mask", dense)
    return sizes


def _saved_numel(model, T, attn_chunk, b=2):
    """Bytes of the distinct storages autograd keeps for backward over one forward of T positions (outside the
    chunks' checkpoints; a tensor saved by many chunks, or a view of one, counts once)."""
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(b, T, 3, 16, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 39, (b, T), generator=g)
    valid = torch.ones(b, T, dtype=torch.bool)
    valid[0, 40] = False  # not a prefix: the masks carry the batch dimension
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = model(aux, ids, valid, attn_chunk=attn_chunk)
    sum(o.sum() for o in outs).backward()
    return sum(storages.values())


def test_chunked_masks_and_saved_tensors_do_not_grow_with_steps_times_t_squared(monkeypatch):
    """Chunks of 8, 3 steps: no mask built holds more than b·C·(T + (steps-1)·C) booleans, and what autograd keeps
    for backward is linear in T (its second difference over T = 64, 128, 192 is exactly 0: no mask, gathered keys
    or score matrix outlives its chunk). The dense path's second difference is positive (the same measure sees
    its [T, steps·T] mask)."""
    model = eagle3_model()
    C, b, steps = 8, 2, model.cfg.ttt_steps

    def second_difference(chunk_of):
        n1, n2, n3 = (_saved_numel(model, T, chunk_of(T), b) for T in (64, 128, 192))
        return n3 - 2 * n2 + n1

    assert second_difference(lambda T: T) > 0
    sizes = _record(monkeypatch)
    assert second_difference(lambda T: C) == 0
    assert max(sizes) <= b * C * (192 + (steps - 1) * C)
    # forward and the backward's recomputation: every (step, chunk) twice
    assert len(sizes) == 2 * steps * (64 + 128 + 192) // C


def test_default_chunk_is_dense_up_to_the_device_limit():
    """Dense (the length itself) up to 4,096 positions on an accelerator and up to 1,024 on a CPU; chunks of 1,024
    above."""
    assert e3model.TTT_DENSE_MAX_LEN == 4096 and e3model.TTT_ATTN_CHUNK == 1024
    for dev, dense_max in (("cuda", 4096), (torch.device("cuda:1"), 4096), ("cpu", 1024)):
        assert default_attn_chunk(dense_max, dev) == dense_max
        assert default_attn_chunk(7, dev) == 7
        assert default_attn_chunk(dense_max + 1, dev) == 1024
        assert default_attn_chunk(32768, dev) == 1024


def test_long_samples_choose_the_chunked_path(monkeypatch):
    """Above the default chunk on a CPU the forward never builds the dense mask; at or below it, it does."""
    model = eagle3_model()
    hid, ids, lm, valid, extra = _batch("padded")
    T = ids.shape[1]
    monkeypatch.setattr(e3model, "TTT_ATTN_CHUNK", 8)
    sizes = _record(monkeypatch)
    with torch.no_grad():
        model(hid[:, :, :3], ids, valid)
    assert len(sizes) == model.cfg.ttt_steps * -(-T // 8)
    monkeypatch.setattr(e3model, "TTT_ATTN_CHUNK", T)
    with pytest.raises(AssertionError, match="dense TTT mask"):
        model(hid[:, :, :3], ids, valid)
