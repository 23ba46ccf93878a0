"""DSpark's objective (arXiv:2607.05147; weights and terms as DeepSpec's ``deepspec/modeling/dspark/loss.py``
and ``config/dspark/dspark_qwen3_8b.py``; re-implemented here).

For the block anchored at p (B slots, 0-based k):

- slot k predicts the data token ``x_{p+k+1}`` (its *label*); its previous token ``prev_k`` is ``x_p``
  for k = 0 and the label of slot k-1 otherwise (teacher forcing of the Markov head);
- the target's distribution for slot k is ``q_k = softmax(lm_head(final_norm(h_{L-1}[p+k])))``;
- supervised: the label lies inside the sequence, is loss-masked and valid, the block is valid, then
  a cumulative product along k (only the contiguous supervised prefix counts);
- ``w_k = exp(-k/γ)`` (γ = 4) times the supervision mask;
- ``L_ce = Σ w·CE(z_k, label) / Σ w`` with ``z_k = lm_head(h_k) + markov_w2(W1[prev_k])``;
  ``L_l1 = Σ w·‖p_k − q_k‖₁ / Σ w`` with fp32 softmaxes (``‖·‖₁ = 2·TV``);
  ``α_k = clamp(1 − ½‖p_k − q_k‖₁, 0, 1)`` (the probability that speculative sampling accepts slot k's
  token given the prefix), **detached**, is the confidence target:
  ``L_conf = Σ w·BCE_with_logits(conf_k, α_k) / Σ w``;
- total = ``0.1·L_ce + 0.9·L_l1 + 1.0·L_conf``.

The [rows, V] logits of the draft and the target are computed ``logit_chunk`` rows at a time (151,936
vocabulary × 512 anchors × 7 slots would be 2.2 GB per fp32 tensor): in the default ``fused`` mode the
gradients of CE and L1 w.r.t. the backbone rows, the Markov r-vectors and ``markov_w2`` are formed chunk
by chunk in the forward pass and only those (no [rows, V] tensor) are kept for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from artcache.errors import ConfigError

if TYPE_CHECKING:
    from .model import DSparkDraft

__all__ = ["BlockLayout", "BlockOutputs", "block_layout", "dspark_loss", "slot_weights"]


@dataclass(frozen=True)
class BlockLayout:
    """Where each slot of each block reads and predicts (all [b, N, B]).

    Attributes:
        labels: long, the data token slot k predicts (``x_{p+k+1}``; clamped index where outside).
        prev: long, the Markov head's previous token (``x_p`` for k = 0, else ``labels[..., k-1]``).
        target_pos: long, the position whose target state gives slot k's distribution (``p + k``).
        supervised: bool, the contiguous supervised prefix (see the module docstring).
    """

    labels: Tensor
    prev: Tensor
    target_pos: Tensor
    supervised: Tensor


def block_layout(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor, block_size: int,
                 context_valid: Tensor | None = None) -> BlockLayout:
    """The DSpark block layout for anchors ``[b, N]`` over sequences ``[b, T]``.

    ``supervised[b, n, k]`` = ``p+k+1 < T`` ∧ ``loss_mask[p+k+1]`` ∧ ``context_valid[p+k+1]`` (if given) ∧
    ``valid[b, n]``, then ``cumprod`` along k (DeepSpec ``build_eval_mask``).

    Raises:
        ConfigError: shapes disagree.
    """
    if input_ids.dim() != 2 or tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ConfigError(f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} must be [b, T]")
    b, T = input_ids.shape
    if anchors.dim() != 2 or anchors.shape[0] != b or tuple(valid.shape) != tuple(anchors.shape):
        raise ConfigError(f"anchors {tuple(anchors.shape)} / valid {tuple(valid.shape)} must both be [b={b}, N]")
    N, B = anchors.shape[1], int(block_size)
    dev = input_ids.device
    a = anchors.long().to(dev)
    k = torch.arange(B, device=dev)
    lab_pos = a[:, :, None] + k + 1  # [b, N, B]
    inside = lab_pos < T
    flat = lab_pos.clamp(max=T - 1).reshape(b, N * B)
    labels = input_ids.gather(1, flat).reshape(b, N, B).long()
    sup = loss_mask.to(dev).bool().gather(1, flat).reshape(b, N, B) & inside & valid.to(dev).bool()[:, :, None]
    if context_valid is not None:
        sup = sup & context_valid.to(dev).bool().gather(1, flat).reshape(b, N, B)
    sup = sup.long().cumprod(dim=-1).bool()
    anchor_tok = input_ids.gather(1, a.clamp(0, T - 1)).long()
    prev = torch.cat((anchor_tok[:, :, None], labels[:, :, :-1]), dim=-1)
    target_pos = (a[:, :, None] + k).clamp(max=T - 1)
    return BlockLayout(labels, prev, target_pos, sup)


def slot_weights(block_size: int, gamma: float, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-slot decay [B] (``dtype``): ``exp(-k/γ)`` for k = 0 … B-1 (DeepSpec ``_build_loss_weight_mask``)."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
        raise ConfigError(f"gamma must be a number > 0, got {gamma!r}")
    return torch.exp(-torch.arange(block_size, dtype=dtype, device=device) / float(gamma))


@dataclass(frozen=True)
class BlockOutputs:
    """What one DSpark loss forward measured, per slot, detached (all [b, N, B] unless said).

    Attributes:
        supervised: bool, the contiguous supervised prefix. weights: float, ``w_k`` × supervised.
        alpha: float32, ``α_k = clamp(1 − ½‖p_k − q_k‖₁, 0, 1)`` (0 where unsupervised).
        correct: bool, ``argmax z_k == label`` (teacher-forced) ∧ supervised.
        conf_logit: float32 confidence logits (0 where unsupervised), or None without the head.
        valid: [b, N] bool, valid blocks.
        ce_sum, l1_sum, conf_sum, weight_sum: float64 scalars, Σ w·CE, Σ w·L1, Σ w·BCE, Σ w.
    """

    supervised: Tensor
    weights: Tensor
    alpha: Tensor
    correct: Tensor
    conf_logit: Tensor | None
    valid: Tensor
    ce_sum: Tensor
    l1_sum: Tensor
    conf_sum: Tensor
    weight_sum: Tensor


class _FusedDSparkTerms(torch.autograd.Function):
    """``c_ce·Σ w·CE(z, y) + c_l1·Σ w·‖softmax(z) − softmax(t)‖₁`` over row chunks, gradients formed in forward.

    ``z = h Wᵀ + m W2ᵀ`` (W the frozen lm_head, W2 ``markov_w2``), ``t = tn Wᵀ`` (target rows, no gradient).
    Per chunk, in float32 (>= the inputs' precision): ``p = softmax(z)``, ``q = softmax(t)``, ``d = p − q``,
    ``s = sign(d)``; ``∂CE/∂z = p − onehot(y)``; ``∂‖d‖₁/∂z = p ⊙ (s − ⟨s, p⟩)`` (softmax Jacobian). With
    ``g = w·(c_ce·∂CE/∂z + c_l1·∂L1/∂z)``: ``∂/∂h = g W``, ``∂/∂m = g W2``, ``∂/∂W2 = gᵀ m``. Only those are
    kept for backward. Returns (loss, CE per row, L1 per row, argmax per row); the last three detached.
    """

    @staticmethod
    def forward(ctx, h, m, w2, weight, tn, labels, w, c_ce: float, c_l1: float, chunk: int,  # noqa: D102
                need_grad: bool, acc_dtype: torch.dtype):
        rows = h.shape[0]
        dev = h.device
        loss = torch.zeros((), dtype=acc_dtype, device=dev)
        ce_rows = torch.empty(rows, dtype=acc_dtype, device=dev)
        l1_rows = torch.empty(rows, dtype=acc_dtype, device=dev)
        preds = torch.empty(rows, dtype=torch.long, device=dev)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_m = torch.empty_like(m) if (need_grad and m is not None) else None
        grad_w2 = torch.zeros(w2.shape, dtype=acc_dtype, device=dev) if (need_grad and w2 is not None) else None
        for s in range(0, rows, chunk):
            e = min(rows, s + chunk)
            z = F.linear(h[s:e].to(weight.dtype), weight).to(acc_dtype)
            if m is not None:
                z = z + F.linear(m[s:e].to(acc_dtype), w2.to(acc_dtype))
            lse = torch.logsumexp(z, dim=-1)
            y = labels[s:e]
            ce = lse - z.gather(1, y[:, None]).squeeze(1)
            preds[s:e] = z.argmax(dim=-1)
            p = torch.exp(z.sub_(lse[:, None]))  # softmax in place over the logits buffer
            del z
            q = torch.softmax(F.linear(tn[s:e].to(weight.dtype), weight).to(acc_dtype), dim=-1)
            d = q.neg_().add_(p)  # p − q, in place over q
            l1 = d.abs().sum(dim=-1)
            ce_rows[s:e], l1_rows[s:e] = ce, l1
            wc = w[s:e].to(acc_dtype)
            loss = loss + c_ce * (wc * ce).sum() + c_l1 * (wc * l1).sum()
            if need_grad:
                sgn = d.sign_()  # s, in place over d
                inner = (sgn * p).sum(dim=-1, keepdim=True)
                g = sgn.sub_(inner).mul_(p).mul_(c_l1)  # c_l1 · p ⊙ (s − ⟨s, p⟩)
                g.add_(p, alpha=c_ce)
                g[torch.arange(e - s, device=dev), y] -= c_ce
                g.mul_(wc[:, None])
                grad_h[s:e] = (g.to(weight.dtype) @ weight).to(h.dtype)
                if m is not None:
                    grad_m[s:e] = (g @ w2.to(acc_dtype)).to(m.dtype)
                    grad_w2 += g.t() @ m[s:e].to(acc_dtype)
        ctx.save_for_backward(grad_h, grad_m, grad_w2)
        ctx.w2_dtype = w2.dtype if w2 is not None else None
        ctx.mark_non_differentiable(ce_rows, l1_rows, preds)
        return loss, ce_rows, l1_rows, preds

    @staticmethod
    def backward(ctx, g_loss, g_ce, g_l1, g_preds):  # noqa: D102
        grad_h, grad_m, grad_w2 = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * g_loss.to(grad_h.dtype)
        gm = None if grad_m is None else grad_m * g_loss.to(grad_m.dtype)
        gw = None if grad_w2 is None else (grad_w2 * g_loss.to(grad_w2.dtype)).to(ctx.w2_dtype)
        return gh, gm, gw, None, None, None, None, None, None, None, None, None


def _plain_terms(model: DSparkDraft, h, m, tn, labels, w, c_ce, c_l1, chunk, acc_dtype):
    """Reference: the same terms with plain autograd per chunk (every chunk's graph kept)."""
    loss = torch.zeros((), dtype=acc_dtype, device=h.device)
    ce_rows, l1_rows, preds = [], [], []
    for s in range(0, h.shape[0], chunk):
        z = model.logits(h[s:s + chunk]).to(acc_dtype)
        if m is not None:
            z = z + F.linear(m[s:s + chunk].to(acc_dtype), model.markov_head.markov_w2.weight.to(acc_dtype))
        t = model.logits(tn[s:s + chunk]).to(acc_dtype)
        ce = F.cross_entropy(z, labels[s:s + chunk], reduction="none")
        l1 = (torch.softmax(z, dim=-1) - torch.softmax(t, dim=-1)).abs().sum(dim=-1)
        wc = w[s:s + chunk].to(acc_dtype)
        loss = loss + c_ce * (wc * ce).sum() + c_l1 * (wc * l1).sum()
        ce_rows.append(ce.detach())
        l1_rows.append(l1.detach())
        preds.append(z.detach().argmax(dim=-1))
    def cat(xs: list[Tensor], dt: torch.dtype) -> Tensor:
        return torch.cat(xs) if xs else torch.empty(0, dtype=dt, device=h.device)

    return loss, cat(ce_rows, acc_dtype), cat(l1_rows, acc_dtype), cat(preds, torch.long)


def dspark_loss(
    model: DSparkDraft,
    hidden: Tensor,
    last_hidden: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    *,
    context_valid: Tensor | None = None,
    chunk_rows: int | None = None,
    mode: Literal["fused", "plain"] = "fused",
) -> tuple[Tensor, BlockOutputs]:
    """The DSpark objective (module docstring) and its per-slot measurements.

    Args:
        model: the draft (frozen lm_head, final norm; Markov and confidence heads).
        hidden: [b, N, B, H] from :meth:`DSparkDraft.forward` (the backbone's final-normed states).
        last_hidden: [b, T, H] the captured output-of-layer ``L - 1``, **before** the target's final norm
            (the norm is applied here, once, by :meth:`DSparkDraft.target_hidden`).
        input_ids: [b, T] long. loss_mask: [b, T] bool. anchors: [b, N] long. valid: [b, N] bool.
        context_valid: optional [b, T] bool (False = padding, never a label).
        chunk_rows: rows per [rows, V] chunk (default ``model.cfg.logit_chunk``).
        mode: ``"fused"`` (default; gradients formed chunk by chunk, see :class:`_FusedDSparkTerms`) or
            ``"plain"`` (autograd reference). Both give the same loss, gradients and outputs.

    Returns:
        (loss: float32 scalar (float64 for a float64 model); 0 with a zero-gradient graph when nothing is
        supervised, :class:`BlockOutputs`).

    Raises:
        ConfigError: shapes disagree, or bad ``chunk_rows`` / ``mode``.
    """
    cfg = model.cfg
    if hidden.dim() != 4:
        raise ConfigError(f"hidden must be [b, N, B, H], got shape {tuple(hidden.shape)}")
    b, N, B, H = hidden.shape
    if cfg.block_size != B:
        raise ConfigError(f"hidden has {B} slots per block, the draft's block_size is {cfg.block_size}")
    if last_hidden.dim() != 3 or tuple(last_hidden.shape) != (b, input_ids.shape[1], H):
        raise ConfigError(f"last_hidden must be [b, T, H] = {(b, input_ids.shape[1], H)}, got "
                          f"{tuple(last_hidden.shape)}")
    chunk = cfg.logit_chunk if chunk_rows is None else chunk_rows
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk!r}")
    if mode not in ("fused", "plain"):
        raise ConfigError(f"mode must be 'fused' or 'plain', got {mode!r}")
    dev = hidden.device
    lay = block_layout(input_ids.to(dev), loss_mask.to(dev), anchors.to(dev), valid.to(dev), B,
                       None if context_valid is None else context_valid.to(dev))
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = slot_weights(B, float(cfg.gamma), dev, acc_dtype) * lay.supervised  # [b, N, B]
    rows = lay.supervised.reshape(-1).nonzero().squeeze(1)
    wr = w.reshape(-1).index_select(0, rows)
    weight_sum = wr.sum()
    denom = float(weight_sum) if rows.numel() else 1.0
    c_ce, c_l1, c_conf = cfg.ce_weight / denom, cfg.l1_weight / denom, cfg.confidence_weight / denom

    h = hidden.reshape(-1, H).index_select(0, rows)
    y = lay.labels.reshape(-1).index_select(0, rows)
    prev = lay.prev.reshape(-1).index_select(0, rows)
    tpos = lay.target_pos.reshape(b, N * B)
    with torch.no_grad():
        lastg = last_hidden.to(dev).gather(1, tpos[:, :, None].expand(b, N * B, H)).reshape(-1, H)
        tn = model.target_hidden(lastg.index_select(0, rows))  # final norm, applied once
    emb, bias_in = model.markov_inputs(prev, h)
    loss = hidden.sum().to(acc_dtype) * 0.0  # a (zero) graph even when nothing is supervised
    if mode == "fused":
        w2 = model.markov_head.markov_w2.weight if bias_in is not None else None
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (h, bias_in, w2))
        part, ce_r, l1_r, preds = _FusedDSparkTerms.apply(h, bias_in, w2, model.lm_head_weight, tn, y, wr, c_ce,
                                                          c_l1, chunk, need_grad, acc_dtype)
    else:
        part, ce_r, l1_r, preds = _plain_terms(model, h, bias_in, tn, y, wr, c_ce, c_l1, chunk, acc_dtype)
    loss = loss + part
    alpha_r = (1.0 - 0.5 * l1_r).clamp(0.0, 1.0).detach()
    conf_r = model.confidence_logits(h, emb)
    conf_sum = torch.zeros((), dtype=torch.float64, device=dev)
    if conf_r is not None:
        bce = F.binary_cross_entropy_with_logits(conf_r.to(acc_dtype), alpha_r.to(acc_dtype), reduction="none")
        loss = loss + c_conf * (bce * wr).sum()
        conf_sum = (bce.detach() * wr).sum().double()

    with torch.no_grad():
        def scatter(vals: Tensor, dtype: torch.dtype) -> Tensor:
            out = torch.zeros(b * N * B, dtype=dtype, device=dev)
            out[rows] = vals.to(dtype)
            return out.reshape(b, N, B)

        outputs = BlockOutputs(
            supervised=lay.supervised, weights=w.detach(), alpha=scatter(alpha_r, torch.float32),
            correct=scatter(preds == y, torch.bool),
            conf_logit=None if conf_r is None else scatter(conf_r.detach(), torch.float32),
            valid=valid.to(dev).bool(), ce_sum=(ce_r * wr).sum().double(), l1_sum=(l1_r * wr).sum().double(),
            conf_sum=conf_sum, weight_sum=weight_sum.detach().double())
    return loss, outputs
