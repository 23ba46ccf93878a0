"""DFlash training loss and metrics (DFlash arXiv:2602.06036; weighting as in z-lab/dflash and
SpecForge's DFlash recipe, re-implemented here)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from artcache.errors import ConfigError
from artcache.trainers.lm_head_ce import linear_ce

if TYPE_CHECKING:
    from .model import DFlashDraft

__all__ = ["LOSS_MODES", "LossStats", "dflash_loss", "slot_weights"]


@dataclass(frozen=True)
class LossStats:
    """Sums (never ratios) for one or more batches, so they add across steps and processes.

    Fields (all detached tensors on the loss's device):
        loss_sum: float64 scalar, Σ w·CE over supervised slots.
        weight_sum: float64 scalar, Σ w.
        correct: int64 [B], indexed by slot k: supervised slots whose argmax equals the target
            (slot 0 is never supervised, so index 0 is always 0).
        total: int64 [B], supervised slots per k (not weighted).
        tau_sum: int64 scalar, Σ τ over valid blocks; τ = 1 + number of leading correct slots
            k = 1, 2, … (stops at the first wrong or unsupervised slot), so τ ∈ [1, B] and **includes
            the +1 bonus token**.
        num_blocks: int64 scalar, number of valid blocks (anchors).

    Combine with ``+``; for ``torch.distributed.all_reduce`` use :meth:`to_tensor` /
    :meth:`from_tensor` (SUM reduction).
    """

    loss_sum: Tensor
    weight_sum: Tensor
    correct: Tensor
    total: Tensor
    tau_sum: Tensor
    num_blocks: Tensor

    def __add__(self, other: LossStats) -> LossStats:
        if self.correct.shape != other.correct.shape:
            raise ConfigError(f"cannot add LossStats of block sizes {self.correct.numel()} and {other.correct.numel()}")
        return LossStats(
            self.loss_sum + other.loss_sum,
            self.weight_sum + other.weight_sum,
            self.correct + other.correct,
            self.total + other.total,
            self.tau_sum + other.tau_sum,
            self.num_blocks + other.num_blocks,
        )

    def to_tensor(self) -> Tensor:
        """Flatten to one float64 vector of length 2B + 4 (exact for counts below 2**53)."""
        return torch.cat([
            self.loss_sum.reshape(1).double(), self.weight_sum.reshape(1).double(),
            self.correct.double(), self.total.double(),
            self.tau_sum.reshape(1).double(), self.num_blocks.reshape(1).double(),
        ])

    @classmethod
    def from_tensor(cls, vec: Tensor) -> LossStats:
        """Inverse of :meth:`to_tensor`."""
        B = (vec.numel() - 4) // 2
        if vec.dim() != 1 or vec.numel() != 2 * B + 4 or B < 2:
            raise ConfigError(f"LossStats vector must be 1-D of length 2B+4 with B >= 2, got {tuple(vec.shape)}")
        v = vec.double()
        return cls(v[0], v[1], v[2:2 + B].round().long(), v[2 + B:2 + 2 * B].round().long(),
                   v[-2].round().long(), v[-1].round().long())

    def summary(self) -> dict:
        """Plain-Python metrics: ``loss`` (Σ w·CE / Σ w), ``acc`` (list of acc_k for k = 1 … B-1;
        NaN where a slot had no supervised rows), ``tau`` (mean acceptance length per valid block,
        τ ∈ [1, B], **including the +1 bonus token**), plus the counts ``num_blocks`` and
        ``weight_sum``. NaN where a denominator is 0."""
        w = float(self.weight_sum)
        nb = int(self.num_blocks)
        corr, tot = self.correct.tolist(), self.total.tolist()
        return {
            "loss": float(self.loss_sum) / w if w > 0 else math.nan,
            "acc": [c / t if t > 0 else math.nan for c, t in zip(corr[1:], tot[1:], strict=True)],
            "tau": int(self.tau_sum) / nb if nb > 0 else math.nan,
            "tau_includes_bonus": True,
            "num_blocks": nb,
            "weight_sum": w,
        }


def slot_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> Tensor:
    """Per-slot decay [B] float32: 0 for slot 0, ``exp(-(k-1)/γ)`` for k ≥ 1 (DFlash arXiv:2602.06036)."""
    if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and gamma > 0):
        raise ConfigError(f"gamma must be a finite number > 0, got {gamma!r}")
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / float(gamma))
    w[0] = 0.0
    return w


def _ce_and_pred(model: DFlashDraft, h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    logits = model.logits(h)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, t, reduction="none"), logits.argmax(dim=-1)


#: ``mode`` values of :func:`dflash_loss`.
LOSS_MODES = ("fused", "checkpoint", "plain", "chunked", "liger")


def dflash_loss(
    model: DFlashDraft,
    hidden: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    gamma: float | None = None,
    chunk_rows: int | None = None,
    *,
    context_valid: Tensor | None = None,
    mode: Literal["fused", "checkpoint", "plain", "chunked", "liger"] = "fused",
    static_rows: bool = False,
    compile: bool = False,
    doc_ids: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """Decay-weighted cross-entropy of a DFlash draft, plus metric sums.

    Slot k of the block anchored at p predicts ``x_{p+k}``. Weight (DFlash arXiv:2602.06036):
    ``w = exp(-(k-1)/γ)`` for k ≥ 1, 0 for k = 0, times ``loss_mask[p+k]``, times ``p+k < T``, times
    the anchor's validity (and ``context_valid[p+k]`` if given). Loss = Σ w·CE / Σ w (0 with a
    zero-gradient graph when Σ w = 0).

    Logits go through the frozen lm_head ``chunk_rows`` rows at a time
    (:func:`artcache.trainers.lm_head_ce.linear_ce`); no [rows, V] tensor outlives its chunk. ``mode``:

    - ``"fused"`` (default, the CPU path): float32 logits (float64 for a float64 model); the gradient
      w.r.t. the selected hidden rows is computed chunk by chunk during the forward pass (the lm_head is
      frozen, so that is all backward needs): two lm_head matmuls per chunk, none in backward.
    - ``"chunked"``: the same with bf16 matmuls and a float32 log-sum-exp per chunk (``compile``:
      the per-chunk softmax body ``torch.compile``-d); the GPU path.
    - ``"liger"``: Liger-Kernel's fused linear cross-entropy (CUDA, optional extra).
    - ``"checkpoint"``: plain autograd per chunk under ``torch.utils.checkpoint`` (one chunk's logits
      alive at a time; the logits matmul is recomputed in backward: three matmuls per chunk).
    - ``"plain"``: plain autograd per chunk; every chunk's logits stay alive until backward. Reference.

    All modes give the same loss, gradients and stats up to float rounding (bf16 for chunked/liger).

    ``static_rows``: the rows sent to the lm_head are every slot k >= 1 of every block (weight 0 where
    unsupervised) instead of the supervised rows found by ``nonzero``: no host synchronisation, and
    fixed shapes for ``torch.compile`` / CUDA graphs, at the cost of the unsupervised rows' matmuls.
    Same loss and stats up to float rounding (the sums run over more, zero-weighted, terms).

    Args:
        model: the draft (its frozen lm_head makes the logits).
        hidden: [b, N, B, H] from :meth:`DFlashDraft.forward`.
        input_ids: [b, T] long. loss_mask: [b, T] bool/int.
        anchors: [b, N] long. valid: [b, N] bool.
        gamma: decay; None -> ``model.cfg.resolved_gamma``.
        chunk_rows: rows per lm_head chunk; None -> ``model.cfg.logit_chunk``.
        context_valid: optional [b, T] bool; False positions are never targets.
        doc_ids: a packed batch (:mod:`artcache.trainers.packing`): [b, T] long; slot k is supervised only
            when ``p+k`` lies in the anchor's document (no block is trained past its document's end).
        mode: one of :data:`LOSS_MODES` (see above). static_rows, compile: see above.

    Returns:
        (loss: float32 scalar (float64 for a float64 model), :class:`LossStats`). Nothing is read back
        to the host when ``static_rows`` (the stats stay device tensors).

    Raises:
        ConfigError: bad ``gamma``/``chunk_rows``/``mode`` or inconsistent shapes; ``"liger"`` off CUDA.
    """
    _check_loss_args(hidden, input_ids, loss_mask, anchors, valid, mode)
    b, N, B, H = hidden.shape
    gamma = model.cfg.resolved_gamma if gamma is None else gamma
    chunk_rows = model.cfg.logit_chunk if chunk_rows is None else chunk_rows
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    T = input_ids.shape[1]
    dev = hidden.device

    k = torch.arange(B, device=dev)
    tpos = anchors.long().to(dev)[:, :, None] + k  # [b, N, B]
    in_range = tpos < T
    flat = tpos.clamp(max=T - 1).reshape(b, N * B)
    targets = input_ids.to(dev).gather(1, flat).reshape(b, N, B)
    sup = loss_mask.to(dev).bool().gather(1, flat).reshape(b, N, B)
    sup = sup & in_range & valid.to(dev).bool()[:, :, None] & (k >= 1)
    if context_valid is not None:
        sup = sup & context_valid.to(dev).bool().gather(1, flat).reshape(b, N, B)
    if doc_ids is not None:
        from artcache.trainers.packing import same_doc

        sup = sup & same_doc(doc_ids.to(dev).long(), tpos, anchors.long().to(dev)[:, :, None].expand(b, N, B))
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for fp64 models
    w = slot_weights(B, gamma, dev).to(acc_dtype) * sup  # [b, N, B]

    if static_rows:  # every slot k >= 1: fixed shapes, no nonzero (no host sync)
        rows = None
        h = hidden[:, :, 1:].reshape(-1, H)
        t = targets[:, :, 1:].reshape(-1)
        ws = w[:, :, 1:].reshape(-1)
    else:
        rows = sup.reshape(-1).nonzero().squeeze(1)
        h = hidden.reshape(-1, H).index_select(0, rows)
        t = targets.reshape(-1).index_select(0, rows)
        ws = w.reshape(-1).index_select(0, rows)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad

    # keeps a (zero) graph when no row is supervised (static rows always reach the lm_head)
    loss_sum = torch.zeros((), dtype=acc_dtype, device=dev) if static_rows else hidden.sum().to(acc_dtype) * 0.0
    if mode in ("fused", "chunked", "liger"):
        impl = {"fused": "reference"}.get(mode, mode)
        part, preds = linear_ce(h, model.lm_head_weight, t, ws, chunk_rows=chunk_rows, impl=impl,
                                acc_dtype=acc_dtype, compile=compile)
        loss_sum = loss_sum + part
    else:
        preds = torch.empty_like(t)
        for s in range(0, t.numel(), chunk_rows):
            hc, tc = h[s:s + chunk_rows], t[s:s + chunk_rows]
            if mode == "checkpoint" and need_grad:
                ce, pred = checkpoint(_ce_and_pred, model, hc, tc, use_reentrant=False)
            else:
                ce, pred = _ce_and_pred(model, hc, tc)
            loss_sum = loss_sum + (ce * ws[s:s + chunk_rows]).sum()
            preds[s:s + chunk_rows] = pred
    weight_sum = ws.sum()
    loss = loss_sum / weight_sum.clamp_min(torch.finfo(acc_dtype).tiny)

    stats = _loss_stats(preds, t, rows, sup, valid.to(dev).bool(), loss_sum, weight_sum, static_rows)
    return loss, stats


def _check_loss_args(hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor,
                     mode: str) -> None:
    """:func:`dflash_loss`'s shape and mode checks (ConfigError naming the bad value)."""
    if hidden.dim() != 4:
        raise ConfigError(f"hidden must be [b, N, B, H], got shape {tuple(hidden.shape)}")
    b, N = hidden.shape[:2]
    if input_ids.dim() != 2 or input_ids.shape[0] != b or tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ConfigError(
            f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} must both be [b={b}, T]"
        )
    if tuple(anchors.shape) != (b, N) or tuple(valid.shape) != (b, N):
        raise ConfigError(f"anchors {tuple(anchors.shape)} / valid {tuple(valid.shape)} must be [{b}, {N}]")
    if mode not in LOSS_MODES:
        raise ConfigError(f"mode must be one of {', '.join(repr(m) for m in LOSS_MODES)}, got {mode!r}")


@torch.no_grad()
def _loss_stats(preds: Tensor, t: Tensor, rows: Tensor | None, sup: Tensor, vb: Tensor, loss_sum: Tensor,
                weight_sum: Tensor, static_rows: bool) -> LossStats:
    """:func:`dflash_loss`'s metric sums from the lm_head's argmax ``preds`` of the rows it scored
    (``rows``: their flat indices into [b, N, B], or every slot k >= 1 when ``static_rows``). ``sup``:
    [b, N, B] supervised slots; ``vb``: [b, N] valid blocks. τ counts the +1 bonus token."""
    b, N, B = sup.shape
    dev = sup.device
    if static_rows:
        correct = torch.zeros(b, N, B, dtype=torch.bool, device=dev)
        correct[:, :, 1:] = (preds == t).reshape(b, N, B - 1)
    else:
        correct = torch.zeros(b * N * B, dtype=torch.bool, device=dev)
        correct[rows] = preds == t
    correct = correct.reshape(b, N, B) & sup
    lead = correct[:, :, 1:].long().cumprod(dim=-1).sum(dim=-1)  # leading correct slots
    return LossStats(
        loss_sum=loss_sum.detach().double(),
        weight_sum=weight_sum.detach().double(),
        correct=correct.sum(dim=(0, 1)).long(),
        total=sup.sum(dim=(0, 1)).long(),
        tau_sum=((lead + 1) * vb).sum().long(),
        num_blocks=vb.sum().long(),
    )
