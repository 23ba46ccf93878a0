"""The draft interface: what the consumer and ``artcache export`` need from a draft algorithm.

A draft is a package ``artcache.trainers.<name>/`` with the same files — ``config.py`` (its msgspec
config), ``model.py`` (the ``nn.Module``), ``loss.py`` (training loss and metric sums), ``adapter.py``
(its :class:`Draft` subclass) and ``export.py`` (its serving layout) — registered by one line in
:data:`artcache.trainers.ADAPTERS`. :func:`build_draft` builds the draft a
:class:`~artcache.trainers.consumer.ConsumerConfig` names; :func:`draft_class` gives its adapter class.

What a :class:`Draft` exposes (shapes: b sequences, T positions, m layers in the draft's view, H the
target's hidden size, V its vocabulary):

- ``model``: the trainable ``nn.Module``; frozen target tensors are buffers, never trained or saved.
  It must offer ``trainable_state_dict()`` (the tensors a checkpoint saves) and ``parameters()``.
- ``needed_layer_ids``: the captured layers it reads, output-of-layer convention, in the order it reads
  them (its *view* of the root's ``contract.layer_ids``, :func:`artcache.layer_ids.layer_view`).
- ``target_info`` (:class:`artcache.target.TargetInfo`) and ``target_lm_head`` ([V, H], frozen): the
  target the draft was built against; the consumer derives the target's argmax from them.
- ``build(cfg, settings, plan, device, vocab_map=...)``: classmethod, the draft around the target.
- ``loss(batch) -> (loss, sums)``: one training forward; ``loss`` a scalar tensor with grad,
  ``sums`` a :class:`MetricSums`, or a :class:`PendingSums` whose values stay on the device (the
  GPU path: no host synchronisation in the step; the consumer reads them back every ``--log-every``
  steps).
- ``evaluate(batch, target_argmax) -> MetricSums``: held-out metrics without gradients;
  ``target_argmax`` [b, T] long (the target's greedy next token after each prefix) or None.
- ``summary(sums) -> dict``: the metrics of a :class:`MetricSums`, each ratio divided once; a figure
  whose denominator is 0 is left out (``acc`` entries are None), never reported as 0.0 or NaN.
- ``headline(summary) -> str``: one log fragment with the draft's acceptance figure, bonus stated.
- ``journal_fields(sums) -> dict``: the Step journal event's ``tau_sum``, ``blocks``, ``acc_correct``,
  ``acc_total``.
- ``config_dict()``: its configuration, JSON-serialisable, stored in checkpoints (``draft_config``).
- ``generators()``: named ``torch.Generator`` it draws from in training (checkpointed).
- ``extra_tensors()``: tensors that belong to it but are not trained (EAGLE-3's vocab map).
- for ``--init-from`` (the one seed loader, :mod:`artcache.trainers.seed`): ``configure(...)`` (the draft
  config a run builds, no weight loaded), ``weight_shapes(config)``, ``read_published(config, L)`` (its
  published layouts' ``config.json``), ``serving_names``, ``target_tensors``, ``seed_fields``,
  ``vocab_coverage``; ``options`` / ``run_options``: the consumer options only this draft uses.
- ``export(...)``: classmethod, its ``config.json`` and serving tensors from a checkpoint.
- ``progress_metric``: the summary key the progress bar shows; ``acc_label``: what the log line calls the
  summary's ``acc`` list.
- ``eval_figures`` / ``eval_slot_figures`` (``held_out_figures(B)``): the names of the figures its
  ``summary`` of a held-out evaluation gives (``--best-metric`` accepts exactly these; a test runs a real
  evaluation of every draft and compares).

A draft never decides which positions it reads; the consumer does.
"""

from __future__ import annotations

import abc
import errno
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from artcache.errors import ConfigError, ContractMismatch, NotReadable
from artcache.target import TargetInfo, by_name, resolve_target, unreadable
from artcache.trainers import ADAPTERS, DRAFT_NAMES
from artcache.trainers.checkpoint import CheckpointState

__all__ = ["COUNT_KEYS", "REPLAY_FIGURES", "Draft", "DraftBatch", "ExportedDraft", "MetricSums", "PendingSums",
           "build_draft", "check_target", "denominator", "describe_figures", "draft_class", "figures_of", "present",
           "replay_headline", "replay_sums", "replay_summary"]

log = logging.getLogger("artcache.consumer")


@dataclass
class DraftBatch:
    """One padded batch, on the consumer's device.

    Attributes:
        hidden: [b, T, m, H] captured layers in the draft's view order (contract dtype; fp8 artifacts
            arrive dequantised, bf16 on CUDA and fp32 on a CPU).
        input_ids: [b, T] long. loss_mask: [b, T] bool. valid: [b, T] bool (False = padding).
        positions: the run positions of the b rows (-1: a held-out sample, read by index).
        last_layer: optional [b, T, H]: output-of-layer ``L - 1`` (un-normed), when the root captures
            it and the caller asked for it (greedy replay against the target's argmax).
        supervised_host: optional [b, T] bool on the **host**: ``loss_mask & valid``, for draws that
            must not read device memory back (DFlash's anchors); None = derive it from the batch.
        doc_ids: a packed batch (:mod:`artcache.trainers.packing`): [b, T] long on the **host**, the
            document (plan position) each token belongs to, numbered in batch order, -1 on padding; None =
            unpacked (one document per row).
        position_ids: a packed batch: [b, T] long on the host, each token's position inside its document
            (restarting at 0 per document; 0 on padding); None = ``arange(T)``.
        samples: the plan sample indices of the b rows when the caller knows them (the held-out
            evaluation sets them: the identity of a held-out row, whose position is -1); empty otherwise.
    """

    hidden: Tensor
    input_ids: Tensor
    loss_mask: Tensor
    valid: Tensor
    positions: tuple[int, ...] = ()
    last_layer: Tensor | None = None
    supervised_host: Tensor | None = None
    samples: tuple[int, ...] = ()
    doc_ids: Tensor | None = None
    position_ids: Tensor | None = None

    @property
    def packed(self) -> bool:
        """Whether rows hold several documents (``doc_ids`` given)."""
        return self.doc_ids is not None

    def supervised_on_host(self) -> Tensor:
        """``loss_mask & valid`` [b, T] bool on the host (no device read when the collator supplied it)."""
        if self.supervised_host is not None:
            return self.supervised_host
        return (self.loss_mask & self.valid).cpu()


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

    def ratio(self, name: str) -> float | None:
        """``num / den``; None when the denominator is 0 or the name is unknown (nothing was measured:
        reported figures leave it out rather than print 0.0 or NaN)."""
        d = self.den.get(name, 0.0)
        return self.num.get(name, 0.0) / d if d > 0 else None


@dataclass
class PendingSums:
    """A :class:`MetricSums` whose values are still on the device: read back only when needed.

    ``names`` lists ``(name, has_den)`` in order; ``values`` is a float64 tensor holding, for each
    name, its numerator then (if ``has_den``) its denominator. Counts are exact below 2**53 and the
    float64 values equal ``float()`` of the tensors they came from, so :meth:`resolve` gives the
    :class:`MetricSums` the same stats would have given on the host. :meth:`resolve_all` reads any
    number of them back with one device-to-host copy (one synchronisation for many steps).
    """

    names: tuple[tuple[str, bool], ...]
    values: Tensor

    @classmethod
    def build(cls, parts: list[tuple[str, Tensor, Tensor | None]]) -> PendingSums:
        """From ``(name, num, den or None)`` scalar (0-d) tensors on one device; no host sync."""
        names = tuple((n, d is not None) for n, _, d in parts)
        flat = [x for _, num, den in parts for x in ((num,) if den is None else (num, den))]
        return cls(names, torch.stack([x.reshape(()).double() for x in flat]))

    def _sums(self, values: list[float]) -> MetricSums:
        out, i = MetricSums(), 0
        for name, has_den in self.names:
            out.add(name, values[i], values[i + 1] if has_den else None)
            i += 2 if has_den else 1
        return out

    def resolve(self) -> MetricSums:
        return self._sums(self.values.tolist())

    @staticmethod
    def resolve_all(pending: list[PendingSums | MetricSums]) -> list[MetricSums]:
        """Each entry as a :class:`MetricSums` (MetricSums pass through); the device values of all
        pending entries come back in one copy."""
        dev = [p for p in pending if isinstance(p, PendingSums)]
        if not dev:
            return list(pending)
        flat = torch.cat([p.values for p in dev]).tolist()
        out, i = [], 0
        for p in pending:
            if isinstance(p, PendingSums):
                n = p.values.numel()
                out.append(p._sums(flat[i:i + n]))
                i += n
            else:
                out.append(p)
        return out


@dataclass
class ExportedDraft:
    """What :meth:`Draft.export` returns: the ``config.json`` dict, the serving tensors (CPU, contiguous)
    and the layer ids the draft reads in the **output-of-layer** convention (None when the checkpoint
    records none), for the export's provenance file."""

    config: dict
    tensors: dict[str, Tensor]
    layer_ids: list[int] | None


# ---- the greedy acceptance replay every draft reports on held-out data --------------------------------

def replay_accepted(preds: Tensor, greedy: Tensor, ok: Tensor, on_data: Tensor) -> tuple[Tensor, Tensor]:
    """Per block, the greedy acceptance walk of :func:`replay_sums` (same arguments, all [N, K]).

    Returns:
        (accepted [N] long: proposals accepted, 0 … K, **no** bonus; truncated [N] bool: the walk was cut
        by the greedy path leaving the data while the next column was still ``ok``).
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
    return accepted, truncated


def replay_sums(preds: Tensor, greedy: Tensor, ok: Tensor, on_data: Tensor) -> MetricSums:
    """Greedy acceptance walk over proposals, one row per block (a DFlash block, or the EAGLE-3 TTT
    steps from one position; see :func:`artcache.trainers.dflash.adapter.greedy_replay`).

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
    N = preds.shape[0]
    accepted, truncated = replay_accepted(preds, greedy, ok, on_data)
    s = MetricSums()
    s.add("replay_tau", float((accepted + 1).sum()), N)
    s.add("replay_truncated", float(truncated.sum()), N)
    return s


#: the greedy-replay figures of :func:`replay_summary`: measured only against the target's argmax, so only when
#: the root captures output-of-layer ``L - 1`` (EAGLE-3 always reads it; DFlash and DSpark need it captured)
REPLAY_FIGURES: tuple[str, ...] = ("replay_tau", "replay_truncated_frac")
#: numbers in an evaluation's summary that count what was evaluated, not how well: never a figure to follow
COUNT_KEYS: tuple[str, ...] = ("blocks", "samples", "step")


def figures_of(summary: dict[str, Any]) -> list[str]:
    """The figures of an evaluation summary, in its order: the keys holding a number (not a bool, not a list),
    :data:`COUNT_KEYS` aside. What ``checkpoints/best`` can follow (``--best-metric``)."""
    return [k for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in COUNT_KEYS]


#: held-out figures where lower is better (base names, before any ``@k``): losses, calibration errors
#: (ECE, Guo et al. 2017), mean absolute errors and the fraction of replays cut short; a ``*_bias`` figure is
#: signed and is better the closer it is to 0; every other figure (τ, acceptance rates, coverage) is
#: better higher
LOWER_IS_BETTER = frozenset({"ece", "ece_cum", "conf_mae", "cum_mae", "replay_truncated_frac"})


def figure_rank(metric: str, value: float) -> float:
    """``value`` of the held-out figure ``metric`` as a rank where lower is better: the one rule
    ``checkpoints/best`` follows (``--best-metric``). Names with ``loss`` and :data:`LOWER_IS_BETTER` rank as
    they are, ``*_bias`` figures by their magnitude, every other figure negated."""
    base = metric.split("@", 1)[0]
    if "loss" in base or base in LOWER_IS_BETTER:
        return value
    if base.endswith("_bias"):
        return abs(value)
    return -value


def describe_direction() -> str:
    """How :func:`figure_rank` orders figures, in words (for messages and help)."""
    return ("a loss, " + ", ".join(sorted(LOWER_IS_BETTER)) + " are minimised, a *_bias figure's magnitude is "
            "minimised, any other figure is maximised")


def describe_figures(cls: type[Draft], block_size: int | None) -> str:
    """``cls``'s held-out figures in words: its :attr:`~Draft.eval_figures`, then per-slot ones as
    ``name@k`` with the slots' range (``accept_rate@k, ece@k (k = 0..6)``)."""
    text = ", ".join(cls.eval_figures)
    if cls.eval_slot_figures and block_size:
        text += f", {', '.join(f'{n}@k' for n in cls.eval_slot_figures)} (k = 0..{block_size - 1})"
    return text


def replay_summary(sums: MetricSums) -> dict[str, float]:
    """Greedy-replay figures (``replay_tau`` incl. +1 bonus, ``replay_truncated_frac``: share of blocks
    cut short) when an evaluation recorded them; ``{}`` otherwise."""
    return present({"replay_tau": sums.ratio("replay_tau"), "replay_truncated_frac": sums.ratio("replay_truncated")})


def present(figures: dict[str, Any]) -> dict[str, Any]:
    """``figures`` without the ones that are None (a zero denominator: not measured, so not reported)."""
    return {k: v for k, v in figures.items() if v is not None}


def replay_headline(summary: dict[str, Any], bonus_note: str = " (incl. +1 bonus)") -> str:
    """`` greedy-replay tau X.XX`` plus ``bonus_note`` when ``summary`` has a replay, else ``""``."""
    if "replay_tau" not in summary:
        return ""
    return f" greedy-replay tau {summary['replay_tau']:.2f}{bonus_note}"


def check_target(settings) -> TargetInfo:
    """The cache root's target, resolved, with the weights it was captured from: the directory the producer
    recorded (``settings.target_path``) when this process can read it; else, for a target every user resolves by
    name (:func:`artcache.target.by_name`: ``random:<arch>``, the bundled GGUF target, a hub id at its recorded
    revision), the same target from this user's own caches (``$ARTCACHE_HOME``, the hub cache), checked by its
    weights digest. A group-shared root's recorded path is often under the producer's private home, which a
    teammate's consumer may not read.

    Raises:
        ContractMismatch: the target's weights digest differs from the root's contract.
        NotReadable: the recorded directory cannot be read here and no name resolves to the same weights (one line:
            the path, its mode and owner, this user's ids and how to share it).
        ConfigError: the target cannot be resolved.
    """
    expected = settings.contract.target_weights_digest
    why = unreadable(settings.target_path)
    if why is not None:
        name = by_name(settings.contract.target_name, settings.contract.target_revision)
        other = ""
        if name is not None:
            try:
                info = resolve_target(name)  # this user's own caches
            except ConfigError as exc:
                other = f"; resolving {name!r} here failed too ({exc})"
            else:
                if info.weights_digest == expected:
                    log.info("the cache root's target %s cannot be read here (%s): using %s from this user's cache "
                             "(same weights digest %s)", settings.target_path, why, info.path, expected)
                    return info
                other = f"; {name!r} resolves here to weights digest {info.weights_digest}, not the root's {expected}"
        raise NotReadable(f"the cache root's target {settings.target_path} cannot be read by this user: {why}{other}; "
                          "a consumer loads the target's embedding, lm_head and tokenizer, so the group sharing the "
                          "root needs read access (chmod -R g+rX on the target and search permission on its "
                          "parents), or capture from a target directory every consumer can read",
                          errno_=errno.EACCES)
    info = resolve_target(settings.target_path)
    if info.weights_digest != expected:
        raise ContractMismatch(
            f"target at {settings.target_path} has weights digest {info.weights_digest}, but the cache "
            f"root was captured from {settings.contract.target_weights_digest}")
    return info


# ---- the interface ------------------------------------------------------------------------------------

class Draft(abc.ABC):
    """The interface the consumer trains through and ``artcache export`` exports through (see the
    module docstring for every member's contract)."""

    #: the registered draft name (a key of :data:`artcache.trainers.ADAPTERS`)
    name: ClassVar[str] = ""
    #: the summary key the progress bar shows
    progress_metric: ClassVar[str] = "tau"
    #: what the log line calls the summary's ``acc`` list (shown as ``<acc_label>1..n``): the draft says what
    #: it counts when that is not obvious next to its acceptance figure
    acc_label: ClassVar[str] = "acc_"
    #: the figures its held-out evaluation reports: the keys of ``summary(evaluate(...))`` holding a number
    #: (:func:`figures_of`), i.e. the names ``--best-metric`` accepts; :data:`REPLAY_FIGURES` among them are
    #: measured only with the target's argmax. tests/unit/test_drafts.py checks them against a real evaluation.
    eval_figures: ClassVar[tuple[str, ...]] = ()
    #: figures it reports once per block slot, as ``name@k`` for k = 0 … B-1 (DSpark), beside ``eval_figures``
    eval_slot_figures: ClassVar[tuple[str, ...]] = ()
    #: the :class:`~artcache.trainers.consumer.ConsumerConfig` fields only this draft uses, with their
    #: defaults: another draft refuses them when given (they would be ignored silently)
    options: ClassVar[dict[str, Any]] = {}
    #: the options among :attr:`options` that define a run (``--resume`` refuses when one differs)
    run_options: ClassVar[tuple[str, ...]] = ()
    #: its export's key renames, ``(native prefix, serving prefix)``; the seed loader maps serving names
    #: back per key, only where the model lacks the key (:func:`artcache.trainers.seed.map_back`)
    serving_names: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: keys a published layout may carry that are the target's own frozen tensors, -> ``"embed"`` |
    #: ``"lm_head"`` | ``"final_norm"``: a seed's copy must equal this run's target's (then it is dropped)
    target_tensors: ClassVar[dict[str, str]] = {}
    #: the draft-config fields a seed must share with the run (besides layer ids and the target)
    seed_fields: ClassVar[tuple[str, ...]] = ()
    model: torch.nn.Module
    needed_layer_ids: tuple[int, ...] = ()
    #: the resolved target (:class:`artcache.target.TargetInfo`) and its frozen lm_head [V, H]
    target_info: TargetInfo | None = None
    target_lm_head: Tensor | None = None
    #: what runs the model's training forward instead of ``model`` itself: a consumer group's
    #: ``DistributedDataParallel`` wrapper of it (None: ``model``, or its compiled forward)
    train_module: torch.nn.Module | None = None
    #: context parallelism (``--cp N``): the ``torch.distributed`` process group whose ranks split each training
    #: sequence (:mod:`artcache.trainers.dflash.cp`, :mod:`artcache.trainers.eagle3.cp`); its :meth:`loss` then
    #: returns this rank's share (the loss and sums of the blocks anchored in its part; EAGLE-3: of its positions).
    #: None: off
    cp_group: Any = None

    #: its ``loss(batch, denominators=...)`` divides each term by a given denominator ([terms] float64: the global
    #: batch's) instead of the batch's own; a consumer group or ``--grad-accum`` then finds them before the parts'
    #: forward (:meth:`loss_denominators`). False: one term, whose parts' gradients are summed and scaled after
    #: their backward (exact where the gradient's rounding does not depend on the normaliser: DFlash)
    global_denominators: ClassVar[bool] = False

    def loss_terms(self) -> tuple[tuple[str, float], ...]:
        """The training loss as ``(name, c)`` pairs of its :class:`MetricSums`: ``loss = Σ c · num[name] /
        den[name]`` over one batch. A consumer group or ``--grad-accum`` normalises each term over the whole
        global batch (:meth:`artcache.trainers.consumer.Session.train_step`); a draft with more than one term
        sets :attr:`global_denominators`."""
        return (("loss", 1.0),)

    def loss_denominators(self, batch: DraftBatch) -> Tensor | None:
        """``den`` of each :meth:`loss_terms` entry over ``batch`` ([terms] float64) without a forward, or None
        (the consumer then counts them with a forward without gradients)."""
        return None

    @classmethod
    def held_out_figures(cls, block_size: int | None = None) -> tuple[str, ...]:
        """Every figure its held-out evaluation reports at block size ``block_size`` (None: a draft without
        blocks): :attr:`eval_figures`, then ``name@k`` of each :attr:`eval_slot_figures` for k = 0 … B-1."""
        slots = tuple(f"{n}@{k}" for n in cls.eval_slot_figures for k in range(block_size or 0))
        return cls.eval_figures + slots

    @classmethod
    @abc.abstractmethod
    def build(cls, cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None,
              info: TargetInfo | None = None) -> Draft:
        """The draft for consumer config ``cfg`` on a root (``settings``, ``plan``), on ``device``.

        Args:
            vocab_map: a draft's own non-trained tensors taken from the checkpoint it resumes or is
                seeded from (EAGLE-3: ``d2t``/``t2d``); a draft that has none must refuse one.
            info: the resolved target when the caller has it (else :func:`check_target`).

        Raises:
            ContractMismatch: a needed layer is not captured, or the target's weights changed.
            ConfigError: bad sizes or options.
        """

    @classmethod
    def export(cls, state: CheckpointState, weights: dict[str, Tensor], target_cfg: Any, fmt: str,
               dtype: torch.dtype, verifier: str, num_speculative_tokens: int | None, what: str,
               target_info: TargetInfo | None = None, target_tensors: bool = True) -> ExportedDraft:
        """The serving ``config.json`` and tensors of a checkpoint of this draft.

        Args:
            state: the checkpoint's state. weights: its ``model.safetensors`` merged with
                ``extra.safetensors``. target_cfg: the target's transformers config. fmt: ``"hf"`` or
                ``"speculators"``. dtype: of the exported floating tensors. verifier: the target's name
                (speculators' ``verifier.name_or_path``; never a local path). num_speculative_tokens: the
                speculators proposal length (None: the draft's default). what: names the checkpoint in
                error messages. target_info: the resolved target when its weights are at hand (a layout
                that carries a target tensor reads it from there), else None. target_tensors: write the
                target's frozen tensors into a layout whose reference loader expects them in the checkpoint
                (DSpark ``hf``: ``embed_tokens`` and ``lm_head``); layouts without such tensors ignore it.

        Raises:
            ConfigError: the draft has no export, or the checkpoint does not fit its config.
        """
        raise ConfigError(f"a {cls.name} draft has no serving export")

    @classmethod
    def configure(cls, cfg, info: TargetInfo, captured: list[int], plan) -> dict[str, Any]:
        """The draft config (:meth:`config_dict`, with ``layer_ids``) a run of ``cfg`` builds on a root
        capturing ``captured`` from target ``info`` with ``plan``, without loading any weight: what
        ``artcache run --dry-run`` compares with a seed or a checkpoint, and what :meth:`build` builds.

        Raises:
            ContractMismatch: a needed layer is not captured. ConfigError: bad sizes or options.
        """
        raise ConfigError(f"a {cls.name} draft cannot be planned without building it")

    @classmethod
    def weight_shapes(cls, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """``trainable_state_dict()`` key -> shape of a draft of ``config`` (built on the meta device: no memory).

        Raises:
            ConfigError: ``config`` does not describe this draft.
        """
        raise ConfigError(f"a {cls.name} draft has no seed loader")

    @classmethod
    def read_published(cls, config: dict[str, Any], num_target_layers: int) -> dict[str, Any] | None:
        """The draft config (as :meth:`config_dict`, ``layer_ids`` output-of-layer, plus ``target_name`` /
        ``num_target_layers`` where recorded and a ``layout`` label) a ``config.json`` of one of this
        draft's published layouts describes; None when it is not one of them. ``num_target_layers``: L of
        the run's target (layouts that leave ids to a formula or imply ``L - 1``).

        Raises:
            ConfigError: it is this draft's layout but lacks a field the draft needs, or holds an option
                this draft does not compute (named).
        """
        return None

    @classmethod
    def export_layout(cls, config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> Any:
        """What a serving engine must resolve from an exported directory of this draft (``config``: its
        ``config.json``; ``tensors``: its ``model.safetensors``), as an
        :class:`~artcache.trainers.export_check.ExportLayout`, for ``artcache export --check``.

        Raises:
            ConfigError: the export would load and serve wrong (one line naming the key, prefixed by ``where``).
        """
        raise ConfigError(f"export check: {where}: a {cls.name} draft has no export check")

    @classmethod
    def vocab_coverage(cls, vocab_map: dict[str, Tensor], counts: Tensor) -> float | None:
        """The share of ``counts`` (int64 [V], the plan's supervised training tokens) a kept vocab map
        covers; None for a draft without one."""
        return None

    @abc.abstractmethod
    def loss(self, batch: DraftBatch) -> tuple[Tensor, MetricSums]:
        """One training forward on ``batch``: (scalar loss with grad, metric sums)."""

    @abc.abstractmethod
    def evaluate(self, batch: DraftBatch, target_argmax: Tensor | None) -> MetricSums:
        """Held-out metric sums, no gradients; ``target_argmax`` [b, T] long or None."""

    @abc.abstractmethod
    def config_dict(self) -> dict[str, Any]:
        """The draft's configuration (JSON-serialisable, with ``layer_ids``): a checkpoint's ``draft_config``."""

    @abc.abstractmethod
    def summary(self, sums: MetricSums) -> dict[str, Any]:
        """Metrics of ``sums`` (``loss``, ``acc`` list, the draft's acceptance figure), ratios divided once."""

    @abc.abstractmethod
    def headline(self, summary: dict[str, Any]) -> str:
        """One log fragment for a summary: the draft's acceptance figure, bonus convention stated."""

    @abc.abstractmethod
    def journal_fields(self, sums: MetricSums) -> dict[str, Any]:
        """The Step journal event's metric sums: ``tau_sum``, ``blocks``, ``acc_correct``, ``acc_total``."""

    def generators(self) -> dict[str, torch.Generator]:
        """Named generators the draft draws from during training (their states are checkpointed)."""
        return {}

    def extra_tensors(self) -> dict[str, Tensor]:
        """Tensors that belong to the draft but are not trained (saved as ``extra.safetensors``)."""
        return {}


def denominator(sums: MetricSums | PendingSums, name: str, device: torch.device) -> Tensor:
    """``den[name]`` of ``sums`` as a float64 scalar tensor on ``device`` (a :class:`PendingSums` entry stays
    on its device: no host synchronisation).

    Raises:
        KeyError: ``name`` has no denominator in ``sums``.
    """
    if isinstance(sums, MetricSums):
        return torch.tensor(sums.den[name], dtype=torch.float64, device=device)
    i = 0
    for n, has_den in sums.names:
        if n == name and has_den:
            return sums.values[i + 1].to(device)
        i += 2 if has_den else 1
    raise KeyError(name)


def draft_class(name: str) -> type[Draft]:
    """The adapter class registered for draft ``name`` (imported on first use).

    Raises:
        ConfigError: ``name`` is not a registered draft.
    """
    target = ADAPTERS.get(name)
    if target is None:
        raise ConfigError(f"--draft {name!r} is not supported; accepted: {', '.join(DRAFT_NAMES)}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_draft(cfg, settings, plan, device: torch.device, *, vocab_map: dict[str, Tensor] | None = None) -> Draft:
    """The draft ``cfg.draft`` names, built by its adapter's :meth:`Draft.build`.

    Args:
        vocab_map: EAGLE-3 only: ``{"d2t", "t2d"}`` to keep (a seeded or resumed draft keeps its
            own map); None computes it from the plan's loss-masked tokens.

    Raises:
        ConfigError: unknown draft. ContractMismatch: see the drafts' ``build``.
    """
    cfg = cfg.resolved() if hasattr(cfg, "resolved") else cfg  # the draft's own option defaults
    return draft_class(cfg.draft).build(cfg, settings, plan, device, vocab_map=vocab_map)
