"""Tests for the DFlash draft: layer ids, config, anchors, attention mask, loss, metrics, training."""

from __future__ import annotations

import math
import types

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from artcache.errors import ConfigError, DataError
from artcache.layer_ids import (
    dflash_layer_ids,
    hf_index_to_output_of_layer,
    output_of_layer_to_hf_index,
    output_of_layer_to_vllm_id,
    vllm_id_to_output_of_layer,
)
from artcache.trainers.dflash import (
    ATTN_IMPLS,
    DFlashConfig,
    DFlashDraft,
    LossStats,
    build_attention_mask,
    default_gamma,
    dflash_loss,
    dflash_mask_mod,
    eligible_anchors,
    sample_anchors,
    slot_weights,
)

V, H, M = 40, 32, 3  # tiny vocab, width, captured layers


def tiny_cfg(**kw) -> DFlashConfig:
    base = dict(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                vocab_size=V, num_context_layers=M, mask_token_id=V - 1, block_size=4, num_anchors=6)
    base.update(kw)
    return DFlashConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float64, **kw) -> DFlashDraft:
    torch.manual_seed(seed)
    cfg = tiny_cfg(**kw)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype) * 0.3
    return DFlashDraft(cfg, emb, head, dtype=dtype)


def tiny_batch(b=2, T=24, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(b, T, M, H, generator=g, dtype=dtype)
    ids = torch.randint(0, V - 1, (b, T), generator=g)
    return ctx, ids


# ----------------------------------------------------------------------------------------- layers

def test_layer_id_goldens():
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert dflash_layer_ids(36, 1) == [18]
    assert dflash_layer_ids(5, 2) == [1, 2]
    ids = dflash_layer_ids(28, 4)
    assert ids[0] == 1 and ids[-1] == 25 and ids == sorted(set(ids))


def test_layer_id_round_half_to_even():
    # L=10, n=5: 1 + i*6/4 = 1, 2.5, 4, 5.5, 7 -> Python round: 2.5 -> 2, 5.5 -> 6
    assert dflash_layer_ids(10, 5) == [1, 2, 4, 6, 7]


@pytest.mark.parametrize("L,n", [(4, 1), (36, 0), (36, 34), (10, 8), (36, -1)])
def test_layer_id_rejects(L, n):
    with pytest.raises(ConfigError, match=str(n)):
        dflash_layer_ids(L, n)


def test_layer_conventions():
    for i in range(40):
        assert output_of_layer_to_hf_index(i) == i + 1
        assert hf_index_to_output_of_layer(output_of_layer_to_hf_index(i)) == i
        assert vllm_id_to_output_of_layer(output_of_layer_to_vllm_id(i)) == i
    # vLLM id L (= last layer's output) is output-of-layer L-1; Qwen3-8B ids in vLLM terms:
    assert vllm_id_to_output_of_layer(36) == 35
    assert [output_of_layer_to_vllm_id(i) for i in dflash_layer_ids(36, 5)] == [2, 10, 18, 26, 34]
    for bad in (hf_index_to_output_of_layer, vllm_id_to_output_of_layer):
        with pytest.raises(ConfigError):
            bad(0)
    with pytest.raises(ConfigError):
        output_of_layer_to_hf_index(-1)


def test_hf_index_matches_transformers_hidden_states():
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, intermediate_size=32, vocab_size=20)
    model = Qwen3Model(cfg).eval()
    ids = torch.randint(0, 20, (1, 5))
    hooked = {}
    model.layers[1].register_forward_hook(lambda m, i, o: hooked.setdefault("out", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hs[output_of_layer_to_hf_index(1)], hooked["out"])


# ----------------------------------------------------------------------------------------- config

def test_default_gamma():
    assert default_gamma(16) == 7.0 and default_gamma(10) == 5.0 and default_gamma(8) == 4.0
    assert default_gamma(2) == 1.0 and default_gamma(4) == 2.0
    assert math.isclose(default_gamma(12), 5 + 2 / 3) and math.isclose(default_gamma(32), 7 + 16 / 3)
    assert tiny_cfg(block_size=16).resolved_gamma == 7.0
    assert tiny_cfg(gamma=3.5).resolved_gamma == 3.5
    gs = [default_gamma(b) for b in range(2, 40)]
    assert gs == sorted(gs)


@pytest.mark.parametrize("kw", [
    dict(block_size=1), dict(num_anchors=0), dict(num_heads=3), dict(mask_token_id=V), dict(mask_token_id=-1),
    dict(gamma=0.0), dict(gamma=float("nan")), dict(head_dim=7), dict(rope_theta=0.0), dict(logit_chunk=0),
    dict(hidden_size=2.5), dict(num_layers=True),
])
def test_config_rejects(kw):
    with pytest.raises(ConfigError):
        tiny_cfg(**kw)


def test_config_msgspec_roundtrip_and_unknown_fields():
    cfg = tiny_cfg()
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=DFlashConfig) == cfg
    raw = msgspec.json.decode(msgspec.json.encode(cfg))
    raw["bogus"] = 1
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(raw), type=DFlashConfig)


def test_from_target():
    from transformers import Qwen3Config

    tc = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=96, vocab_size=100, num_hidden_layers=8, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    cfg = DFlashConfig.from_target(tc, num_layers=3, block_size=10, num_anchors=64, mask_token_id=99)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 32)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_context_layers) == (96, 100, 3)
    assert cfg.rope_theta == 1_000_000.0 and cfg.rms_norm_eps == 1e-5 and cfg.resolved_gamma == 5.0
    legacy = types.SimpleNamespace(hidden_size=48, num_attention_heads=6, intermediate_size=10, vocab_size=7,
                                   rope_theta=5e5)
    cfg2 = DFlashConfig.from_target(legacy, num_layers=1, mask_token_id=6)
    assert (cfg2.head_dim, cfg2.num_kv_heads, cfg2.rope_theta) == (8, 6, 5e5)
    with pytest.raises(ConfigError):
        DFlashConfig.from_target(legacy, num_layers=1, mask_token_id=7)
    with pytest.raises(ConfigError):
        DFlashConfig.from_target(legacy, num_layers=1)


# ---------------------------------------------------------------------------------------- anchors

def _check_anchors(lm: torch.Tensor, n: int, anchors: torch.Tensor, valid: torch.Tensor) -> None:
    elig = eligible_anchors(lm)
    b, T = lm.shape
    assert anchors.shape == (b, n) and valid.shape == (b, n)
    assert anchors.dtype == torch.long and valid.dtype == torch.bool
    for r in range(b):
        k = int(valid[r].sum())
        assert k == min(n, int(elig[r].sum()))
        assert valid[r, :k].all() and not valid[r, k:].any()  # valid first, then padding
        a = anchors[r, :k]
        assert (a[1:] > a[:-1]).all()  # sorted, no duplicates
        assert elig[r, a].all()
        assert lm.bool()[r, a].all() and lm.bool()[r, a + 1].all()
        assert (anchors[r, k:] == 0).all()


def test_anchor_sampling_basic():
    lm = torch.zeros(3, 30, dtype=torch.uint8)
    lm[0, 5:25] = 1
    lm[1, ::2] = 1  # never two consecutive -> no eligible anchor
    lm[2, 28:] = 1  # exactly one eligible anchor (28)
    a, v = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    _check_anchors(lm, 8, a, v)
    assert int(v[0].sum()) == 8 and int(v[1].sum()) == 0 and a[2, 0] == 28 and int(v[2].sum()) == 1
    # determinism
    a2, v2 = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    assert torch.equal(a, a2) and torch.equal(v, v2)
    # N larger than T
    a3, v3 = sample_anchors(torch.ones(1, 5, dtype=torch.bool), 9, torch.Generator().manual_seed(1))
    assert a3.tolist() == [[0, 1, 2, 3, 0, 0, 0, 0, 0]] and v3.sum() == 4
    with pytest.raises(ConfigError):
        sample_anchors(lm, 0, torch.Generator())


def test_anchor_sampling_is_uniform():
    lm = torch.ones(1, 11, dtype=torch.bool)  # 10 eligible positions, choose 3
    g = torch.Generator().manual_seed(123)
    counts = torch.zeros(11)
    trials = 3000
    for _ in range(trials):
        a, v = sample_anchors(lm, 3, g)
        counts[a[0]] += 1
    freq = counts[:10] / trials
    assert counts[10] == 0
    assert (freq - 0.3).abs().max() < 0.05


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.booleans(), min_size=0, max_size=40), min_size=1, max_size=4),
    n=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_anchor_sampling_property(rows, n, seed):
    T = max(len(r) for r in rows)
    if T == 0:
        return
    lm = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        lm[i, : len(r)] = torch.tensor(r, dtype=torch.bool)
    a, v = sample_anchors(lm, n, torch.Generator().manual_seed(seed))
    _check_anchors(lm, n, a, v)


# ------------------------------------------------------------------------------------------- mask

def test_attention_mask_matches_definition():
    anchors = torch.tensor([[0, 3, 6], [2, 5, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    cv = torch.ones(2, 8, dtype=torch.bool)
    cv[1, 4] = False
    B, T = 3, 8
    mask = build_attention_mask(anchors, valid, T, B, cv)
    assert mask.shape == (2, 1, 9, 8 + 9) and mask.dtype == torch.bool
    for bi in range(2):
        for qn in range(3):
            for s in range(B):
                q = qn * B + s
                for j in range(T):
                    want = bool(valid[bi, qn]) and j < anchors[bi, qn] and bool(cv[bi, j])
                    assert bool(mask[bi, 0, q, j]) == want
                for kn in range(3):
                    for s2 in range(B):
                        assert bool(mask[bi, 0, q, T + kn * B + s2]) == (kn == qn)
    assert mask.any(dim=-1).all()  # no empty row, ever


def test_attention_exactness_by_perturbation():
    model = tiny_model()
    ctx, ids = tiny_batch(b=1, T=24)
    anchors = torch.tensor([[3, 10, 17]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        base = model(ctx, ids, anchors, valid)
        # 1) context at/after anchor 10 must not change block 1 (nor block 0); it changes block 2
        c2 = ctx.clone()
        c2[:, 10:] += torch.randn_like(c2[:, 10:]) * 5
        out = model(c2, ids, anchors, valid)
        torch.testing.assert_close(out[:, :2], base[:, :2], rtol=0, atol=1e-12)
        assert (out[:, 2] - base[:, 2]).abs().max() > 1e-3
        # 2) context just before the anchor (position 9) changes block 1, not block 0
        c3 = ctx.clone()
        c3[:, 9] += 3.0
        out = model(c3, ids, anchors, valid)
        torch.testing.assert_close(out[:, 0], base[:, 0], rtol=0, atol=1e-12)
        assert (out[:, 1] - base[:, 1]).abs().max() > 1e-3
        # 3) another block's tokens: changing x_17 (block 2's anchor token) changes only block 2
        ids2 = ids.clone()
        ids2[0, 17] = (ids[0, 17] + 1) % (V - 1)
        out = model(ctx, ids2, anchors, valid)
        torch.testing.assert_close(out[:, :2], base[:, :2], rtol=0, atol=1e-12)
        assert (out[:, 2] - base[:, 2]).abs().max() > 1e-3
        # 4) input tokens after the anchor never enter its block (targets are not leaked)
        ids3 = ids.clone()
        ids3[0, 4:10] = (ids[0, 4:10] + 1) % (V - 1)
        out = model(ctx, ids3, anchors, valid)
        torch.testing.assert_close(out, base, rtol=0, atol=1e-12)
        # 5) within a block attention is bidirectional: every slot depends on the anchor token
        ids4 = ids.clone()
        ids4[0, 10] = (ids[0, 10] + 1) % (V - 1)
        out = model(ctx, ids4, anchors, valid)
        assert ((out[0, 1] - base[0, 1]).abs().amax(dim=-1) > 1e-6).all()


def test_context_valid_masks_padding():
    model = tiny_model()
    ctx, ids = tiny_batch(b=2, T=20)
    cv = torch.ones(2, 20, dtype=torch.bool)
    cv[1, 12:] = False
    anchors = torch.tensor([[2, 15], [4, 11]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    with torch.no_grad():
        base = model(ctx, ids, anchors, valid, context_valid=cv)
        c2 = ctx.clone()
        c2[1, 12:] = 1e3
        torch.testing.assert_close(model(c2, ids, anchors, valid, context_valid=cv), base, rtol=0, atol=1e-12)
        # the same sequence alone, unpadded, gives the same result
        alone = model(ctx[1:, :12], ids[1:, :12], anchors[1:], valid[1:])
        torch.testing.assert_close(alone, base[1:], rtol=1e-10, atol=1e-10)


def test_padded_anchors_finite_and_zero():
    model = tiny_model(dtype=torch.float32)
    ctx, ids = tiny_batch(b=2, T=16, dtype=torch.bfloat16)  # any float dtype is accepted
    lm = torch.ones(2, 16, dtype=torch.bool)
    lm[1, 3:] = False  # row 1: only anchors 0 and 1 are eligible -> 3 padded slots
    anchors, valid = sample_anchors(lm, 5, torch.Generator().manual_seed(0))
    assert valid[1].tolist() == [True, True, False, False, False] and anchors[1].tolist() == [0, 1, 0, 0, 0]
    out = model(ctx, ids, anchors, valid)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out[~valid] == 0).all() and (out[valid].abs().sum(-1) > 0).all()
    loss, _ = dflash_loss(model, out, ids, lm, anchors, valid)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # an anchor outside [0, T) that is marked valid is a data error
    with pytest.raises(DataError):
        model(ctx, ids, torch.tensor([[16], [0]]), torch.ones(2, 1, dtype=torch.bool))
    # invalid anchors may hold any value
    model(ctx, ids, torch.tensor([[99], [0]]), torch.tensor([[False], [True]]))


def test_shape_errors():
    model = tiny_model()
    ctx, ids = tiny_batch(b=1, T=8)
    a, v = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ConfigError):
        model(ctx[:, :, :2], ids, a, v)
    with pytest.raises(ConfigError):
        model(ctx, ids[:, :5], a, v)
    with pytest.raises(ConfigError):
        DFlashDraft(tiny_cfg(), torch.randn(V, H + 1), torch.randn(V, H))


# ------------------------------------------------------------------------------------------- loss

def test_slot_weights():
    w = slot_weights(5, 2.0)
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[1:], torch.exp(-torch.arange(4.0) / 2.0))


def test_loss_weights_by_hand():
    model = tiny_model(block_size=4)
    ctx, ids = tiny_batch(b=1, T=10)
    lm = torch.ones(1, 10, dtype=torch.bool)
    lm[0, 0] = False
    lm[0, 5] = False
    anchors = torch.tensor([[3, 7, 1]])
    valid = torch.tensor([[True, True, False]])
    gamma = 1.5
    hidden = model(ctx, ids, anchors, valid)
    loss, stats = dflash_loss(model, hidden, ids, lm, anchors, valid, gamma, 1024)
    logp = torch.log_softmax(model.logits(hidden.detach()).double(), -1)
    num = den = 0.0
    # anchor 3: slots 1..3 -> positions 4, 5 (loss_mask 0), 6
    # anchor 7: slots 1..3 -> positions 8, 9, 10 (>= T: not supervised)
    # anchor 1 is invalid: nothing
    for n, slots in ((0, (1, 3)), (1, (1, 2))):
        for k in slots:
            w = math.exp(-(k - 1) / gamma)
            pos = int(anchors[0, n]) + k
            num += -w * float(logp[0, n, k, ids[0, pos]])
            den += w
    assert math.isclose(loss.item(), num / den, rel_tol=1e-6)
    assert math.isclose(float(stats.weight_sum), den, rel_tol=1e-6)
    assert math.isclose(float(stats.loss_sum), num, rel_tol=1e-6)
    assert stats.total.tolist() == [0, 2, 1, 1] and int(stats.num_blocks) == 2
    # default gamma comes from the config (B=4 -> 2.0)
    l2, _ = dflash_loss(model, hidden, ids, lm, anchors, valid)
    l3, _ = dflash_loss(model, hidden, ids, lm, anchors, valid, 2.0)
    assert l2.item() == l3.item()


def test_loss_with_no_supervised_rows_is_zero_with_graph():
    model = tiny_model()
    ctx, ids = tiny_batch(b=1, T=8)
    a, v = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool)
    hidden = model(ctx, ids, a, v)
    loss, stats = dflash_loss(model, hidden, ids, torch.ones(1, 8), a, v)
    loss.backward()
    assert loss.item() == 0.0 and math.isnan(stats.summary()["loss"]) and math.isnan(stats.summary()["tau"])


def test_chunked_equals_unchunked():
    model = tiny_model(block_size=4)
    ctx, ids = tiny_batch(b=2, T=24)
    lm = torch.ones(2, 24, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 6, torch.Generator().manual_seed(3))
    results = []
    for chunk, mode in ((10**6, "plain"), (5, "plain"), (5, "checkpoint"), (1, "checkpoint"),
                        (10**6, "fused"), (7, "fused"), (1, "fused")):
        model.zero_grad()
        hidden = model(ctx, ids, anchors, valid)
        loss, stats = dflash_loss(model, hidden, ids, lm, anchors, valid, None, chunk, mode=mode)
        loss.backward()
        results.append((loss.detach(), stats, model.fc.weight.grad.clone()))
    ref_loss, ref_stats, ref_grad = results[0]
    for loss, stats, grad in results[1:]:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
        assert torch.equal(stats.correct, ref_stats.correct) and torch.equal(stats.tau_sum, ref_stats.tau_sum)


def test_gradients_reach_trainables_never_frozen():
    model = tiny_model(dtype=torch.float32)
    names = {n for n, _ in model.named_parameters()}
    assert "embed_weight" not in names and "lm_head_weight" not in names
    assert not model.embed_weight.requires_grad and not model.lm_head_weight.requires_grad
    tsd = model.trainable_state_dict()
    assert "embed_weight" not in tsd and "lm_head_weight" not in tsd and "fc.weight" in tsd
    assert set(tsd) == names  # every trainable tensor, nothing else
    ctx, ids = tiny_batch(b=2, T=16, dtype=torch.float32)
    lm = torch.ones(2, 16, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    loss, _ = dflash_loss(model, model(ctx, ids, anchors, valid), ids, lm, anchors, valid)
    loss.backward()
    assert model.embed_weight.grad is None and model.lm_head_weight.grad is None
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert model.fc.weight.grad.abs().sum() > 0
    for layer in model.layers:
        assert layer.self_attn.q_proj.weight.grad.abs().sum() > 0
        assert layer.self_attn.k_proj.weight.grad.abs().sum() > 0
        assert layer.mlp.down_proj.weight.grad.abs().sum() > 0


def test_bf16_module():
    model = tiny_model(dtype=torch.float32)
    model = DFlashDraft(model.cfg, model.embed_weight, model.lm_head_weight, dtype=torch.bfloat16)
    ctx, ids = tiny_batch(b=1, T=12, dtype=torch.float32)
    lm = torch.ones(1, 12, dtype=torch.bool)
    a, v = sample_anchors(lm, 3, torch.Generator().manual_seed(0))
    out = model(ctx, ids, a, v)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    loss, _ = dflash_loss(model, out, ids, lm, a, v)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())


def test_fused_loss_under_autocast_and_no_grad():
    model = tiny_model(dtype=torch.float32)
    ctx, ids = tiny_batch(b=2, T=16, dtype=torch.float32)
    lm = torch.ones(2, 16, dtype=torch.bool)
    a, v = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
    res = {}
    for mode in ("plain", "fused"):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ctx, ids, a, v)
            loss, _ = dflash_loss(model, out, ids, lm, a, v, None, 5, mode=mode)
        loss.backward()
        res[mode] = (loss.item(), model.fc.weight.grad.clone())
    assert math.isclose(res["plain"][0], res["fused"][0], rel_tol=2e-2)
    cos = torch.nn.functional.cosine_similarity(res["plain"][1].flatten(), res["fused"][1].flatten(), dim=0)
    assert cos > 0.98
    with torch.no_grad():
        out = model(ctx, ids, a, v)
        l_ng, s_ng = dflash_loss(model, out, ids, lm, a, v)
    l_pl, s_pl = dflash_loss(model, out, ids, lm, a, v, mode="plain")
    assert math.isclose(l_ng.item(), l_pl.item(), rel_tol=1e-5) and torch.equal(s_ng.correct, s_pl.correct)
    with pytest.raises(ConfigError):
        dflash_loss(model, out, ids, lm, a, v, mode="bogus")


def test_tiny_training_loop_loss_decreases():
    torch.manual_seed(0)
    model = tiny_model(dtype=torch.float32, num_anchors=8)
    g = torch.Generator().manual_seed(5)
    T = 24
    # learnable structure: the next tokens are a function of the context at the anchor
    ids = torch.randint(0, V - 1, (4, T), generator=g)
    ctx = model.embed_weight[ids][:, :, None, :].repeat(1, 1, M, 1) + 0.1 * torch.randn(4, T, M, H, generator=g)
    lm = torch.ones(4, T, dtype=torch.bool)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    assert all(p is not model.embed_weight for grp in opt.param_groups for p in grp["params"])
    emb0, head0 = model.embed_weight.clone(), model.lm_head_weight.clone()
    losses = []
    for step in range(40):
        anchors, valid = sample_anchors(lm, 8, torch.Generator().manual_seed(step % 4))
        loss, _ = dflash_loss(model, model(ctx, ids, anchors, valid), ids, lm, anchors, valid)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert torch.equal(emb0, model.embed_weight) and torch.equal(head0, model.lm_head_weight)


def test_draft_learns_to_read_the_next_token_from_the_context():
    """The context path end to end (fc, context norm, the strictly-before-anchor mask, RoPE): when the
    context state of position p-1 carries x_{p+1}, a tiny draft learns slot 1 almost perfectly (the CPU
    training of docs/training.md asked whether DFlash uses its context at all). Nothing else carries
    x_{p+1} here (ids are uniform random), so slots 2+ stay near chance (1/39)."""
    torch.manual_seed(0)
    model = tiny_model(dtype=torch.float32, num_anchors=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    T = 32

    def batch():
        ids = torch.randint(0, V - 1, (4, T), generator=g)
        ctx = 0.1 * torch.randn(4, T, M, H, generator=g)
        ctx[:, :-2] += model.embed_weight[ids[:, 2:]][:, :, None, :]  # state at t-1 encodes x_{t+1}
        return ctx, ids

    lm = torch.ones(4, T, dtype=torch.bool)
    for step in range(300):
        ctx, ids = batch()
        anchors, valid = sample_anchors(lm, 8, torch.Generator().manual_seed(step))
        loss, _ = dflash_loss(model, model(ctx, ids, anchors, valid), ids, lm, anchors, valid)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ctx, ids = batch()  # held out
    anchors, valid = sample_anchors(lm, 8, torch.Generator().manual_seed(999))
    with torch.no_grad():
        _, st = dflash_loss(model, model(ctx, ids, anchors, valid), ids, lm, anchors, valid)
        _, blind = dflash_loss(model, model(torch.zeros_like(ctx), ids, anchors, valid), ids, lm, anchors, valid)
    acc = st.summary()["acc"]
    assert acc[0] > 0.8, acc
    assert blind.summary()["acc"][0] < 0.2  # and it is the context that carries it


# ----------------------------------------------------------------------------------- metrics / tau

def _identity_head_model(B: int) -> DFlashDraft:
    """vocab == hidden and lm_head = 10·I, so argmax(logits(h)) is the index of h's largest entry."""
    n = 12
    cfg = DFlashConfig(hidden_size=n, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=6,
                       intermediate_size=8, vocab_size=n, num_context_layers=1, mask_token_id=n - 1,
                       block_size=B)
    return DFlashDraft(cfg, torch.randn(n, n), 10 * torch.eye(n))


def test_tau_and_accuracy_hand_example():
    B, T = 4, 20
    model = _identity_head_model(B)
    ids = torch.arange(T)[None] % 11
    lm = torch.ones(1, T, dtype=torch.bool)
    lm[0, 15] = False
    anchors = torch.tensor([[0, 4, 8, 13, 17, 2]])
    valid = torch.tensor([[True, True, True, True, True, False]])
    # predictions per block and slot (slot 0 is never scored); -1 = wrong
    right = lambda n, k: int(ids[0, anchors[0, n] + k])  # noqa: E731
    plan = {
        0: [None, "r", "r", "w"],  # tau = 3
        1: [None, "r", "r", "r"],  # tau = 4 = B (all correct)
        2: [None, "w", "r", "r"],  # tau = 1
        3: [None, "r", "r", "r"],  # slot 2 -> position 15 unsupervised: tau = 2 (slot 3 still counts in acc)
        4: [None, "r", "r", "r"],  # positions 18, 19, 20 (>= T): tau = 3
        5: [None, "r", "r", "r"],  # invalid: not counted
    }
    hidden = torch.zeros(1, 6, B, 12)
    for n, slots in plan.items():
        for k, how in enumerate(slots):
            if how is None:
                continue
            tok = right(n, k) if anchors[0, n] + k < T else 0
            hidden[0, n, k, tok if how == "r" else (tok + 1) % 11] = 1.0
    _, stats = dflash_loss(model, hidden, ids, lm, anchors, valid, 2.0, 3)
    assert int(stats.num_blocks) == 5
    assert int(stats.tau_sum) == 3 + 4 + 1 + 2 + 3
    s = stats.summary()
    assert s["tau"] == 13 / 5 and s["tau_includes_bonus"] is True
    assert 1 <= s["tau"] <= B
    # slot totals: k=1: 5 blocks; k=2: blocks 0,1,2,4 (block 3 hits the hole); k=3: blocks 0,1,2,3
    assert stats.total.tolist() == [0, 5, 4, 4]
    assert stats.correct.tolist() == [0, 4, 4, 3]
    assert s["acc"] == [4 / 5, 1.0, 3 / 4]


def test_loss_stats_reduce():
    B = 4
    model = _identity_head_model(B)
    ids = torch.arange(16)[None] % 11
    lm = torch.ones(1, 16, dtype=torch.bool)
    a, v = sample_anchors(lm, 3, torch.Generator().manual_seed(0))
    _, s1 = dflash_loss(model, torch.randn(1, 3, B, 12), ids, lm, a, v)
    _, s2 = dflash_loss(model, torch.randn(1, 3, B, 12), ids, lm, a, v)
    tot = s1 + s2
    assert torch.equal(tot.total, s1.total + s2.total) and int(tot.num_blocks) == 6
    back = LossStats.from_tensor(tot.to_tensor())
    assert torch.equal(back.correct, tot.correct) and int(back.tau_sum) == int(tot.tau_sum)
    assert math.isclose(back.summary()["loss"], tot.summary()["loss"])
    summ = tot.summary()
    assert math.isclose(summ["loss"], (float(s1.loss_sum) + float(s2.loss_sum)) /
                        (float(s1.weight_sum) + float(s2.weight_sum)))
    assert 1 <= summ["tau"] <= B and len(summ["acc"]) == B - 1


def test_rmsnorm_matches_torch():
    from artcache.trainers.dflash.model import RMSNorm

    x = torch.randn(3, 5, 16)
    ours, ref = RMSNorm(16, 1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x))
    assert ours(x.bfloat16()).dtype == torch.bfloat16


# ------------------------------------------------------- attention paths (sdpa / flex / dense)

def _mask_from_mod(mod, b: int, S: int, K: int) -> torch.Tensor:
    """Evaluate a FlexAttention mask_mod on the full [b, 1, S, K] index grid by broadcasting."""
    bi = torch.arange(b)[:, None, None, None]
    qi = torch.arange(S)[None, None, :, None]
    ki = torch.arange(K)[None, None, None, :]
    return mod(bi, torch.zeros_like(bi), qi, ki).expand(b, 1, S, K)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), b=st.integers(1, 3), T=st.integers(1, 20), N=st.integers(1, 5), B=st.integers(2, 5))
def test_flex_mask_mod_equals_dense_mask(data, b, T, N, B):
    anchors = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, T - 1), min_size=N, max_size=N),
                                              min_size=b, max_size=b)))
    valid = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=N, max_size=N), min_size=b, max_size=b)))
    cv = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=b, max_size=b)))
    for context_valid in (None, cv):
        dense = build_attention_mask(anchors, valid, T, B, context_valid)
        flex = _mask_from_mod(dflash_mask_mod(anchors, valid, T, B, context_valid), b, N * B, T + N * B)
        assert torch.equal(flex, dense)


def test_flex_block_mask_matches_dense_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    anchors = torch.tensor([[3, 10, 17], [2, 5, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    T, B = 24, 4
    mod = dflash_mask_mod(anchors, valid, T, B)
    bm = create_block_mask(mod, 2, None, 3 * B, T + 3 * B, device="cpu", BLOCK_SIZE=4)
    # the block mask keeps exactly the 4x4 tiles that hold at least one visible pair
    dense = build_attention_mask(anchors, valid, T, B)[:, 0]
    tiles = dense.reshape(2, 3, 4, (T + 3 * B) // 4, 4).any(dim=(2, 4))
    assert torch.equal(bm.to_dense()[:, 0].bool(), tiles)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_attention_impls_agree(dtype, tol):
    model = tiny_model(dtype=dtype)
    ctx, ids = tiny_batch(b=2, T=24, dtype=dtype)
    cv = torch.ones(2, 24, dtype=torch.bool)
    cv[1, 15:] = False  # row 1 is padding after 15
    anchors = torch.tensor([[3, 10, 17, 0], [0, 5, 14, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, False]])
    outs = {}
    with torch.no_grad():
        for impl in ATTN_IMPLS:
            model.attn_impl = impl
            outs[impl] = model(ctx, ids, anchors, valid, context_valid=cv)
    assert set(outs) == {"sdpa", "flex", "dense"}
    for impl in ("flex", "dense"):
        torch.testing.assert_close(outs[impl], outs["sdpa"], rtol=tol, atol=tol)
        assert torch.isfinite(outs[impl]).all() and (outs[impl][~valid] == 0).all()  # padded blocks


def test_attention_impls_agree_on_gradients():
    grads = {}
    for impl in ("sdpa", "dense"):  # flex has no backward on CPU (next test)
        model = tiny_model(dtype=torch.float64)
        model.attn_impl = impl
        ctx, ids = tiny_batch(b=2, T=16)
        lm = torch.ones(2, 16, dtype=torch.bool)
        a, v = sample_anchors(lm, 4, torch.Generator().manual_seed(0))
        loss, _ = dflash_loss(model, model(ctx, ids, a, v), ids, lm, a, v)
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["dense"][n], g, rtol=1e-9, atol=1e-12)


def test_flex_training_on_cpu_is_a_clear_error():
    model = tiny_model(dtype=torch.float32)
    model.attn_impl = "flex"
    ctx, ids = tiny_batch(b=1, T=12, dtype=torch.float32)
    a, v = torch.tensor([[2, 6]]), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ConfigError, match="sdpa"):
        model(ctx, ids, a, v)  # parameters require grad -> flex would need a CPU backward
    with torch.no_grad():
        assert torch.isfinite(model(ctx, ids, a, v)).all()


def test_attn_impl_rejected():
    m = tiny_model()
    with pytest.raises(ConfigError, match="bogus"):
        DFlashDraft(m.cfg, m.embed_weight, m.lm_head_weight, attn_impl="bogus")


# ------------------------------------------------------ training forward == inference forward

@pytest.mark.parametrize("impl", ATTN_IMPLS)
def test_single_anchor_training_forward_equals_inference_forward(impl):
    """An inference-style forward (one block [x_p, MASK...] attending, with no mask at all, to the
    context positions 0..p-1 only) equals the training forward's output for the anchor at p: both
    for a single-anchor batch and inside a multi-anchor, padded batch."""
    model = tiny_model()
    model.attn_impl = impl
    T = 20
    ctx, ids = tiny_batch(b=2, T=T)
    cv = torch.ones(2, T, dtype=torch.bool)
    cv[1, 13:] = False
    with torch.no_grad():
        for p in (0, 1, 7, T - 1):
            single = model(ctx[:1], ids[:1], torch.tensor([[p]]), torch.ones(1, 1, dtype=torch.bool))
            inf = model.infer_block(ctx[:1, :p], ids[0, p:p + 1])
            assert inf.shape == (1, model.cfg.block_size, H)
            torch.testing.assert_close(single[0, 0], inf[0], rtol=1e-10, atol=1e-10)
        anchors = torch.tensor([[2, 9, 15, 19, 0], [0, 4, 11, 12, 3]])
        valid = torch.tensor([[True, True, True, True, False], [True, True, True, True, False]])
        train = model(ctx, ids, anchors, valid, context_valid=cv)
        for bi in range(2):
            for n in range(4):
                p = int(anchors[bi, n])
                inf = model.infer_block(ctx[bi:bi + 1, :p], ids[bi, p:p + 1])
                torch.testing.assert_close(train[bi, n], inf[0], rtol=1e-10, atol=1e-10)
                greedy = model.logits(train[bi, n, 1:]).argmax(-1)
                assert torch.equal(model.propose(ctx[bi:bi + 1, :p], ids[bi, p:p + 1])[0], greedy)
        # the inference path really sees only what it is given: context after p is not an input
        with pytest.raises(ConfigError):
            model.infer_block(ctx[:1, :5, :2], ids[0, 5:6])


def test_inference_forward_is_sensitive_to_every_context_position():
    """Guards the equality test above against a vacuous pass (a block that ignored its context)."""
    model = tiny_model()
    ctx, ids = tiny_batch(b=1, T=12)
    with torch.no_grad():
        base = model.infer_block(ctx[:, :8], ids[0, 8:9])
        for j in (0, 7):
            c2 = ctx[:, :8].clone()
            c2[:, j] += 1.0
            assert (model.infer_block(c2, ids[0, 8:9]) - base).abs().max() > 1e-6


# --------------------------------------------------------------- chunked logits (memory bound)

@pytest.mark.parametrize("mode", ["fused", "checkpoint", "plain"])
def test_logits_are_computed_in_chunks(monkeypatch, mode):
    """The lm_head never sees more than ``chunk_rows`` rows at once, so no anchors × B × vocab
    tensor is built. In "fused" and "checkpoint" modes at most one chunk of logits is alive at a time,
    none survives the forward and autograd saves no vocab-wide tensor for backward; "plain" (the
    reference mode) saves one [chunk, V] tensor per chunk until backward."""
    import weakref

    model = tiny_model(dtype=torch.float32, block_size=4)
    ctx, ids = tiny_batch(b=2, T=24, dtype=torch.float32)
    lm = torch.ones(2, 24, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 6, torch.Generator().manual_seed(3))
    hidden = model(ctx, ids, anchors, valid)
    real_linear = torch.nn.functional.linear
    calls, alive, max_alive = [], [], [0]

    def spy(x, weight, bias=None):
        out = real_linear(x, weight, bias)
        if weight is model.lm_head_weight:
            max_alive[0] = max(max_alive[0], sum(r() is not None for r in alive))
            calls.append(tuple(out.shape))
            alive.append(weakref.ref(out))
        return out

    saved = []

    head_storage = model.lm_head_weight.untyped_storage().data_ptr()

    def pack(t):
        if t.untyped_storage().data_ptr() != head_storage:  # the frozen head itself is not a new tensor
            saved.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    chunk = 5
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, stats = dflash_loss(model, hidden, ids, lm, anchors, valid, None, chunk, mode=mode)
    rows = int(stats.total.sum())
    assert rows > 3 * chunk
    assert len(calls) == -(-rows // chunk) and all(r <= chunk and v == V for r, v in calls)
    vocab_wide = [s for s in saved if len(s) >= 2 and s[-1] == V]
    if mode == "plain":
        assert len(vocab_wide) >= len(calls) and all(s[0] <= chunk for s in vocab_wide)
    else:
        survivors = sum(r() is not None for r in alive)
        assert max_alive[0] <= 1 and survivors == 0 and vocab_wide == []
    loss.backward()
    assert model.fc.weight.grad.abs().sum() > 0
