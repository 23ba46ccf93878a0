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
by chunk in the forward pass and only those (no [rows, V] tensor) are kept for backward. The GPU path
(:class:`~artcache.trainers.speed.SpeedOptions`, as DFlash's) uses ``mode="chunked"`` (the same algorithm with
bf16 lm_head matmuls and an fp32 per-chunk body, optionally ``torch.compile``-d) and ``static_rows`` (every slot
reaches the heads, weight 0 where unsupervised: no ``nonzero``, no host read-back, fixed shapes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from artcache.errors import ConfigError
from artcache.trainers.lm_head_ce import _matmul_dtype, compute_weight

if TYPE_CHECKING:
    from .model import DSparkDraft

__all__ = ["LOSS_MODES", "BlockLayout", "BlockOutputs", "block_layout", "block_weight_sum", "cp_dspark_loss",
           "dspark_loss", "slot_weights"]

#: ``mode`` values of :func:`dspark_loss`.
LOSS_MODES = ("fused", "chunked", "plain")


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
                 context_valid: Tensor | None = None, doc_ids: Tensor | None = None) -> BlockLayout:
    """The DSpark block layout for anchors ``[b, N]`` over sequences ``[b, T]``.

    ``supervised[b, n, k]`` = ``p+k+1 < T`` ∧ ``loss_mask[p+k+1]`` ∧ ``context_valid[p+k+1]`` (if given) ∧
    ``valid[b, n]`` ∧ (a packed batch, ``doc_ids`` [b, T] given) ``p+k+1`` in the anchor's document, then
    ``cumprod`` along k (DeepSpec ``build_eval_mask``): the heads never see a slot of another document.

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
    if doc_ids is not None:
        from artcache.trainers.packing import same_doc

        sup = sup & same_doc(doc_ids.to(dev).long(), lab_pos, a[:, :, None].expand(b, N, B))
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


def block_weight_sum(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor, block_size: int,
                     gamma: float, context_valid: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
    """``Σ w`` of the blocks at ``anchors`` ([1] float64, no forward): :func:`slot_weights` times the supervised
    prefix of :func:`block_layout` (same arguments), the denominator :func:`dspark_loss` divides by."""
    lay = block_layout(input_ids, loss_mask, anchors, valid, block_size, context_valid, doc_ids=doc_ids)
    w = slot_weights(block_size, float(gamma), input_ids.device) * lay.supervised
    return w.sum().double().reshape(1)


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
                need_grad: bool, acc_dtype: torch.dtype, impl: str = "reference", compile: bool = False):
        rows = h.shape[0]
        dev = h.device
        loss = torch.zeros((), dtype=acc_dtype, device=dev)
        ce_rows = torch.empty(rows, dtype=acc_dtype, device=dev)
        l1_rows = torch.empty(rows, dtype=acc_dtype, device=dev)
        preds = torch.empty(rows, dtype=torch.long, device=dev)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_m = torch.empty_like(m) if (need_grad and m is not None) else None
        grad_w2 = torch.zeros(w2.shape, dtype=acc_dtype, device=dev) if (need_grad and w2 is not None) else None
        if impl == "chunked":
            wmat = compute_weight(weight, _matmul_dtype(h, weight))
        for s in range(0, rows, chunk):
            e = min(rows, s + chunk)
            if impl == "chunked":
                part = _chunked_chunk(h[s:e], None if m is None else m[s:e], w2, wmat, tn[s:e], labels[s:e],
                                      w[s:e], c_ce, c_l1, need_grad, acc_dtype, compile,
                                      (ce_rows[s:e], l1_rows[s:e], preds[s:e]),
                                      None if grad_h is None else grad_h[s:e],
                                      None if grad_m is None else grad_m[s:e], grad_w2)
                loss = loss + part
                continue
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
        return gh, gm, gw, None, None, None, None, None, None, None, None, None, None, None


def _chunked_body(z: Tensor, bias: Tensor | None, t: Tensor, y: Tensor, wc: Tensor, c_ce: float, c_l1: float,
                  need_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk of :class:`_FusedDSparkTerms` in ``chunked`` mode, functional (so ``torch.compile`` fuses it).

    Args:
        z: [c, V] the backbone's lm_head logits (bf16). bias: [c, V] float32 Markov logits or None.
        t: [c, V] the target's lm_head logits (bf16). y: [c] long labels. wc: [c] float32 row weights.

    Returns:
        (CE [c], L1 [c], argmax [c] long, the weighted gradient w.r.t. the draft logits [c, V], or an empty
        tensor without ``need_grad``); log-sum-exp, both softmaxes and the outputs in float32 (float64 for a
        float64 model).
    """
    acc = torch.promote_types(z.dtype, torch.float32)
    z = z.to(acc) if bias is None else z.to(acc) + bias
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, y[:, None]).squeeze(1)
    preds = z.argmax(dim=-1)
    p = torch.exp(z - lse[:, None])
    d = p - torch.softmax(t.to(acc), dim=-1)
    l1 = d.abs().sum(dim=-1)
    if not need_grad:
        return ce, l1, preds, z.new_empty(0)
    sgn = d.sign()
    g = (sgn - (sgn * p).sum(dim=-1, keepdim=True)) * p * c_l1 + p * c_ce
    g = g.scatter_add(1, y[:, None], torch.full_like(ce[:, None], -c_ce))
    return ce, l1, preds, g * wc.to(acc)[:, None]


@functools.cache
def _compiled_body():
    return torch.compile(_chunked_body, dynamic=False, fullgraph=True)


def _chunked_chunk(h, m, w2, wmat, tn, y, wc, c_ce, c_l1, need_grad, acc_dtype, compile, outs, grad_h, grad_m,
                   grad_w2) -> Tensor:
    """Rows ``h`` [c, H] of :class:`_FusedDSparkTerms` in ``chunked`` mode: bf16 lm_head matmuls (``wmat``, the
    frozen head cast once, :func:`~artcache.trainers.lm_head_ce.compute_weight`), the Markov logits and its
    gradients in float32; writes CE, L1 and argmax into ``outs`` and the gradients into ``grad_h`` /
    ``grad_m`` (row views) and ``grad_w2`` (summed). Returns the chunk's ``c_ce·Σ w·CE + c_l1·Σ w·L1``."""
    z = F.linear(h.to(wmat.dtype), wmat)
    t = F.linear(tn.to(wmat.dtype), wmat)
    bias = None if m is None else F.linear(m.to(acc_dtype), w2.to(acc_dtype))
    body = _compiled_body() if compile else _chunked_body
    ce, l1, preds, g = body(z, bias, t, y, wc, c_ce, c_l1, need_grad)
    ce_out, l1_out, pred_out = outs
    ce_out.copy_(ce)
    l1_out.copy_(l1)
    pred_out.copy_(preds)
    wa = wc.to(acc_dtype)
    part = c_ce * (wa * ce.to(acc_dtype)).sum() + c_l1 * (wa * l1.to(acc_dtype)).sum()
    if need_grad:
        grad_h.copy_(g.to(wmat.dtype) @ wmat)
        if m is not None:
            g = g.to(acc_dtype)
            grad_m.copy_(g @ w2.to(acc_dtype))
            grad_w2 += g.t() @ m.to(acc_dtype)
    return part


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
    mode: Literal["fused", "chunked", "plain"] = "fused",
    static_rows: bool = False,
    compile: bool = False,
    denominator: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, BlockOutputs]:
    """The DSpark objective (module docstring) and its per-slot measurements.

    Args:
        model: the draft (frozen lm_head, final norm; Markov and confidence heads).
        hidden: [b, N, B, H] from :meth:`DSparkDraft.forward` (the backbone's final-normed states).
        last_hidden: [b, T, H] the captured output-of-layer ``L - 1``, **before** the target's final norm
            (the norm is applied here, once, by :meth:`DSparkDraft.target_hidden`).
        input_ids: [b, T] long. loss_mask: [b, T] bool. anchors: [b, N] long. valid: [b, N] bool.
        context_valid: optional [b, T] bool (False = padding, never a label).
        doc_ids: a packed batch (:mod:`artcache.trainers.packing`): [b, T] long; a slot is supervised only
            inside its anchor's document (:func:`block_layout`).
        chunk_rows: rows per [rows, V] chunk (default ``model.cfg.logit_chunk``).
        mode: ``"fused"`` (default; gradients formed chunk by chunk, see :class:`_FusedDSparkTerms`),
            ``"chunked"`` (the same with bf16 lm_head matmuls and an fp32 per-chunk body; the GPU path) or
            ``"plain"`` (autograd reference). All give the same loss, gradients and outputs up to float
            rounding (bf16 for ``chunked``).
        static_rows: every slot of every block reaches the heads (weight 0 where unsupervised) instead of
            the supervised rows found by ``nonzero``, and the loss is divided by ``Σ w`` on the device: no
            host synchronisation and fixed shapes (``torch.compile`` / CUDA graphs), at the cost of the
            unsupervised rows' matmuls. Same loss and outputs up to float rounding.
        compile: ``"chunked"`` only: ``torch.compile`` the per-chunk body.
        denominator: divide by this (a float64 scalar: ``Σ w`` of a consumer group's or ``--grad-accum``'s whole
            global batch) instead of this batch's own ``Σ w``; the fused modes form the gradient scaled by it, so
            the parts of a global batch round exactly as the whole batch does.

    Returns:
        (loss: float32 scalar (float64 for a float64 model); 0 with a zero-gradient graph when nothing is
        supervised, :class:`BlockOutputs`).

    Raises:
        ConfigError: shapes disagree, or bad ``chunk_rows`` / ``mode``.
    """
    cfg = model.cfg
    _check_loss_args(cfg, hidden, last_hidden, input_ids, mode)
    b, N, B, H = hidden.shape
    chunk = cfg.logit_chunk if chunk_rows is None else chunk_rows
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk!r}")
    dev = hidden.device
    lay = block_layout(input_ids.to(dev), loss_mask.to(dev), anchors.to(dev), valid.to(dev), B,
                       None if context_valid is None else context_valid.to(dev), doc_ids)
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = slot_weights(B, float(cfg.gamma), dev, acc_dtype) * lay.supervised  # [b, N, B]
    if static_rows:  # every slot: fixed shapes, no nonzero, the division by Σ w on the device
        rows = None
        wr = w.reshape(-1)
        weight_sum = wr.sum()
        norm = weight_sum if denominator is None else denominator.to(device=dev, dtype=acc_dtype)
        c_ce, c_l1, c_conf = cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight
        h, y, prev = hidden.reshape(-1, H), lay.labels.reshape(-1), lay.prev.reshape(-1)
    else:
        rows = lay.supervised.reshape(-1).nonzero().squeeze(1)
        wr = w.reshape(-1).index_select(0, rows)
        weight_sum = wr.sum()
        denom = float(denominator) if denominator is not None and float(denominator) > 0 else \
            float(weight_sum) if rows.numel() else 1.0
        c_ce, c_l1, c_conf = cfg.ce_weight / denom, cfg.l1_weight / denom, cfg.confidence_weight / denom
        h = hidden.reshape(-1, H).index_select(0, rows)
        y = lay.labels.reshape(-1).index_select(0, rows)
        prev = lay.prev.reshape(-1).index_select(0, rows)
    tpos = lay.target_pos.reshape(b, N * B)
    with torch.no_grad():
        lastg = last_hidden.to(dev).gather(1, tpos[:, :, None].expand(b, N * B, H)).reshape(-1, H)
        tn = model.target_hidden(lastg if static_rows else lastg.index_select(0, rows))  # final norm, applied once
    emb, bias_in = model.markov_inputs(prev, h)
    loss = hidden.sum().to(acc_dtype) * 0.0  # a (zero) graph even when nothing is supervised
    if mode in ("fused", "chunked"):
        w2 = model.markov_head.markov_w2.weight if bias_in is not None else None
        need_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (h, bias_in, w2))
        part, ce_r, l1_r, preds = _FusedDSparkTerms.apply(
            h, bias_in, w2, model.lm_head_weight, tn, y, wr, c_ce, c_l1, chunk, need_grad, acc_dtype,
            "chunked" if mode == "chunked" else "reference", compile and mode == "chunked")
    else:
        part, ce_r, l1_r, preds = _plain_terms(model, h, bias_in, tn, y, wr, c_ce, c_l1, chunk, acc_dtype)
    terms = [part]
    alpha_r = (1.0 - 0.5 * l1_r).clamp(0.0, 1.0).detach()
    conf_r = model.confidence_logits(h, emb)
    conf_sum = torch.zeros((), dtype=torch.float64, device=dev)
    if conf_r is not None:
        bce = F.binary_cross_entropy_with_logits(conf_r.to(acc_dtype), alpha_r.to(acc_dtype), reduction="none")
        terms.append(c_conf * (bce * wr).sum())
        conf_sum = (bce.detach() * wr).sum().double()
    if static_rows:  # the coefficients were not divided by Σ w: divide once here
        loss = loss + sum(terms[1:], terms[0]) / norm.clamp_min(torch.finfo(acc_dtype).tiny)
    else:
        for t in terms:
            loss = loss + t

    with torch.no_grad():
        sup_flat = lay.supervised.reshape(-1)

        def scatter(vals: Tensor, dtype: torch.dtype) -> Tensor:
            if rows is None:  # static rows: every slot scored; zero where unsupervised
                return (vals.to(dtype) * sup_flat).to(dtype).reshape(b, N, B)
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


def _check_loss_args(cfg, hidden: Tensor, last_hidden: Tensor, input_ids: Tensor, mode: str) -> None:
    """:func:`dspark_loss`'s shape and mode checks (ConfigError naming the bad value)."""
    if hidden.dim() != 4:
        raise ConfigError(f"hidden must be [b, N, B, H], got shape {tuple(hidden.shape)}")
    b, N, B, H = hidden.shape
    if cfg.block_size != B:
        raise ConfigError(f"hidden has {B} slots per block, the draft's block_size is {cfg.block_size}")
    if last_hidden.dim() != 3 or tuple(last_hidden.shape) != (b, input_ids.shape[1], H):
        raise ConfigError(f"last_hidden must be [b, T, H] = {(b, input_ids.shape[1], H)}, got "
                          f"{tuple(last_hidden.shape)}")
    if mode not in LOSS_MODES:
        raise ConfigError(f"mode must be one of {', '.join(repr(m) for m in LOSS_MODES)}, got {mode!r}")


def cp_dspark_loss(model: DSparkDraft, context_shard: Tensor, last_hidden: Tensor, input_ids: Tensor,
                   loss_mask: Tensor, anchors: Tensor, valid: Tensor, *, context_valid: Tensor | None = None,
                   group=None, denominator: Tensor | None = None, **loss_kwargs) -> tuple[Tensor, Tensor, BlockOutputs]:
    """This rank's share of the DSpark loss under context parallelism (:mod:`artcache.trainers.dflash.cp`):
    ``(share, loss, outputs)``.

    The backbone runs :func:`~artcache.trainers.dflash.cp.cp_forward` (this rank's context shard, keys/values
    all-gathered per layer) for the blocks anchored in this rank's shard; :func:`dspark_loss` scores them. The heads
    and the target distribution are local to a block's slots (``last_hidden`` is read at the blocks' positions
    ``p + k``, which may lie past the shard), so nothing else is exchanged.

    ``share`` (backward this one) = this rank's ``Σ c · Σ w·term`` over its blocks / ``denominator``; with
    ``denominator`` None it is the group's ``Σ w`` (an all-reduce of :func:`block_weight_sum` over the ranks'
    blocks), so the shares add up to :func:`dspark_loss` of one rank holding everything, and their gradients (each
    rank's through its own computation, summed: :func:`~artcache.trainers.dflash.cp.all_reduce_grads`) to its
    gradient. ``loss`` is the shares' sum (detached, the same on every rank); ``outputs`` this rank's blocks'
    :class:`BlockOutputs` (their sums add up over the ranks).

    Args:
        context_shard: [b, S, m, H] this rank's context positions (:func:`~artcache.trainers.dflash.cp.context_shard`).
        last_hidden: [b, T, H] the whole sequence's captured output-of-layer ``L - 1`` (before the final norm).
        input_ids, loss_mask: [b, T]. anchors, valid: [b, N], the whole draw (the same on every rank).
        context_valid: optional [b, T] bool. group: the CP group (default: the world).
        denominator: a float64 scalar, the ``Σ w`` to divide by (a consumer's global batch), or None.
        loss_kwargs: to :func:`dspark_loss` (``mode``, ``chunk_rows``).

    Raises:
        ConfigError: shapes disagree (:func:`~artcache.trainers.dflash.cp.cp_forward`, :func:`dspark_loss`).
    """
    import torch.distributed as dist

    from artcache.trainers.dflash.cp import cp_forward

    hidden, la, lv = cp_forward(model, context_shard, input_ids, anchors, valid, context_valid, group)
    if denominator is None:
        denominator = block_weight_sum(input_ids, loss_mask, la, lv, model.cfg.block_size, model.cfg.gamma,
                                       context_valid)
        dist.all_reduce(denominator, group=group)
        denominator = denominator[0]
    share, out = dspark_loss(model, hidden, last_hidden, input_ids, loss_mask, la, lv, context_valid=context_valid,
                             denominator=denominator, **loss_kwargs)
    loss = share.detach().clone()
    dist.all_reduce(loss, group=group)
    return share, loss, out
