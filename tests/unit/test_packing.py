"""Packing changes nothing but speed: a packed batch's loss and gradients equal those of the same documents
unpacked, with the same anchors (DFlash, EAGLE-3, DSpark), and the packer is a function of the plan alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from artcache.errors import ConfigError, DataError
from artcache.plan import EpochOrder
from artcache.trainers.dflash import DFlashConfig, DFlashDraft
from artcache.trainers.dflash.anchors import eligible_anchors
from artcache.trainers.dflash.loss import dflash_loss
from artcache.trainers.dspark import DSparkConfig, DSparkDraft
from artcache.trainers.dspark.loss import dspark_loss
from artcache.trainers.eagle3.config import Eagle3Config
from artcache.trainers.eagle3.loss import eagle3_loss
from artcache.trainers.eagle3.model import Eagle3Draft
from artcache.trainers.eagle3.vocab import build_vocab_map
from artcache.trainers.packing import (
    Packer,
    doc_eligible_anchors,
    pack_rows,
    packed_layout,
    sample_packed_anchors,
)

V, H = 40, 16
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- documents, unpacked and packed ------------------------------------------------------------------

def documents(lengths, m, seed=0):
    """Documents with prompt (unsupervised) and response (supervised) spans: (hidden [n, m, H] float64, ids [n],
    loss mask [n] bool) each."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        hid = torch.randn(n, m, H, generator=g, dtype=torch.float64)
        ids = torch.randint(0, V - 1, (n,), generator=g)
        lm = torch.zeros(n, dtype=torch.bool)
        lm[max(1, n // 4):] = True
        lm[n // 2] = False  # a gap inside the response
        docs.append((hid, ids, lm))
    return docs


def unpacked(docs):
    """One row per document, right-padded: hidden [D, T, m, H], ids, loss mask, valid [D, T]."""
    t = max(d[1].numel() for d in docs)
    D, m = len(docs), docs[0][0].shape[1]
    hid = torch.zeros(D, t, m, H, dtype=torch.float64)
    ids = torch.zeros(D, t, dtype=torch.long)
    lm = torch.zeros(D, t, dtype=torch.bool)
    valid = torch.zeros(D, t, dtype=torch.bool)
    for i, (h, x, mk) in enumerate(docs):
        n = x.numel()
        hid[i, :n], ids[i, :n], lm[i, :n], valid[i, :n] = h, x, mk, True
    return hid, ids, lm, valid


def packed(docs, pack_tokens, rows=8):
    """The documents packed by :func:`pack_rows`: hidden, ids, loss mask, valid, doc_ids, position_ids
    [R, T...] and the placement (row, offset, length) of each document."""
    lengths = [d[1].numel() for d in docs]
    row_of = pack_rows(lengths, rows, pack_tokens, len(docs))
    assert len(row_of) == len(docs)
    doc_ids, pos, place = packed_layout(lengths, row_of)
    R, t = doc_ids.shape
    m = docs[0][0].shape[1]
    hid = torch.zeros(R, t, m, H, dtype=torch.float64)
    ids = torch.zeros(R, t, dtype=torch.long)
    lm = torch.zeros(R, t, dtype=torch.bool)
    for (h, x, mk), (r, off, n) in zip(docs, place, strict=True):
        hid[r, off:off + n], ids[r, off:off + n], lm[r, off:off + n] = h, x, mk
    return hid, ids, lm, doc_ids >= 0, doc_ids, pos, place


def unpack_anchors(anchors, valid, doc_ids, pos, D):
    """Packed anchors -> the same anchors per document: [D, M] (document-local positions) and their validity."""
    per = [[] for _ in range(D)]
    for r in range(anchors.shape[0]):
        for a, ok in zip(anchors[r].tolist(), valid[r].tolist(), strict=True):
            if ok:
                per[int(doc_ids[r, a])].append(int(pos[r, a]))
    m = max(1, max(len(p) for p in per))
    out = torch.zeros(D, m, dtype=torch.long)
    ok = torch.zeros(D, m, dtype=torch.bool)
    for d, p in enumerate(per):
        out[d, :len(p)] = torch.tensor(p, dtype=torch.long)
        ok[d, :len(p)] = True
    return out, ok


def grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        scale = max(float(b[k].abs().max()), 1e-12)
        assert float((a[k] - b[k]).abs().max()) <= RTOL * scale, k


def rel(a, b):
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-12)


LENGTHS = [13, 7, 22, 5, 18, 9, 30, 11]


# ---- the packer -------------------------------------------------------------------------------------------

def test_pack_rows_fills_rows_first_fit_and_stops_at_rows_and_positions():
    assert pack_rows([5, 5, 5, 5, 5], rows=2, pack_tokens=10, max_positions=99) == (0, 0, 1, 1)
    assert pack_rows([6, 5, 4, 10], rows=9, pack_tokens=10, max_positions=99) == (0, 1, 0, 2)  # 4 fills row 0
    assert pack_rows([1] * 20, rows=3, pack_tokens=10, max_positions=7) == (0,) * 7
    assert pack_rows([3, 3], rows=4, pack_tokens=10, max_positions=99) == (0, 0)  # the lengths run out
    # a step ends at the first position that fits no row once every row is open
    assert pack_rows([8, 8, 3, 2, 5], rows=2, pack_tokens=10, max_positions=99) == (0, 1)
    assert pack_rows([8, 8, 2, 2, 5], rows=2, pack_tokens=10, max_positions=99) == (0, 1, 0, 1)
    with pytest.raises(ConfigError, match="--pack-tokens 10"):
        pack_rows([11], rows=1, pack_tokens=10, max_positions=5)


def test_packer_depends_on_the_plan_only_and_refuses_a_short_row():
    lengths = np.array([12, 3, 40, 7, 7, 25, 1, 9, 33, 18], dtype=np.int64)
    order = EpochOrder(10, 10, seed=3)
    a = Packer(lengths, order, rows=2, pack_tokens=40, max_positions=64)
    b = Packer(lengths, EpochOrder(10, 10, seed=3), rows=2, pack_tokens=40, max_positions=64)
    walk = [a.step(p) for p in (0, a.step_positions(0))]
    assert walk == [b.step(p) for p in (0, b.step_positions(0))]  # a resumed run packs the same rows
    assert a.step(0) == (0, 0, 1, 0, 0)  # [12, 3, 7, 7] and [40]: the 7s fill the room the 40 left in row 0
    end = a.end_after(5)
    assert end == sum(a.step_positions(p) for p in _starts(a, 5))
    assert a.steps_within(end) == 5
    with pytest.raises(ConfigError, match="--pack-tokens 39 is below the plan's longest sample"):
        Packer(lengths, order, rows=2, pack_tokens=39, max_positions=64)


def _starts(packer, steps):
    p, out = 0, []
    for _ in range(steps):
        out.append(p)
        p += packer.step_positions(p)
    return out


def test_packed_anchors_are_drawn_per_document_inside_it():
    docs = documents(LENGTHS, 1)
    _, _, lm, valid, doc_ids, pos, place = packed(docs, pack_tokens=40)
    g = torch.Generator().manual_seed(0)
    n = 4
    anchors, ok = sample_packed_anchors(lm & valid, doc_ids, n, g)
    elig = doc_eligible_anchors(lm & valid, doc_ids)
    per_doc = torch.zeros(len(docs), dtype=torch.long)
    for r in range(anchors.shape[0]):
        a = anchors[r][ok[r]]
        assert torch.equal(a, a.sort().values) and elig[r, a].all()
        assert (doc_ids[r, a + 1] == doc_ids[r, a]).all()  # its slot 1 lies in its document
        for x in a.tolist():
            per_doc[doc_ids[r, x]] += 1
    for d, (_, _x, mk) in enumerate(docs):  # as many as the document alone draws: min(N, its eligible)
        assert int(per_doc[d]) == min(n, int(eligible_anchors(mk[None]).sum()))


# ---- DFlash -------------------------------------------------------------------------------------------------

def dflash_model(cls=DFlashDraft, cfg_cls=DFlashConfig, **kw):
    torch.manual_seed(0)
    base = dict(hidden_size=H, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                vocab_size=V, num_context_layers=2, mask_token_id=V - 1, block_size=4, num_anchors=6)
    base.update(kw)
    emb, head = torch.randn(V, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64) * 0.3
    if cls is DSparkDraft:
        return cls(cfg_cls(**base, markov_rank=6), emb, head, torch.rand(H, dtype=torch.float64) + 0.5,
                   dtype=torch.float64)
    return cls(cfg_cls(**base), emb, head, dtype=torch.float64)


def _dflash_step(model, hid, ids, lm, valid, anchors, avalid, doc_ids=None, pos=None):
    model.zero_grad()
    out = model(hid, ids, anchors, avalid, context_valid=valid, doc_ids=doc_ids, position_ids=pos)
    loss, stats = dflash_loss(model, out, ids, lm, anchors, avalid, context_valid=valid, doc_ids=doc_ids)
    loss.backward()
    return loss.detach(), stats, grads(model)


@pytest.mark.parametrize("attn", ["sdpa", "dense"])
def test_dflash_packed_loss_and_gradients_equal_unpacked(attn):
    model = dflash_model()
    model.attn_impl = attn
    docs = documents(LENGTHS, 2)
    p_hid, p_ids, p_lm, p_valid, doc_ids, pos, _ = packed(docs, pack_tokens=40)
    anchors, avalid = sample_packed_anchors(p_lm & p_valid, doc_ids, 6, torch.Generator().manual_seed(1))
    p_loss, p_stats, p_grads = _dflash_step(model, p_hid, p_ids, p_lm, p_valid, anchors, avalid, doc_ids, pos)
    u_anchors, u_valid = unpack_anchors(anchors, avalid, doc_ids, pos, len(docs))
    u_hid, u_ids, u_lm, u_valid_tok = unpacked(docs)
    u_loss, u_stats, u_grads = _dflash_step(model, u_hid, u_ids, u_lm, u_valid_tok, u_anchors, u_valid)
    assert rel(p_loss, u_loss) <= RTOL
    assert_close_grads(p_grads, u_grads)
    for f in ("correct", "total", "tau_sum", "num_blocks"):
        assert torch.equal(getattr(p_stats, f), getattr(u_stats, f)), f
    assert rel(p_stats.weight_sum, u_stats.weight_sum) <= 1e-12
    # the weighted combination of the documents' own losses (each alone, weight Σ w of its blocks)
    num = den = 0.0
    for d, doc in enumerate(docs):
        h1, x1, m1, v1 = unpacked([doc])
        n = int(u_valid[d].sum())
        if not n:
            continue
        loss_d, st, _ = _dflash_step(model, h1, x1, m1, v1, u_anchors[d:d + 1, :n], u_valid[d:d + 1, :n])
        num, den = num + float(loss_d) * float(st.weight_sum), den + float(st.weight_sum)
    assert rel(p_loss, num / den) <= RTOL


def test_dflash_packed_block_sees_nothing_of_another_document():
    """Perturbing every other document changes nothing in a document's packed blocks."""
    model = dflash_model()
    docs = documents(LENGTHS[:4], 2)
    p_hid, p_ids, p_lm, p_valid, doc_ids, pos, place = packed(docs, pack_tokens=60)
    anchors, avalid = sample_packed_anchors(p_lm & p_valid, doc_ids, 6, torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(p_hid, p_ids, anchors, avalid, context_valid=p_valid, doc_ids=doc_ids, position_ids=pos)
        other = doc_ids != 1
        hid2 = torch.where(other[..., None, None], torch.randn_like(p_hid), p_hid)
        ids2 = torch.where(other, torch.randint_like(p_ids, 0, V - 1), p_ids)
        out2 = model(hid2, ids2, anchors, avalid, context_valid=p_valid, doc_ids=doc_ids, position_ids=pos)
    mine = avalid & (doc_ids.gather(1, anchors) == 1)
    assert mine.any()
    assert torch.allclose(out[mine], out2[mine], rtol=0, atol=1e-12)


# ---- DSpark -------------------------------------------------------------------------------------------------

def _dspark_step(model, hid, ids, lm, valid, anchors, avalid, doc_ids=None, pos=None):
    model.zero_grad()
    ctx, last = hid[:, :, :2], hid[:, :, 2]
    out = model(ctx, ids, anchors, avalid, context_valid=valid, doc_ids=doc_ids, position_ids=pos)
    loss, res = dspark_loss(model, out, last, ids, lm, anchors, avalid, context_valid=valid, doc_ids=doc_ids)
    loss.backward()
    return loss.detach(), res, grads(model)


def test_dspark_packed_loss_and_gradients_equal_unpacked():
    model = dflash_model(DSparkDraft, DSparkConfig, num_layers=1)
    docs = documents(LENGTHS, 3, seed=2)
    p_hid, p_ids, p_lm, p_valid, doc_ids, pos, _ = packed(docs, pack_tokens=40)
    anchors, avalid = sample_packed_anchors(p_lm & p_valid, doc_ids, 6, torch.Generator().manual_seed(2))
    p_loss, p_res, p_grads = _dspark_step(model, p_hid, p_ids, p_lm, p_valid, anchors, avalid, doc_ids, pos)
    u_anchors, u_valid = unpack_anchors(anchors, avalid, doc_ids, pos, len(docs))
    u_loss, u_res, u_grads = _dspark_step(model, *unpacked(docs), u_anchors, u_valid)
    assert rel(p_loss, u_loss) <= RTOL
    assert_close_grads(p_grads, u_grads)
    assert int(p_res.supervised.sum()) == int(u_res.supervised.sum()) > 0
    for f in ("ce_sum", "l1_sum", "conf_sum", "weight_sum"):
        assert rel(getattr(p_res, f), getattr(u_res, f)) <= RTOL, f
    num = den = 0.0
    for d, doc in enumerate(docs):
        n = int(u_valid[d].sum())
        if not n:
            continue
        loss_d, res, _ = _dspark_step(model, *unpacked([doc]), u_anchors[d:d + 1, :n], u_valid[d:d + 1, :n])
        num, den = num + float(loss_d) * float(res.weight_sum), den + float(res.weight_sum)
    assert rel(p_loss, num / den) <= RTOL


# ---- EAGLE-3 ------------------------------------------------------------------------------------------------

def eagle3_model():
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=H, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, vocab_size=V,
                       draft_vocab_size=24, ttt_steps=3)
    emb = torch.randn(V, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64) * 0.3
    counts = torch.zeros(V, dtype=torch.long)
    counts[torch.arange(0, V, 2)] = 5
    counts[torch.arange(1, 9, 2)] = 3
    d2t, t2d = build_vocab_map(counts, 24)
    return Eagle3Draft(cfg, emb, 1 + 0.1 * torch.randn(H, dtype=torch.float64), head, d2t, t2d,
                       dtype=torch.float64)


def _eagle3_step(model, hid, ids, lm, valid, doc_ids=None, pos=None):
    model.zero_grad()
    loss, stats = eagle3_loss(model, hid[:, :, :3], hid[:, :, 3], ids, lm, valid, doc_ids=doc_ids, position_ids=pos)
    loss.backward()
    return loss.detach(), stats, grads(model)


def test_eagle3_packed_loss_and_gradients_equal_unpacked():
    model = eagle3_model()
    docs = documents(LENGTHS, 4, seed=3)
    p_hid, p_ids, p_lm, p_valid, doc_ids, pos, _ = packed(docs, pack_tokens=40)
    p_loss, p_stats, p_grads = _eagle3_step(model, p_hid, p_ids, p_lm, p_valid, doc_ids, pos)
    u_loss, u_stats, u_grads = _eagle3_step(model, *unpacked(docs))
    assert rel(p_loss, u_loss) <= RTOL
    assert_close_grads(p_grads, u_grads)
    assert torch.equal(p_stats.kept, u_stats.kept) and int(p_stats.kept.sum()) > 0
    assert torch.equal(p_stats.correct, u_stats.correct) and torch.equal(p_stats.total, u_stats.total)
    assert torch.allclose(p_stats.loss_sum, u_stats.loss_sum, rtol=RTOL, atol=0)


def test_eagle3_packed_ttt_never_reads_another_document():
    """Every TTT step's output in a document is unchanged when every other document is replaced."""
    model = eagle3_model()
    docs = documents(LENGTHS[:4], 4, seed=3)
    p_hid, p_ids, p_lm, p_valid, doc_ids, pos, _ = packed(docs, pack_tokens=80)
    with torch.no_grad():
        outs = model(p_hid[:, :, :3], p_ids, p_valid, doc_ids=doc_ids, position_ids=pos)
        other = doc_ids != 2
        hid2 = torch.where(other[..., None, None], torch.randn_like(p_hid), p_hid)
        ids2 = torch.where(other, torch.randint_like(p_ids, 0, V - 1), p_ids)
        outs2 = model(hid2[:, :, :3], ids2, p_valid, doc_ids=doc_ids, position_ids=pos)
    mine = doc_ids == 2
    for a, b in zip(outs, outs2, strict=True):
        assert torch.allclose(a[mine], b[mine], rtol=0, atol=1e-12)


def test_dflash_flex_mask_carries_the_document_like_the_dense_mask():
    """The FlexAttention ``mask_mod`` of a packed batch equals the dense SDPA mask element for element, and the
    flex forward (eager on a CPU) gives the sdpa forward's blocks."""
    from artcache.trainers.dflash.model import build_attention_mask, dflash_mask_mod

    docs = documents(LENGTHS[:5], 2)
    p_hid, p_ids, p_lm, p_valid, doc_ids, pos, _ = packed(docs, pack_tokens=40)
    anchors, avalid = sample_packed_anchors(p_lm & p_valid, doc_ids, 3, torch.Generator().manual_seed(4))
    R, T = doc_ids.shape
    B, N = 4, anchors.shape[1]
    dense = build_attention_mask(anchors, avalid, T, B, p_valid, doc_ids)[:, 0]
    mod = dflash_mask_mod(anchors, avalid, T, B, p_valid, doc_ids)
    q = torch.arange(N * B)[:, None].expand(N * B, T + N * B)
    kv = torch.arange(T + N * B)[None].expand(N * B, T + N * B)
    for r in range(R):
        got = mod(torch.tensor(r), torch.tensor(0), q, kv)
        assert torch.equal(got, dense[r])
    model = dflash_model()
    with torch.no_grad():
        ref = model(p_hid, p_ids, anchors, avalid, context_valid=p_valid, doc_ids=doc_ids, position_ids=pos)
        model.attn_impl = "flex"
        flex = model(p_hid, p_ids, anchors, avalid, context_valid=p_valid, doc_ids=doc_ids, position_ids=pos)
    assert torch.allclose(flex, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("fp8", [False, True])
def test_collate_packed_places_each_document_as_the_unpacked_collate_does(fp8):
    """Each document's tokens in a packed batch are its row of the unpacked batch (the draft's layer view, fp8
    dequantised alike), position ids restart per document, padding is invalid and of no document."""
    import types

    from artcache.fp8 import quantize_rows
    from artcache.trainers.consumer.reader import collate
    from artcache.trainers.packing import collate_packed

    g = torch.Generator().manual_seed(0)
    items = []
    for p, n in enumerate([9, 4, 12, 3, 7]):
        hid = torch.randn(n, 4, 8, generator=g).to(torch.bfloat16)
        art = types.SimpleNamespace(input_ids=torch.randint(0, V, (n,), generator=g, dtype=torch.int32),
                                    loss_mask=(torch.rand(n, generator=g) > 0.3).to(torch.uint8),
                                    hidden_states=hid, hidden_scales=None)
        if fp8:
            art.hidden_states, art.hidden_scales = quantize_rows(hid.float())
        items.append(types.SimpleNamespace(position=10 + p, artifact=art))
    layers = torch.tensor([3, 1])
    cpu = torch.device("cpu")
    with pytest.raises(DataError, match="do not pack into 2 rows of 16 tokens"):
        collate_packed(items, cpu, rows=2, pack_tokens=16, layers=layers)  # the split the reader read is another
    got = collate_packed(items, cpu, rows=3, pack_tokens=16, layers=layers)
    ref = collate(items, cpu, layers)
    assert got.positions == tuple(range(10, 15)) and got.hidden.shape[:2] == (3, 16)  # T: the longest row
    place = _placements(got.doc_ids)
    assert place == [(0, 0, 9), (0, 9, 4), (1, 0, 12), (0, 13, 3), (2, 0, 7)]  # first fit: the 3 fills row 0
    for d, (r, off, n) in enumerate(place):
        assert torch.equal(got.hidden[r, off:off + n], ref.hidden[d, :n])
        assert torch.equal(got.input_ids[r, off:off + n], ref.input_ids[d, :n])
        assert torch.equal(got.loss_mask[r, off:off + n], ref.loss_mask[d, :n])
        assert torch.equal(got.position_ids[r, off:off + n], torch.arange(n))
    assert torch.equal(got.valid, got.doc_ids >= 0)
    assert torch.equal(got.supervised_host, got.loss_mask & got.valid)
    assert not got.loss_mask[~got.valid].any()


def _placements(doc_ids):
    """(row, offset, length) of each document of a packed batch, in document order."""
    out = []
    for d in range(int(doc_ids.max()) + 1):
        r, cols = torch.nonzero(doc_ids == d, as_tuple=True)
        out.append((int(r[0]), int(cols.min()), int(cols.numel())))
    return out


def test_bench_anchor_coverage_counts_supervised_tokens_a_block_trains_inside_its_document():
    """Slots 1 … B-1 of a valid block, supervised and inside the anchor's document, each token once."""
    import types

    from artcache.bench.packing import anchor_coverage

    lm = torch.tensor([[0, 1, 1, 1, 1, 0, 1, 1, 1, 0]], dtype=torch.bool)
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, -1]])
    batch = types.SimpleNamespace(loss_mask=lm, valid=doc_ids >= 0, doc_ids=doc_ids)
    anchors, valid = torch.tensor([[1, 2, 3, 6]]), torch.tensor([[True, True, True, False]])
    # blocks of B=3 at 1, 2, 3 train 2, 3, 4 (3, 4 again; 5 is another document); the block at 6 is invalid
    assert anchor_coverage(batch, anchors, valid, 3) == (3, 7)
    batch.doc_ids = None  # unpacked: one document per row, padding invalid
    batch.valid = torch.ones_like(lm)
    assert anchor_coverage(batch, anchors, valid, 3) == (3, 7)


# ---- the sync-free (CUDA) step on packed batches -------------------------------------------------------------

class _Art:
    def __init__(self, hidden, ids, mask) -> None:
        self.hidden_states, self.input_ids, self.loss_mask, self.hidden_scales = hidden, ids, mask, None


class _Item:
    def __init__(self, position, artifact) -> None:
        self.position, self.artifact = position, artifact


def packed_draft_batch(m, lengths=(13, 7, 22, 5, 18, 9, 30, 11), rows=4, pack_tokens=40, seed=0):
    """A packed DraftBatch as the consumer collates it on a CPU (bf16 hidden states, prompt prefix unsupervised)."""
    from artcache.trainers.packing import collate_packed
    from tests.unit.test_fast_consumer import H as FH
    from tests.unit.test_fast_consumer import V as FV

    g = torch.Generator().manual_seed(seed)
    items = []
    for p, n in enumerate(lengths):
        lm = torch.zeros(n, dtype=torch.bool)
        lm[2:] = True
        hid = torch.randn(n, m, FH, generator=g).to(torch.bfloat16)
        items.append(_Item(p, _Art(hid, torch.randint(0, FV - 2, (n,), generator=g), lm)))
    return collate_packed(items, torch.device("cpu"), rows, pack_tokens)


def test_spread_anchor_rows_repeats_a_row_per_n_anchors_and_keeps_the_blocks():
    from artcache.trainers.packing import draw_anchors, spread_anchor_rows

    batch = packed_draft_batch(2)
    anchors, valid = draw_anchors(batch, 5, torch.Generator().manual_seed(0))
    assert anchors.shape[1] > 5  # a row of several documents drew more than N
    out, a, v = spread_anchor_rows(batch, anchors, valid, 5)
    assert a.shape == v.shape and a.shape[1] == 5
    # every row's valid anchors, in order, across its copies; the copies carry the row's tensors
    got = {}
    rows = []
    for i in range(a.shape[0]):
        r = next(r for r in range(batch.input_ids.shape[0])
                 if torch.equal(out.input_ids[i], batch.input_ids[r]) and torch.equal(out.doc_ids[i], batch.doc_ids[r]))
        rows.append(r)
        got.setdefault(r, []).extend(a[i][v[i]].tolist())
        assert torch.equal(out.hidden[i], batch.hidden[r]) and torch.equal(out.position_ids[i], batch.position_ids[r])
        assert torch.equal(out.supervised_on_host()[i], batch.supervised_on_host()[r])
    want = {r: anchors[r][valid[r]].tolist() for r in range(anchors.shape[0]) if valid[r].any()}
    assert got == want
    assert rows == sorted(rows) and a.shape[0] == sum(-(-len(x) // 5) for x in want.values())
    # unpacked batches and rows within N pass through untouched
    assert spread_anchor_rows(batch, anchors, valid, anchors.shape[1])[0] is batch
    with pytest.raises(ConfigError, match="slots must be an int >= 1, got 0"):
        spread_anchor_rows(batch, anchors, valid, 0)


def test_spread_anchor_rows_rounds_the_row_count_up_with_rows_without_anchors():
    from artcache.trainers.packing import draw_anchors, spread_anchor_rows, spread_row_step

    batch = packed_draft_batch(2)
    anchors, valid = draw_anchors(batch, 5, torch.Generator().manual_seed(0))
    plain, a1, v1 = spread_anchor_rows(batch, anchors, valid, 5)
    for step in (2, 3, 4):
        out, a, v = spread_anchor_rows(batch, anchors, valid, 5, step)
        n = a1.shape[0]
        assert a.shape[0] == -(-n // step) * step and not v[n:].any()
        assert torch.equal(a[:n], a1) and torch.equal(v[:n], v1) and torch.equal(out.hidden[:n], plain.hidden)
    assert [spread_row_step(r) for r in (1, 2, 4, 5, 8, 16)] == [1, 1, 1, 2, 2, 4]
    with pytest.raises(ConfigError, match="row_step must be an int >= 1, got 0"):
        spread_anchor_rows(batch, anchors, valid, 5, 0)


def test_spread_anchor_rows_keeps_one_row_when_no_anchor_was_drawn():
    from artcache.trainers.packing import spread_anchor_rows

    batch = packed_draft_batch(2)
    anchors = torch.zeros(batch.input_ids.shape[0], 7, dtype=torch.long)
    out, a, v = spread_anchor_rows(batch, anchors, torch.zeros_like(anchors, dtype=torch.bool), 3)
    assert out.input_ids.shape[0] == 1 and a.shape == (1, 3) and not v.any()


@pytest.mark.parametrize("row_step", [1, 3])
@pytest.mark.parametrize("draft", ["dflash", "dspark"])
def test_sync_free_packed_step_equals_the_host_step(draft, row_step, monkeypatch):
    """The sync-free step (CUDA's; it computes every anchor slot, so a packed batch's anchors are spread over rows
    of N slots, the row count rounded up to a multiple of ``row_step`` with rows without anchors) gives the host
    step's loss, metric sums and gradients on a packed batch."""
    import importlib

    from artcache.trainers.packing import draw_anchors, spread_anchor_rows
    from artcache.trainers.speed import SpeedOptions
    from tests.unit.test_fast_consumer import M, _dflash, _dspark

    make = _dflash if draft == "dflash" else _dspark
    monkeypatch.setattr(importlib.import_module(f"artcache.trainers.{draft}.adapter"), "spread_row_step",
                        lambda rows: row_step)
    batch = packed_draft_batch(M)
    a, v = draw_anchors(batch, 5, torch.Generator().manual_seed(0))
    _, a2, v2 = spread_anchor_rows(batch, a, v, 5, row_step)
    assert a.shape[1] > 5 and bool((~v2).all(dim=1).any()) == (row_step == 3)  # spread; padded rows with step 3
    host, fast = make(), make(speed=SpeedOptions(sync_free=True))
    losses, sums, grads_ = [], [], []
    for d in (host, fast):
        loss, s = d.loss(batch)
        d.model.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        sums.append(s if hasattr(s, "num") else s.resolve())
        grads_.append(grads(d.model))
    assert rel(losses[1], losses[0]) <= 1e-5
    # DSpark's fused loss rounds its lm_head gradient rows in bf16, scaled by 1 / Σ w before or after the rounding
    # (test_fast_consumer's static-rows test): a bf16 ulp apart. A block read with another row's context is O(1).
    assert_close_grads_tol(grads_[1], grads_[0], 1e-4 if draft == "dflash" else 1e-2)
    for k in sums[0].den:
        assert sums[1].den[k] == pytest.approx(sums[0].den[k], rel=1e-6), k


def assert_close_grads_tol(a, b, tol):
    assert a.keys() == b.keys() and a
    for k in a:
        scale = max(float(b[k].abs().max()), 1e-12)
        assert float((a[k] - b[k]).abs().max()) <= tol * scale, k


def test_regression_dspark_packed_denominators_are_those_of_its_loss():
    """A DSpark step normalises its loss by ``loss_denominators`` (one process and groups alike). For a packed
    batch that Σ w came from a second anchor draw (the generator advanced between the two) and counted slots past
    the anchor's document: the loss was divided by another batch's Σ w (85.998 against 85.226 here)."""
    from tests.unit.test_fast_consumer import M, _dspark

    batch = packed_draft_batch(M)
    d = _dspark()
    before = d.generator.get_state()
    den = float(d.loss_denominators(batch)[0])
    assert torch.equal(d.generator.get_state(), before)
    _, sums = d.loss(batch)
    assert den == pytest.approx(sums.den["loss"], rel=1e-6)


def test_regression_packing_bench_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys,
                                                                                   smollm2_tokenizer):
    """Bug: ``python -m artcache.bench.packing`` took ``--steps -1`` and ``--rows 0`` and ended in a
    ZeroDivisionError / ConfigError traceback (exit 1), and a missing, non-directory or damaged ``--plan`` ended in a
    DataError traceback. Now each is refused in one line naming the bad value and what is accepted, a nonzero exit,
    and ``--out`` is not written (it is written atomically, only once the bench is done)."""
    from artcache.bench.packing import main
    from artcache.plan import PlanSpec, build_plan
    from tests.support import TINY_SHAREGPT

    plan = build_plan(PlanSpec(dataset=str(TINY_SHAREGPT), max_length=64, max_samples=8), smollm2_tokenizer,
                      target_vocab_size=49152)
    saved = plan.save(tmp_path / "plans")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "plan.json").write_bytes((saved / "plan.json").read_bytes())
    body = bytearray((saved / "plan.safetensors").read_bytes())
    body[-5] ^= 0xFF
    (damaged / "plan.safetensors").write_bytes(bytes(body))
    out = tmp_path / "o" / "packing.json"
    base = ["--out", str(out), "--arch", "tiny-llama", "--threads", "1", "--walk", "4", "--anchors", "4",
            "--block-size", "4"]
    cases = [(["--plan", str(saved), "--steps", "-1"], "--steps -1 is not accepted: an integer >= 0"),
             (["--plan", str(saved), "--rows", "0"], "--rows 0 is not accepted: an integer >= 1"),
             (["--plan", str(tmp_path / "missing")], "is not a directory: give a saved plan directory"),
             (["--plan", str(saved / "plan.json")], "is not a directory: give a saved plan directory"),
             (["--plan", str(damaged), "--steps", "0"], "is damaged (plan.safetensors does not match")]
    for extra, needle in cases:
        with pytest.raises(SystemExit) as got:
            main(base + extra)
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert got.value.code not in (0, None) and len(err) == 1 and needle in err[0], (extra, got.value.code, err)
        assert not out.exists() and not out.parent.exists(), extra
    main(base + ["--plan", str(saved), "--steps", "0"])
    assert json.loads(out.read_text())["plan"]["samples"] == len(plan)


def test_regression_packing_bench_names_a_plan_too_short_for_its_steps(tmp_path, capsys, smollm2_tokenizer):
    """Bug: ``python -m artcache.bench.packing --plan DIR --steps N`` on a plan too short for N steps ended with
    "--samples 8 is too few for the steps asked; raise --samples" (exit 1), though --samples does not apply to a
    saved plan. Now one line says the plan ran out and what is accepted (fewer --steps or --rows, or a plan of more
    samples), exit 2, and --out is not written."""
    from artcache.bench.packing import main
    from artcache.plan import PlanSpec, build_plan
    from tests.support import TINY_SHAREGPT

    plan = build_plan(PlanSpec(dataset=str(TINY_SHAREGPT), max_length=64, max_samples=8), smollm2_tokenizer,
                      target_vocab_size=49152)
    out = tmp_path / "packing.json"
    with pytest.raises(SystemExit) as got:
        main(["--out", str(out), "--arch", "tiny-llama", "--threads", "1", "--walk", "4", "--anchors", "4",
              "--block-size", "4", "--draft", "dspark", "--plan", str(plan.save(tmp_path / "plans")), "--steps", "20"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln.lower()]  # progress lines aside
    assert got.value.code == 2 and len(err) == 1, (got.value.code, err)
    assert f"the plan's {len(plan)} samples ran out after" in err[0] and "accepted: fewer --steps or --rows" in err[0]
    assert not out.exists()
