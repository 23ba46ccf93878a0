"""DSpark behind the :class:`~artcache.trainers.draft.Draft` interface: build, train, evaluate, export.

The draft's view of the capture is :func:`~artcache.layer_ids.dspark_layer_ids`: the m context layers
(the DFlash formula by default) followed by output-of-layer ``L - 1`` (the target's last decoder layer,
stored **before** the final norm; :meth:`~artcache.trainers.dspark.model.DSparkDraft.target_hidden`
applies the norm once), from which the frozen lm_head gives the target distribution of every slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.layer_ids import LAST_LAYER_STATE, dspark_layer_ids, layer_view
from artcache.trainers.dflash.adapter import evenly_spaced
from artcache.trainers.dflash.anchors import eligible_anchors
from artcache.trainers.draft import (
    Draft,
    DraftBatch,
    ExportedDraft,
    MetricSums,
    PendingSums,
    check_target,
    replay_accepted,
    replay_sums,
)
from artcache.trainers.export import decode_draft_config
from artcache.trainers.packing import draw_anchors, packed_on, spread_anchor_rows, spread_row_step
from artcache.trainers.speed import SpeedOptions, to_device

from .config import DEFAULT_BLOCK_SIZE, DEFAULT_MARKOV_RANK, DSparkConfig
from .export import SERVING_NAMES, TARGET_TENSORS, export_layout, read_published
from .loss import BlockOutputs, block_weight_sum, cp_dspark_loss, dspark_loss
from .metrics import block_pending, block_sums, replay_walk, summarize

__all__ = ["CALIBRATION_KEY", "HELDOUT_PREFIX", "DSparkAdapter", "dspark_default_layers", "weights_check"]

#: Prefix of the held-out confidence records in a checkpoint's extra.safetensors (read by ``calibrate``).
HELDOUT_PREFIX = "heldout."
#: The per-slot confidence temperatures ``artcache calibrate`` adds to a checkpoint's extra.safetensors ([B]
#: float64; read by the export).
CALIBRATION_KEY = "calibration.temperatures"


def weights_check(weights: dict[str, Tensor]) -> Tensor:
    """[2] float64: Σ and Σ² of every trainable tensor (sorted keys): ties held-out records to the weights
    that produced them (equal up to float reduction order on another device)."""
    s = torch.zeros(2, dtype=torch.float64)
    for k in sorted(weights):
        t = weights[k].detach().double()
        s += torch.stack((t.sum(), t.pow(2).sum())).cpu()
    return s


class DSparkAdapter(Draft):
    """DSpark (arXiv:2607.05147) for the consumer.

    Args:
        model: a :class:`~artcache.trainers.dspark.DSparkDraft`. cfg: its config.
        needed_layer_ids: context ids then ``L - 1`` (output-of-layer).
        anchor_generator: CPU generator for anchors (checkpointed). eval_anchors: as DFlash.
        speed: the GPU speed options (:class:`~artcache.trainers.speed.SpeedOptions`), used as DFlash uses
            them: a sync-free training step (static rows, metric sums left on the device as
            :class:`~artcache.trainers.draft.PendingSums`), the ``chunked`` bf16 lm_head matmuls and the
            compiled forward. ``liger`` is refused (Liger's kernel has no L1 term).

    Held-out evaluation also records, per held-out block, the confidence logits, α, the supervised prefix,
    the greedy-replay outcome and the block's plan sample (``extra_tensors`` -> the checkpoint's
    extra.safetensors), which ``artcache calibrate`` fits its temperatures on.
    """

    name = "dspark"
    progress_metric = "tau"
    acc_label = "data-token top-1 acc (teacher-forced) slots "
    #: :func:`~.metrics.summarize`'s figures (replay with layer L-1 only; ``ece*`` from the confidence head)
    eval_figures = ("loss", "ce_loss", "l1_loss", "conf_loss", "tau", "conf_mae", "conf_bias", "cum_mae", "cum_bias",
                    "replay_tau", "replay_truncated_frac", "ece", "ece_cum")
    #: and per slot k = 0 … B-1, as ``name@k``
    eval_slot_figures = ("accept_rate", "ece", "ece_cum")
    #: ``num_anchors`` None: its default depends on the device (ConsumerConfig.resolved, default_anchors)
    options = {"block_size": DEFAULT_BLOCK_SIZE, "num_anchors": None, "draft_layers": None, "eval_anchors": 0,
               "markov_rank": DEFAULT_MARKOV_RANK, "markov_head": "vanilla"}
    run_options = ("block_size", "num_anchors")
    serving_names = SERVING_NAMES
    target_tensors = TARGET_TENSORS
    seed_fields = ("mask_token_id", "block_size", "hidden_size", "vocab_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "intermediate_size", "num_context_layers", "rope_theta",
                   "rms_norm_eps", "markov_rank", "markov_head_type", "enable_confidence_head",
                   "confidence_head_with_markov")

    def __init__(self, model, cfg: DSparkConfig, needed_layer_ids: Sequence[int], anchor_generator: torch.Generator,
                 eval_anchors: int = 0, speed: SpeedOptions | None = None) -> None:
        self.speed = speed or SpeedOptions()
        if self.speed.ce_impl == "liger":
            raise ConfigError("--loss-impl liger does not apply to DSpark: its objective also needs the target's "
                              "softmax (the L1 term), which Liger's fused cross-entropy does not compute; use "
                              "--loss-impl chunked")
        model.attn_impl = self.speed.attn
        self._forward_fn = self.speed.compiled(model)
        self.model = model
        self.cfg = cfg
        self.needed_layer_ids = tuple(int(i) for i in needed_layer_ids)
        self.generator = anchor_generator
        self.eval_anchors = int(eval_anchors)
        self._weights_seen = 0  # training steps so far (held-out records belong to one weight state)
        # plan sample -> (conf_logit, alpha, supervised, accepted, truncated) of its blocks
        self._heldout: dict[int, tuple[Tensor, ...]] = {}
        self._heldout_check: Tensor | None = None
        self._heldout_at = -1

    @classmethod
    def configure(cls, cfg, info, captured, plan) -> dict[str, Any]:
        """See :func:`_configure` (no weight loaded: what ``artcache run --dry-run`` compares with a seed)."""
        return _configure(cfg, info, captured, plan)

    @classmethod
    def build(cls, cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None,
              info=None) -> DSparkAdapter:
        """See :func:`_build`. Raises ConfigError for a vocab map (a DSpark draft has none)."""
        if vocab_map:
            raise ConfigError("a DSpark draft has no vocab map; the checkpoint given carries one (an EAGLE-3 draft?)")
        return _build(cls, cfg, settings, plan, device, info)

    @classmethod
    def weight_shapes(cls, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        from .export import _meta_model

        cfg = decode_draft_config(config, DSparkConfig, "DSpark draft config")
        return {k: tuple(v.shape) for k, v in _meta_model(cfg).trainable_state_dict().items()}

    @classmethod
    def export_layout(cls, config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> Any:
        return export_layout(config, tensors, where)

    @classmethod
    def read_published(cls, config: dict[str, Any], num_target_layers: int) -> dict[str, Any] | None:
        """:func:`artcache.trainers.dspark.export.read_published` (artcache's exports, DeepSpec's layout)."""
        return read_published(config, num_target_layers)

    @classmethod
    def export(cls, state, weights, target_cfg, fmt, dtype, verifier, num_speculative_tokens, what,
               target_info=None, target_tensors=True) -> ExportedDraft:
        """:func:`artcache.trainers.dspark.export.export_dspark` (calibration temperatures included when
        ``artcache calibrate`` added them; ``hf`` with ``target_tensors``: the target's embedding and lm_head,
        read from ``target_info``)."""
        from artcache.target import load_embedding_and_lm_head

        from .export import export_dspark

        frozen = None
        if fmt == "hf" and target_tensors and target_info is not None:
            frozen = load_embedding_and_lm_head(target_info)
        return export_dspark(state, weights, target_cfg, fmt, dtype, verifier, num_speculative_tokens, what,
                             target_tensors=frozen if fmt == "hf" and target_tensors else None,
                             need_target_tensors=fmt == "hf" and target_tensors)

    def generators(self) -> dict[str, torch.Generator]:
        return {"anchors": self.generator}

    @property
    def _loss_weights(self) -> tuple[float, float, float]:
        c = self.cfg
        return (c.ce_weight, c.l1_weight, c.confidence_weight)

    def _forward(self, batch: DraftBatch, anchors: Tensor, avalid: Tensor, *, train: bool = False,
                 denominator: Tensor | None = None) -> tuple[Tensor, Tensor, BlockOutputs]:
        m = self.cfg.num_context_layers
        dev = batch.hidden.device
        fast = train and self.speed.sync_free
        anchors, avalid = to_device(anchors, dev), to_device(avalid, dev)
        ctx, last = batch.hidden[:, :, :m], batch.hidden[:, :, m]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            # a consumer group's training forward runs through its DistributedDataParallel wrapper
            forward = self.train_module if train and self.train_module is not None else \
                self._forward_fn if fast else self.model
            docs, pos = packed_on(batch, dev)
            hidden = forward(ctx, batch.input_ids, anchors, avalid, context_valid=batch.valid, check_anchors=not fast,
                             doc_ids=docs, position_ids=pos)
            loss, out = dspark_loss(self.model, hidden, last, batch.input_ids, batch.loss_mask, anchors, avalid,
                                    context_valid=batch.valid, mode=self._loss_mode() if train else "fused",
                                    static_rows=fast, compile=fast and self.speed.compile != "off",
                                    denominator=denominator, doc_ids=docs)
        return hidden, loss, out

    def _loss_mode(self) -> str:
        return "fused" if self.speed.ce_impl == "reference" else self.speed.ce_impl

    #: its fused loss forms the gradient in the lm_head's dtype, scaled by 1 / Σ w: a global batch's parts are
    #: normalised by the whole batch's Σ w before their forward (:meth:`loss_denominators`)
    global_denominators = True

    def loss_denominators(self, batch: DraftBatch) -> Tensor:
        """``Σ w`` of the batch's blocks ([1] float64, no forward): the anchors :meth:`loss` draws next (drawn from a
        copy of the generator's state, which is left as it was), their layout (a packed batch's blocks cut at their
        document's end, as the loss cuts them). Under context parallelism (:attr:`cp_group`) the blocks anchored in
        this rank's shard only (:func:`~artcache.trainers.dflash.cp.local_anchors`): summed over the consumer's
        ranks, each block counts once."""
        state = self.generator.get_state()
        anchors, avalid = draw_anchors(batch, self.cfg.num_anchors, self.generator)
        self.generator.set_state(state)
        dev = batch.hidden.device
        docs, _ = packed_on(batch, dev)
        anchors, avalid = to_device(anchors, dev), to_device(avalid, dev)
        if self.cp_group is not None:  # this rank's blocks only: the group's ranks' sums add up to the batch's
            from artcache.trainers.dflash.cp import local_anchors, shard_bounds

            start, end, _ = shard_bounds(batch.input_ids.shape[1], torch.distributed.get_world_size(self.cp_group),
                                         torch.distributed.get_rank(self.cp_group))
            anchors, avalid = local_anchors(anchors, avalid, start, end)
        return block_weight_sum(batch.input_ids, batch.loss_mask, anchors, avalid, self.cfg.block_size,
                                float(self.cfg.gamma), batch.valid, doc_ids=docs)

    def loss(self, batch: DraftBatch, denominators: Tensor | None = None) -> tuple[Tensor, MetricSums | PendingSums]:
        # anchors are drawn on the CPU generator whatever the device (the same draws on every device),
        # from the host copy of the batch's masks (no device read-back)
        anchors, avalid = draw_anchors(batch, self.cfg.num_anchors, self.generator)
        self.speed.step_begin()
        if self.cp_group is not None:
            out = self._cp_loss(batch, anchors, avalid, denominators)
            self._weights_seen += 1
            return out
        if self.speed.sync_free:  # every slot is computed: a packed row's many anchors over rows of N slots
            batch, anchors, avalid = spread_anchor_rows(batch, anchors, avalid, self.cfg.num_anchors,
                                                        spread_row_step(anchors.shape[0]))
        _, loss, out = self._forward(batch, anchors, avalid, train=True,
                                     denominator=None if denominators is None else denominators[0])
        self._weights_seen += 1
        if self.speed.sync_free:
            return loss, block_pending(out, self._loss_weights)
        return loss, block_sums(out, self._loss_weights)

    def _cp_loss(self, batch: DraftBatch, anchors: Tensor, avalid: Tensor, denominators: Tensor | None
                 ) -> tuple[Tensor, MetricSums | PendingSums]:
        """Context parallelism (:attr:`cp_group`): this rank's part of the training loss
        (:func:`~.loss.cp_dspark_loss`: the backbone over this rank's context shard with the group's keys/values, the
        heads on the blocks anchored in the shard) and those blocks' metric sums. Every rank of the group draws the
        same anchors. ``denominators`` (the consumer's: ``Σ w`` of the global batch over its ``world`` ranks, each
        rank's :meth:`loss_denominators` counting its own blocks) scale this rank's weighted sums, so the ranks'
        gradients summed are ``world`` × the one-rank gradient, and ``Session._accumulate``'s average over the
        ranks gives it; without them the CP group's own ``Σ w``. The batch arrives whole; this rank keeps
        positions ``[start, end)`` of its context (:func:`~artcache.trainers.dflash.cp.context_shard`), zeros past
        the end, and the whole last layer (the target's states at its blocks' slots).

        Raises:
            ConfigError: a packed batch (the split context has no per-document attention).
        """
        from artcache.trainers.dflash.cp import check_unpacked, context_shard

        check_unpacked(batch.doc_ids)
        m, dev = self.cfg.num_context_layers, batch.hidden.device
        shard = context_shard(batch.hidden[:, :, :m], self.cp_group)
        anchors, avalid = to_device(anchors, dev), to_device(avalid, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, _, out = cp_dspark_loss(self.model, shard, batch.hidden[:, :, m], batch.input_ids, batch.loss_mask,
                                          anchors, avalid, context_valid=batch.valid, group=self.cp_group,
                                          denominator=None if denominators is None else denominators[0],
                                          mode=self._loss_mode())
        if self.speed.sync_free:
            return loss, block_pending(out, self._loss_weights)
        return loss, block_sums(out, self._loss_weights)

    @torch.no_grad()
    def evaluate(self, batch: DraftBatch, target_argmax: Tensor | None) -> MetricSums:
        """Held-out metrics over every eligible anchor (or ``eval_anchors`` evenly spaced ones per sample):
        the loss terms, α per slot, τ, calibration, and with ``target_argmax`` ([b, T] long) a greedy
        acceptance replay (``replay_tau``, +1 bonus included; see :func:`~.metrics.replay`).

        Each row's blocks are recorded for ``artcache calibrate`` under the row's plan sample index
        (``batch.samples``; the run position when the batch carries none and it is not -1; a row with neither
        identity is not recorded), so every held-out sample keeps its own records."""
        if self._heldout_at != self._weights_seen:  # a new weight state: records of the old one are void
            self._heldout = {}
            self._heldout_check = weights_check(self.model.trainable_state_dict())
            self._heldout_at = self._weights_seen
        elig = eligible_anchors((batch.loss_mask & batch.valid).cpu())
        sums = MetricSums()
        n = max(self.cfg.num_anchors, 256)
        for row in range(elig.shape[0]):
            one = DraftBatch(batch.hidden[row:row + 1], batch.input_ids[row:row + 1], batch.loss_mask[row:row + 1],
                             batch.valid[row:row + 1])
            pos = evenly_spaced(elig[row].nonzero().squeeze(1), self.eval_anchors)
            recs = []
            for s in range(0, pos.numel(), n):
                anchors = pos[s:s + n][None]
                hidden, _, out = self._forward(one, anchors, torch.ones_like(anchors, dtype=torch.bool))
                sums = sums + block_sums(out, self._loss_weights)
                N = anchors.shape[1]
                accepted = torch.full((N,), -1, dtype=torch.long)  # -1: no replay (no target argmax)
                truncated = torch.zeros(N, dtype=torch.bool)
                if target_argmax is not None:
                    walk = replay_walk(self.model, hidden.float(), one.input_ids, one.loss_mask & one.valid, anchors,
                                       target_argmax[row:row + 1])
                    sums = sums + replay_sums(*walk)
                    accepted, truncated = (x.cpu() for x in replay_accepted(*walk))
                if out.conf_logit is not None:
                    recs.append((out.conf_logit[0].cpu(), out.alpha[0].cpu(), out.supervised[0].cpu(), accepted,
                                 truncated))
            key = _sample_of(batch, row)
            if recs and key is not None:
                self._heldout[key] = tuple(torch.cat(x) for x in zip(*recs, strict=True))
        return sums

    def extra_tensors(self) -> dict[str, Tensor]:
        """The latest held-out confidence records, one row per held-out block, samples in plan order:
        ``heldout.conf_logit`` / ``alpha`` [n, B] float32, ``heldout.supervised`` [n, B] bool,
        ``heldout.accepted`` [n] int64 (greedy-replay proposals accepted, **no** bonus; -1 where no replay ran),
        ``heldout.truncated`` [n] bool (the replay walk was cut by the target's greedy path leaving the data),
        ``heldout.sample`` [n] int64 (the block's plan sample index), ``heldout.weights_check`` [2] float64
        (see :func:`weights_check`); empty before any."""
        if not self._heldout or self._heldout_check is None:
            return {}
        order = sorted(self._heldout)
        conf, alpha, sup, accepted, truncated = (torch.cat([self._heldout[p][i] for p in order]) for i in range(5))
        sample = torch.cat([torch.full((self._heldout[p][0].shape[0],), p, dtype=torch.long) for p in order])
        return {f"{HELDOUT_PREFIX}conf_logit": conf.float().contiguous(),
                f"{HELDOUT_PREFIX}alpha": alpha.float().contiguous(),
                f"{HELDOUT_PREFIX}supervised": sup.bool().contiguous(),
                f"{HELDOUT_PREFIX}accepted": accepted.long().contiguous(),
                f"{HELDOUT_PREFIX}truncated": truncated.bool().contiguous(), f"{HELDOUT_PREFIX}sample": sample,
                f"{HELDOUT_PREFIX}weights_check": self._heldout_check.clone()}

    def config_dict(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self.cfg), "layer_ids": list(self.needed_layer_ids),
                "target_state": LAST_LAYER_STATE}

    def summary(self, sums: MetricSums) -> dict[str, Any]:
        """See :func:`~.metrics.summarize` (τ and ``replay_tau`` include the +1 bonus token)."""
        return summarize(sums, self.cfg.block_size)

    def headline(self, summary: dict[str, Any]) -> str:
        """Each figure says what it counts: ``tau`` is the expected acceptance length under speculative sampling
        from the teacher-forced α (``1 + Σ_k Π α``; α compares the draft's and the target's distributions), the
        greedy replay counts proposals equal to the target's argmax, both incl. the +1 bonus; the confidence's
        cumulative ECE is against α. The ``acc`` list beside it (:attr:`acc_label`) is the teacher-forced top-1
        accuracy against the data tokens, which can be 0 while α is high (e.g. a near-uniform target)."""
        tau = f"{summary['tau']:.2f}" if "tau" in summary else "-"
        out = f"tau(alpha) {tau} (expected length under speculative sampling, teacher-forced, incl. +1 bonus)"
        if "replay_tau" in summary:
            out += f" greedy-replay tau {summary['replay_tau']:.2f} (vs target argmax, incl. +1 bonus)"
        if "ece_cum" in summary:
            out += f" conf cum-ECE vs alpha {summary['ece_cum']:.3f}"
        return out

    def journal_fields(self, sums: MetricSums) -> dict[str, Any]:
        """Step event sums: ``tau_sum`` = Σ τ (expected acceptance length incl. +1 bonus) over ``blocks``;
        ``acc_*`` the teacher-forced top-1 counts of slots 0 … B-1."""
        B = self.cfg.block_size
        return {"tau_sum": sums.num.get("tau", 0.0), "blocks": int(sums.den.get("tau", 0)),
                "acc_correct": [int(sums.num.get(f"acc_{k}", 0)) for k in range(B)],
                "acc_total": [int(sums.den.get(f"acc_{k}", 0)) for k in range(B)]}


def _sample_of(batch: DraftBatch, row: int) -> int | None:
    """The identity row ``row``'s held-out records are kept under: its plan sample index, else its run position
    when it has one (not -1), else None."""
    if row < len(batch.samples):
        return int(batch.samples[row])
    if row < len(batch.positions) and int(batch.positions[row]) >= 0:
        return int(batch.positions[row])
    return None


def dspark_default_layers(num_target_layers: int, captured: Sequence[int], cap: int = 5) -> int:
    """Draft layers n when ``--draft-layers`` is not given: the largest n <= ``cap`` (DSpark's 5) whose
    :func:`dspark_layer_ids` are all captured; ``cap`` when none is (its missing ids are then named)."""
    have = set(captured)
    for n in range(min(cap, num_target_layers - 3), 0, -1):
        if set(dspark_layer_ids(num_target_layers, n)) <= have:
            return n
    return min(cap, num_target_layers - 3)


def _configure(cfg, info, captured, plan) -> dict[str, Any]:
    """The DSpark config and view a run builds, without loading a weight (:meth:`DSparkAdapter.config_dict`'s
    fields).

    View: ``cfg.layer_ids`` when given (context ids, then ``L - 1``), else
    ``dspark_layer_ids(L, n)`` with n = ``cfg.draft_layers`` or :func:`dspark_default_layers`.
    MASK: chosen and validated as for DFlash (:func:`artcache.plan.choose_mask_token`).

    Raises:
        ContractMismatch: the root lacks a layer of the view.
        ConfigError: a bad view, no valid MASK token, or bad sizes.
    """
    from transformers import AutoConfig

    from artcache.layer_ids import check_layer_ids
    from artcache.plan import choose_mask_token
    from artcache.target import load_tokenizer

    L = info.num_layers
    captured = list(captured)
    if cfg.layer_ids:
        need = check_layer_ids([int(i) for i in cfg.layer_ids], L, f"--layer-ids {','.join(map(str, cfg.layer_ids))}")
        if len(need) < 2 or need[-1] != L - 1 or (L - 1) in need[:-1]:
            # the default named in the message is a valid view of this target (a small target has L - 3 < 5)
            n_default = cfg.draft_layers if cfg.draft_layers and 1 <= cfg.draft_layers <= L - 3 else \
                dspark_default_layers(L, captured)
            raise ConfigError(f"--layer-ids {','.join(map(str, need))} for DSpark: give the context ids then the "
                              f"last layer {L - 1} once (default for {n_default} draft layers: "
                              f"{','.join(map(str, dspark_layer_ids(L, n_default)))})")
        n = cfg.draft_layers or len(need) - 1
        hint = " (--layer-ids)"
    else:
        n = cfg.draft_layers or dspark_default_layers(L, captured)
        need = dspark_layer_ids(L, n, "--draft-layers")
        hint = f" (--draft-layers {n}: the DFlash formula plus the last layer {L - 1})"
    layer_view(captured, need, draft=f"a {n}-layer DSpark draft", flag_hint=hint)
    mask_id = choose_mask_token(load_tokenizer(info), info.vocab_size, plan)
    dcfg = DSparkConfig.from_target(AutoConfig.from_pretrained(info.path), num_layers=n, block_size=cfg.block_size,
                                    num_anchors=cfg.num_anchors, mask_token_id=mask_id,
                                    num_context_layers=len(need) - 1, markov_rank=cfg.markov_rank,
                                    markov_head_type=cfg.markov_head)
    return {**msgspec.to_builtins(dcfg), "layer_ids": list(need), "target_state": LAST_LAYER_STATE}


def _build(cls, cfg, settings, plan, device: torch.device, info=None) -> DSparkAdapter:
    """The DSpark draft around the target's frozen embedding, final norm and lm_head (config and view:
    :func:`_configure`).

    Raises:
        ContractMismatch: the root lacks a layer of the view, or the target's weights changed.
        ConfigError: a bad view, no valid MASK token, or bad sizes.
    """
    from artcache.target import load_embedding_and_lm_head, load_final_norm

    info = info or check_target(settings)
    planned = _configure(cfg, info, settings.contract.layer_ids, plan)
    need = planned.pop("layer_ids")
    planned.pop("target_state")
    dcfg = msgspec.convert(planned, DSparkConfig)
    embed, lm_head = load_embedding_and_lm_head(info)
    norm = load_final_norm(info)
    from .model import DSparkDraft

    torch.manual_seed(cfg.seed)
    model = DSparkDraft(dcfg, embed.to(device), lm_head.to(device), norm.to(device))
    draft = cls(model, dcfg, need, torch.Generator().manual_seed(cfg.seed), eval_anchors=cfg.eval_anchors or 0,
                speed=SpeedOptions.for_device(cfg, device))
    draft.target_info, draft.target_lm_head = info, model.lm_head_weight
    return draft
