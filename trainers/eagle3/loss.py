"""EAGLE-3 training-time-test loss and metrics (EAGLE-3 arXiv:2503.01840; soft cross-entropy, vocab
restriction and 0.8 step decay as in SpecForge's ``OnlineEagle3Model``; re-implemented here).

Shift convention (positions 0 … T-1 of one sample; ``x_j`` its tokens, ``z_j`` the target logits at
position j = ``target_lm_head(final_norm(last_hidden_j))``, the target's prediction of ``x_{j+1}``):

- step i, query position t reads the features of position t (step 0: ``fc(aux_t)``; step i > 0: the
  draft's own step i-1 output at t) and the token ``x_{t+1+i}``;
- it **predicts** ``x_{t+2+i}``; its soft label is ``softmax(z_{t+1+i})`` restricted to the draft
  vocabulary and renormalised;
- it is supervised iff ``t + 2 + i < T``, ``loss_mask[t+2+i]`` (the predicted token is a training
  token, as in the DFlash loss of this repo), ``valid`` at t, t+1+i and t+2+i, and the argmax of
  ``z_{t+1+i}`` over the **full** vocabulary is in the draft vocabulary (otherwise the position is
  "dropped": no loss, counted as a miss in the accuracy).

SpecForge differs in two bookkeeping details: it masks step i at t with ``loss_mask[t+i]`` (the mask
of the feature position, not of the predicted token) and averages each step's loss over all b·T
positions; artcache averages over the supervised positions of the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from artcache.errors import ConfigError

if TYPE_CHECKING:
    from .model import Eagle3Draft

__all__ = ["Eagle3Stats", "eagle3_loss", "kept_steps", "simulated_acc_len", "supervision_masks", "target_soft_labels"]


def simulated_acc_len(acc: list[float]) -> float:
    """``Σ_k Π_{i<=k} acc_i`` over per-TTT-step accuracies (SpecForge's ``simulated_acc_len``): the
    expected accepted length of a chain whose step k is accepted with probability ``acc_k`` given the
    steps before. Does **not** include the +1 bonus token. NaN if any ``acc_i`` is NaN."""
    sim, prod = 0.0, 1.0
    for a in acc:
        prod *= a
        sim += prod
    return sim


@dataclass(frozen=True)
class Eagle3Stats:
    """Sums (never ratios) over one or more batches, indexed by TTT step i; they add across steps and
    processes.

    Fields (detached tensors on the loss's device):
        loss_sum: float64 [S], Σ soft-CE over the kept positions of step i.
        kept: int64 [S], positions in step i's loss (supervised and target argmax in the draft vocab).
        correct: int64 [S], kept positions where the draft argmax equals the target argmax.
        total: int64 [S], supervised positions of step i, **including** the dropped ones (target
            argmax outside the draft vocab): the accuracy denominator.
        loss_decay: the per-step decay (step i weighs ``loss_decay ** i``).

    Combine with ``+``; for ``torch.distributed.all_reduce`` use :meth:`to_tensor` / :meth:`from_tensor`.
    """

    loss_sum: Tensor
    kept: Tensor
    correct: Tensor
    total: Tensor
    loss_decay: float

    def __add__(self, other: Eagle3Stats) -> Eagle3Stats:
        if self.total.shape != other.total.shape or self.loss_decay != other.loss_decay:
            raise ConfigError(f"cannot add Eagle3Stats of {self.total.numel()} / {other.total.numel()} steps and "
                              f"decays {self.loss_decay} / {other.loss_decay}")
        return Eagle3Stats(self.loss_sum + other.loss_sum, self.kept + other.kept, self.correct + other.correct,
                           self.total + other.total, self.loss_decay)

    def to_tensor(self) -> Tensor:
        """One float64 vector of length 4S (counts exact below 2**53)."""
        return torch.cat([self.loss_sum.double(), self.kept.double(), self.correct.double(), self.total.double()])

    @classmethod
    def from_tensor(cls, vec: Tensor, loss_decay: float) -> Eagle3Stats:
        """Inverse of :meth:`to_tensor`."""
        if vec.dim() != 1 or vec.numel() % 4 or vec.numel() == 0:
            raise ConfigError(f"Eagle3Stats vector must be 1-D of length 4S, got {tuple(vec.shape)}")
        v = vec.double()
        S = v.numel() // 4
        return cls(v[:S].clone(), v[S:2 * S].round().long(), v[2 * S:3 * S].round().long(),
                   v[3 * S:].round().long(), float(loss_decay))

    def summary(self) -> dict:
        """Plain-Python metrics, each divided once from the sums.

        - ``loss``: ``Σ_i loss_decay**i · loss_sum_i / kept_i`` (the training objective's form);
        - ``loss_per_step``: ``loss_sum_i / kept_i``;
        - ``acc``: per-step accuracy ``correct_i / total_i`` (dropped positions count as misses);
        - ``sim_acc_len``: ``Σ_k Π_{i<=k} acc_i`` over the TTT steps (SpecForge's
          ``simulated_acc_len``); it does **not** include the +1 bonus token (NeMo adds 1);
        - ``coverage``: ``Σ kept / Σ total``, the share of supervised positions whose target argmax is
          in the draft vocab; ``total``: ``Σ total``.

        NaN where a denominator is 0 (and in anything computed from it).
        """
        ls, kept = self.loss_sum.tolist(), self.kept.tolist()
        corr, tot = self.correct.tolist(), self.total.tolist()
        per_step = [s / k if k > 0 else math.nan for s, k in zip(ls, kept, strict=True)]
        acc = [c / t if t > 0 else math.nan for c, t in zip(corr, tot, strict=True)]
        sim = simulated_acc_len(acc)
        n_tot = sum(tot)
        return {
            "loss": sum(self.loss_decay ** i * v for i, v in enumerate(per_step)),
            "loss_per_step": per_step,
            "acc": acc,
            "sim_acc_len": sim,
            "sim_acc_len_includes_bonus": False,
            "coverage": sum(kept) / n_tot if n_tot > 0 else math.nan,
            "total": n_tot,
        }


@torch.no_grad()
def target_soft_labels(model: Eagle3Draft, last_hidden: Tensor, valid: Tensor | None = None,
                       chunk_rows: int | None = None, *, normed: bool = False,
                       all_rows: bool = False) -> tuple[Tensor, Tensor]:
    """Target distributions restricted to the draft vocabulary, computed ``chunk_rows`` rows at a time.

    For each valid position j: ``z_j = target_logits(last_hidden_j)`` over the full vocabulary V,
    computed per chunk of rows so that only a [chunk_rows, V] block exists at once (never [b, T, V]);
    the argmax over V is mapped to its draft id (-1 if the draft vocabulary lacks it); the stored label
    is ``softmax(z_j[used_ids])``, the target distribution restricted to the draft vocab and renormalised.

    Memory: the result is [b, T, V_d] in float32 (float64 for a float64 model), e.g. 393 MB for T=3072,
    V_d=32000; plus one transient [chunk_rows, V] logits block.

    ``all_rows``: compute every row (invalid ones masked afterwards) instead of finding the valid rows
    with ``nonzero``: no host synchronisation, fixed shapes; same result.

    Returns:
        ``probs`` [b, T, V_d] (zero rows at invalid positions) and ``argmax_draft`` [b, T] int64 (-1 at
        invalid positions and where the target argmax is outside the draft vocab).
    """
    chunk_rows = model.cfg.logit_chunk if chunk_rows is None else chunk_rows
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    b, T, H = last_hidden.shape
    dev = last_hidden.device
    acc_dtype = torch.promote_types(model.dtype, torch.float32)
    Vd = model.cfg.draft_vocab_size
    used = model.used_ids().to(dev)
    t2d_index = model.target_to_draft().to(dev)
    probs = torch.zeros(b * T, Vd, dtype=acc_dtype, device=dev)
    arg = torch.full((b * T,), -1, dtype=torch.long, device=dev)
    flat = last_hidden.reshape(b * T, H)
    if all_rows:
        for s in range(0, b * T, chunk_rows):
            z = model.target_logits(flat[s:s + chunk_rows], normed=normed)
            z = z.to(torch.promote_types(z.dtype, acc_dtype))
            arg[s:s + chunk_rows] = t2d_index[z.argmax(dim=-1)]
            probs[s:s + chunk_rows] = torch.softmax(z.index_select(1, used), dim=-1)
        if valid is not None:
            vb = valid.to(dev).bool().reshape(-1)
            probs.mul_(vb[:, None])
            arg.masked_fill_(~vb, -1)
        return probs.reshape(b, T, Vd), arg.reshape(b, T)
    rows = (valid.to(dev).bool().reshape(-1).nonzero().squeeze(1) if valid is not None
            else torch.arange(b * T, device=dev))
    for s in range(0, rows.numel(), chunk_rows):
        r = rows[s:s + chunk_rows]
        z = model.target_logits(flat.index_select(0, r), normed=normed)
        z = z.to(torch.promote_types(z.dtype, acc_dtype))
        arg[r] = t2d_index[z.argmax(dim=-1)]
        probs[r] = torch.softmax(z.index_select(1, used), dim=-1)
    return probs.reshape(b, T, Vd), arg.reshape(b, T)


def supervision_masks(loss_mask: Tensor, valid: Tensor, steps: int, doc_ids: Tensor | None = None) -> list[Tensor]:
    """Per-step supervision [b, T] bool (before dropping out-of-vocab argmaxes): step i at t is
    supervised iff ``t + 2 + i < T`` and ``loss_mask[t+2+i]`` and ``valid`` at t, t+1+i and t+2+i, and (a
    packed batch, ``doc_ids`` [b, T]) t+2+i lies in t's document."""
    lm = loss_mask.bool() & valid.bool()
    vb = valid.bool()
    b, T = lm.shape
    out = []
    for i in range(steps):
        m = torch.zeros_like(lm)
        n = T - 2 - i
        if n > 0:
            m[:, :n] = lm[:, 2 + i:] & vb[:, :n] & vb[:, 1 + i:T - 1]
            if doc_ids is not None:
                m[:, :n] &= doc_ids[:, :n] == doc_ids[:, 2 + i:].to(doc_ids.device)
        out.append(m)
    return out


def _soft_ce(model: Eagle3Draft, h: Tensor, probs: Tensor, label_rows: Tensor) -> tuple[Tensor, Tensor]:
    """Soft CE of rows h [c, H] against ``probs[label_rows]`` [c, V_d] (gathered here, so a checkpoint
    keeps only the indices, not a copy of the labels), and the draft argmax [c]."""
    logits = model.draft_logits(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logq = torch.log_softmax(logits, dim=-1)
    p = probs.index_select(0, label_rows).to(logq.dtype)
    return -(p * logq).sum(dim=-1), logits.argmax(dim=-1)


def eagle3_loss(
    model: Eagle3Draft,
    aux_hidden: Tensor,
    last_hidden: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    valid: Tensor,
    *,
    steps: int | None = None,
    chunk_rows: int | None = None,
    last_hidden_normed: bool = False,
    sync_free: bool = False,
    forward=None,
    denominators: Tensor | None = None,
    doc_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    attn_chunk: int | None = None,
) -> tuple[Tensor, Eagle3Stats]:
    """EAGLE-3 TTT loss of one batch, plus metric sums (shift convention: module docstring).

    ``loss = Σ_i loss_decay**i · loss_i`` with ``loss_i`` = mean over step i's kept positions of the
    soft cross-entropy ``-Σ_v p_v · log q_v`` between the restricted target distribution p
    (:func:`target_soft_labels`) and the draft's softmax q over the draft vocabulary. A step with no
    kept position contributes 0 (with a zero-gradient graph).

    The draft logits are computed only for kept rows, ``chunk_rows`` at a time; under autograd each
    chunk runs inside ``torch.utils.checkpoint`` so only one [chunk_rows, V_d] logits block is alive
    (the lm_head matmul is recomputed in backward). Target logits: :func:`target_soft_labels`.

    Args:
        model: the draft.
        aux_hidden: [b, T, 3, H] captured aux layers (un-normed, :func:`eagle3_layer_ids` order).
        last_hidden: [b, T, H], output of the last decoder layer (id L-1) **before** the final norm;
            pass ``last_hidden_normed=True`` for a post-norm state.
        input_ids: [b, T] long. loss_mask: [b, T] bool/int (nonzero = training token).
        valid: [b, T] bool, False marks padding (contributes nothing; garbage there stays finite).
        steps: TTT steps (default ``cfg.ttt_steps``). chunk_rows: default ``cfg.logit_chunk``.
        sync_free: the GPU path: every position of every step reaches the draft head (weight 0 where
            not kept) instead of the kept rows found with ``nonzero``; plain autograd over chunks of at
            least 2**26 / V_d rows (no recomputation); the stats stay device tensors; the model's
            input checks are skipped (:meth:`Eagle3Draft.forward` ``validate``): no host
            synchronisation. Same loss and stats up to float rounding.
        forward: the callable that runs the model (a ``torch.compile``-d ``model``); default ``model``.
        doc_ids, position_ids: a packed batch (:mod:`artcache.trainers.packing`), [b, T] long each: attention,
            TTT shifts and supervision stay inside each document; RoPE positions restart per document.
        denominators: [steps] float64: divide step i's sum by ``denominators[i]`` instead of its own kept count
            (a consumer group or ``--grad-accum``: the kept counts of the whole global batch, so the sum of the
            parts' gradients is the global batch's); None: the batch's own counts.
        attn_chunk: the TTT attention's query chunk (:meth:`Eagle3Draft.forward`); None: chosen by the length.

    Returns:
        ``(loss, stats)``: a scalar in float32 (float64 for a float64 model), and :class:`Eagle3Stats`.

    Raises:
        ConfigError: inconsistent shapes or bad ``steps``/``chunk_rows``.
    """
    cfg = model.cfg
    steps = cfg.ttt_steps if steps is None else steps
    chunk_rows = cfg.logit_chunk if chunk_rows is None else chunk_rows
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    if aux_hidden.dim() != 4:
        raise ConfigError(f"aux_hidden must be [b, T, 3, H], got shape {tuple(aux_hidden.shape)}")
    b, T = aux_hidden.shape[:2]
    for name, t in (("input_ids", input_ids), ("loss_mask", loss_mask), ("valid", valid)):
        if tuple(t.shape) != (b, T):
            raise ConfigError(f"{name} shape {tuple(t.shape)} != (b, T) = {(b, T)}")
    if tuple(last_hidden.shape) != (b, T, cfg.hidden_size):
        raise ConfigError(f"last_hidden shape {tuple(last_hidden.shape)} != {(b, T, cfg.hidden_size)}")
    dev = aux_hidden.device
    vb = valid.to(dev).bool()
    lh = torch.where(vb[:, :, None], last_hidden.to(dev), torch.zeros((), dtype=last_hidden.dtype, device=dev))

    probs, arg = target_soft_labels(model, lh, vb, chunk_rows, normed=last_hidden_normed, all_rows=sync_free)
    # checks the other shapes
    docs = None if doc_ids is None else doc_ids.to(dev).long()
    packed = {} if docs is None else {"doc_ids": docs, "position_ids": position_ids}
    hiddens = (model if forward is None else forward)(aux_hidden, input_ids, vb, steps=steps, validate=not sync_free,
                                                      attn_chunk=attn_chunk, **packed)
    sup = supervision_masks(loss_mask.to(dev), vb, steps, docs)
    if sync_free:
        return _sync_free_steps(model, hiddens, sup, probs, arg, max(chunk_rows, (1 << 26) // cfg.draft_vocab_size),
                                denominators)
    return kept_steps(model, hiddens, sup, probs, arg, chunk_rows, denominators)


def kept_steps(model: Eagle3Draft, hiddens: list[Tensor], sup: list[Tensor], probs: Tensor, arg: Tensor,
               chunk_rows: int, denominators: Tensor | None = None) -> tuple[Tensor, Eagle3Stats]:
    """The TTT steps' loss and stats over the kept positions (found with ``nonzero``): :func:`eagle3_loss`'s
    loop, also the context-parallel loss's (:mod:`artcache.trainers.eagle3.cp`).

    Args:
        hiddens: ``steps`` tensors [b, S, H], the draft's outputs at S query positions (the local position t of
            row r is flattened ``r·S + t``). sup: ``steps`` masks [b, S] bool (:func:`supervision_masks`).
        probs: [b, L, V_d], arg: [b, L] (:func:`target_soft_labels`) over positions whose local index t + 1 + i is
            step i's label of query t (``L >= S + steps - 1`` wherever ``sup`` is True); one rank: ``L = S = T``.
        chunk_rows, denominators: as :func:`eagle3_loss`'s.
    """
    cfg = model.cfg
    b, S = sup[0].shape
    L = probs.shape[1]
    dev = probs.device
    acc_dtype = probs.dtype
    probs_flat, arg_flat = probs.reshape(b * L, -1), arg.reshape(-1)
    need_grad = torch.is_grad_enabled()

    total_loss = hiddens[0].sum().to(acc_dtype) * 0.0  # a (zero) graph even when nothing is supervised
    loss_sums, kept_n, correct_n, total_n = [], [], [], []
    for i, (h, m) in enumerate(zip(hiddens, sup, strict=True)):
        q_rows = m.reshape(-1).nonzero().squeeze(1)  # query positions t (flattened b·S)
        l_rows = q_rows // S * L + q_rows % S + 1 + i  # label positions t+1+i, same sequence (t+2+i < T)
        keep = arg_flat[l_rows] >= 0
        q_rows, l_rows = q_rows[keep], l_rows[keep]
        hf = h.reshape(b * S, -1)
        step_sum = h.sum().to(acc_dtype) * 0.0
        correct = torch.zeros((), dtype=torch.long, device=dev)
        for s in range(0, q_rows.numel(), chunk_rows):
            hc = hf.index_select(0, q_rows[s:s + chunk_rows])
            lc = l_rows[s:s + chunk_rows]
            if need_grad:
                ce, pred = checkpoint(_soft_ce, model, hc, probs_flat, lc, use_reentrant=False)
            else:
                ce, pred = _soft_ce(model, hc, probs_flat, lc)
            step_sum = step_sum + ce.sum()
            correct = correct + (pred == arg_flat[lc]).sum()
        n_kept = q_rows.numel()
        # a given (global) denominator may be below 1 on one rank (den / world): only 0 is replaced
        den = max(n_kept, 1) if denominators is None else _nonzero(denominators[i].to(acc_dtype))
        total_loss = total_loss + cfg.loss_decay ** i * step_sum / den
        loss_sums.append(step_sum.detach().double())
        kept_n.append(n_kept)
        correct_n.append(correct)
        total_n.append(int(m.sum()))
    stats = Eagle3Stats(
        loss_sum=torch.stack(loss_sums),
        kept=torch.tensor(kept_n, dtype=torch.long, device=dev),
        correct=torch.stack(correct_n),
        total=torch.tensor(total_n, dtype=torch.long, device=dev),
        loss_decay=float(cfg.loss_decay),
    )
    return total_loss, stats


def _nonzero(den: Tensor) -> Tensor:
    """``den``, or 1 where it is 0 (a step that kept no position anywhere: its sum is 0 too)."""
    return torch.where(den > 0, den, torch.ones_like(den))


def _sync_free_steps(model: Eagle3Draft, hiddens: list[Tensor], sup: list[Tensor], probs: Tensor, arg: Tensor,
                     chunk_rows: int, denominators: Tensor | None = None) -> tuple[Tensor, Eagle3Stats]:
    """The TTT steps' loss and stats over all b·T positions, kept ones weighted 1, no host read-back."""
    cfg = model.cfg
    b, T, Vd = probs.shape
    dev = probs.device
    acc_dtype = probs.dtype
    probs_flat, arg_flat = probs.reshape(b * T, Vd), arg.reshape(-1)
    q_all = torch.arange(b * T, device=dev)
    total_loss = torch.zeros((), dtype=acc_dtype, device=dev)
    loss_sums, kept_n, correct_n, total_n = [], [], [], []
    for i, (h, m) in enumerate(zip(hiddens, sup, strict=True)):
        # label of query t is position t+1+i of the same sequence; where t+2+i >= T the mask is False
        # and the clamped label row is only a placeholder (weight 0)
        l_rows = (q_all + 1 + i).clamp(max=b * T - 1)
        label_arg = arg_flat[l_rows]
        keep = m.reshape(-1) & (label_arg >= 0)
        hf = h.reshape(b * T, -1)
        step_sum = torch.zeros((), dtype=acc_dtype, device=dev)
        correct = torch.zeros((), dtype=torch.long, device=dev)
        for s in range(0, b * T, chunk_rows):
            ce, pred = _soft_ce(model, hf[s:s + chunk_rows], probs_flat, l_rows[s:s + chunk_rows])
            kc = keep[s:s + chunk_rows]
            step_sum = step_sum + (ce * kc).sum()
            correct = correct + ((pred == label_arg[s:s + chunk_rows]) & kc).sum()
        n_kept = keep.sum()
        den = n_kept.clamp_min(1) if denominators is None else _nonzero(denominators[i].to(dev))
        total_loss = total_loss + cfg.loss_decay ** i * step_sum / den.to(acc_dtype)
        loss_sums.append(step_sum.detach().double())
        kept_n.append(n_kept)
        correct_n.append(correct)
        total_n.append(m.sum())
    stats = Eagle3Stats(loss_sum=torch.stack(loss_sums), kept=torch.stack(kept_n), correct=torch.stack(correct_n),
                        total=torch.stack(total_n).long(), loss_decay=float(cfg.loss_decay))
    return total_loss, stats
