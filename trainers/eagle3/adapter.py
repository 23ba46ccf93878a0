"""EAGLE-3 behind the :class:`~artcache.trainers.draft.Draft` interface: build (with its vocab map),
train, evaluate (greedy replay against the target's argmax), export."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.layer_ids import check_layer_ids, eagle3_capture_ids, layer_view
from artcache.target import load_embedding_and_lm_head, load_final_norm
from artcache.trainers.draft import (
    Draft,
    DraftBatch,
    MetricSums,
    PendingSums,
    check_target,
    present,
    replay_headline,
    replay_summary,
    replay_sums,
)
from artcache.trainers.export import decode_draft_config
from artcache.trainers.packing import packed_on
from artcache.trainers.speed import SpeedOptions

from .config import Eagle3Config
from .export import SERVING_NAMES, TARGET_TENSORS, export_checkpoint_files, export_layout, read_published
from .loss import eagle3_loss, simulated_acc_len, supervision_masks
from .model import Eagle3Draft
from .vocab import build_vocab_map, count_plan_tokens, vocab_coverage

__all__ = ["Eagle3Adapter", "TrainingTokens"]

log = logging.getLogger("artcache.consumer")


class Eagle3Adapter(Draft):
    """EAGLE-3 (arXiv:2503.01840) behind the :class:`Draft` interface.

    The draft's view is :func:`~artcache.layer_ids.eagle3_capture_ids` ``(L)``: three auxiliary layers
    then output-of-layer ``L - 1`` (un-normed), from which the frozen target head gives the soft labels.

    Args:
        model: a :class:`~artcache.trainers.eagle3.Eagle3Draft`. ecfg: its config. needed_layer_ids: the view.
    """

    name = "eagle3"
    progress_metric = "sim_acc_len"
    #: :meth:`summary`'s figures (``sim_acc_len`` without the bonus, ``replay_tau`` with it; always a replay)
    eval_figures = ("loss", "sim_acc_len", "coverage", "replay_tau", "replay_truncated_frac")
    options = {"ttt_steps": 7, "draft_vocab": 32000, "min_vocab_coverage": 0.5, "keep_vocab_map": False}
    serving_names = SERVING_NAMES
    target_tensors = TARGET_TENSORS
    seed_fields = ("hidden_size", "vocab_size", "draft_vocab_size", "num_heads", "num_kv_heads", "head_dim",
                   "intermediate_size", "rope_theta", "rms_norm_eps")

    def __init__(self, model, ecfg, needed_layer_ids: Sequence[int], speed: SpeedOptions | None = None) -> None:
        self.model = model
        self.ecfg = ecfg
        self.needed_layer_ids = tuple(int(i) for i in needed_layer_ids)
        self.speed = speed or SpeedOptions()
        if self.speed.attn != "sdpa":
            raise ConfigError(f"attention {self.speed.attn!r} is DFlash and DSpark's block attention; EAGLE-3 runs "
                              "sdpa only")
        self._forward_fn = self.speed.compiled(self.model)

    @classmethod
    def configure(cls, cfg, info, captured, plan) -> dict[str, Any]:
        """The EAGLE-3 config and view a run builds (three auxiliary layers then ``L - 1``, each captured).

        Raises:
            ContractMismatch: the root lacks a layer. ConfigError: a bad ``--layer-ids`` or sizes.
        """
        from transformers import AutoConfig

        need = eagle3_capture_ids(info.num_layers)
        if cfg.layer_ids:  # an explicit view: three auxiliary layers, then L-1 for the target logits
            need = check_layer_ids(cfg.layer_ids, info.num_layers, f"--layer-ids {list(cfg.layer_ids)}")
            if len(need) != 4 or need[-1] != info.num_layers - 1:
                raise ConfigError(f"--layer-ids {need} for EAGLE-3: give three auxiliary output-of-layer ids then "
                                  f"the last layer {info.num_layers - 1} "
                                  f"(default {eagle3_capture_ids(info.num_layers)})")
        layer_view(list(captured), need,
                   draft="an EAGLE-3 draft (3 auxiliary layers, then the last layer L-1 for the target logits)",
                   flag_hint="")
        ecfg = Eagle3Config.from_target(AutoConfig.from_pretrained(info.path), draft_vocab_size=cfg.draft_vocab,
                                        ttt_steps=cfg.ttt_steps)
        return {**msgspec.to_builtins(ecfg), "layer_ids": list(need)}

    @classmethod
    def build(cls, cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None,
              info=None) -> Eagle3Adapter:
        """The EAGLE-3 draft around the target's frozen embedding, final norm and lm_head (config:
        :meth:`configure`).

        The vocab map (``d2t``/``t2d``) is ``vocab_map`` when given (a resumed or seeded draft keeps its
        own), else built from the loss-masked tokens of the plan's **training** samples (the held-out
        split, ``--eval-samples``, is left out) with ``--draft-vocab`` entries.

        Raises:
            ContractMismatch: the root lacks a layer (three aux layers and L-1), or the target changed.
            ConfigError: a given vocab map's size differs from ``--draft-vocab``, or bad sizes.
        """
        info = info or check_target(settings)
        planned = cls.configure(cfg, info, settings.contract.layer_ids, plan)
        need = planned.pop("layer_ids")
        ecfg = msgspec.convert(planned, Eagle3Config)
        if ecfg.draft_vocab_size < cfg.draft_vocab:  # the default 32000 on a smaller-vocab target is not an error
            log.warning("--draft-vocab %d exceeds the target vocabulary (%d tokens): the draft uses all %d "
                        "(identity vocab map)", cfg.draft_vocab, ecfg.vocab_size, ecfg.vocab_size)
        d2t, t2d = _vocab_map(cfg, plan, info, ecfg, vocab_map)
        embed, lm_head = load_embedding_and_lm_head(info)
        norm = load_final_norm(info)
        torch.manual_seed(cfg.seed)
        model = Eagle3Draft(ecfg, embed.to(device), norm.to(device), lm_head.to(device), d2t, t2d)
        draft = cls(model, ecfg, need, speed=SpeedOptions.for_device(cfg, device))
        draft.target_info, draft.target_lm_head = info, model.target_lm_head_weight
        return draft

    @classmethod
    def weight_shapes(cls, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        ecfg = decode_draft_config(config, Eagle3Config, "EAGLE-3 draft config")
        V, Vd, H = ecfg.vocab_size, ecfg.draft_vocab_size, ecfg.hidden_size
        with torch.device("meta"):
            model = Eagle3Draft(ecfg, torch.empty(V, H), torch.empty(H), torch.empty(V, H),
                                torch.empty(Vd, dtype=torch.long), torch.empty(V, dtype=torch.bool))
        return {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()}

    @classmethod
    def export_layout(cls, config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> Any:
        return export_layout(config, tensors, where)

    @classmethod
    def read_published(cls, config: dict[str, Any], num_target_layers: int) -> dict[str, Any] | None:
        return read_published(config, num_target_layers)

    @classmethod
    def vocab_coverage(cls, vocab_map: dict[str, Tensor], counts: Tensor) -> float | None:
        """Share of the supervised training tokens (``counts`` int64 [V]) inside the map's draft
        vocabulary (``t2d`` bool [V]): the positions whose label the draft head can predict."""
        return vocab_coverage(vocab_map["t2d"], counts)

    @classmethod
    def export(cls, state, weights, target_cfg, fmt, dtype, verifier, num_speculative_tokens, what, target_info=None,
               target_tensors=True):
        """``hf``: the draft's own trained ``lm_head`` [V_d, H], no embedding (vLLM's ``LlamaForCausalLMEagle3``
        shares the target's; ``target_tensors`` is ignored). ``speculators``: the target's embedding is always
        written (speculators' loader reads it from the checkpoint)."""
        embed = None
        if fmt == "speculators" and target_info is not None:
            embed = load_embedding_and_lm_head(target_info)[0]
        return export_checkpoint_files(state, weights, target_cfg, fmt, dtype, verifier, num_speculative_tokens,
                                       what, target_embed=embed)

    def _split(self, batch: DraftBatch) -> tuple[Tensor, Tensor]:
        return batch.hidden[:, :, :3], batch.hidden[:, :, 3]

    #: one denominator per TTT step (its kept positions): counted over a global batch before its parts' forward
    global_denominators = True

    def loss_terms(self) -> tuple[tuple[str, float], ...]:
        """Step i's soft cross-entropy over its own kept positions, weighted ``loss_decay ** i``."""
        return tuple((f"loss_{i}", self.model.cfg.loss_decay ** i) for i in range(self.model.cfg.ttt_steps))

    def loss_denominators(self, batch: DraftBatch) -> Tensor | None:
        """Under context parallelism (:attr:`cp_group`): each TTT step's kept positions among this rank's positions
        ([steps] float64, :func:`~.cp.cp_kept_counts`: the target's labels over its window, no forward); summed over
        the consumer's ranks, each position counts once. Otherwise None (counted by a forward without gradients)."""
        if self.cp_group is None:
            return None
        from .cp import cp_kept_counts

        _, last = self._split(batch)
        return cp_kept_counts(self.model, last, batch.input_ids, batch.loss_mask, batch.valid, group=self.cp_group)

    def loss(self, batch: DraftBatch, denominators: Tensor | None = None) -> tuple[Tensor, MetricSums | PendingSums]:
        if self.cp_group is not None:
            return self._cp_loss(batch, denominators)
        aux, last = self._split(batch)
        dev = batch.hidden.device
        fast = self.speed.sync_free
        self.speed.step_begin()
        forward = self.train_module or (self._forward_fn if fast else None)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            docs, pos = packed_on(batch, dev)
            loss, stats = eagle3_loss(self.model, aux, last, batch.input_ids, batch.loss_mask, batch.valid,
                                      sync_free=fast, forward=forward, denominators=denominators, doc_ids=docs,
                                      position_ids=pos)
        return loss, (self._pending(stats) if fast else self._sums(stats))

    def _cp_loss(self, batch: DraftBatch, denominators: Tensor | None) -> tuple[Tensor, MetricSums]:
        """Context parallelism (:attr:`cp_group`): this rank's part of the training loss (:func:`~.cp.cp_eagle3_loss`:
        the TTT unroll over this rank's positions with the group's step-0 keys/values, the labels over its window of
        the whole last layer) and its positions' metric sums. ``denominators`` (the consumer's: each step's kept
        positions of the global batch over its ``world`` ranks, each rank's :meth:`loss_denominators` counting its
        own) divide this rank's per-step sums, so the ranks' gradients summed are ``world`` × the one-rank gradient
        and ``Session._accumulate``'s average over the ranks gives it; without them the CP group's own counts. The
        batch arrives whole; this rank keeps positions ``[start, end)`` of its auxiliary layers
        (:func:`~artcache.trainers.dflash.cp.context_shard`). The loss runs the kept-rows path (host reads), also
        on CUDA.

        Raises:
            ConfigError: a packed batch (the split sequence has no per-document attention).
        """
        from artcache.trainers.dflash.cp import check_unpacked, context_shard

        from .cp import cp_eagle3_loss

        check_unpacked(batch.doc_ids)
        aux, last = self._split(batch)
        dev = batch.hidden.device
        self.speed.step_begin()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            share, _, stats = cp_eagle3_loss(self.model, context_shard(aux, self.cp_group), last, batch.input_ids,
                                             batch.loss_mask, batch.valid, denominators=denominators,
                                             group=self.cp_group)
        return share, self._sums(stats)

    @staticmethod
    def _pending(stats) -> PendingSums:
        """:meth:`_sums` with the values left on the device."""
        parts = []
        for i in range(stats.total.numel()):
            parts += [(f"loss_{i}", stats.loss_sum[i], stats.kept[i]), (f"acc_{i + 1}", stats.correct[i],
                                                                        stats.total[i])]
        return PendingSums.build(parts)

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
        proposals of steps 0 … S-1 are walked as in :func:`~artcache.trainers.draft.replay_sums`
        (``replay_tau`` includes the +1 bonus token). The target's argmax comes from the captured
        ``L - 1`` layer when not given."""
        aux, last = self._split(batch)
        model = self.model
        _, stats = eagle3_loss(model, aux, last, batch.input_ids, batch.loss_mask, batch.valid)
        sums = self._sums(stats)
        b, T = batch.input_ids.shape
        if target_argmax is None:
            flat = last.reshape(b * T, -1)
            target_argmax = torch.cat([model.target_logits(flat[s:s + 256]).argmax(dim=-1)
                                       for s in range(0, flat.shape[0], 256)]).reshape(b, T)
        walk = replay_inputs(model, aux, batch.input_ids, batch.loss_mask, batch.valid, target_argmax,
                             self.ecfg.ttt_steps)
        return sums if walk is None else sums + replay_sums(*walk[1:])

    def config_dict(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self.ecfg), "layer_ids": list(self.needed_layer_ids)}

    def summary(self, sums: MetricSums) -> dict[str, Any]:
        """``loss`` = Σ_i decay^i · loss_i over the steps that kept a position (a step with none adds
        0, as in the objective); ``acc`` per TTT step; ``sim_acc_len`` = Σ_k Π_{i<=k} acc_i (SpecForge's
        ``simulated_acc_len``, **no** bonus token); ``coverage`` = kept / supervised positions."""
        S = self.ecfg.ttt_steps
        per_step = [sums.ratio(f"loss_{i}") for i in range(S)]
        acc = [sums.ratio(f"acc_{i + 1}") for i in range(S)]
        kept = sum(sums.den.get(f"loss_{i}", 0.0) for i in range(S))
        total = sum(sums.den.get(f"acc_{i + 1}", 0.0) for i in range(S))
        measured = [v for v in per_step if v is not None]
        out = present({
            # a step that kept no position adds nothing (as in the objective); none kept: no loss at all
            "loss": sum(self.ecfg.loss_decay ** i * v for i, v in enumerate(per_step) if v is not None)
            if measured else None,
            "loss_per_step": per_step, "acc": acc,
            "sim_acc_len": simulated_acc_len([a or 0.0 for a in acc]) if total > 0 else None,
            "sim_acc_len_includes_bonus": False, "coverage": kept / total if total > 0 else None})
        return {**out, **replay_summary(sums)}

    def headline(self, summary: dict[str, Any]) -> str:
        sim = f"{summary['sim_acc_len']:.2f}" if "sim_acc_len" in summary else "-"
        return f"sim_acc_len {sim} (no bonus)" + replay_headline(summary)

    def journal_fields(self, sums: MetricSums) -> dict[str, Any]:
        """Step event sums: no blocks (τ is a DFlash figure); ``acc_*`` hold the per-TTT-step counts."""
        S = self.ecfg.ttt_steps
        return {"tau_sum": 0.0, "blocks": 0,
                "acc_correct": [int(sums.num.get(f"acc_{i + 1}", 0)) for i in range(S)],
                "acc_total": [int(sums.den.get(f"acc_{i + 1}", 0)) for i in range(S)]}


class TrainingTokens:
    """The plan's training samples only (its held-out split left out), as ``count_plan_tokens`` reads them."""

    def __init__(self, plan, train_samples: int) -> None:
        cut = int(plan.offsets[train_samples])
        self.input_ids, self.loss_mask = plan.input_ids[:cut], plan.loss_mask[:cut]
        self.provenance = plan.provenance


def _vocab_map(cfg, plan, info, ecfg: Eagle3Config, given: dict[str, Tensor] | None) -> tuple[Tensor, Tensor]:
    """(d2t, t2d): the given map checked against ``--draft-vocab``, or one built from the training tokens."""
    if not given:
        train = len(plan) - cfg.eval_samples
        return build_vocab_map(count_plan_tokens(TrainingTokens(plan, train), info.vocab_size), ecfg.draft_vocab_size)
    missing = {"d2t", "t2d"} - set(given)
    if missing:
        raise ConfigError(f"the EAGLE-3 vocab map given lacks {sorted(missing)}")
    d2t, t2d = given["d2t"], given["t2d"]
    if d2t.numel() != ecfg.draft_vocab_size:
        raise ConfigError(f"the draft's own vocab map has {d2t.numel()} entries, but --draft-vocab "
                          f"{cfg.draft_vocab} gives {ecfg.draft_vocab_size}: pass --draft-vocab {d2t.numel()}")
    return d2t, t2d


@torch.no_grad()
def replay_inputs(model: Eagle3Draft, aux: Tensor, input_ids: Tensor, loss_mask: Tensor, valid: Tensor,
                  target_argmax: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """What :meth:`Eagle3Adapter.evaluate`'s greedy replay walks: ``(rows, preds, greedy, ok, on_data)``.

    ``rows`` [N] are the flattened ``b·T`` positions t whose step-0 prediction is supervised; the other four
    are [N, steps] (column i = TTT step i, which predicts ``x_{t+2+i}`` against the target's argmax at
    ``t+1+i``), as :func:`artcache.trainers.draft.replay_sums` takes them. None when no position is
    supervised. aux: [b, T, 3, H]; input_ids, loss_mask, valid, target_argmax: [b, T].
    """
    b, T = input_ids.shape
    hiddens = model(aux, input_ids, valid, steps=steps)
    dev = hiddens[0].device
    used = model.used_ids().to(dev)
    sup = supervision_masks(loss_mask, valid, steps)
    ids, g = input_ids.to(dev), target_argmax.to(dev)
    rows = sup[0].to(dev).reshape(-1).nonzero().squeeze(1)  # positions t (flattened b·T) with step 0 supervised
    if rows.numel() == 0:
        return None
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
    return rows, torch.stack(preds, 1), torch.stack(greedy, 1), torch.stack(ok, 1), torch.stack(on_data, 1)
