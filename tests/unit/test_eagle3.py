"""Tests for the EAGLE-3 draft: layer ids, config, vocab map, TTT attention and shift, loss, metrics,
training, padding, export, and the target's final norm."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch
import torch.nn.functional as F

from artcache.errors import ConfigError, DataError
from artcache.layer_ids import eagle3_capture_ids, eagle3_layer_ids, output_of_layer_to_vllm_id
from artcache.plan import Plan
from artcache.target import load_final_norm, resolve_target
from artcache.trainers.dflash.model import _rope
from artcache.trainers.eagle3 import (
    EAGLE3_LAST_LAYER,
    Eagle3Config,
    Eagle3Draft,
    Eagle3Stats,
    build_ttt_mask,
    build_vocab_map,
    count_plan_tokens,
    draft_ids_to_target,
    eagle3_loss,
    export_config,
    export_state_dict,
    supervision_masks,
    target_soft_labels,
    ttt_input_ids,
)

V, VD, H = 40, 16, 32  # tiny target vocab, draft vocab, width


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine OpenMP threads that spin
    against other processes make these tests 10-100x slower; restore the setting afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_cfg(**kw) -> Eagle3Config:
    base = dict(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=V,
                draft_vocab_size=VD, ttt_steps=3)
    base.update(kw)
    return Eagle3Config(**base)


def tiny_model(seed: int = 0, dtype=torch.float64, head_scale: float = 0.3, used=None, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = tiny_cfg(**kw)
    emb = torch.randn(cfg.vocab_size, H, dtype=dtype)
    head = torch.randn(cfg.vocab_size, H, dtype=dtype) * head_scale
    norm_w = 1 + 0.1 * torch.randn(H, dtype=dtype)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.long)
    counts[torch.arange(0, cfg.vocab_size, 2) if used is None else used] = 5
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    return Eagle3Draft(cfg, emb, norm_w, head, d2t, t2d, dtype=dtype)


def tiny_batch(b=2, T=10, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(b, T, 3, H, generator=g, dtype=dtype)
    last = torch.randn(b, T, H, generator=g, dtype=dtype)
    ids = torch.randint(0, V, (b, T), generator=g)
    lm = torch.rand(b, T, generator=g) < 0.7
    return aux, last, ids, lm


# ------------------------------------------------------------------------------------- layer ids

def test_layer_ids_goldens_and_vllm_default():
    assert eagle3_layer_ids(30) == [1, 14, 26]
    assert eagle3_layer_ids(36) == [1, 17, 32]
    assert eagle3_capture_ids(30) == [1, 14, 26, 29] and eagle3_capture_ids(36) == [1, 17, 32, 35]
    assert EAGLE3_LAST_LAYER(30) == 29 and EAGLE3_LAST_LAYER(36) == 35
    assert [output_of_layer_to_vllm_id(i) for i in eagle3_layer_ids(30)] == [2, 15, 27]
    for L in range(5, 80):  # the same layers as vLLM's default (2, L//2, L-3), which is input-of-layer
        assert [output_of_layer_to_vllm_id(i) for i in eagle3_layer_ids(L)] == [2, L // 2, L - 3]
    assert eagle3_layer_ids(6) == [1, 2, 2]
    for bad in (4, 0, -3, 30.0, True):
        with pytest.raises(ConfigError):
            eagle3_layer_ids(bad)


# ---------------------------------------------------------------------------------------- config

def test_config_defaults_roundtrip_and_rejects():
    cfg = tiny_cfg(ttt_steps=7)
    assert cfg.loss_decay == 0.8 and cfg.ttt_steps == 7
    assert cfg.step_weights() == pytest.approx([0.8 ** i for i in range(7)])
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=Eagle3Config) == cfg
    raw = msgspec.json.decode(msgspec.json.encode(cfg))
    raw["bogus"] = 1
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(raw), type=Eagle3Config)
    for kw in (dict(draft_vocab_size=V + 1), dict(draft_vocab_size=0), dict(ttt_steps=0), dict(num_heads=3),
               dict(head_dim=7), dict(loss_decay=0.0), dict(loss_decay=float("inf")), dict(rope_theta=-1.0),
               dict(hidden_size=2.5), dict(logit_chunk=True)):
        with pytest.raises(ConfigError):
            tiny_cfg(**kw)


def test_from_target():
    from transformers import Qwen3Config

    tc = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=96, vocab_size=100, num_hidden_layers=8, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    cfg = Eagle3Config.from_target(tc, draft_vocab_size=32)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size) == (96, 100, 32)
    assert cfg.rope_theta == 1_000_000.0 and cfg.rms_norm_eps == 1e-5 and cfg.ttt_steps == 7
    assert Eagle3Config.from_target(tc, draft_vocab_size=32000).draft_vocab_size == 100  # clamped to V


# ------------------------------------------------------------------------------------- vocab map

def test_vocab_map_hand_example():
    counts = torch.tensor([0, 5, 3, 5, 0, 9, 1, 3])
    d2t, t2d = build_vocab_map(counts, 4)
    # top-4 by count, ties by smaller id: 5 (9), 1 (5), 3 (5), 2 (3) [7 also has 3 but a larger id]
    used = torch.arange(4) + d2t
    assert used.tolist() == [1, 2, 3, 5] and d2t.tolist() == [1, 1, 1, 2]
    assert t2d.tolist() == [False, True, True, True, False, True, False, False]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert draft_ids_to_target(torch.tensor([0, 3, 2]), d2t).tolist() == [1, 5, 3]
    # padding: only 3 ids seen, V_d = 5 -> the two smallest unseen ids (0, 1) fill up
    d2t, t2d = build_vocab_map(torch.tensor([0, 0, 4, 0, 2, 7]), 5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 5]


def test_vocab_map_properties_and_determinism():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        n = int(torch.randint(1, 60, (1,), generator=g))
        counts = torch.randint(0, 4, (n,), generator=g) * (torch.rand(n, generator=g) < 0.5)
        vd = int(torch.randint(1, n + 3, (1,), generator=g))
        d2t, t2d = build_vocab_map(counts, vd)
        d2t2, t2d2 = build_vocab_map(counts.clone(), vd)
        assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
        k = min(vd, n)
        used = torch.arange(k) + d2t
        assert d2t.shape == (k,) and t2d.shape == (n,) and int(t2d.sum()) == k
        assert torch.equal(used, t2d.nonzero().squeeze(1))  # ascending, consistent with t2d
        if k < n:  # every kept id has a count >= every dropped id's count
            assert int(counts[t2d].min()) >= int(counts[~t2d].max())
        else:
            assert (d2t == 0).all() and t2d.all()  # identity map
    with pytest.raises(ConfigError):
        build_vocab_map(torch.tensor([1, 2]), 0)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([1, -1]), torch.zeros(2, 2, dtype=torch.long)):
        with pytest.raises(DataError):
            build_vocab_map(bad, 1)


def test_count_plan_tokens():
    ids = torch.tensor([3, 1, 1, 4, 1, 5, 9, 2, 6, 5], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    plan = Plan("p", ids, mask, torch.tensor([0, 4, 10]), {"target_vocab_size": 12})
    counts = count_plan_tokens(plan)
    expected = torch.zeros(12, dtype=torch.long)
    for i, m in zip(ids.tolist(), mask.tolist(), strict=True):
        expected[i] += m
    assert torch.equal(counts, expected) and counts.dtype == torch.long
    assert count_plan_tokens(plan, vocab_size=20).shape == (20,)
    with pytest.raises(DataError):
        count_plan_tokens(plan, vocab_size=9)
    with pytest.raises(ConfigError):
        count_plan_tokens(Plan("p", ids, mask, torch.tensor([0, 10]), {}))


# --------------------------------------------------------------------------- TTT attention / shift

def test_ttt_mask_hand_check():
    m = build_ttt_mask(3, 2)
    assert m.shape == (1, 1, 3, 6) and m.dtype == torch.bool
    # columns: step-0 keys at positions 0,1,2 | step-1 keys at 0,1,2
    assert m[0, 0].int().tolist() == [
        [1, 0, 0, 1, 0, 0],  # query t=0: step-0 key 0; at step 1 also its own step-1 key
        [1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    # step 0 uses the first T columns only: plain causal
    assert m[0, 0, :, :3].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    kv = torch.tensor([[False, True, True]])  # position 0 is padding: hidden as a step-0 key, but
    mk = build_ttt_mask(3, 2, kv)  # every query keeps its own diagonal
    assert mk[0, 0].int().tolist() == [[1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 1]]


def test_ttt_input_ids_shift():
    ids = torch.tensor([[10, 11, 12, 13]])
    assert ttt_input_ids(ids, 0).tolist() == [[11, 12, 13, 0]]
    assert ttt_input_ids(ids, 1).tolist() == [[12, 13, 0, 0]]
    assert ttt_input_ids(ids, 3).tolist() == [[0, 0, 0, 0]]


def _reference_forward(model: Eagle3Draft, aux, ids, steps):
    """The TTT unroll written from the definition: query (step i, position t) attends to the explicit
    key list [(0, j) for j <= t] + [(k, t) for 1 <= k <= i]; token x_{t+1+i}; RoPE position t+i."""
    layer, att = model.midlayer, model.midlayer.self_attn
    b, T = ids.shape
    nh, nkv, d = att.nh, att.nkv, att.hd
    h = model.fc(aux.reshape(b, T, -1))
    ks, vs, outs = [], [], []
    for i in range(steps):
        tok = torch.zeros_like(ids)
        for t in range(T):
            if t + 1 + i < T:
                tok[:, t] = ids[:, t + 1 + i]
        x = torch.cat((layer.input_layernorm(model.embed(tok)), layer.hidden_norm(h)), dim=-1)
        pos = (torch.arange(T) + i)[None]
        q = _rope(att.q_proj(x).view(b, T, nh, d).transpose(1, 2), pos, att.theta)
        ks.append(_rope(att.k_proj(x).view(b, T, nkv, d).transpose(1, 2), pos, att.theta))
        vs.append(att.v_proj(x).view(b, T, nkv, d).transpose(1, 2))
        o = torch.zeros(b, nh, T, d, dtype=x.dtype)
        for t in range(T):
            keys = [(0, j) for j in range(t + 1)] + [(k, t) for k in range(1, i + 1)]
            K = torch.stack([ks[s][:, :, j] for s, j in keys], dim=2).repeat_interleave(nh // nkv, dim=1)
            Vv = torch.stack([vs[s][:, :, j] for s, j in keys], dim=2).repeat_interleave(nh // nkv, dim=1)
            w = torch.softmax(q[:, :, t:t + 1] @ K.transpose(-1, -2) / math.sqrt(d), dim=-1)
            o[:, :, t] = (w @ Vv)[:, :, 0]
        h = h + att.o_proj(o.transpose(1, 2).reshape(b, T, nh * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
    return outs


def test_forward_matches_definition():
    model = tiny_model()
    aux, _, ids, _ = tiny_batch(b=2, T=5)
    with torch.no_grad():
        got = model(aux, ids, steps=3)
        ref = _reference_forward(model, aux, ids, 3)
    assert len(got) == 3
    for g_, r_ in zip(got, ref, strict=True):
        torch.testing.assert_close(g_, r_, rtol=1e-10, atol=1e-10)


def test_shift_convention_by_perturbation():
    """Step i at position t reads the token x_{t+1+i}: changing x_m first changes step i at t = m-1-i
    and nothing before it; changing the features at j changes every step exactly at t >= j."""
    model = tiny_model()
    aux, _, ids, _ = tiny_batch(b=1, T=8)
    m = 6  # a token position near the end (T = 8)
    with torch.no_grad():
        base = model(aux, ids, steps=3)
        ids2 = ids.clone()
        ids2[0, m] = (ids[0, m] + 1) % V
        pert = model(aux, ids2, steps=3)
        for i in range(3):
            diff = (base[i] - pert[i]).abs().amax(dim=-1)[0]
            first = m - 1 - i
            assert diff[:first].max() <= 1e-12 and diff[first] > 1e-6, (i, diff)
        j = 3
        aux2 = aux.clone()
        aux2[0, j] += 1.0
        pert = model(aux2, ids, steps=3)
        for i in range(3):
            diff = (base[i] - pert[i]).abs().amax(dim=-1)[0]
            assert diff[:j].max() <= 1e-12 and (diff[j:] > 1e-8).all(), (i, diff)


def test_supervision_masks_hand_check():
    lm = torch.tensor([[0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    valid = torch.ones(1, 6, dtype=torch.bool)
    s = supervision_masks(lm, valid, 3)
    # step i at t predicts x_{t+2+i}: supervised iff t+2+i < 6 and lm[t+2+i]
    assert s[0].int().tolist() == [[1, 1, 0, 1, 0, 0]]
    assert s[1].int().tolist() == [[1, 0, 1, 0, 0, 0]]
    assert s[2].int().tolist() == [[0, 1, 0, 0, 0, 0]]
    valid[0, 5] = False  # the last position is padding: nothing predicts it and nothing reads it
    assert supervision_masks(lm, valid, 3)[0].int().tolist() == [[1, 1, 0, 0, 0, 0]]


# ------------------------------------------------------------------------------------------ loss

def _hand_loss(model, aux, last, ids, lm, valid, steps):
    """Σ_i 0.8^i · mean over kept (t) of -Σ_v softmax(z_{t+1+i}[used])_v · log_softmax(draft(h_i[t]))_v."""
    used = model.used_ids()
    with torch.no_grad():
        hs = model(aux, ids, valid, steps=steps)
    b, T = ids.shape
    total, kept, correct, tot = 0.0, [], [], []
    for i in range(steps):
        ces, n_ok, n_tot = [], 0, 0
        for r in range(b):
            for t in range(T - 2 - i):
                if not (lm[r, t + 2 + i] and valid[r, t] and valid[r, t + 1 + i] and valid[r, t + 2 + i]):
                    continue
                n_tot += 1
                z = model.target_logits(last[r, t + 1 + i])
                if int(z.argmax()) not in used.tolist():
                    continue  # dropped
                p = torch.softmax(z[used], dim=-1)
                logits = model.draft_logits(hs[i][r, t])
                ces.append(-(p * torch.log_softmax(logits, dim=-1)).sum())
                n_ok += int(int(logits.argmax()) == int(p.argmax()))
        if ces:
            total += 0.8 ** i * float(torch.stack(ces).mean().detach())
        kept.append(len(ces))
        correct.append(n_ok)
        tot.append(n_tot)
    return total, kept, correct, tot


def test_soft_ce_matches_hand_computation():
    model = tiny_model(head_scale=1.0)
    aux, last, ids, lm = tiny_batch(b=2, T=9)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 7:] = False
    loss, stats = eagle3_loss(model, aux, last, ids, lm, valid, chunk_rows=3)
    want, kept, correct, tot = _hand_loss(model, aux, last, ids, lm, valid, 3)
    assert math.isclose(loss.item(), want, rel_tol=1e-9)
    assert stats.kept.tolist() == kept and stats.correct.tolist() == correct and stats.total.tolist() == tot
    assert sum(tot) > sum(kept) > 0  # the fixture drops some positions (argmax outside the draft vocab)
    s = stats.summary()
    assert math.isclose(s["loss"], want, rel_tol=1e-9)
    assert s["acc"] == pytest.approx([c / t for c, t in zip(correct, tot, strict=True)])
    # chunking and no-grad do not change anything
    loss_big, stats_big = eagle3_loss(model, aux, last, ids, lm, valid, chunk_rows=1000)
    with torch.no_grad():
        loss_ng, _ = eagle3_loss(model, aux, last, ids, lm, valid, chunk_rows=2)
    assert math.isclose(loss_big.item(), want, rel_tol=1e-9) and math.isclose(loss_ng.item(), want, rel_tol=1e-9)
    assert torch.equal(stats_big.correct, stats.correct)


def test_positions_with_target_argmax_outside_draft_vocab_are_dropped():
    model = tiny_model(head_scale=1.0)
    aux, last, ids, lm = tiny_batch(b=1, T=8)
    lm[:] = True
    probs, arg = target_soft_labels(model, last, chunk_rows=2)
    full_arg = model.target_logits(last).argmax(dim=-1)
    t2d = model.t2d
    assert torch.equal(arg >= 0, t2d[full_arg])  # -1 exactly where the argmax is not in the draft vocab
    assert torch.equal(model.used_ids()[arg[arg >= 0]], full_arg[arg >= 0])
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 8, dtype=probs.dtype))
    assert (~t2d[full_arg]).any() and t2d[full_arg].any()
    _, stats = eagle3_loss(model, aux, last, ids, lm, torch.ones(1, 8, dtype=torch.bool))
    dropped = [int((~t2d[full_arg[0, 1 + i:8 - 1]]).sum()) for i in range(3)]  # label rows t+1+i
    assert (stats.total - stats.kept).tolist() == dropped
    # the labels of dropped positions do not matter: swapping the target states of two dropped label
    # rows leaves the loss unchanged, while swapping two kept ones changes it
    ok = torch.ones(1, 8, dtype=torch.bool)
    rows = torch.arange(1, 7)  # label rows t+1+i of step 0
    out_rows = rows[~t2d[full_arg[0, 1:7]]].tolist()
    in_rows = rows[t2d[full_arg[0, 1:7]]].tolist()
    assert len(out_rows) >= 2 and len(in_rows) >= 2, (out_rows, in_rows)
    base, _ = eagle3_loss(model, aux, last, ids, lm, ok)
    for pair, same in ((out_rows[:2], True), (in_rows[:2], False)):
        swapped = last.clone()
        swapped[0, pair] = last[0, pair[::-1]]
        loss2, _ = eagle3_loss(model, aux, swapped, ids, lm, ok)
        assert math.isclose(base.item(), loss2.item(), rel_tol=1e-12) == same, pair


def test_stats_sim_acc_len_and_reduce():
    s = Eagle3Stats(loss_sum=torch.tensor([4.0, 3.0, 1.0], dtype=torch.float64), kept=torch.tensor([8, 6, 2]),
                    correct=torch.tensor([8, 5, 1]), total=torch.tensor([10, 10, 4]), loss_decay=0.8)
    out = s.summary()
    assert out["acc"] == pytest.approx([0.8, 0.5, 0.25])
    assert out["sim_acc_len"] == pytest.approx(0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25)  # = 1.3, no bonus token
    assert out["sim_acc_len_includes_bonus"] is False
    assert out["loss"] == pytest.approx(4 / 8 + 0.8 * 3 / 6 + 0.64 * 1 / 2)
    assert out["coverage"] == pytest.approx(16 / 24) and out["total"] == 24
    both = s + s
    assert both.summary()["acc"] == pytest.approx(out["acc"]) and both.total.tolist() == [20, 20, 8]
    back = Eagle3Stats.from_tensor(both.to_tensor(), 0.8)
    assert torch.equal(back.correct, both.correct) and torch.equal(back.loss_sum, both.loss_sum)
    empty = Eagle3Stats(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long),
                        torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0.8)
    assert math.isnan(empty.summary()["sim_acc_len"])
    with pytest.raises(ConfigError):
        _ = s + Eagle3Stats(s.loss_sum, s.kept, s.correct, s.total, 0.9)


def test_gradients_reach_trainables_never_frozen():
    model = tiny_model(dtype=torch.float32, head_scale=1.0)
    aux, last, ids, lm = tiny_batch(dtype=torch.float32)
    frozen = {k: getattr(model, k).clone() for k in ("embed_weight", "target_norm_weight",
                                                     "target_lm_head_weight", "d2t", "t2d")}
    loss, _ = eagle3_loss(model, aux, last, ids, lm, torch.ones_like(lm))
    loss.backward()
    names = {n for n, _ in model.named_parameters()}
    assert names == {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.input_layernorm.weight",
                     "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                     *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                     *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    for k, v in frozen.items():
        buf = getattr(model, k)
        assert not buf.requires_grad and buf.grad is None and torch.equal(buf, v), k
    assert set(model.state_dict()) == names | {"d2t", "t2d"}  # frozen target tensors are never saved


def test_tiny_training_loop_loss_decreases():
    torch.manual_seed(0)
    model = tiny_model(dtype=torch.float32, head_scale=1.0)
    g = torch.Generator().manual_seed(5)
    b, T = 4, 16
    ids = torch.randint(0, V, (b, T), generator=g)
    # learnable structure: the target's distribution at j is a function of x_j, which the draft reads
    # as its input token at the step that predicts x_{j+1}
    mix = torch.randn(H, H, generator=g) / math.sqrt(H)
    last = model.embed_weight[ids] @ mix
    aux = model.embed_weight[ids][:, :, None, :].repeat(1, 1, 3, 1) + 0.1 * torch.randn(b, T, 3, H, generator=g)
    lm = torch.ones(b, T, dtype=torch.bool)
    valid = torch.ones(b, T, dtype=torch.bool)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    emb0, head0 = model.embed_weight.clone(), model.target_lm_head_weight.clone()
    losses, accs = [], []
    for _ in range(40):
        loss, stats = eagle3_loss(model, aux, last, ids, lm, valid)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append(stats.summary()["sim_acc_len"])
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert accs[-1] > accs[0], accs
    assert torch.equal(emb0, model.embed_weight) and torch.equal(head0, model.target_lm_head_weight)


def test_padding_is_finite_and_contributes_nothing():
    model = tiny_model(head_scale=1.0)
    aux, last, ids, lm = tiny_batch(b=1, T=7)
    ref_loss, ref_stats = eagle3_loss(model, aux, last, ids, lm, torch.ones(1, 7, dtype=torch.bool))

    def garbage(shape):
        return torch.full(shape, float("nan"), dtype=torch.float64)

    # right padding with NaN features, out-of-range ids, and a second, entirely padded row
    T2 = 11
    aux_p = torch.cat((aux, garbage((1, 4, 3, H))), dim=1)
    aux_p = torch.cat((aux_p, garbage((1, T2, 3, H))), dim=0)
    last_p = torch.cat((torch.cat((last, garbage((1, 4, H))), dim=1), garbage((1, T2, H))), dim=0)
    ids_p = torch.full((2, T2), -100)
    ids_p[0, :7] = ids[0]
    lm_p = torch.ones(2, T2, dtype=torch.bool)
    lm_p[0, :7] = lm[0]
    valid = torch.zeros(2, T2, dtype=torch.bool)
    valid[0, :7] = True
    loss, stats = eagle3_loss(model, aux_p, last_p, ids_p, lm_p, valid)
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-9)
    for f in ("kept", "correct", "total"):
        assert torch.equal(getattr(stats, f), getattr(ref_stats, f)), f
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # left padding (a non-prefix validity: the step-0 keys of padding are masked)
    aux_l = torch.cat((garbage((1, 3, 3, H)), aux), dim=1)
    last_l = torch.cat((garbage((1, 3, H)), last), dim=1)
    ids_l = torch.cat((torch.full((1, 3), -1), ids), dim=1)
    lm_l = torch.cat((torch.ones(1, 3, dtype=torch.bool), lm), dim=1)
    valid_l = torch.cat((torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool)), dim=1)
    loss_l, stats_l = eagle3_loss(model, aux_l, last_l, ids_l, lm_l, valid_l)
    assert math.isclose(loss_l.item(), ref_loss.item(), rel_tol=1e-7)  # RoPE is relative
    assert torch.equal(stats_l.correct, ref_stats.correct) and torch.equal(stats_l.total, ref_stats.total)


def test_no_supervised_position_gives_zero_loss_with_graph():
    model = tiny_model()
    aux, last, ids, _ = tiny_batch()
    loss, stats = eagle3_loss(model, aux, last, ids, torch.zeros_like(ids, dtype=torch.bool),
                              torch.ones_like(ids, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad and int(stats.total.sum()) == 0
    loss.backward()


def test_shape_and_input_errors():
    model = tiny_model()
    aux, last, ids, lm = tiny_batch()
    ok = torch.ones_like(lm)
    with pytest.raises(ConfigError):
        eagle3_loss(model, aux[:, :, :2], last, ids, lm, ok)
    with pytest.raises(ConfigError):
        eagle3_loss(model, aux, last[:, :-1], ids, lm, ok)
    with pytest.raises(ConfigError):
        eagle3_loss(model, aux, last, ids, lm, ok, chunk_rows=0)
    with pytest.raises(DataError):
        model(aux, torch.full_like(ids, V))
    with pytest.raises(ConfigError):
        model(aux, ids, steps=0)
    cfg = tiny_cfg()
    d2t, t2d = build_vocab_map(torch.arange(V), VD)
    emb = torch.zeros(V, H)
    with pytest.raises(ConfigError, match="inconsistent"):
        Eagle3Draft(cfg, emb, torch.ones(H), emb, d2t + 1, t2d)
    with pytest.raises(ConfigError, match="shape"):
        Eagle3Draft(cfg, emb[:-1], torch.ones(H), emb, d2t, t2d)


def test_bf16_target_tensors_fp32_draft():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    d2t, t2d = build_vocab_map(torch.arange(V), VD)
    emb = torch.randn(V, H).to(torch.bfloat16)
    model = Eagle3Draft(cfg, emb, torch.ones(H, dtype=torch.bfloat16), emb, d2t, t2d)
    aux, last, ids, lm = tiny_batch(dtype=torch.bfloat16)
    loss, stats = eagle3_loss(model, aux, last, ids, lm, torch.ones_like(lm))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert model.fc.weight.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------- export

def test_export_roundtrip_and_config():
    from transformers import LlamaConfig

    model = tiny_model(seed=0)
    sd = export_state_dict(model)
    assert set(sd) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                       "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                       "midlayer.post_attention_layernorm.weight",
                       *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
                       *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert sd["fc.weight"].shape == (H, 3 * H) and sd["lm_head.weight"].shape == (VD, H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)
    assert sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    torch.manual_seed(1)  # a fresh draft on the same target: other weights, another vocab map
    d2t0, t2d0 = build_vocab_map(torch.zeros(V, dtype=torch.long), VD)
    other = Eagle3Draft(model.cfg, model.embed_weight, model.target_norm_weight, model.target_lm_head_weight,
                        d2t0, t2d0, dtype=torch.float64)
    aux, last, ids, lm = tiny_batch()
    assert not torch.equal(other.d2t, model.d2t)
    other.load_state_dict(sd, strict=True)
    assert torch.equal(other.d2t, model.d2t) and torch.equal(other.t2d, model.t2d)
    with torch.no_grad():
        for a, b_ in zip(model(aux, ids), other(aux, ids), strict=True):
            assert torch.equal(model.draft_logits(a), other.draft_logits(b_))
    half = export_state_dict(model, dtype=torch.bfloat16)
    assert half["fc.weight"].dtype == torch.bfloat16 and half["d2t"].dtype == torch.long

    target = LlamaConfig(hidden_size=H, num_hidden_layers=30, num_attention_heads=4, vocab_size=V,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    out = export_config(model.cfg, target)
    assert out["architectures"] == ["LlamaForCausalLMEagle3"] and out["num_hidden_layers"] == 1
    assert out["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM ids = output-of-layer [1, 14, 26] + 1
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang's: it adds 1 itself
    assert (out["vocab_size"], out["draft_vocab_size"], out["head_dim"]) == (V, VD, 8)
    assert out["max_position_embeddings"] == 4096 and out["tie_word_embeddings"] is False
    json.dumps(out)  # JSON-serialisable
    hf = LlamaConfig(**out)  # a transformers Llama config accepts it and keeps the EAGLE-3 fields
    assert hf.draft_vocab_size == VD and hf.num_hidden_layers == 1 and hf.head_dim == 8
    with pytest.raises(ConfigError):
        export_config(model.cfg, target, aux_layer_ids=[1, 2, 30])
    with pytest.raises(ConfigError):
        export_config(model.cfg, LlamaConfig(hidden_size=2 * H, num_hidden_layers=30, num_attention_heads=4))


# ------------------------------------------------------------------------------- target final norm

def test_load_final_norm(tmp_path):
    from safetensors.torch import save_file

    hidden, vocab = 8, 12
    norm = torch.linspace(0.5, 2.0, hidden).to(torch.bfloat16)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden),
        "model.layers.0.input_layernorm.weight": torch.full((hidden,), 3.0),  # decoys inside the layers
        "model.layers.0.self_attn.q_norm.weight": torch.full((4,), 5.0),
        "model.norm.weight": norm,
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": hidden,
           "vocab_size": vocab, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = load_final_norm(resolve_target(str(tmp_path)))
    assert w.dtype == torch.float32 and torch.equal(w, norm.float())
    # no final norm tensor -> a clear error; a LayerNorm target -> refused
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="final-norm"):
        load_final_norm(resolve_target(str(tmp_path)))
    del cfg["rms_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_norm_eps": 1e-5}))
    with pytest.raises(ConfigError, match="rmsnorm"):
        load_final_norm(resolve_target(str(tmp_path)))


def test_target_logits_use_final_norm():
    model = tiny_model()
    h = torch.randn(3, H, dtype=torch.float64)
    want = F.linear(F.rms_norm(h, (H,), model.target_norm_weight, eps=model.cfg.rms_norm_eps),
                    model.target_lm_head_weight)
    torch.testing.assert_close(model.target_logits(h), want)
    normed = F.rms_norm(h, (H,), model.target_norm_weight, eps=model.cfg.rms_norm_eps)
    torch.testing.assert_close(model.target_logits(normed, normed=True), want)
