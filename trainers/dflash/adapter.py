"""DFlash behind the :class:`~artcache.trainers.draft.Draft` interface: build, train, evaluate (greedy
replay against the target's argmax), export."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.layer_ids import check_layer_ids, dflash_layer_ids, layer_view
from artcache.plan import choose_mask_token
from artcache.target import load_embedding_and_lm_head, load_tokenizer
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
from artcache.trainers.packing import draw_anchors, packed_on, spread_anchor_rows, spread_row_step
from artcache.trainers.speed import SpeedOptions, to_device

from .anchors import eligible_anchors
from .config import DFlashConfig
from .export import SERVING_NAMES, TARGET_TENSORS, export_checkpoint_files, export_layout, read_published
from .loss import dflash_loss
from .model import DFlashDraft

__all__ = ["DFlashAdapter", "dflash_default_layers", "evenly_spaced", "greedy_replay"]


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
        needed_layer_ids: the ``dflash_layer_ids(L, n)`` it reads (or the explicit ``--layer-ids`` view).
        anchor_generator: the CPU generator anchors are drawn from (checkpointed with the run).
        eval_anchors: evaluate at most this many evenly spaced anchors per sample (0: every one).
    """

    name = "dflash"
    #: :meth:`summary`'s figures (``tau`` and ``replay_tau`` include the +1 bonus; replay with layer L-1 only)
    eval_figures = ("loss", "tau", "replay_tau", "replay_truncated_frac")
    options = {"block_size": 16, "num_anchors": 64, "draft_layers": None, "eval_anchors": 0}
    run_options = ("block_size", "num_anchors")
    serving_names = SERVING_NAMES
    target_tensors = TARGET_TENSORS
    seed_fields = ("mask_token_id", "block_size", "hidden_size", "vocab_size", "num_layers", "num_heads",
                   "num_kv_heads", "head_dim", "intermediate_size", "num_context_layers", "rope_theta",
                   "rms_norm_eps")

    def __init__(self, model, dcfg, needed_layer_ids: Sequence[int], anchor_generator: torch.Generator,
                 eval_anchors: int = 0, speed: SpeedOptions | None = None) -> None:
        self.model = model
        self.dcfg = dcfg
        self.needed_layer_ids = tuple(int(i) for i in needed_layer_ids)
        self.generator = anchor_generator
        self.eval_anchors = int(eval_anchors)
        self.speed = speed or SpeedOptions()
        self.model.attn_impl = self.speed.attn
        self._forward_fn = self.speed.compiled(self.model)

    @classmethod
    def configure(cls, cfg, info, captured, plan) -> dict[str, Any]:
        """The DFlash config and view a run builds: the layers (formula or ``--layer-ids``, each captured),
        the MASK token (:func:`artcache.plan.choose_mask_token`) and the sizes of the target's config.

        Raises:
            ContractMismatch: a layer the draft needs is not captured. ConfigError: no MASK token, bad sizes.
        """
        from transformers import AutoConfig

        captured = list(captured)
        if cfg.layer_ids:  # an explicit view replaces the formula
            need = check_layer_ids(cfg.layer_ids, info.num_layers, f"--layer-ids {list(cfg.layer_ids)}")
            n = cfg.draft_layers or len(need)
            layer_view(captured, need, draft=f"a {n}-layer DFlash draft", flag_hint=" (--layer-ids)")
        else:
            n = cfg.draft_layers or dflash_default_layers(info.num_layers, captured)
            need = dflash_layer_ids(info.num_layers, n, "--draft-layers")
            layer_view(captured, need, draft=f"a {n}-layer DFlash draft", flag_hint=f" (--draft-layers {n})")
        mask_id = choose_mask_token(load_tokenizer(info), info.vocab_size, plan)
        dcfg = DFlashConfig.from_target(AutoConfig.from_pretrained(info.path), num_layers=n,
                                        block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                        mask_token_id=mask_id, num_context_layers=len(need))
        return {**msgspec.to_builtins(dcfg), "layer_ids": list(need)}

    @classmethod
    def build(cls, cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None,
              info=None) -> DFlashAdapter:
        """The DFlash draft around the target's frozen embedding and lm_head (config: :meth:`configure`).

        Raises:
            ContractMismatch: a layer the draft needs is not captured, or the target's weights changed.
            ConfigError: a vocab map given (a DFlash draft has none), no valid MASK token, or bad sizes.
        """
        if vocab_map:
            raise ConfigError("a DFlash draft has no vocab map; the checkpoint given carries one (an EAGLE-3 draft?)")
        info = info or check_target(settings)
        planned = cls.configure(cfg, info, settings.contract.layer_ids, plan)
        need = planned.pop("layer_ids")
        dcfg = msgspec.convert(planned, DFlashConfig)
        embed, lm_head = load_embedding_and_lm_head(info)
        torch.manual_seed(cfg.seed)
        model = DFlashDraft(dcfg, embed.to(device), lm_head.to(device))
        draft = cls(model, dcfg, need, torch.Generator().manual_seed(cfg.seed), eval_anchors=cfg.eval_anchors or 0,
                    speed=SpeedOptions.for_device(cfg, device))
        draft.target_info, draft.target_lm_head = info, model.lm_head_weight
        return draft

    @classmethod
    def weight_shapes(cls, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        dcfg = decode_draft_config(config, DFlashConfig, "DFlash draft config")
        with torch.device("meta"):
            meta = torch.empty(dcfg.vocab_size, dcfg.hidden_size)
            model = DFlashDraft(dcfg, meta, meta)
        return {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()}

    @classmethod
    def export_layout(cls, config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> Any:
        return export_layout(config, tensors, where)

    @classmethod
    def read_published(cls, config: dict[str, Any], num_target_layers: int) -> dict[str, Any] | None:
        return read_published(config, num_target_layers)

    @classmethod
    def export(cls, state, weights, target_cfg, fmt, dtype, verifier, num_speculative_tokens, what, target_info=None,
               target_tensors=True):
        """No target tensor in either layout (``target_tensors`` is ignored): z-lab's ``DFlashDraftModel`` has
        no embedding or lm_head of its own (generation passes the target's), and vLLM shares the target's."""
        return export_checkpoint_files(state, weights, target_cfg, fmt, dtype, verifier, num_speculative_tokens,
                                       what)

    def generators(self) -> dict[str, torch.Generator]:
        return {"anchors": self.generator}

    def _forward(self, batch: DraftBatch, anchors: Tensor, avalid: Tensor, *, train: bool = False):
        dev = batch.hidden.device
        fast = train and self.speed.sync_free
        anchors, avalid = to_device(anchors, dev), to_device(avalid, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            # a consumer group's training forward runs through its DistributedDataParallel wrapper
            forward = self.train_module if train and self.train_module is not None else \
                self._forward_fn if fast else self.model
            docs, pos = packed_on(batch, dev)
            out = forward(batch.hidden, batch.input_ids, anchors, avalid, context_valid=batch.valid,
                          check_anchors=not fast, doc_ids=docs, position_ids=pos)
            loss, stats = dflash_loss(self.model, out, batch.input_ids, batch.loss_mask, anchors, avalid,
                                      context_valid=batch.valid, mode=self._loss_mode() if train else "fused",
                                      static_rows=fast, compile=fast and self.speed.compile != "off", doc_ids=docs)
        return out, loss, stats

    def loss(self, batch: DraftBatch) -> tuple[Tensor, MetricSums | PendingSums]:
        # anchors are drawn on the CPU generator whatever the device (the same draws on every device),
        # from the host copy of the batch's masks (no device read-back)
        anchors, avalid = draw_anchors(batch, self.dcfg.num_anchors, self.generator)
        self.speed.step_begin()
        if self.cp_group is not None:
            loss, stats = self._cp_loss(batch, anchors, avalid)
        else:
            if self.speed.sync_free:  # every slot is computed: a packed row's many anchors over rows of N slots
                batch, anchors, avalid = spread_anchor_rows(batch, anchors, avalid, self.dcfg.num_anchors,
                                                            spread_row_step(anchors.shape[0]))
            _, loss, stats = self._forward(batch, anchors, avalid, train=True)
        return loss, (self._pending(stats) if self.speed.sync_free else self._sums(stats))

    def _cp_loss(self, batch: DraftBatch, anchors: Tensor, avalid: Tensor):
        """Context parallelism (:attr:`cp_group`): this rank's part of the training loss
        (:func:`~artcache.trainers.dflash.cp.cp_forward`): the mean of its blocks' decay-weighted cross-entropy
        and its :class:`~.loss.LossStats`. Every rank of the group draws the same anchors (per position);
        ``loss × stats.weight_sum`` summed over the ranks is the one-rank loss's numerator, so the consumer's
        gradient normalisation over the global batch (``Session._accumulate``) gives the one-rank gradient.
        The batch arrives whole; this rank keeps positions ``[start, end)`` of its context
        (:func:`~artcache.trainers.dflash.cp.context_shard`), zeros past the end.

        Raises:
            ConfigError: a packed batch (the split context has no per-document attention).
        """
        from .cp import check_unpacked, context_shard, cp_forward

        check_unpacked(batch.doc_ids)
        group = self.cp_group
        dev = batch.hidden.device
        shard = context_shard(batch.hidden, group)
        anchors, avalid = to_device(anchors, dev), to_device(avalid, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out, la, lv = cp_forward(self.model, shard, batch.input_ids, anchors, avalid, batch.valid, group)
            loss, stats = dflash_loss(self.model, out, batch.input_ids, batch.loss_mask, la, lv,
                                      context_valid=batch.valid, mode=self._loss_mode())
        # a rank without a block of its own still runs the gathers' backward (a collective): out stays in the graph
        return loss + out.sum() * 0.0, stats

    def _loss_mode(self) -> str:
        return "fused" if self.speed.ce_impl == "reference" else self.speed.ce_impl

    @staticmethod
    def _pending(stats) -> PendingSums:
        """:meth:`_sums` with the values left on the device."""
        parts = [("loss", stats.loss_sum, stats.weight_sum), ("tau", stats.tau_sum, stats.num_blocks)]
        parts += [(f"acc_{k}", stats.correct[k], stats.total[k]) for k in range(1, stats.correct.numel())]
        return PendingSums.build(parts)

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
        out = present({"loss": sums.ratio("loss"), "acc": [sums.ratio(f"acc_{k}") for k in range(1, B)],
                       "tau": sums.ratio("tau"), "tau_includes_bonus": True, "blocks": int(sums.den.get("tau", 0))})
        return {**out, **replay_summary(sums)}

    def headline(self, summary: dict[str, Any]) -> str:
        tau = f"{summary['tau']:.2f}" if "tau" in summary else "-"
        return f"tau {tau} (incl. +1 bonus)" + replay_headline(summary, bonus_note="")

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
    return replay_sums(*replay_inputs(model, out, input_ids, supervised, anchors, target_argmax))


def replay_inputs(model, out: Tensor, input_ids: Tensor, supervised: Tensor, anchors: Tensor,
                  target_argmax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What :func:`greedy_replay` walks (same arguments): ``(preds, greedy, ok, on_data)``, each [N, B-1]
    (row = anchor, column k-1 = slot k), as :func:`artcache.trainers.draft.replay_sums` takes them."""
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
    return preds, greedy, ok, on_data


def dflash_default_layers(num_target_layers: int, captured: Sequence[int]) -> int:
    """Draft layers n when ``--draft-layers`` is not given: the largest n <= len(captured) whose
    ``dflash_layer_ids(L, n)`` are all captured (a DFlash-only root: one per captured layer)."""
    cap = set(captured)
    for n in range(min(len(cap), num_target_layers - 3), 0, -1):
        if set(dflash_layer_ids(num_target_layers, n)) <= cap:
            return n
    return len(cap)  # nothing fits: dflash_layer_ids of this n names the missing ids
