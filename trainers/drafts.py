"""Draft adapters: what the consumer needs from a draft algorithm, independent of which one it is.

:func:`build_draft` turns a :class:`~artcache.trainers.consumer.ConsumerConfig`, the cache root's settings, the
plan and a device into a :class:`Draft`: an object exposing

- ``model``: the trainable ``nn.Module`` (frozen target tensors are buffers, never trained or saved);
- ``needed_layer_ids``: the captured layers it reads, output-of-layer convention, in the order it
  reads them (its *view* of the root's ``contract.layer_ids``, see :func:`layer_view`);
- ``loss(batch) -> (loss, stats)``: one training forward; ``stats`` are sums (:class:`MetricSums`);
- ``evaluate(batch, target_argmax) -> MetricSums``: held-out metrics without gradients;
- ``config_dict()``: the draft's own configuration (JSON-serialisable), stored in checkpoints;
- ``summary(sums)``: the metrics of a :class:`MetricSums`, each ratio divided once;
- ``extra_tensors()``: tensors that belong to the draft but are not trained (EAGLE-3's vocab map).

A draft never decides which positions it reads; the consumer does.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch import Tensor

from artcache.errors import ConfigError, ContractMismatch
from artcache.layer_ids import layer_view

__all__ = ["DFlashAdapter", "Draft", "DraftBatch", "Eagle3Adapter", "MetricSums", "build_draft",
           "replay_sums"]


@dataclass
class DraftBatch:
    """One padded batch, on the consumer's device.

    Attributes:
        hidden: [b, T, m, H] captured layers in the draft's view order (contract dtype).
        input_ids: [b, T] long. loss_mask: [b, T] bool. valid: [b, T] bool (False = padding).
        positions: the plan positions of the b rows.
        last_layer: optional [b, T, H]: output-of-layer ``L - 1`` (un-normed), when the root captures
            it and the caller asked for it (greedy replay against the target's argmax).
    """

    hidden: Tensor
    input_ids: Tensor
    loss_mask: Tensor
    valid: Tensor
    positions: tuple[int, ...] = ()
    last_layer: Tensor | None = None


@dataclass
class MetricSums:
    """Named numerator / denominator sums that add across steps, batches and processes.

    Every reported ratio is ``num[name] / den[name]`` computed once over the summed values (never a
    mean of per-step ratios). A name absent from ``den`` is a plain sum (a count).
    """

    num: dict[str, float] = field(default_factory=dict)
    den: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, num: float, den: float | None = None) -> None:
        self.num[name] = self.num.get(name, 0.0) + float(num)
        if den is not None:
            self.den[name] = self.den.get(name, 0.0) + float(den)

    def __add__(self, other: MetricSums) -> MetricSums:
        out = MetricSums(dict(self.num), dict(self.den))
        for k, v in other.num.items():
            out.num[k] = out.num.get(k, 0.0) + v
        for k, v in other.den.items():
            out.den[k] = out.den.get(k, 0.0) + v
        return out

    def ratio(self, name: str) -> float:
        """``num / den`` (NaN when the denominator is 0 or the name is unknown)."""
        d = self.den.get(name, 0.0)
        return self.num.get(name, 0.0) / d if d > 0 else math.nan


def _replay_summary(sums: MetricSums) -> dict[str, float]:
    """Greedy-replay figures (τ incl. +1 bonus, share of truncated blocks) when an evaluation recorded them."""
    if "replay_tau" not in sums.den:
        return {}
    return {"replay_tau": sums.ratio("replay_tau"), "replay_truncated_frac": sums.ratio("replay_truncated")}


def _replay_headline(summary: dict[str, Any], bonus_note: str = " (incl. +1 bonus)") -> str:
    if "replay_tau" not in summary:
        return ""
    return f" greedy-replay tau {summary['replay_tau']:.2f}{bonus_note}"


class Draft(abc.ABC):
    """The interface the consumer trains through (see the module docstring). Subclasses implement it."""

    name: str = ""
    model: torch.nn.Module
    needed_layer_ids: tuple[int, ...] = ()
    #: the resolved target (:class:`artcache.target.TargetInfo`) and its frozen lm_head [V, H]
    target_info: Any = None
    target_lm_head: Tensor | None = None
    #: the summary key the progress bar shows
    progress_metric: str = "tau"

    def generators(self) -> dict[str, torch.Generator]:
        """Named generators the draft draws from during training (their states are checkpointed)."""
        return {}

    @abc.abstractmethod
    def journal_fields(self, sums: MetricSums) -> dict[str, Any]:
        """The Step journal event's metric sums: ``tau_sum``, ``blocks``, ``acc_correct``, ``acc_total``."""
        ...

    @abc.abstractmethod
    def loss(self, batch: DraftBatch) -> tuple[Tensor, MetricSums]:
        ...

    @abc.abstractmethod
    @torch.no_grad()
    def evaluate(self, batch: DraftBatch, target_argmax: Tensor | None) -> MetricSums:
        ...

    @abc.abstractmethod
    def config_dict(self) -> dict[str, Any]:
        ...

    @abc.abstractmethod
    def summary(self, sums: MetricSums) -> dict[str, Any]:
        ...

    def extra_tensors(self) -> dict[str, Tensor]:
        return {}

    @abc.abstractmethod
    def headline(self, summary: dict[str, Any]) -> str:
        """One log fragment for a summary: the draft's acceptance figure, bonus convention stated."""
        ...


# ---- DFlash ------------------------------------------------------------------------------------------

def evenly_spaced(positions: Tensor, k: int) -> Tensor:
    """``k`` entries of the 1-D ``positions`` at evenly spaced indices (first and last included), in order.

    ``k <= 0`` or ``k >= len(positions)``: ``positions`` unchanged. Indices are
    ``round(linspace(0, n - 1, k))`` (distinct for k <= n), so the choice is deterministic.
    """
    n = positions.numel()
    if k <= 0 or k >= n:
        return positions
    if k == 1:
        return positions[:1]
    idx = torch.linspace(0, n - 1, k, dtype=torch.float64).round().long()
    return positions[idx]


class DFlashAdapter(Draft):
    """DFlash (arXiv:2602.06036) behind the :class:`Draft` interface.

    Args:
        model: a :class:`~artcache.trainers.dflash.DFlashDraft`. dcfg: its config.
        needed_layer_ids: the ``dflash_layer_ids(L, n)`` it reads.
        anchor_generator: the CPU generator anchors are drawn from (checkpointed with the run).
    """

    name = "dflash"

    def __init__(self, model, dcfg, needed_layer_ids: Sequence[int], anchor_generator: torch.Generator,
                 eval_anchors: int = 0) -> None:
        self.model = model
        self.dcfg = dcfg
        self.needed_layer_ids = tuple(int(i) for i in needed_layer_ids)
        self.generator = anchor_generator
        self.eval_anchors = int(eval_anchors)

    def generators(self) -> dict[str, torch.Generator]:
        return {"anchors": self.generator}

    def _forward(self, batch: DraftBatch, anchors: Tensor, avalid: Tensor):
        from artcache.trainers.dflash import dflash_loss

        dev = batch.hidden.device
        anchors, avalid = anchors.to(dev), avalid.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = self.model(batch.hidden, batch.input_ids, anchors, avalid, context_valid=batch.valid)
            loss, stats = dflash_loss(self.model, out, batch.input_ids, batch.loss_mask, anchors, avalid,
                                      context_valid=batch.valid)
        return out, loss, stats

    def loss(self, batch: DraftBatch) -> tuple[Tensor, MetricSums]:
        from artcache.trainers.dflash import sample_anchors

        # anchors are drawn on the CPU generator whatever the device (reproducible across devices)
        anchors, avalid = sample_anchors((batch.loss_mask & batch.valid).cpu(), self.dcfg.num_anchors, self.generator)
        _, loss, stats = self._forward(batch, anchors, avalid)
        return loss, self._sums(stats)

    @staticmethod
    def _sums(stats) -> MetricSums:
        s = MetricSums()
        s.add("loss", float(stats.loss_sum), float(stats.weight_sum))
        s.add("tau", int(stats.tau_sum), int(stats.num_blocks))
        for k, (c, t) in enumerate(zip(stats.correct.tolist(), stats.total.tolist(), strict=True)):
            if k >= 1:
                s.add(f"acc_{k}", c, t)
        return s

    @torch.no_grad()
    def evaluate(self, batch: DraftBatch, target_argmax: Tensor | None) -> MetricSums:
        """Held-out metrics over **every** eligible anchor (no sampling), ``max(num_anchors, 256)`` at a time.

        With ``eval_anchors`` k > 0, a sample with more than k eligible anchors is evaluated on k of them,
        evenly spaced over its eligible positions (first and last included; deterministic, no RNG), so
        an evaluation costs at most ``k × B`` draft positions per sample instead of ``T × B``.

        Data-token metrics: loss, acc_k, τ (``tau``, +1 bonus included). With ``target_argmax``
        ([b, T] long, the target's greedy next token after each prefix) also a greedy acceptance
        replay (``replay_tau``, +1 bonus included; see :func:`greedy_replay`).
        """
        from artcache.trainers.dflash import eligible_anchors

        elig = eligible_anchors((batch.loss_mask & batch.valid).cpu())
        sums = MetricSums()
        n = max(self.dcfg.num_anchors, 256)  # no gradients: larger chunks than in training
        for row in range(elig.shape[0]):
            one = DraftBatch(batch.hidden[row:row + 1], batch.input_ids[row:row + 1],
                             batch.loss_mask[row:row + 1], batch.valid[row:row + 1])
            pos = elig[row].nonzero().squeeze(1)
            pos = evenly_spaced(pos, self.eval_anchors)
            for s in range(0, pos.numel(), n):
                anchors = pos[s:s + n][None]
                out, _, stats = self._forward(one, anchors, torch.ones_like(anchors, dtype=torch.bool))
                sums = sums + self._sums(stats)
                if target_argmax is not None:
                    sums = sums + greedy_replay(self.model, out, one.input_ids, one.loss_mask & one.valid,
                                                anchors.to(out.device), target_argmax[row:row + 1])
        return sums

    def config_dict(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self.dcfg), "layer_ids": list(self.needed_layer_ids)}

    def summary(self, sums: MetricSums) -> dict[str, Any]:
        B = self.dcfg.block_size
        out = {"loss": sums.ratio("loss"), "acc": [sums.ratio(f"acc_{k}") for k in range(1, B)],
               "tau": sums.ratio("tau"), "tau_includes_bonus": True, "blocks": int(sums.den.get("tau", 0))}
        return {**out, **_replay_summary(sums)}

    def headline(self, summary: dict[str, Any]) -> str:
        return f"tau {summary['tau']:.2f} (incl. +1 bonus)" + _replay_headline(summary, bonus_note="")

    def journal_fields(self, sums: MetricSums) -> dict[str, Any]:
        """The Step event's metric sums (block size B: acc lists have B entries, index 0 unused)."""
        B = self.dcfg.block_size
        return {"tau_sum": sums.num.get("tau", 0.0), "blocks": int(sums.den.get("tau", 0)),
                "acc_correct": [0] + [int(sums.num.get(f"acc_{k}", 0)) for k in range(1, B)],
                "acc_total": [0] + [int(sums.den.get(f"acc_{k}", 0)) for k in range(1, B)]}


def greedy_replay(model, out: Tensor, input_ids: Tensor, supervised: Tensor, anchors: Tensor,
                  target_argmax: Tensor) -> MetricSums:
    """Greedy acceptance of DFlash blocks against the target's own argmax (one sequence).

    For the block anchored at p the draft proposes ``d_k`` (slot k, k = 1 … B-1, all in parallel).
    Greedy verification accepts ``d_k`` while ``d_k == g_k``, where ``g_k`` is the target's greedy
    token after ``x_≤p, g_1 … g_{k-1}``. From captures of the data sequence ``g_k`` is known only while
    the greedy path stays on the data, i.e. ``g_j == x_{p+j}`` for j < k; then ``g_k =
    target_argmax[p+k-1]``. The walk stops at the first rejection, at an unsupervised or padded
    position (as τ in training), or — counted in ``replay_truncated`` — when the draft is still
    being accepted but the greedy path leaves the data (the figure is then a lower bound). Exact when
    the data are the target's own greedy outputs.

    Args:
        out: [1, N, B, H] draft hidden states. input_ids, supervised: [1, T]. anchors: [1, N] long.
        target_argmax: [1, T] long: argmax of the target's logits at each position.

    Returns:
        MetricSums with ``replay_tau`` (Σ (accepted + 1) / blocks; **includes the +1 bonus**) and
        ``replay_truncated`` (blocks cut short by the path leaving the data / blocks).
    """
    _, N, B, H = out.shape
    T = input_ids.shape[1]
    dev = out.device
    k = torch.arange(1, B, device=dev)
    tpos = anchors[0][:, None] + k  # [N, B-1] positions of slots 1..B-1
    inside = tpos < T
    tpc = tpos.clamp(max=T - 1)
    ok = inside & supervised[0].to(dev)[tpc]
    logits_rows = out[0, :, 1:].reshape(-1, H)
    preds = torch.empty(logits_rows.shape[0], dtype=torch.long, device=dev)
    chunk = 512
    for s in range(0, logits_rows.shape[0], chunk):
        preds[s:s + chunk] = model.logits(logits_rows[s:s + chunk]).argmax(dim=-1)
    preds = preds.reshape(N, B - 1)
    greedy = target_argmax[0].to(dev)[(tpos - 1).clamp(max=T - 1)]  # g_k = argmax after x_{<= p+k-1}
    on_data = input_ids[0].to(dev)[tpc] == greedy  # g_k == x_{p+k}: the path stays on the data
    return replay_sums(preds, greedy, ok, on_data)


def replay_sums(preds: Tensor, greedy: Tensor, ok: Tensor, on_data: Tensor) -> MetricSums:
    """Greedy acceptance walk over proposals, one row per block (see :func:`greedy_replay`).

    Args (all [N, K], column k = the k-th proposed token of a block):
        preds: the draft's proposals (target vocabulary ids). greedy: the target's greedy token
            there, valid while the path stays on the data. ok: the position is supervised and inside
            the sequence. on_data: ``greedy == data token`` there.

    The walk accepts column k while ``preds == greedy`` and ``ok``, and continues past column k only
    if ``on_data`` there. ``replay_truncated`` counts walks cut short by a path leaving the data
    while the next column was still ``ok`` (the figure is then a lower bound).

    Returns:
        MetricSums: ``replay_tau`` = Σ (accepted + 1) / N (**includes the +1 bonus token**),
        ``replay_truncated`` / N.
    """
    N, K = preds.shape
    dev = preds.device
    match = (preds == greedy) & ok
    lead = match.long().cumprod(dim=1)  # 1 while every column so far was accepted
    cont = torch.cat((torch.ones(N, 1, dtype=torch.long, device=dev), on_data[:, :-1].long()), dim=1).cumprod(dim=1)
    accepted = (lead * cont).sum(dim=1)
    if K > 1:
        last = (accepted - 1).clamp(min=0)
        truncated = (accepted > 0) & (accepted < K) & ~on_data.gather(1, last[:, None]).squeeze(1) \
            & ok.gather(1, accepted.clamp(max=K - 1)[:, None]).squeeze(1)
    else:
        truncated = torch.zeros(N, dtype=torch.bool, device=dev)
    s = MetricSums()
    s.add("replay_tau", float((accepted + 1).sum()), N)
    s.add("replay_truncated", float(truncated.sum()), N)
    return s


def _check_target(settings):
    from artcache.target import resolve_target

    info = resolve_target(settings.target_path)
    if info.weights_digest != settings.contract.target_weights_digest:
        raise ContractMismatch(
            f"target at {settings.target_path} has weights digest {info.weights_digest}, but the cache "
            f"root was captured from {settings.contract.target_weights_digest}")
    return info


def _check_ids(ids: Sequence[int], num_layers: int) -> None:
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or not ids:
        raise ConfigError(f"--layer-ids {list(ids)}: the target has {num_layers} decoder layers; accepted "
                          f"output-of-layer ids are 0..{num_layers - 1}")


def dflash_default_layers(num_target_layers: int, captured: Sequence[int]) -> int:
    """Draft layers n when ``--draft-layers`` is not given: the largest n <= len(captured) whose
    ``dflash_layer_ids(L, n)`` are all captured (a DFlash-only root: one per captured layer)."""
    from artcache.layer_ids import dflash_layer_ids

    cap = set(captured)
    for n in range(min(len(cap), num_target_layers - 3), 0, -1):
        if set(dflash_layer_ids(num_target_layers, n)) <= cap:
            return n
    return len(cap)  # nothing fits: dflash_layer_ids of this n names the missing ids


def build_dflash(cfg, settings, plan, device: torch.device, info=None) -> DFlashAdapter:
    """The DFlash draft around the target's frozen embedding and lm_head.

    Raises:
        ContractMismatch: a layer the draft needs is not captured, or the target's weights changed.
        ConfigError: no valid MASK token, or bad sizes.
    """
    from transformers import AutoConfig

    from artcache.layer_ids import dflash_layer_ids
    from artcache.plan import choose_mask_token
    from artcache.target import load_embedding_and_lm_head, load_tokenizer
    from artcache.trainers.dflash import DFlashConfig, DFlashDraft

    info = info or _check_target(settings)
    captured = list(settings.contract.layer_ids)
    if cfg.layer_ids:  # an explicit view replaces the formula
        need = [int(i) for i in cfg.layer_ids]
        _check_ids(need, info.num_layers)
        n = cfg.draft_layers or len(need)
        layer_view(captured, need, draft=f"a {n}-layer DFlash draft", flag_hint=" (--layer-ids)")
    else:
        n = cfg.draft_layers or dflash_default_layers(info.num_layers, captured)
        need = dflash_layer_ids(info.num_layers, n)
        layer_view(captured, need, draft=f"a {n}-layer DFlash draft", flag_hint=f" (--draft-layers {n})")
    tok = load_tokenizer(info)
    mask_id = choose_mask_token(tok, info.vocab_size, plan)
    embed, lm_head = load_embedding_and_lm_head(info)
    dcfg = DFlashConfig.from_target(AutoConfig.from_pretrained(info.path), num_layers=n,
                                    block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                    mask_token_id=mask_id, num_context_layers=len(need))
    torch.manual_seed(cfg.seed)
    model = DFlashDraft(dcfg, embed.to(device), lm_head.to(device))
    draft = DFlashAdapter(model, dcfg, need, torch.Generator().manual_seed(cfg.seed),
                          eval_anchors=cfg.eval_anchors)
    draft.target_info, draft.target_lm_head = info, model.lm_head_weight
    return draft


# ---- EAGLE-3 -----------------------------------------------------------------------------------------

class Eagle3Adapter(Draft):
    """EAGLE-3 (arXiv:2503.01840) behind the :class:`Draft` interface.

    The draft's view is :func:`~artcache.trainers.eagle3.eagle3_capture_ids` ``(L)``: three auxiliary layers
    then output-of-layer ``L - 1`` (un-normed), from which the frozen target head gives the soft labels.

    Args:
        model: a :class:`~artcache.trainers.eagle3.Eagle3Draft`. ecfg: its config. needed_layer_ids: the view.
    """

    name = "eagle3"
    progress_metric = "sim_acc_len"

    def __init__(self, model, ecfg, needed_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.ecfg = ecfg
        self.needed_layer_ids = tuple(int(i) for i in needed_layer_ids)

    def _split(self, batch: DraftBatch) -> tuple[Tensor, Tensor]:
        return batch.hidden[:, :, :3], batch.hidden[:, :, 3]

    def loss(self, batch: DraftBatch) -> tuple[Tensor, MetricSums]:
        from artcache.trainers.eagle3 import eagle3_loss

        aux, last = self._split(batch)
        dev = batch.hidden.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, stats = eagle3_loss(self.model, aux, last, batch.input_ids, batch.loss_mask, batch.valid)
        return loss, self._sums(stats)

    @staticmethod
    def _sums(stats) -> MetricSums:
        s = MetricSums()
        for i, (ls, kept, c, t) in enumerate(zip(stats.loss_sum.tolist(), stats.kept.tolist(), stats.correct.tolist(),
                                                 stats.total.tolist(), strict=True)):
            s.add(f"loss_{i}", ls, kept)
            s.add(f"acc_{i + 1}", c, t)
        return s

    @torch.no_grad()
    def evaluate(self, batch: DraftBatch, target_argmax: Tensor | None) -> MetricSums:
        """Held-out TTT metrics (loss, per-step accuracy, ``sim_acc_len``) and a greedy acceptance replay
        against the target's argmax: at each position t whose step-0 prediction is supervised, the
        proposals of steps 0 … S-1 are walked as in :func:`replay_sums` (``replay_tau`` includes the
        +1 bonus token). The target's argmax comes from the captured ``L - 1`` layer when not given."""
        from artcache.trainers.eagle3 import eagle3_loss, supervision_masks

        aux, last = self._split(batch)
        model = self.model
        _, stats = eagle3_loss(model, aux, last, batch.input_ids, batch.loss_mask, batch.valid)
        sums = self._sums(stats)
        b, T = batch.input_ids.shape
        dev = batch.hidden.device
        if target_argmax is None:
            flat = last.reshape(b * T, -1)
            target_argmax = torch.cat([model.target_logits(flat[s:s + 256]).argmax(dim=-1)
                                       for s in range(0, flat.shape[0], 256)]).reshape(b, T)
        S = self.ecfg.ttt_steps
        hiddens = model(aux, batch.input_ids, batch.valid, steps=S)
        used = model.used_ids().to(dev)
        sup = supervision_masks(batch.loss_mask, batch.valid, S)
        ids, g = batch.input_ids.to(dev), target_argmax.to(dev)
        rows = sup[0].reshape(-1).nonzero().squeeze(1)  # positions t (flattened b·T) with step 0 supervised
        if rows.numel() == 0:
            return sums
        tb, tt = rows // T, rows % T
        preds, greedy, ok, on_data = [], [], [], []
        for i, h in enumerate(hiddens):
            hr = h.reshape(b * T, -1).index_select(0, rows)
            pred = torch.cat([model.draft_logits(hr[s:s + 256]).argmax(dim=-1) for s in range(0, hr.shape[0], 256)])
            preds.append(used[pred])
            lab = (tt + 1 + i).clamp(max=T - 1)  # step i predicts x_{t+2+i}: the target's argmax at t+1+i
            nxt = (tt + 2 + i).clamp(max=T - 1)
            greedy.append(g[tb, lab])
            ok.append(sup[i].to(dev)[tb, tt])
            on_data.append(ids[tb, nxt] == g[tb, lab])
        return sums + replay_sums(torch.stack(preds, 1), torch.stack(greedy, 1), torch.stack(ok, 1),
                                  torch.stack(on_data, 1))

    def config_dict(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self.ecfg), "layer_ids": list(self.needed_layer_ids)}

    def summary(self, sums: MetricSums) -> dict[str, Any]:
        """``loss`` = Σ_i decay^i · loss_i over the steps that kept a position (a step with none adds
        0, as in the objective); ``acc`` per TTT step; ``sim_acc_len`` = Σ_k Π_{i<=k} acc_i (SpecForge's
        ``simulated_acc_len``, **no** bonus token); ``coverage`` = kept / supervised positions."""
        S = self.ecfg.ttt_steps
        per_step = [sums.ratio(f"loss_{i}") for i in range(S)]
        acc = [sums.ratio(f"acc_{i + 1}") for i in range(S)]
        sim, prod = 0.0, 1.0
        for a in acc:
            prod *= a
            sim += prod
        kept = sum(sums.den.get(f"loss_{i}", 0.0) for i in range(S))
        total = sum(sums.den.get(f"acc_{i + 1}", 0.0) for i in range(S))
        out = {"loss": sum(self.ecfg.loss_decay ** i * v for i, v in enumerate(per_step) if math.isfinite(v)),
               "loss_per_step": per_step, "acc": acc, "sim_acc_len": sim, "sim_acc_len_includes_bonus": False,
               "coverage": kept / total if total > 0 else math.nan}
        return {**out, **_replay_summary(sums)}

    def headline(self, summary: dict[str, Any]) -> str:
        return f"sim_acc_len {summary['sim_acc_len']:.2f} (no bonus)" + _replay_headline(summary)

    def journal_fields(self, sums: MetricSums) -> dict[str, Any]:
        """Step event sums: no blocks (τ is a DFlash figure); ``acc_*`` hold the per-TTT-step counts."""
        S = self.ecfg.ttt_steps
        return {"tau_sum": 0.0, "blocks": 0,
                "acc_correct": [int(sums.num.get(f"acc_{i + 1}", 0)) for i in range(S)],
                "acc_total": [int(sums.den.get(f"acc_{i + 1}", 0)) for i in range(S)]}


class _TrainingTokens:
    """The plan's training samples only (its held-out split left out), as ``count_plan_tokens`` reads them."""

    def __init__(self, plan, train_samples: int) -> None:
        cut = int(plan.offsets[train_samples])
        self.input_ids, self.loss_mask = plan.input_ids[:cut], plan.loss_mask[:cut]
        self.provenance = plan.provenance


def build_eagle3(cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None,
                 info=None) -> Eagle3Adapter:
    """The EAGLE-3 draft around the target's frozen embedding, final norm and lm_head.

    The vocab map (``d2t``/``t2d``) is ``vocab_map`` when given (a resumed or seeded draft keeps its
    own), else built from the loss-masked tokens of the plan's **training** samples (the held-out split,
    ``--eval-samples``, is left out) with ``--draft-vocab`` entries.

    Raises:
        ContractMismatch: the root lacks a layer (three aux layers and L-1), or the target changed.
        ConfigError: a given vocab map's size differs from ``--draft-vocab``, or bad sizes.
    """
    from transformers import AutoConfig

    from artcache.layer_ids import eagle3_capture_ids
    from artcache.target import load_embedding_and_lm_head, load_final_norm
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_map, count_plan_tokens

    info = info or _check_target(settings)
    need = eagle3_capture_ids(info.num_layers)
    if cfg.layer_ids:  # an explicit view: three auxiliary layers, then L-1 for the target logits
        need = [int(i) for i in cfg.layer_ids]
        _check_ids(need, info.num_layers)
        if len(need) != 4 or need[-1] != info.num_layers - 1:
            raise ConfigError(f"--layer-ids {need} for EAGLE-3: give three auxiliary output-of-layer ids then "
                              f"the last layer {info.num_layers - 1} (default {eagle3_capture_ids(info.num_layers)})")
    layer_view(settings.contract.layer_ids, need,
               draft="an EAGLE-3 draft (3 auxiliary layers, then the last layer L-1 for the target logits)",
               flag_hint="")
    ecfg = Eagle3Config.from_target(AutoConfig.from_pretrained(info.path), draft_vocab_size=cfg.draft_vocab,
                                    ttt_steps=cfg.ttt_steps)
    if ecfg.draft_vocab_size < cfg.draft_vocab:  # the default 32000 on a smaller-vocab target is not an error
        logging.getLogger("artcache.consumer").warning(
            "--draft-vocab %d exceeds the target vocabulary (%d tokens): the draft uses all %d (identity vocab map)",
            cfg.draft_vocab, ecfg.vocab_size, ecfg.vocab_size)
    if vocab_map:
        missing = {"d2t", "t2d"} - set(vocab_map)
        if missing:
            raise ConfigError(f"the EAGLE-3 vocab map given lacks {sorted(missing)}")
        d2t, t2d = vocab_map["d2t"], vocab_map["t2d"]
        if d2t.numel() != ecfg.draft_vocab_size:
            raise ConfigError(f"the draft's own vocab map has {d2t.numel()} entries, but --draft-vocab "
                              f"{cfg.draft_vocab} gives {ecfg.draft_vocab_size}: pass --draft-vocab {d2t.numel()}")
    else:
        train = len(plan) - cfg.eval_samples
        d2t, t2d = build_vocab_map(count_plan_tokens(_TrainingTokens(plan, train), info.vocab_size),
                                   ecfg.draft_vocab_size)
    embed, lm_head = load_embedding_and_lm_head(info)
    norm = load_final_norm(info)
    torch.manual_seed(cfg.seed)
    model = Eagle3Draft(ecfg, embed.to(device), norm.to(device), lm_head.to(device), d2t, t2d)
    draft = Eagle3Adapter(model, ecfg, need)
    draft.target_info, draft.target_lm_head = info, model.target_lm_head_weight
    return draft


def build_draft(cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None) -> Draft:
    """The draft ``cfg.draft`` names (``dflash`` or ``eagle3``).

    Args:
        vocab_map: EAGLE-3 only: ``{"d2t", "t2d"}`` to keep (a seeded or resumed draft keeps its
            own map); None computes it from the plan's loss-masked tokens.

    Raises:
        ConfigError: unknown draft. ContractMismatch: see the per-draft builders.
    """
    if cfg.draft == "dflash":
        if vocab_map:
            raise ConfigError("a DFlash draft has no vocab map; the checkpoint given carries one (an EAGLE-3 draft?)")
        return build_dflash(cfg, settings, plan, device)
    if cfg.draft == "eagle3":
        return build_eagle3(cfg, settings, plan, device, vocab_map=vocab_map)
    raise ConfigError(f"--draft {cfg.draft!r} is not supported; accepted: dflash, eagle3")
