"""DSpark unit tests: layer ids, block layout, Markov teacher forcing, the supervised prefix, the three loss
terms, fused = plain gradients, metrics and calibration on small hand-checked cases, export round trips."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from artcache.errors import ConfigError
from artcache.layer_ids import dspark_layer_ids
from artcache.trainers.dflash import sample_anchors
from artcache.trainers.dspark import (
    BlockOutputs,
    DSparkConfig,
    DSparkDraft,
    block_layout,
    dspark_loss,
    slot_weights,
)
from artcache.trainers.dspark.calibrate import cumulative_ece, fit_temperatures
from artcache.trainers.dspark.loss import _FusedDSparkTerms
from artcache.trainers.dspark.metrics import block_sums, ece_from_arrays, greedy_proposals, summarize

V, H = 40, 16


def cfg_of(**kw) -> DSparkConfig:
    base = dict(hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                vocab_size=V, num_context_layers=2, mask_token_id=V - 1, block_size=4, num_anchors=6, markov_rank=6)
    base.update(kw)
    return DSparkConfig(**base)


def model_of(seed: int = 0, dtype=torch.float64, **kw) -> DSparkDraft:
    torch.manual_seed(seed)
    emb, head = torch.randn(V, H, dtype=dtype), torch.randn(V, H, dtype=dtype)
    return DSparkDraft(cfg_of(**kw), emb, head, torch.rand(H, dtype=dtype) + 0.5, dtype=dtype)


def test_dspark_layer_ids_goldens():
    assert dspark_layer_ids(30, 5) == [1, 8, 14, 20, 27, 29]  # SmolLM2: --layer-ids 1,8,14,20,27,29
    assert dspark_layer_ids(36, 5) == [1, 9, 17, 25, 33, 35]  # Qwen3-8B: DeepSpec's context ids + L-1
    assert dspark_layer_ids(6, 3) == [1, 2, 3, 5]


def test_config_defaults_and_validation():
    c = DSparkConfig(hidden_size=H, num_layers=5, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                     vocab_size=V, num_context_layers=5, mask_token_id=3)
    assert (c.block_size, c.num_anchors, c.markov_rank, c.markov_head_type, c.gamma) == (7, 512, 256, "vanilla", 4.0)
    assert (c.ce_weight, c.l1_weight, c.confidence_weight) == (0.1, 0.9, 1.0)
    assert c.confidence_input_size == H + 256
    with pytest.raises(ConfigError, match="markov-rank -1"):
        cfg_of(markov_rank=-1)
    with pytest.raises(ConfigError, match="needs the Markov head"):
        cfg_of(markov_rank=0)  # confidence_head_with_markov defaults to True
    assert cfg_of(markov_rank=0, confidence_head_with_markov=False).confidence_input_size == H
    with pytest.raises(ConfigError, match="markov_head_type"):
        cfg_of(markov_head_type="rnn")


def test_block_layout_sample_from_anchor_and_prefix_mask():
    """Slot k of the block at p predicts x_{p+k+1} from the target state at p+k; prev is x_p then the labels;
    a hole in the loss mask ends the supervised prefix; the sequence end and invalid blocks supervise nothing."""
    ids = torch.arange(10, 20)[None]  # x_t = 10 + t, T = 10
    lm = torch.ones(1, 10, dtype=torch.bool)
    lm[0, 5] = False
    anchors = torch.tensor([[2, 7, 0]])
    valid = torch.tensor([[True, True, False]])
    lay = block_layout(ids, lm, anchors, valid, 4)
    assert lay.labels[0, 0].tolist() == [13, 14, 15, 16]
    assert lay.prev[0, 0].tolist() == [12, 13, 14, 15]  # anchor, then the data tokens (teacher forcing)
    assert lay.target_pos[0, 0].tolist() == [2, 3, 4, 5]
    assert lay.supervised[0, 0].tolist() == [True, True, False, False]  # label 15 is at position 5: hole
    assert lay.supervised[0, 1].tolist() == [True, True, False, False]  # labels at 8, 9, then past T
    assert lay.labels[0, 1, :2].tolist() == [18, 19]
    assert lay.supervised[0, 2].tolist() == [False] * 4  # padded block
    cv = torch.ones(1, 10, dtype=torch.bool)
    cv[0, 9] = False
    assert block_layout(ids, lm, anchors, valid, 4, cv).supervised[0, 1].tolist() == [True, False, False, False]


def test_slot_weights():
    assert torch.allclose(slot_weights(4, 4.0), torch.exp(-torch.arange(4.0) / 4))
    assert float(slot_weights(7, 4.0)[0]) == 1.0  # slot 0 (the anchor) is trained: every slot predicts


def test_fused_terms_hand_checked():
    """p = (1/2, 1/4, 1/4), q uniform: CE(label 0) = ln 2, ‖p − q‖₁ = 1/3, α = 5/6."""
    W = torch.eye(3, dtype=torch.float64)
    h = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64))
    tn = torch.zeros(1, 3, dtype=torch.float64)
    loss, ce, l1, pred = _FusedDSparkTerms.apply(h, None, None, W, tn, torch.tensor([0]),
                                                 torch.ones(1, dtype=torch.float64), 0.1, 0.9, 8, False, torch.float64)
    assert math.isclose(float(ce), math.log(2), rel_tol=1e-12)
    assert math.isclose(float(l1), 1 / 3, rel_tol=1e-12)
    assert math.isclose(float(loss), 0.1 * math.log(2) + 0.9 / 3, rel_tol=1e-12)
    assert int(pred) == 0


def _setup(model, b=2, T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(b, T, 2, H, dtype=torch.float64, generator=g)
    last = torch.randn(b, T, H, dtype=torch.float64, generator=g) * 3
    ids = torch.randint(0, V - 1, (b, T), generator=g)
    lm = torch.ones(b, T, dtype=torch.bool)
    lm[:, :3] = False
    lm[-1, 11:] = False
    a, v = sample_anchors(lm, model.cfg.num_anchors, torch.Generator().manual_seed(seed))
    return ctx, last, ids, lm, a, v


def test_three_loss_terms_against_a_direct_computation():
    """0.1·CE + 0.9·L1 + 1.0·BCE(conf, detached clamp(1 − ½L1)), weights exp(−k/4) over the supervised prefix,
    normalised by Σw; the target distribution through the final norm once; the Markov head teacher-forced."""
    m = model_of()
    ctx, last, ids, lm, a, v = _setup(m)
    hidden = m(ctx, ids, a, v)
    loss, out = dspark_loss(m, hidden, last, ids, lm, a, v)
    lay = block_layout(ids, lm, a, v, 4)
    w = torch.exp(-torch.arange(4.0, dtype=torch.float64) / 4) * lay.supervised
    ce_n = l1_n = bce_n = 0.0
    for bi, n, k in lay.supervised.nonzero().tolist():
        h = hidden[bi, n, k]
        prev = int(lay.prev[bi, n, k])
        assert prev == (int(ids[bi, a[bi, n]]) if k == 0 else int(ids[bi, a[bi, n] + k]))  # teacher forcing
        emb = m.markov_head.markov_w1.weight[prev]
        z = m.lm_head_weight @ h + m.markov_head.markov_w2.weight @ emb
        x = last[bi, a[bi, n] + k]
        x = x / torch.sqrt(x.pow(2).mean() + m.cfg.rms_norm_eps) * m.target_norm_weight
        q = torch.softmax(m.lm_head_weight @ x, dim=-1)
        p = torch.softmax(z, dim=-1)
        ce = -torch.log_softmax(z, dim=-1)[ids[bi, a[bi, n] + k + 1]]
        l1 = (p - q).abs().sum()
        alpha = (1 - 0.5 * l1).clamp(0, 1)
        c = m.confidence_head.proj(torch.cat((h, emb)))[0]
        bce = F.binary_cross_entropy_with_logits(c, alpha)
        wk = w[bi, n, k]
        ce_n, l1_n, bce_n = ce_n + wk * ce, l1_n + wk * l1, bce_n + wk * bce
        assert math.isclose(float(out.alpha[bi, n, k]), float(alpha.detach()), rel_tol=1e-5)
    ws = w.sum()
    expect = (0.1 * ce_n + 0.9 * l1_n + 1.0 * bce_n) / ws
    assert math.isclose(float(loss.detach()), float(expect.detach()), rel_tol=1e-10)
    assert math.isclose(float(out.weight_sum), float(ws), rel_tol=1e-12)
    assert math.isclose(float(out.ce_sum), float(ce_n.detach()), rel_tol=1e-10)
    # the confidence target is detached: its gradient does not flow into the L1 path
    loss.backward()
    assert m.confidence_head.proj.weight.grad is not None


def test_markov_teacher_forcing_reads_the_data_not_the_backbone():
    """The backbone sees only the anchor and MASKs; slot k's Markov input is the data token x_{p+k}: changing
    x_{p+1} changes slot 1's loss and leaves the backbone's states alone."""
    m = model_of()
    ctx, last, ids, lm, _, _ = _setup(m, b=1)
    a, v = torch.tensor([[5]]), torch.tensor([[True]])
    h1 = m(ctx, ids, a, v)
    _, o1 = dspark_loss(m, h1, last, ids, lm, a, v)
    ids2 = ids.clone()
    ids2[0, 6] = (ids[0, 6] + 1) % (V - 1)
    h2 = m(ctx, ids2, a, v)
    _, o2 = dspark_loss(m, h2, last, ids2, lm, a, v)
    assert torch.equal(h1, h2)
    assert o1.alpha[0, 0, 0] == o2.alpha[0, 0, 0]  # slot 0: prev = anchor, same target state
    assert o1.alpha[0, 0, 1] != o2.alpha[0, 0, 1]  # slot 1: prev = x_6 changed


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_fused_equals_plain_gradients(head):
    m = model_of(markov_head_type=head)
    ctx, last, ids, lm, a, v = _setup(m)
    res = {}
    for mode in ("fused", "plain"):
        m.zero_grad()
        loss, out = dspark_loss(m, m(ctx, ids, a, v), last, ids, lm, a, v, mode=mode, chunk_rows=5)
        loss.backward()
        res[mode] = (loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}, out)
    (lf, gf, of), (lp, gp, op) = res["fused"], res["plain"]
    assert math.isclose(lf, lp, rel_tol=1e-12)
    assert set(gf) == set(gp) and "markov_head.markov_w2.weight" in gf and "markov_head.markov_w1.weight" in gf
    for k in gp:
        assert torch.allclose(gf[k], gp[k], atol=1e-12), k
    assert torch.equal(of.correct, op.correct) and torch.allclose(of.alpha, op.alpha)


@pytest.mark.parametrize("mode", ["fused", "chunked"])
@pytest.mark.parametrize("heads", [{"markov_head_type": "vanilla"}, {"markov_head_type": "gated"},
                                   {"markov_rank": 0, "confidence_head_with_markov": False},
                                   {"enable_confidence_head": False, "confidence_weight": 0.0}])
def test_static_rows_equal_plain_gradients_in_float64(mode, heads):
    """The sync-free objective (static rows, Σ w divided on the device; ``chunked``: the functional per-chunk
    body, which keeps float64 matmuls for a float64 model) is the reference's, to float64 rounding, with
    each head configuration; unsupervised slots stay 0 in the outputs."""
    m = model_of(**heads)
    ctx, last, ids, lm, a, v = _setup(m)
    v[1, -1] = False  # an invalid block
    res = {}
    for static in (False, True):
        m.zero_grad()
        loss, out = dspark_loss(m, m(ctx, ids, a, v), last, ids, lm, a, v, chunk_rows=5,
                                mode=mode if static else "plain", static_rows=static)
        loss.backward()
        res[static] = (loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, out)
    (lp, gp, op), (ls, gs, os_) = res[False], res[True]
    assert math.isclose(ls, lp, rel_tol=1e-12)
    assert set(gs) == set(gp)
    for k in gp:
        assert torch.allclose(gs[k], gp[k], atol=1e-12), k
    assert torch.equal(os_.correct, op.correct) and torch.allclose(os_.alpha, op.alpha, atol=1e-12)
    assert (op.conf_logit is None) == (os_.conf_logit is None)
    if op.conf_logit is not None:
        assert torch.allclose(os_.conf_logit, op.conf_logit, atol=1e-12)
    for name in ("ce_sum", "l1_sum", "conf_sum", "weight_sum"):
        assert math.isclose(float(getattr(os_, name)), float(getattr(op, name)), rel_tol=1e-12, abs_tol=1e-15), name


def test_static_rows_with_nothing_supervised_give_a_zero_loss_with_a_graph():
    m = model_of()
    ctx, last, ids, _, a, v = _setup(m)
    lm = torch.zeros_like(ids, dtype=torch.bool)
    loss, out = dspark_loss(m, m(ctx, ids, a, v), last, ids, lm, a, v, mode="chunked", static_rows=True)
    loss.backward()
    assert loss.item() == 0.0 and float(out.weight_sum) == 0.0 and m.fc.weight.grad.abs().sum() == 0


def test_no_supervised_row_gives_a_zero_loss_with_a_graph():
    m = model_of()
    ctx, last, ids, _, a, v = _setup(m)
    lm = torch.zeros_like(ids, dtype=torch.bool)
    loss, out = dspark_loss(m, m(ctx, ids, a, v), last, ids, lm, a, v)
    loss.backward()
    assert loss.item() == 0.0 and float(out.weight_sum) == 0.0
    s = summarize(block_sums(out, (0.1, 0.9, 1.0)), 4)
    assert "tau" not in s and "conf_mae" not in s and "ece" not in s and "accept_rate@0" not in s


def _outputs(alpha, sup, conf, valid=None) -> BlockOutputs:
    alpha, sup = torch.tensor(alpha, dtype=torch.float32)[None], torch.tensor(sup)[None]
    conf = torch.tensor(conf, dtype=torch.float32)[None]
    w = torch.exp(-torch.arange(alpha.shape[-1], dtype=torch.float64) / 4) * sup
    z = torch.zeros((), dtype=torch.float64)
    return BlockOutputs(supervised=sup, weights=w, alpha=alpha * sup, correct=sup & (alpha > 0.6), conf_logit=conf,
                        valid=torch.ones(sup.shape[:2], dtype=torch.bool) if valid is None else valid,
                        ce_sum=z + 1.0, l1_sum=z + 2.0, conf_sum=z + 3.0, weight_sum=w.sum())


def test_metrics_hand_checked():
    """One block, α = (0.8, 0.5, ·) over a prefix of 2, confidence logits 0 (c = 0.5)."""
    out = _outputs([[0.8, 0.5, 0.9]], [[True, True, False]], [[0.0, 0.0, 0.0]])
    s = summarize(block_sums(out, (0.1, 0.9, 1.0)), 3)
    assert math.isclose(s["tau"], 1 + 0.8 + 0.8 * 0.5, rel_tol=1e-6)  # incl. the +1 bonus
    assert s["tau_includes_bonus"] is True and s["blocks"] == 1
    assert math.isclose(s["accept_rate@0"], 0.8, rel_tol=1e-6) and math.isclose(s["accept_rate@1"], 0.5, rel_tol=1e-6)
    assert "accept_rate@2" not in s and s["accept_rate"][2] is None  # no supervised row: omitted
    wsum, w1 = 1 + math.exp(-0.25), math.exp(-0.25)  # the slot decay weighs the confidence errors (DeepSpec)
    assert math.isclose(s["conf_mae"], (0.3 + 0.0 * w1) / wsum, rel_tol=1e-6)
    assert math.isclose(s["conf_bias"], (-0.3 + 0.0 * w1) / wsum, rel_tol=1e-6)
    assert math.isclose(s["cum_mae"], (0.3 + 0.15 * w1) / wsum, rel_tol=1e-6)  # Πc = (.5, .25), Πα = (.8, .4)
    assert math.isclose(s["ece@0"], 0.3, rel_tol=1e-6) and math.isclose(s["ece_cum@1"], 0.15, rel_tol=1e-6)
    assert math.isclose(s["ece_cum"], (0.3 + 0.15) / 2, rel_tol=1e-6) and "ece@2" not in s
    assert math.isclose(s["loss"], (0.1 * 1 + 0.9 * 2 + 3) / wsum, rel_tol=1e-9)
    assert s["acc"][:2] == [1.0, 0.0]


def test_regression_confidence_errors_are_weighted_by_the_slot_decay():
    """conf_mae, conf_bias, cum_mae and cum_bias were plain means over supervised slots while DeepSpec's figures of
    the same names (deepspec/modeling/dspark/loss.py: confidence_abs_error, confidence_bias,
    confidence_cumprod_bias) are Σ w_k·err / Σ w_k with the slot decay w_k = exp(-k/4): the same outputs gave
    other numbers than DeepSpec's. Hand-computed here for one block of 3 supervised slots, on the host path
    (block_sums) and the sync-free device path (block_pending) alike."""
    from artcache.trainers.dspark.metrics import block_pending

    # α = (0.9, 0.5, 0.2), c = sigmoid(z) with z = (0, ln 3, ln(1/4)): c = (0.5, 0.75, 0.2)
    out = _outputs([[0.9, 0.5, 0.2]], [[True, True, True]], [[0.0, math.log(3.0), math.log(0.25)]])
    w = [1.0, math.exp(-0.25), math.exp(-0.5)]  # 1, 0.778801, 0.606531
    W = sum(w)  # 2.385332
    err = [0.5 - 0.9, 0.75 - 0.5, 0.2 - 0.2]  # -0.4, 0.25, 0.0
    cerr = [0.5 - 0.9, 0.375 - 0.45, 0.075 - 0.09]  # Πc = (.5, .375, .075), Πα = (.9, .45, .09)
    want = {"conf_mae": (0.4 + 0.25 * w[1]) / W,  # 0.249315 (the plain mean: 0.216667)
            "conf_bias": (-0.4 + 0.25 * w[1]) / W,  # -0.086067 (plain: -0.05)
            "cum_mae": (0.4 + 0.075 * w[1] + 0.015 * w[2]) / W,  # 0.195978
            "cum_bias": (-0.4 - 0.075 * w[1] - 0.015 * w[2]) / W}  # -0.195978 (plain: -0.163333)
    assert math.isclose(want["conf_mae"], 0.249315, abs_tol=1e-6) and math.isclose(want["conf_bias"], -0.086067,
                                                                                    abs_tol=1e-6)
    assert math.isclose(sum(abs(e) for e in err) / 3, 0.216667, abs_tol=1e-6)  # what the plain mean gave
    assert math.isclose(sum(cerr) / 3, -0.163333, abs_tol=1e-6)
    for sums in (block_sums(out, (0.1, 0.9, 1.0)), block_pending(out, (0.1, 0.9, 1.0)).resolve()):
        s = summarize(sums, 3)
        for name, value in want.items():
            assert math.isclose(s[name], value, rel_tol=1e-6), (name, s[name], value)


def test_metric_sums_divide_once_across_batches():
    """Two batches summed then divided: τ is the mean over all blocks (not the mean of batch means)."""
    a = _outputs([[0.5, 0.5]], [[True, True]], [[0.0, 0.0]])
    b = _outputs([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], [[True, True], [True, False], [True, False]],
                 [[0.0, 0.0]] * 3)
    s = summarize(block_sums(a, (0.1, 0.9, 1.0)) + block_sums(b, (0.1, 0.9, 1.0)), 2)
    assert math.isclose(s["tau"], (1.75 + 3.0 + 1.0 + 1.0) / 4, rel_tol=1e-6)
    assert s["blocks"] == 4


def test_ece_bins():
    """Two predictions in one bin: |mean pred − mean target| there, weighted by the bin's share."""
    pred = torch.tensor([[0.31], [0.39], [0.95]])
    tgt = torch.tensor([[0.5], [0.6], [0.95]])
    e = ece_from_arrays(pred, tgt, torch.ones(3, 1, dtype=torch.bool))
    assert math.isclose(e[0], (abs(0.70 - 1.10) + 0.0) / 3, rel_tol=1e-6)


def test_sts_recovers_temperatures_and_lowers_ece():
    """Targets made with per-slot temperatures (2, 0.5, 1): STS finds them and lowers the cumulative ECE."""
    g = torch.Generator().manual_seed(0)
    n, true = 1500, torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64)
    z = torch.randn(n, 3, generator=g, dtype=torch.float64) * 2
    alpha = torch.sigmoid(z / true)
    mask = torch.ones(n, 3, dtype=torch.bool)
    mask[: n // 4, 2] = False
    temps = torch.tensor(fit_temperatures(z, alpha, mask), dtype=torch.float64)
    assert torch.allclose(temps, true, rtol=0.05), temps
    _, before = cumulative_ece(z, alpha, mask, torch.ones(3, dtype=torch.float64))
    _, after = cumulative_ece(z, alpha, mask, temps)
    assert after < 0.2 * before


def test_greedy_proposals_feed_their_own_tokens_and_match_propose():
    """Serving-style drafting: prev is the draft's own previous proposal; propose() (one block, no mask)
    equals greedy_proposals over forward()'s block at the same anchor."""
    m = model_of(dtype=torch.float32)
    ctx, _, ids, _, _, _ = _setup(m, b=1)
    ctx = ctx.float()
    p = 9
    h = m(ctx, ids, torch.tensor([[p]]), torch.tensor([[True]]))
    got = greedy_proposals(m, h[0], ids[0, [p]])
    toks, conf = m.propose(ctx[:, :p], ids[:, p])
    assert torch.equal(got, toks)
    assert conf.shape == (1, 4) and bool(((conf > 0) & (conf < 1)).all())
    # by hand: slot 1 reads slot 0's proposal
    _, bias_in = m.markov_inputs(toks[:, 0], h[0, :, 1])
    assert int(m.draft_logits(h[0, :, 1], bias_in).argmax()) == int(toks[0, 1])


def test_frozen_target_tensors_are_not_trainable():
    m = model_of()
    keys = set(m.trainable_state_dict())
    assert not keys & {"embed_weight", "lm_head_weight", "target_norm_weight"}
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "context_norm.weight"} <= keys


# ------------------------------------------------------------------------------------------ export

def _checkpoint(tmp_path, m: DSparkDraft, ids, calib=None):
    from artcache.trainers.checkpoint import point_latest, save_checkpoint

    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    extra = {} if calib is None else {"calibration.temperatures": torch.tensor(calib, dtype=torch.float64)}
    path = save_checkpoint(tmp_path / "run", step=1, cursor=0, weights=m.trainable_state_dict(), optimizer=opt,
                           generators={}, extra_tensors=extra,
                           state={"draft": "dspark", "layer_ids": ids,
                                  "draft_config": {**msgspec.to_builtins(m.cfg), "layer_ids": ids}})
    point_latest(tmp_path / "run", path)
    return path


def _target_cfg(L=6):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=32, architectures=["LlamaForCausalLM"])


@pytest.mark.parametrize("fmt", ["hf", "speculators"])
def test_export_round_trip(tmp_path, fmt):
    from artcache.trainers.dspark.export import load_dspark_export
    from artcache.trainers.export import export_checkpoint

    m = model_of(dtype=torch.float32)
    ckpt = _checkpoint(tmp_path, m, [1, 3, 5], calib=[1.5, 1.0, 0.8, 2.0])
    # a config-only target: the hf export without the target's tensors (test_regression_dspark_hf_export_... has them)
    res = export_checkpoint(ckpt, tmp_path / "out", fmt, target=_target_cfg(), dtype="float32", target_tensors=False)
    c = res.config
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["sample_from_anchor"] is True
    assert c["block_size"] == 4 and c["markov_rank"] == 6 and c["markov_head_type"] == "vanilla"
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["mask_token_id"] == V - 1 and c["confidence_temperatures"] == [1.5, 1.0, 0.8, 2.0]
    if fmt == "speculators":
        assert c["speculators_model_type"] == "dspark" and c["aux_hidden_state_layer_ids"] == [2, 4]  # input-of-layer
        assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    else:
        assert c["target_layer_ids"] == [1, 3] and c["model_type"] == "qwen3"  # output-of-layer, as DeepSpec
    assert "hidden_norm.weight" in res.keys and "context_norm.weight" not in res.keys
    assert "confidence_head.proj.bias" in res.keys and not any(k.startswith(("embed", "lm_head")) for k in res.keys)
    m2, ctx_ids, temps = load_dspark_export(tmp_path / "out", m.embed_weight, m.lm_head_weight, m.target_norm_weight)
    assert ctx_ids == [1, 3] and temps == [1.5, 1.0, 0.8, 2.0]
    for k, v in m.trainable_state_dict().items():
        assert torch.equal(v, m2.trainable_state_dict()[k]), k
    prov = json.loads((tmp_path / "out" / "export.json").read_text())
    assert prov["draft"] == "dspark" and prov["layer_ids_output_of_layer"] == [1, 3]
    assert "before the final norm" in c["dspark_target_state"]


@pytest.mark.parametrize("tied", [False, True])
def test_regression_dspark_hf_export_carries_the_targets_embedding_and_lm_head(tmp_path, tied):
    """The DSpark hf export had no embed_tokens / lm_head: DeepSpec's evaluator loads a draft with transformers'
    from_pretrained alone, which initialises absent tensors at random, so its proposals were made with a random
    embedding and head. The export now writes the target's (default): a model with DeepSpec's top-level names,
    loaded by transformers' own from_pretrained from the export directory, has them equal to the target's and
    reports neither missing (a target with tied embeddings too: both written, as two tensors); a config-only
    target is refused in one message naming --no-target-tensors; with target_tensors=False they are left out."""
    from torch import nn
    from transformers import LlamaForCausalLM, Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

    from artcache.trainers.dspark.export import load_dspark_export
    from artcache.trainers.export import export_checkpoint

    class DeepSpecNames(Qwen3PreTrainedModel):  # the frozen tensors DeepSpec's Qwen3DSparkModel owns, its names
        config_class = Qwen3Config

        def __init__(self, config) -> None:
            super().__init__(config)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

    torch.manual_seed(1)
    cfg = _target_cfg()
    cfg.tie_word_embeddings = tied
    target = LlamaForCausalLM(cfg)
    target.save_pretrained(str(tmp_path / "target"))
    m = model_of(dtype=torch.float32)
    ckpt = _checkpoint(tmp_path, m, [1, 3, 5])
    res = export_checkpoint(ckpt, tmp_path / "out", "hf", target=str(tmp_path / "target"), dtype="float32")
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(res.keys)
    loaded, info = DeepSpecNames.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not [k for k in info["missing_keys"] if "embed_tokens" in k or "lm_head" in k], info["missing_keys"]
    assert torch.equal(loaded.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    # artcache's own loader reads them from the export too, and rebuilds the draft's trained tensors exactly
    m2, _, _ = load_dspark_export(tmp_path / "out", None, None, m.target_norm_weight)
    assert torch.equal(m2.embed_weight, target.model.embed_tokens.weight)
    for k, v in m.trainable_state_dict().items():
        assert torch.equal(v, m2.trainable_state_dict()[k]), k
    (tmp_path / "config-only").mkdir()
    target.config.save_pretrained(str(tmp_path / "config-only"))
    with pytest.raises(ConfigError, match="no weights; .*--no-target-tensors"):
        export_checkpoint(ckpt, tmp_path / "o2", "hf", target=str(tmp_path / "config-only"))
    assert not (tmp_path / "o2").exists()
    res = export_checkpoint(ckpt, tmp_path / "o3", "hf", target=str(tmp_path / "target"), target_tensors=False)
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(res.keys)
    spec = export_checkpoint(ckpt, tmp_path / "o4", "speculators", target=str(tmp_path / "target"))
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(spec.keys)  # vLLM shares the target's


def test_export_refuses_a_gated_head_as_speculators_and_mismatched_weights(tmp_path):
    from artcache.trainers.checkpoint import write_state
    from artcache.trainers.export import export_checkpoint

    m = model_of(dtype=torch.float32, markov_head_type="gated")
    ckpt = _checkpoint(tmp_path, m, [1, 3, 5])
    with pytest.raises(ConfigError, match="vanilla"):
        export_checkpoint(ckpt, tmp_path / "o1", "speculators", target=_target_cfg())
    export_checkpoint(ckpt, tmp_path / "o2", "hf", target=_target_cfg(), target_tensors=False)  # has gate_proj
    m3 = model_of(dtype=torch.float32)
    st = json.loads((ckpt / "state.json").read_text())
    ck2 = _checkpoint(tmp_path / "x", m3, [1, 3, 5])
    st2 = json.loads((ck2 / "state.json").read_text())
    st2["draft_config"]["markov_rank"] = 5
    write_state(ck2, st2)
    with pytest.raises(ConfigError, match="does not match its draft config"):
        export_checkpoint(ck2, tmp_path / "o3", "hf", target=_target_cfg())
    assert st["draft"] == "dspark" and not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


@pytest.mark.parametrize("fmt", ["speculators", "hf"])
def test_init_from_an_export_maps_names_back_and_checks_the_config(tmp_path, fmt):
    """A DSpark export (either format) seeds a run through the one seed loader (artcache.trainers.seed): its
    config.json is read back as DSpark's (layer ids = the context ids then L - 1), its serving names map back
    onto the model's keys and load the source's tensors, and a run reading other layers or with another Markov
    rank is refused naming the field and both values."""
    from artcache.trainers.dspark.adapter import DSparkAdapter
    from artcache.trainers.export import export_checkpoint
    from artcache.trainers.seed import SeedPlan, compare_configs, load_seed, map_back, read_seed

    m = model_of(dtype=torch.float32)
    export_checkpoint(_checkpoint(tmp_path, m, [1, 3, 5]), tmp_path / "out", fmt, target=_target_cfg(),
                      dtype="float32", target_tensors=False)
    own = {k: tuple(v.shape) for k, v in m.trainable_state_dict().items()}
    ours = {**msgspec.to_builtins(m.cfg), "layer_ids": [1, 3, 5]}
    assert DSparkAdapter.weight_shapes(ours) == own
    src = read_seed(tmp_path / "out", 6)
    assert src.draft == "dspark" and src.recorded["layer_ids"] == [1, 3, 5]
    assert compare_configs(src, ours, DSparkAdapter.seed_fields, [], "seed") == []
    mapping, target = map_back(src.shapes, own, DSparkAdapter.serving_names, DSparkAdapter.target_tensors, "seed")
    assert sorted(mapping.values()) == sorted(own) and not target
    assert any(k.startswith("hidden_norm.") for k in mapping)  # a serving name, mapped back
    got = load_seed(SeedPlan(src, mapping))
    for k, v in m.trainable_state_dict().items():
        assert torch.equal(got[k], v), k
    with pytest.raises(ConfigError, match=r"trained on layers \[1, 3, 5\], this run reads \[1, 2, 5\]"):
        compare_configs(src, {**ours, "layer_ids": [1, 2, 5]}, DSparkAdapter.seed_fields, [], "seed")
    with pytest.raises(ConfigError, match="markov_rank differs: seed 6, this run 5"):
        compare_configs(src, {**ours, "markov_rank": 5}, DSparkAdapter.seed_fields, [], "seed")


def test_views_union_and_default_layers():
    from artcache.app.config import Experiment
    from artcache.app.experiments import draft_view, layer_union
    from artcache.errors import ContractMismatch
    from artcache.layer_ids import layer_view
    from artcache.trainers.dspark.adapter import dspark_default_layers

    views = [draft_view(Experiment(name="d", draft_layers=5), 30), draft_view(Experiment(name="e", draft="eagle3"), 30),
             draft_view(Experiment(name="s", draft="dspark", draft_layers=5), 30)]
    assert views[2] == [1, 8, 14, 20, 27, 29]
    assert layer_union(views) == [1, 8, 14, 20, 26, 27, 29]
    assert dspark_default_layers(30, [1, 8, 14, 20, 26, 27, 29]) == 5
    assert dspark_default_layers(30, [1, 14, 26, 27, 29]) == 3  # [1, 14, 27] + 29
    with pytest.raises(ContractMismatch, match=r"missing \[29\].*--layer-ids 1,8,14,20,27,29"):
        layer_view([1, 8, 14, 20, 27], dspark_layer_ids(30, 5), draft="a 5-layer DSpark draft", flag_hint="")


def test_consume_refuses_bad_dspark_flags(tmp_path):
    from click.testing import CliRunner

    from artcache.app.cli import main

    res = CliRunner().invoke(main, ["consume", "--cache", str(tmp_path), "--draft", "dspark", "--markov-rank", "-1"])
    assert res.exit_code == 2 and "--markov-rank -1" in res.output
    res = CliRunner().invoke(main, ["consume", "--cache", str(tmp_path), "--draft", "dspork"])
    assert res.exit_code == 2 and "dflash, eagle3, dspark" in res.output
    from artcache.trainers.consumer import default_anchors, default_block_size

    assert (default_block_size("dspark"), default_block_size("dflash")) == (7, 16)
    assert (default_anchors("dspark", "cuda:0"), default_anchors("dspark", "cpu"), default_anchors("dflash", "cuda")) \
        == (512, 64, 64)


def test_calibrate_checkpoint_writes_temperatures_and_refuses_stale_or_missing_records(tmp_path):
    from artcache.trainers.checkpoint import save_checkpoint
    from artcache.trainers.dspark.adapter import CALIBRATION_KEY, HELDOUT_PREFIX, weights_check
    from artcache.trainers.dspark.calibrate import calibrate_checkpoint

    m = model_of(dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(400, 4, generator=g) * 2
    rec = {"conf_logit": z, "alpha": torch.sigmoid(z / 2), "supervised": torch.ones(400, 4, dtype=torch.bool),
           "sample": torch.arange(400) // 50, "weights_check": weights_check(m.trainable_state_dict())}

    def save(run, weights, extra):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return save_checkpoint(tmp_path / run, step=3, cursor=6, weights=weights, optimizer=opt, generators={},
                               extra_tensors={HELDOUT_PREFIX + k: v for k, v in extra.items()},
                               state={"draft": "dspark", "draft_config": msgspec.to_builtins(m.cfg)})

    with pytest.raises(ConfigError, match="no greedy-replay outcomes .* --against alpha"):
        calibrate_checkpoint(save("no-replay", m.trainable_state_dict(), rec))  # the default is --against replay
    rep = calibrate_checkpoint(save("ok", m.trainable_state_dict(), rec), against="alpha")
    assert rep["against"] == "alpha" and rep["at_grid_edge"] == []
    assert len(rep["temperatures"]) == 4 and all(1.8 < t < 2.2 for t in rep["temperatures"])
    assert rep["ece_cum_pooled_after"] < 0.3 * rep["ece_cum_pooled_before"]
    assert rep["ece_cum_pooled_after_crossval"] < rep["ece_cum_pooled_before"] and rep["samples"] == 8
    ck = tmp_path / "ok" / "checkpoints" / "step-00000003"
    assert json.loads((ck / "calibration.json").read_text())["temperatures"] == rep["temperatures"]
    written = safetensors.torch.load_file(ck / "extra.safetensors")
    assert written[CALIBRATION_KEY].tolist() == rep["temperatures"] and HELDOUT_PREFIX + "alpha" in written
    stale = {k: v + 1e-3 if v.is_floating_point() else v for k, v in m.trainable_state_dict().items()}
    with pytest.raises(ConfigError, match="other weights"):
        calibrate_checkpoint(save("stale", stale, rec), against="alpha")
    old = {**{k: v for k, v in rec.items() if k != "sample"}, "position": torch.full((400,), -1)}
    with pytest.raises(ConfigError, match="keyed by run position"):  # an older artcache's one-sample records
        calibrate_checkpoint(save("old", m.trainable_state_dict(), old), against="alpha")
    with pytest.raises(ConfigError, match="no held-out confidence records"):
        calibrate_checkpoint(save("none", m.trainable_state_dict(), {}))


def test_calibrate_cli_refuses_bad_checkpoints_in_one_line(tmp_path):
    """`artcache calibrate` on a missing path, a corrupt or non-object state.json and another draft's checkpoint:
    exit 2 and one stderr line naming the path and what is accepted; nothing written."""
    from click.testing import CliRunner

    from artcache.app.cli import main

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"")
    cases = {"missing": (tmp_path / "nope", "accepted: a DSpark checkpoint"),
             "{": (bad, "state.json is unreadable"), "[1]": (bad, "not a checkpoint state"),
             '{"step": 1, "cursor": 2}': (bad, "holds a None draft"),
             '{"step": 1, "cursor": 2, "draft": "dflash"}': (bad, "holds a 'dflash' draft")}
    for state, (path, message) in cases.items():
        if state != "missing":
            (bad / "state.json").write_text(state)
        res = CliRunner().invoke(main, ["calibrate", "--checkpoint", str(path)])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and message in lines[0] and str(path) in lines[0], res.output
    assert sorted(p.name for p in bad.iterdir()) == ["model.safetensors", "state.json"]


def test_greedy_replay_hand_checked():
    """Slot k of the block at p proposes x_{p+k+1} and is checked against the target's argmax at p+k: proposals
    (x3, x4, wrong) at p = 2 accept 2 (τ 3 incl. the bonus); a wrong first proposal accepts none (τ 1)."""
    from artcache.trainers.dspark.metrics import replay

    class Fake:  # draft logits = the hidden state itself; no Markov head
        def markov_inputs(self, prev, h):
            return None, None

        def draft_logits(self, h, bias_in):
            return h

    Vs, T = 12, 8
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    target_argmax = torch.roll(ids, -1, dims=1)  # the data are the target's greedy path: g_t = x_{t+1}
    sup = torch.ones(1, T, dtype=torch.bool)
    want = [[4, 5, 11], [9, 6, 7]]  # block at 2: x3, x4, wrong; block at 4: wrong first
    hidden = F.one_hot(torch.tensor(want), Vs).float()[None]
    s = replay(Fake(), hidden, ids, sup, torch.tensor([[2, 4]]), target_argmax)
    assert s.num["replay_tau"] == (2 + 1) + (0 + 1) and s.den["replay_tau"] == 2


def test_regression_dspark_bad_layer_ids_message_on_a_small_target():
    """A bad --layer-ids on a 6-layer target raised "num_draft_layers=5 must be in [1, 3]" (the message's own
    default view was computed for 5 draft layers) instead of naming the bad ids; now it names them and a valid
    default. Reproduced with `consume --draft dspark --layer-ids 1,2` on a tiny-target root."""
    from types import SimpleNamespace

    from artcache.trainers.dspark.adapter import DSparkAdapter, _build

    settings = SimpleNamespace(contract=SimpleNamespace(layer_ids=(1, 2, 3)))
    for ids, n in (([1, 2], None), ([2, 2, 3], None), ([5, 1, 5], 2)):
        cfg = SimpleNamespace(layer_ids=ids, draft_layers=n)
        default = "1,3,5" if n == 2 else "1,2,3,5"
        with pytest.raises(ConfigError, match=rf"^--layer-ids {','.join(map(str, ids))} for DSpark: .*last layer 5 "
                           rf"once \(default for {n or 3} draft layers: {default}\)$"):
            _build(DSparkAdapter, cfg, settings, None, torch.device("cpu"), info=SimpleNamespace(num_layers=6))


def test_regression_calibrate_names_an_evaluation_that_never_ran(tmp_path):
    """A DSpark run with ``--eval-samples 8`` cancelled before its final evaluation left a checkpoint without
    held-out records, and ``artcache calibrate`` told the user to "train with --eval-samples N", which they had.
    It now says the evaluation never ran (the run was stopped before it) and how to get the records."""
    from artcache.trainers.checkpoint import save_checkpoint
    from artcache.trainers.dspark.calibrate import calibrate_checkpoint

    m = model_of(dtype=torch.float32)
    ck = save_checkpoint(tmp_path / "run", step=2, cursor=4, weights=m.trainable_state_dict(), optimizer=None,
                         generators={}, extra_tensors={},
                         state={"draft": "dspark", "draft_config": msgspec.to_builtins(m.cfg),
                                "run": {"draft": "dspark", "eval_samples": 8}})
    with pytest.raises(ConfigError) as info:
        calibrate_checkpoint(ck)
    msg = str(info.value)
    assert "--eval-samples 8, but no evaluation ran" in msg and "stopped before its final evaluation" in msg, msg
    assert "--resume" in msg and "--eval-interval" in msg and "train with --eval-samples N" not in msg, msg
