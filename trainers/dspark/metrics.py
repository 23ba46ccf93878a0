"""DSpark metrics: acceptance (α_k, τ), teacher-forced accuracy, confidence calibration, greedy replay.

Definitions (DSpark arXiv:2607.05147; DeepSpec ``deepspec/modeling/dspark/loss.py`` and
``deepspec/eval/dspark/confidence_head.py``):

- ``accept_rate@k`` = mean of ``α_k = 1 − ½‖p_k − q_k‖₁`` over supervised slots k (0-based): the
  probability that speculative sampling accepts slot k's draft token given the prefix was accepted.
- ``tau`` = mean over valid blocks of ``1 + Σ_k Π_{i≤k} α_i`` (over the supervised prefix): the expected
  acceptance length **including the +1 bonus token**, in [1, B + 1].
- calibration of the confidence ``c_k = sigmoid(conf_k)`` (conditional: slot k accepted given slots < k
  were): ``conf_mae`` / ``conf_bias`` = ``Σ w_k·|c_k − α_k| / Σ w_k`` / ``Σ w_k·(c_k − α_k) / Σ w_k`` over
  supervised slots, weighted by the slot decay ``w_k = exp(-k/γ)`` of the objective; ``cum_mae`` /
  ``cum_bias`` the same for ``Π_{i≤k} c_i`` against ``Π_{i≤k} α_i`` (the probability that the first k+1
  slots are all accepted). The weighting is DeepSpec's: ``deepspec/modeling/dspark/loss.py``
  (``_collect_local_terms``: ``confidence_abs_error``, ``confidence_bias`` and ``confidence_cumprod_bias`` are
  sums times its ``loss_weight_mask`` over the mask's sum; DeepSpec has no cumulative MAE, ``cum_mae`` is
  weighted alike). ``ece@k`` / ``ece_cum@k`` = expected calibration error of slot k
  with 10 equal-width bins of the prediction: ``Σ_bins |Σ pred − Σ α| / n_k`` (the targets are the
  teacher-forced α, not sampled accept/reject outcomes); ``ece`` / ``ece_cum`` pool every slot's bins.
- ``replay_tau``: greedy acceptance replay against the target's argmax (as the other drafts), +1 bonus
  included.

Every ratio is accumulated as numerator and denominator sums (:class:`~artcache.trainers.draft.MetricSums`)
and divided once; a metric whose denominator is 0 is left out of the summary.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from artcache.trainers.draft import MetricSums, PendingSums, replay_sums

from .loss import BlockOutputs

if TYPE_CHECKING:
    from .model import DSparkDraft

__all__ = ["ECE_BINS", "block_pending", "block_sums", "ece_from_arrays", "greedy_proposals", "replay", "replay_walk",
           "summarize"]

#: Bins of every expected-calibration-error figure.
ECE_BINS = 10


def _bin_sums(pred: Tensor, target: Tensor, bins: int = ECE_BINS) -> tuple[Tensor, Tensor, Tensor]:
    """(count, Σ pred, Σ target) per bin [bins] float64 for 1-D ``pred`` in [0, 1]."""
    idx = (pred.double() * bins).long().clamp_(0, bins - 1)
    n = torch.zeros(bins, dtype=torch.float64, device=pred.device)
    n.index_add_(0, idx, torch.ones_like(pred, dtype=torch.float64))
    ps = torch.zeros_like(n).index_add_(0, idx, pred.double())
    ts = torch.zeros_like(n).index_add_(0, idx, target.double())
    return n, ps, ts


def _ece(n: Tensor, ps: Tensor, ts: Tensor) -> float:
    total = float(n.sum())
    return float((ps - ts).abs().sum()) / total if total > 0 else math.nan


def ece_from_arrays(pred: Tensor, target: Tensor, mask: Tensor, bins: int = ECE_BINS) -> list[float]:
    """Per-slot ECE of ``pred`` against ``target`` over ``mask`` (all [n, B]); NaN for a slot with no row."""
    out = []
    for k in range(pred.shape[1]):
        m = mask[:, k]
        out.append(_ece(*_bin_sums(pred[m, k], target[m, k], bins)))
    return out


def _slot_bin_sums(pred: Tensor, target: Tensor, sup: Tensor, bins: int = ECE_BINS, masked: bool = False) -> Tensor:
    """[3, B, bins] float64: count, Σ pred, Σ target per slot and bin over the supervised entries of the
    [..., B] ``pred`` / ``target`` (one scatter for every slot). ``masked``: every entry is scattered with
    weight ``sup`` (``pred`` / ``target`` must be 0 where unsupervised) instead of selecting the supervised
    ones: no ``nonzero``, no host synchronisation; the same sums up to summation order."""
    B = sup.shape[-1]
    if masked:
        slot = torch.arange(B, device=sup.device).expand_as(sup).reshape(-1)
        p, t, ones = pred.double().reshape(-1), target.double().reshape(-1), sup.double().reshape(-1)
    else:
        slot = torch.arange(B, device=sup.device).expand_as(sup)[sup]
        p, t = pred[sup].double(), target[sup].double()
        ones = torch.ones_like(p)
    idx = slot * bins + (p * bins).long().clamp_(0, bins - 1)
    out = torch.zeros(3, B * bins, dtype=torch.float64, device=sup.device)
    out[0].index_add_(0, idx, ones)
    out[1].index_add_(0, idx, p)
    out[2].index_add_(0, idx, t)
    return out.reshape(3, B, bins)


def _block_values(out: BlockOutputs, masked: bool) -> list[Tensor]:
    """The figures of :func:`block_sums` as float64 device tensors, in its order: ``[ce, l1, conf, Σ w, Σ τ,
    blocks]``, Σ α [B], correct [B], supervised [B], and with the confidence head the ``w_k``-weighted sums
    ``[mae, bias, cum mae, cum bias]`` (divided by Σ w in the summary) and the ECE bin sums of c and of Π c (each
    [3 · B · ECE_BINS]). ``masked``: no boolean selection (no host synchronisation); unsupervised entries are 0
    in every summand, so the sums are the same."""
    sup = out.supervised
    alpha = out.alpha.double() * sup
    cum_alpha = alpha.cumprod(dim=-1)
    blocks = out.valid & sup.any(dim=-1)
    head = [out.ce_sum, out.l1_sum, out.conf_sum, out.weight_sum,
            ((1.0 + cum_alpha.sum(dim=-1)) * blocks).sum(), blocks.sum()]
    per_slot = [alpha.sum(dim=(0, 1)), out.correct.sum(dim=(0, 1)), sup.sum(dim=(0, 1))]
    parts = [torch.stack([x.double() for x in head]), *[x.double() for x in per_slot]]
    if out.conf_logit is not None:
        c = torch.sigmoid(out.conf_logit.double()) * sup
        cum_c = c.cumprod(dim=-1)
        w = out.weights.double()  # w_k x supervised: the slot decay, as DeepSpec weighs these figures
        if masked:  # c, α, their cumulative products and w are 0 off the supervised prefix
            err, cerr, w = (c - alpha).reshape(-1), (cum_c - cum_alpha).reshape(-1), w.reshape(-1)
        else:
            err, cerr, w = (c - alpha)[sup], (cum_c - cum_alpha)[sup], w[sup]
        parts.append(torch.stack([(err.abs() * w).sum(), (err * w).sum(), (cerr.abs() * w).sum(),
                                  (cerr * w).sum()]))
        parts.append(_slot_bin_sums(c, alpha, sup, masked=masked).reshape(-1))
        parts.append(_slot_bin_sums(cum_c, cum_alpha, sup, masked=masked).reshape(-1))
    return parts


def block_pending(out: BlockOutputs, loss_weights: tuple[float, float, float]) -> PendingSums:
    """:func:`block_sums` left on the device (the sync-free training step): nothing is read back. Every ECE
    bin is named (an empty bin resolves to a zero count, which :func:`summarize` skips as it skips an absent
    one), so the resolved sums are :func:`block_sums`' plus those zero entries."""
    parts = _block_values(out, masked=True)
    B = out.supervised.shape[-1]
    ce, l1, cf, ws, tau, nblocks = parts[0].unbind()
    a_sum, correct, n_k = parts[1:4]
    ce_w, l1_w, cf_w = loss_weights
    names = [("loss", True), ("ce_loss", True), ("l1_loss", True)]
    vals = [torch.stack([ce_w * ce + l1_w * l1 + cf_w * cf, ws, ce, ws, l1, ws])]
    names += [(f"{m}{k}", True) for k in range(B) for m in ("accept_rate@", "acc_")]
    vals.append(torch.stack([a_sum, n_k, correct, n_k], dim=1).reshape(-1))
    names.append(("tau", True))
    vals.append(torch.stack([tau, nblocks]))
    if out.conf_logit is not None:
        mae, bias, cmae, cbias = parts[4].unbind()
        names += [(n, True) for n in ("conf_loss", "conf_mae", "conf_bias", "cum_mae", "cum_bias")]
        vals.append(torch.stack([cf, ws, mae, ws, bias, ws, cmae, ws, cbias, ws]))
        for tag, flat in (("ece", parts[5]), ("ece_cum", parts[6])):
            names += [(f"{tag}@{k}.{x}{i}", False) for k in range(B) for i in range(ECE_BINS) for x in "npt"]
            vals.append(flat.reshape(3, B, ECE_BINS).permute(1, 2, 0).reshape(-1))
    return PendingSums(tuple(names), torch.cat(vals))


def block_sums(out: BlockOutputs, loss_weights: tuple[float, float, float]) -> MetricSums:
    """The :class:`MetricSums` of one forward's :class:`BlockOutputs` (every figure computed on the
    outputs' device and read back in one transfer).

    Args:
        loss_weights: (ce, l1, confidence) weights of the objective (``loss`` = their weighted sum).
    """
    B = out.supervised.shape[-1]
    ce_w, l1_w, cf_w = loss_weights
    conf = out.conf_logit is not None
    vals = torch.cat(_block_values(out, masked=False)).tolist()
    (ce, l1, cf, ws, tau, nblocks), vals = vals[:6], vals[6:]
    a_sum, correct, n_k, vals = vals[:B], vals[B:2 * B], vals[2 * B:3 * B], vals[3 * B:]
    s = MetricSums()
    s.add("loss", ce_w * ce + l1_w * l1 + cf_w * cf, ws)
    s.add("ce_loss", ce, ws)
    s.add("l1_loss", l1, ws)
    for k in range(B):
        s.add(f"accept_rate@{k}", a_sum[k], n_k[k])
        s.add(f"acc_{k}", correct[k], n_k[k])
    s.add("tau", tau, nblocks)
    if conf:
        (mae, bias, cmae, cbias), vals = vals[:4], vals[4:]
        s.add("conf_loss", cf, ws)
        s.add("conf_mae", mae, ws)  # Σ w·|c − α| / Σ w (DeepSpec's weighting, module docstring)
        s.add("conf_bias", bias, ws)
        s.add("cum_mae", cmae, ws)
        s.add("cum_bias", cbias, ws)
        size = 3 * B * ECE_BINS
        for tag, flat in (("ece", vals[:size]), ("ece_cum", vals[size:2 * size])):
            for k in range(B):
                for i in range(ECE_BINS):
                    j = k * ECE_BINS + i
                    if flat[j] > 0:
                        s.add(f"{tag}@{k}.n{i}", flat[j])
                        s.add(f"{tag}@{k}.p{i}", flat[B * ECE_BINS + j])
                        s.add(f"{tag}@{k}.t{i}", flat[2 * B * ECE_BINS + j])
    return s


def _ece_of(sums: MetricSums, tag: str, slots: range) -> float:
    n = err = 0.0
    for k in slots:
        for i in range(ECE_BINS):
            nb = sums.num.get(f"{tag}@{k}.n{i}", 0.0)
            if nb > 0:
                n += nb
                err += abs(sums.num.get(f"{tag}@{k}.p{i}", 0.0) - sums.num.get(f"{tag}@{k}.t{i}", 0.0))
    return err / n if n > 0 else math.nan


def summarize(sums: MetricSums, block_size: int) -> dict[str, Any]:
    """Plain-Python figures of summed :class:`MetricSums` (each ratio divided once; zero-denominator
    metrics left out). ``acc`` (teacher-forced top-1 accuracy per slot 0 … B-1) and ``accept_rate``
    (α per slot) are lists with None where a slot had no supervised row (the consumer's log reads
    ``acc``); every other per-slot figure is a scalar key ``name@k``. ``tau`` and ``replay_tau``
    include the +1 bonus token (``tau_includes_bonus``)."""
    out: dict[str, Any] = {}
    for name in ("loss", "ce_loss", "l1_loss", "conf_loss", "tau", "conf_mae", "conf_bias", "cum_mae", "cum_bias",
                 "replay_tau", "replay_truncated"):
        if sums.den.get(name, 0.0) > 0:
            out[name] = sums.ratio(name)
    if "replay_truncated" in out:
        out["replay_truncated_frac"] = out.pop("replay_truncated")
    out["tau_includes_bonus"] = True
    out["blocks"] = int(sums.den.get("tau", 0))
    out["acc"] = [sums.ratio(f"acc_{k}") for k in range(block_size)]
    out["accept_rate"] = [sums.ratio(f"accept_rate@{k}") for k in range(block_size)]
    for k in range(block_size):
        if sums.den.get(f"accept_rate@{k}", 0.0) > 0:
            out[f"accept_rate@{k}"] = sums.ratio(f"accept_rate@{k}")
        for tag in ("ece", "ece_cum"):
            e = _ece_of(sums, tag, range(k, k + 1))
            if math.isfinite(e):
                out[f"{tag}@{k}"] = e
    for tag in ("ece", "ece_cum"):
        e = _ece_of(sums, tag, range(block_size))
        if math.isfinite(e):
            out[tag] = e
    return out


@torch.no_grad()
def greedy_proposals(model: DSparkDraft, hidden: Tensor, anchor_tokens: Tensor, chunk: int = 256) -> Tensor:
    """The draft's greedy block proposals as it drafts when serving: slot k's token is
    ``argmax(lm_head(h_k) + markov_w2(W1[prev_k]))`` with ``prev_0`` the anchor token and ``prev_k`` the
    proposal of slot k-1 (its own, not the data's).

    Args:
        hidden: [N, B, H] backbone states of N blocks. anchor_tokens: [N] long (x_p).

    Returns:
        [N, B] long proposals for x_{p+1} … x_{p+B}.
    """
    N, B, _ = hidden.shape
    out = torch.empty(N, B, dtype=torch.long, device=hidden.device)
    for s in range(0, N, chunk):
        prev = anchor_tokens[s:s + chunk].long().to(hidden.device)
        for k in range(B):
            h = hidden[s:s + chunk, k]
            _, bias_in = model.markov_inputs(prev, h)
            prev = model.draft_logits(h, bias_in).argmax(dim=-1)
            out[s:s + chunk, k] = prev
    return out


@torch.no_grad()
def replay(model: DSparkDraft, hidden: Tensor, input_ids: Tensor, supervised: Tensor, anchors: Tensor,
           target_argmax: Tensor) -> MetricSums:
    """Greedy acceptance of DSpark blocks against the target's own argmax (one sequence).

    Slot k of the block at p proposes ``d_k`` for ``x_{p+k+1}``; greedy verification accepts it while
    ``d_k == g_k``, the target's argmax after ``x_{≤p}, g_0 … g_{k-1}``, known from the data while the
    greedy path stays on it (``g_k = target_argmax[p+k]``). As :func:`artcache.trainers.draft.replay_sums`
    (``replay_tau`` includes the +1 bonus; ``replay_truncated`` counts walks cut by the path leaving the data).

    Args:
        hidden: [1, N, B, H]. input_ids, supervised: [1, T]. anchors: [1, N] long. target_argmax: [1, T] long.
    """
    return replay_sums(*replay_walk(model, hidden, input_ids, supervised, anchors, target_argmax))


@torch.no_grad()
def replay_walk(model: DSparkDraft, hidden: Tensor, input_ids: Tensor, supervised: Tensor, anchors: Tensor,
                target_argmax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inputs of the greedy acceptance walk of :func:`replay` (same arguments): ``(preds, greedy, ok,
    on_data)``, each [N, B], as :func:`artcache.trainers.draft.replay_sums` and
    :func:`~artcache.trainers.draft.replay_accepted` take them (the latter gives each block's observed
    outcome: proposals accepted, and whether the walk was cut by the greedy path leaving the data)."""
    _, N, B, _ = hidden.shape
    T = input_ids.shape[1]
    dev = hidden.device
    a = anchors[0].to(dev).long()
    ids = input_ids[0].to(dev)
    preds = greedy_proposals(model, hidden[0], ids[a])
    k = torch.arange(B, device=dev)
    lab = a[:, None] + k + 1
    inside = lab < T
    labc = lab.clamp(max=T - 1)
    ok = inside & supervised[0].to(dev).bool()[labc]
    greedy = target_argmax[0].to(dev)[(a[:, None] + k).clamp(max=T - 1)]
    on_data = ids[labc] == greedy
    return preds, greedy, ok, on_data
