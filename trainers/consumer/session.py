"""One consumer run as a :class:`Session`: one draft trainer reading target hidden states from a cache root.

Read it top to bottom, like nanoGPT's ``train.py``: :func:`run_consumer` runs the phases in order —

1. :meth:`Session.setup`: read the root and the plan, fix the held-out split and the run directory,
   find the start (``--resume`` / ``--init-from``, :mod:`.restore`), build the draft (it reads its own
   ordered view of the root's captured layers), size its checkpoints and check that they fit under the
   run directory (:func:`~artcache.trainers.checkpoint.check_checkpoint_space`). Nothing is written yet.
2. :meth:`Session.resume`: load the start's weights (and, for ``--resume``, optimizer, RNG, step, cursor).
3. :meth:`Session.register`: the run directory, the journal, the registration (window, held-out split
   pinned, checkpoint cursor), the tracker, the reader thread (:mod:`.reader`), the heartbeat, the
   signal handlers (the first SIGTERM / Ctrl-C stops at the next step boundary, a second at once; the
   previous handlers come back in :meth:`close`).
4. :meth:`Session.run`: the loop — :meth:`step` (wait for a batch, forward, backward, optimizer step,
   release the batch's leases, commit the cursor when due), with :meth:`checkpoint` every ``--save-every`` and
   :meth:`evaluate` every ``--eval-interval`` steps — then :meth:`close` whatever happened: threads
   stopped, unused leases released, a final checkpoint when the state is a consistent step, the
   registration finished, the journal closed.

The cursor is committed only after the optimizer step that consumed its positions, when due
(``--commit-interval``, :meth:`Session._commit_due`); leases are released once the batch is no longer used.
Checkpoints (:mod:`artcache.trainers.checkpoint`), held-out evaluation (:mod:`artcache.trainers.evaluation`)
and tracking (:mod:`artcache.trainers.tracking`) hang off the loop; see docs/training.md. Crash points
(``ARTCACHE_CRASH_AT``, docs/protocol.md): ``cursor.before-commit``, ``cursor.after-commit`` in
:meth:`Session._commit`; ``checkpoint.before-record``, ``checkpoint.after-record`` in :meth:`checkpoint`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import statistics
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from artcache import journal as J
from artcache import registry
from artcache.client import CacheClient, Leased, open_root
from artcache.crashpoints import crash_point
from artcache.errors import CheckpointWriteError, ConfigError, ConsumerFenced, TrainingDiverged
from artcache.fsio import unwritable_dir
from artcache.layer_ids import layer_view, view_slice
from artcache.layout import host_id
from artcache.liveness import this_process
from artcache.report import LOSS_ENDS_STEPS, format_bytes, loss_ends
from artcache.rolespec import spec_digest
from artcache.shutdown import Cancelled, GracefulShutdown
from artcache.target import quiet_transformers
from artcache.trainers.checkpoint import (
    CheckpointSize,
    Loaded,
    adamw_state_specs,
    best_checkpoint,
    check_checkpoint_space,
    checkpoint_size,
    list_checkpoints,
    planned_saves,
    point_best,
    point_latest,
    prune,
    read_state,
    remove_orphan_temps,
    restore_optimizer,
    restore_rng,
    save_checkpoint,
)
from artcache.trainers.draft import (
    REPLAY_FIGURES,
    DraftBatch,
    MetricSums,
    PendingSums,
    build_draft,
    check_target,
    denominator,
    draft_class,
    figure_rank,
    figures_of,
)
from artcache.trainers.evaluation import Evaluator, epoch_steps, eval_split, heldout_samples, target_argmax_fn
from artcache.trainers.packing import collate_packed, packer_of
from artcache.trainers.seed import SeedPlan, load_seed, read_seed, seed_vocab_map
from artcache.trainers.speed import SpeedOptions
from artcache.trainers.tracking import Progress, RunTracker

from .config import ConsumerConfig, check_anchors, lr_at, read_workers, run_settings
from .group import (
    Group,
    GroupHandle,
    agree,
    cp_layout,
    env_world,
    join,
    launch,
    leave,
    micro_batches,
    sums_from_vector,
    sums_names,
    sums_vector,
)
from .reader import DeviceCollator, Fetched, Reader, collate, group_cursor
from .reader_process import ProcessReader, SlotRing, Start, batch_itemsize, slot_bytes
from .restore import (
    check_same_draft,
    find_resume,
    jsonable,
    load_weights_strict,
    plan_init,
    refuse_existing_run,
    refuse_reused_id,
    vocab_map_of,
    with_horizon,
)
from .shard import gather_optimizer, gather_weights, gathered, local_params, shard_draft, shard_optimizer_state

__all__ = ["Session", "run_consumer"]

log = logging.getLogger("artcache.consumer")


HOST_PHASES = ("wait", "launch", "leases", "commit", "record")
"""The phases of :meth:`Session.step` on the trainer thread: ``wait`` for the reader's next batch, ``launch``
the step's compute (forward, backward, optimizer: on CUDA the host time to enqueue it, which includes
blocking once the device's queue is full, i.e. GPU-bound time), ``leases`` their release (one unlink each)
and the retired buffers' check, ``commit`` the cursor (flock + registration rewrite), ``record`` the
reader's authorization and the step's metrics (journal, log, progress)."""


def host_ms_per_step(host_s: dict[str, Sequence[float]]) -> dict[str, float] | None:
    """The median milliseconds per step of each of :data:`HOST_PHASES` and of their per-step ``total``
    (host wall clock, ``time.monotonic``), from ``host_s`` (phase -> seconds, one entry per step; medians,
    so a compiling first step does not count); None when no step was trained. On CUDA a step whose
    ``launch`` is most of ``total`` is bound by the device; one whose other phases add up to a large share
    is bound by the host's bookkeeping."""
    per_step = list(zip(*(host_s[phase] for phase in HOST_PHASES), strict=True))
    if not per_step:
        return None
    out = {phase: 1e3 * statistics.median(host_s[phase]) for phase in HOST_PHASES}
    out["total"] = 1e3 * statistics.median(sum(step) for step in per_step)
    return out


def run_consumer(cfg: ConsumerConfig, step_hook: Callable[[int], None] | None = None) -> dict | None:
    """Train one draft on the cache root; returns a summary dict. Raises on failure (after fencing).

    A consumer group (:mod:`.group`): with ``cfg.nproc`` > 1 and no ``WORLD_SIZE`` in the environment the ranks
    are started here (:func:`~.group.launch`) and rank 0's summary is returned; inside a group (``WORLD_SIZE`` set:
    a rank :func:`~.group.launch` or torchrun started) this process is one rank, and ranks > 0 return None.

    ``step_hook``, when given, is called on the trainer thread after every step with the step's 0-based index
    (a profiler's ``step()``: ``artcache.bench.consumer_speed`` profiles a window of the from-cache steps so).

    Summary keys: ``consumer_id``, ``draft``, ``batch_size`` (samples per step), ``state`` (the registration's
    final state: ``completed``, ``cancelled``), ``steps_planned`` (``--steps``), ``steps`` (done), ``cursor``,
    ``epoch`` (of the last position trained on, 0-based) and ``epoch_len`` (training samples per epoch),
    ``resumed_from_step`` (None for a
    fresh run), ``seconds``, ``first_loss`` / ``final_loss`` (means over the first / last ``loss_ends_steps``
    of the ``loss_steps`` losses this process logged, :func:`artcache.report.loss_ends`: never the same step twice
    unless it logged one; None when it trained none), ``tau``, ``checkpoint``, ``run_dir``, ``wait_s``,
    ``host_ms_per_step`` (:func:`host_ms_per_step`: where the trainer thread's time went, per phase),
    and ``sim_acc_len`` (EAGLE-3) / ``eval`` (the last evaluation) when there are such figures.

    Raises:
        ConfigError / ContractMismatch: bad settings, layers the root does not capture, a resume or
            init source that does not fit (all before registering). Training errors after fencing.
        artcache.shutdown.Cancelled: SIGINT / SIGTERM stopped the run (after its final checkpoint and fence):
            a KeyboardInterrupt carrying the signal and the summary (its ``state`` ``"cancelled"``).
    """
    world = env_world()
    if world is None and cfg.nproc > 1:  # artcache consume --nproc N: start the N ranks (group.launch)
        preflight(cfg)
        return launch(cfg)
    if world is not None and world > 1:  # one rank of a group (launch's or torchrun's)
        if cfg.nproc not in (1, world):
            raise ConfigError(f"--nproc {cfg.nproc} differs from this group's WORLD_SIZE {world} (torchrun "
                              "--nproc-per-node): leave --nproc out under torchrun, or give the same number")
        cfg = msgspec.structs.replace(cfg, nproc=world)
    session = Session(cfg, step_hook)
    try:
        session.setup()
        session.resume()
        session.register()
        try:
            out = session.run()
        except KeyboardInterrupt as exc:
            if isinstance(exc, Cancelled):
                raise
            try:
                summary = session.summary() if session.main else None
            except Exception:  # the run stopped before it had figures (e.g. during the first evaluation's setup)
                summary = None
            raise Cancelled(session.shutdown.signum, summary) from exc
    finally:
        leave(session.group)
    return out if session.main else None


def preflight(cfg: ConsumerConfig) -> None:
    """What :meth:`Session.setup` checks first, without a draft or a group: the launcher of a group runs it before it
    starts any rank, so bad input is one error of one process (nothing read or written beyond the root's files).

    Raises:
        ConfigError / CacheRootError: bad settings, a missing or damaged root, anchors beyond its max length, speed
            options the device cannot run, an ``--out`` that cannot be a run directory, ``--out`` or ``--id`` of an
            earlier run without ``--resume``.
        ConfigError / ContractMismatch: layers (``--layer-ids``, ``--draft-layers``) or sizes the draft refuses, or
            layers the root does not capture (the draft's own :meth:`~artcache.trainers.draft.Draft.configure`, which
            builds nothing).
    """
    cfg.validate()
    resolved = cfg.resolved()
    layout, settings, plan = _open(resolved, cfg.num_anchors)
    SpeedOptions.for_device(resolved, torch.device(cfg.device))
    run_dir = _run_dir(cfg)
    _check_run_dir(run_dir)
    if not cfg.resume:
        refuse_existing_run(run_dir)
        refuse_reused_id(cfg.consumer_id, registry.read(layout, cfg.consumer_id), run_dir)
    draft_class(resolved.draft).configure(resolved, check_target(settings), list(settings.contract.layer_ids), plan)


def _open(cfg: ConsumerConfig, given_anchors: int | None):
    """``(layout, settings, plan)`` of the consumer's root (:func:`~artcache.client.open_root`: CacheRootError for a
    missing or uninitialised one), ``--anchors`` as given checked against its max length."""
    layout, settings, plan = open_root(cfg.cache)
    check_anchors(given_anchors, settings.contract.max_length)
    return layout, settings, plan


def _run_dir(cfg: ConsumerConfig) -> Path:
    """The run directory: ``--out``, else ``runs/<id>`` (absolute)."""
    return Path(cfg.out_dir or Path("runs") / cfg.consumer_id).absolute()


class Session:
    """One consumer run; :func:`run_consumer` calls its phases in order (see the module docstring)."""

    def __init__(self, cfg: ConsumerConfig, step_hook: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.spec = spec_digest(cfg)  # the settings as given (consumer_start.spec; artcache.rolespec)
        self.step_hook = step_hook  # run_consumer's: called after every step with its index
        self.resumed: Loaded | None = None  # --resume: the checkpoint continued
        self.unrecorded: list[Path] = []  # --resume from step 0: the killed run's unrecorded checkpoints
        self.unknown_best_noted = False  # the warning that --best-metric names no figure of the evaluation
        self.init: SeedPlan | None = None  # --init-from: the seed, checked against this run
        self.start_step = self.start_cursor = 0
        self.steps_done = 0  # optimizer steps done (the checkpoint's step)
        self.cursor = 0  # one past the last position trained on
        self.committed = 0  # the cursor the registration holds (<= cursor; :meth:`_commit`)
        self.t_committed = 0.0  # time.monotonic() of the last commit
        self.state, self.error = "failed", ""  # the registration's final state
        self.saved_step = -1  # the step of the newest checkpoint of this run (-1: none)
        self.ckpt: Path | None = None
        self.consistent = True  # model, optimizer and RNG match (steps_done, cursor): safe to checkpoint
        self.total: MetricSums | None = None
        # the first and the last LOSS_ENDS_STEPS training losses of this process and how many it logged: enough
        # for :func:`artcache.report.loss_ends` over all of them
        self.first_losses: list[float] = []
        self.last_losses: list[float] = []
        self.loss_steps = 0
        self.wait_total = 0.0
        # host seconds of each phase of :meth:`step` (HOST_PHASES), one entry per step of this process
        self.host_s = {phase: array("d") for phase in HOST_PHASES}
        self.last_eval: dict = {}
        self.save_error: Exception | None = None
        self.failure: BaseException | None = None  # what stopped the loop (None: it ran to the end)
        self.checkpoint_bytes: CheckpointSize | None = None  # one checkpoint's size (None: checkpoints off)
        self.fenced = threading.Event()
        self.beat_stop = threading.Event()
        self.stop_req = threading.Event()  # a signal asked to stop: finish the current step, then cancel
        # SIGTERM / Ctrl-C: the first sets stop_req (the run ends at the next step boundary), a second raises
        # KeyboardInterrupt at once (artcache.shutdown); installed in register(), the previous handlers restored
        # in close()
        self.shutdown = GracefulShutdown(f"[{cfg.consumer_id}]", event=self.stop_req,
                                         asked="stopping after the current step")
        self.pending: list[_StepRecord] = []  # steps whose figures are not written yet (_flush_metrics)
        self.last_progress: float | None = None
        self.bad_step: torch.Tensor | None = None  # device flag: first step with a non-finite loss/grad (-1: none)
        self.bad_what: torch.Tensor | None = None  # 1: loss, 2: gradient norm, 3: both
        self.diverged = False
        self.best: tuple[str, float, int] | None = None  # (metric, value, step) of checkpoints/best
        self.group: Group | None = None  # a torch.distributed group's rank (None: a one-process consumer)
        self.ddp: torch.nn.Module | None = None  # the group's DistributedDataParallel wrapper of the draft
        self.units: list[torch.nn.Module] = []  # --shard full: the draft's FSDP units, the root last (:mod:`.shard`)
        # --shard full: (step, full weights, full optimizer state) every rank gathered for rank 0's checkpoint
        self.snapshot: tuple[int, dict, dict | None] | None = None
        self.gathered_step = -1  # the step of the last such gathering (every rank)
        self.dp_rank = 0  # the slice of each global batch this rank reads (its rank, or its CP group's index)
        self.cp_group = None  # --cp N: the process group of the N ranks that split each sequence (None: off)
        self.group_stop = False  # every rank agreed (after a step) to stop at the next step boundary
        self.ring = None  # --reader process: its shared-memory ring (allocated before registering)

    @property
    def main(self) -> bool:
        """This process writes for the consumer (registration, cursor, checkpoints, metrics): the only process of
        a one-process consumer, rank 0 of a group."""
        return self.group is None or self.group.main

    @property
    def world(self) -> int:
        return 1 if self.group is None else self.group.world

    # ---- setup: read the root, choose the start, build the draft (nothing written yet) ------------------

    def setup(self) -> None:
        self.cfg.validate()
        self.group = join(self.cfg.device, self.cfg.group_timeout_s, self.cfg.demand_timeout_s, self.cfg.devices)
        given_anchors = self.cfg.num_anchors  # None: the draft's default, not checked against the root
        cfg = self.cfg = self.cfg.resolved()
        quiet_transformers()
        # raises CacheRootError for a missing/uninitialised root (its reader process opens it the same way)
        self.layout, self.settings, self.plan = _open(cfg, given_anchors)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and (self.group is not None or cfg.devices):  # its own device (rank_gpu)
            self.device = torch.device("cuda", self.group.gpu if self.group is not None else cfg.devices[0])
        held = heldout_samples(self.plan, cfg.eval_samples)  # a plan's data.eval split is every consumer's
        if held != cfg.eval_samples:
            cfg = self.cfg = msgspec.structs.replace(cfg, eval_samples=held)
        self.pinned = eval_split(len(self.plan), cfg.eval_samples)
        # training walks the plan's first epoch_len samples epoch after epoch; the held-out split never
        self.epoch_len = self.pinned[0] or len(self.plan)
        self.order = self.plan.order(self.epoch_len)
        self.packer = packer_of(cfg, self.plan, self.order, self.settings.contract.max_length)
        if cfg.epochs:
            cfg = self.cfg = msgspec.structs.replace(cfg, steps=epoch_steps(cfg.epochs, self.epoch_len,
                                                                             cfg.global_batch)
                                                     if self.packer is None else
                                                     self.packer.epoch_steps(cfg.epochs, self.epoch_len))
        # exclusive: the consumer never reads at or past it
        self.end = cfg.steps * cfg.global_batch if self.packer is None else self.packer.end_after(cfg.steps)
        self.run_dir = _run_dir(cfg)
        _check_run_dir(self.run_dir)  # before anything is sized or created under it
        vocab_map = src = None
        if cfg.resume:
            self.resumed = find_resume(cfg, self.layout, self.settings, self.run_dir)
            if self.resumed is None:  # killed before recording its first checkpoint: the previous one is none
                self.unrecorded = [p for _, p in list_checkpoints(self.run_dir)]
            else:
                cfg = self.cfg = with_horizon(cfg, self.resumed.state)
                vocab_map = vocab_map_of(self.resumed.weights)
        else:
            refuse_existing_run(self.run_dir)
            # before the draft is built (checked again under the registry lock when registering)
            refuse_reused_id(cfg.consumer_id, registry.read(self.layout, cfg.consumer_id), self.run_dir)
            if cfg.init_from:  # any published layout; checked against the built draft below, before loading
                src = read_seed(cfg.init_from, check_target(self.settings).num_layers)
                if src.draft != cfg.draft:
                    raise ConfigError(f"--init-from {src.path} ({src.layout}) holds a {src.draft} draft, "
                                      f"not {cfg.draft}")
                vocab_map = seed_vocab_map(src)  # a seeded EAGLE-3 keeps its own map
        self.draft = build_draft(cfg, self.settings, self.plan, self.device, vocab_map=vocab_map)
        self.model = self.draft.model
        self.dp_rank, _, self.cp_group = cp_layout(self.group, cfg.cp)
        self.draft.cp_group = self.cp_group  # the training forward splits each sequence over it (--cp)
        if src is not None:
            own = {k: tuple(v.shape) for k, v in self.model.trainable_state_dict().items()}
            self.init = plan_init(cfg, src, self.draft.config_dict(), own, self.draft.target_info,
                                  self.settings.contract, self.plan)
        captured = list(self.settings.contract.layer_ids)
        layers = view_slice(layer_view(captured, self.draft.needed_layer_ids, draft=cfg.draft, flag_hint=""))
        # None: the draft reads every captured layer, in order
        self.layers = None if isinstance(layers, slice) and layers == slice(0, len(captured)) else layers
        # greedy replay against the target's argmax needs output-of-layer L-1 (un-normed) in the root
        last_id = self.draft.target_info.num_layers - 1
        self.last_index = captured.index(last_id) if (cfg.eval_samples and last_id in captured) else None
        if cfg.eval_samples and self.last_index is None:
            log.warning("[%s] --eval-samples %d: the root does not capture the target's last layer %d (captured: "
                        "%s), so the held-out evaluation has no greedy replay against the target's argmax: no "
                        "replay_tau, its acceptance figures use the data tokens (a run config captures %d for a "
                        "held-out split: capture.replay_layer)", cfg.consumer_id, cfg.eval_samples, last_id,
                        captured, last_id)
        if self.group is not None:  # before anything is written: every rank runs the same consumer
            self._agree()
        if not self.main:
            return
        # a save killed mid-way left its temp directory (nothing else removes it): gone before the space check
        gone, freed = remove_orphan_temps(self.run_dir)
        if gone:
            log.warning("[%s] removed %d checkpoint temp director%s of a dead earlier process (%s) under %s",
                        cfg.consumer_id, gone, "y" if gone == 1 else "ies", format_bytes(freed), self.run_dir)
        self._check_checkpoint_space()

    def _agree(self) -> None:
        """The ranks of a group refuse to start unless they agree about the plan, the contract, the window, the
        batch, the resume point and the draft (:func:`~.group.agree`).

        Raises:
            ConfigError: naming the rank and the setting it disagrees about.
        """
        cfg, st = self.cfg, self.resumed.state if self.resumed is not None else None
        agree(self.group, {
            "cache": str(self.layout.root), "consumer_id": cfg.consumer_id, "plan_id": self.settings.plan_id,
            "contract_id": self.settings.contract.contract_id, "window": [cfg.lookbehind, cfg.lookahead],
            "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "world": self.world, "cp": cfg.cp,
            "steps": cfg.steps,
            "resume_point": [st.step, st.cursor, str(self.resumed.path)] if st is not None else None,
            "shard": cfg.shard, "run": run_settings(cfg), "draft_config": jsonable(self.draft.config_dict()),
            "init_from": cfg.init_from, "out_dir": str(self.run_dir), "device_type": self.device.type})

    def _check_checkpoint_space(self) -> None:
        """The checkpoints this run writes (sized from the draft before step 1: trainable weights, the AdamW
        state they will have, extras, RNG, at their dtypes) must fit under the run directory.

        Raises:
            InsufficientSpace: naming the bytes needed and free (before anything is written).
        """
        cfg = self.cfg
        if not cfg.checkpoints:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]  # the optimizer's, in its order
        opt = adamw_state_specs(params) if cfg.checkpoint_optimizer else None
        size = checkpoint_size(self.model.trainable_state_dict(), self.draft.extra_tensors(), opt,
                               self.draft.generators())
        start = self.resumed.state.step if self.resumed is not None else 0
        # a held-out split makes the run follow checkpoints/best: an evaluation that beats the best so far
        # checkpoints its step, and prune keeps that one even outside the newest --keep-checkpoints
        best = bool(cfg.eval_samples)
        saves = planned_saves(start, cfg.steps, cfg.save_every, cfg.eval_interval if best else 0)
        existing = len(list_checkpoints(self.run_dir)) if self.resumed is not None else 0
        needed = check_checkpoint_space(self.run_dir, size, keep=cfg.keep_checkpoints, saves=saves,
                                        existing=existing, best=best, what=f"consumer {cfg.consumer_id!r}")
        self.checkpoint_bytes = size
        log.info("[%s] checkpoints: %s each (%s), %d to write, %s free space needed under %s", cfg.consumer_id,
                 format_bytes(size.total), "with optimizer state" if opt is not None else "weights only", saves,
                 format_bytes(needed), self.run_dir)

    # ---- resume: the start's weights, and for --resume its optimizer, RNG, step and cursor ---------------

    def resume(self) -> None:
        cfg, draft = self.cfg, self.draft
        if self.resumed is not None:
            check_same_draft(self.resumed.state.draft_config, draft.config_dict(), self.resumed.path)
            load_weights_strict(self.model, self.resumed.weights, f"checkpoint {self.resumed.path}")
        elif self.init is not None:
            src = self.init.source
            load_weights_strict(self.model, load_seed(self.init), f"--init-from {src.path}")
            log.info("[%s] weights seeded from %s (%s)%s", cfg.consumer_id, src.path, src.layout,
                     " (its own vocab map kept)" if self.init.coverage is not None else "")
        if self.group is not None and cfg.shard == "full":  # weights loaded whole, then cut (before the optimizer)
            self.units = shard_draft(self.model, self.device, self.world)
            draft.train_module = self.model
            mine = sum(p.to_local().numel() for p in self.model.parameters() if p.requires_grad)
            whole = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            log.info("[%s] --shard full: %d FSDP units over %d ranks; rank %d holds %d of the %d trainable parameters",
                     cfg.consumer_id, len(self.units), self.world, self.group.rank, mine, whole)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                           fused=True)
        self.generators = draft.generators()
        # gradients averaged over the ranks in backward (DDP's buckets); with --cp the context-parallel gathers'
        # backward is a collective of its own inside the graph, so the ranks' gradients are averaged after the backward
        # instead (_accumulate); with --shard full FSDP2 reduce-scatters them (shard_draft above)
        if self.group is not None and self.cp_group is None and not self.units:
            import inspect

            from torch.nn.parallel import DistributedDataParallel

            # the draft's buffers are the frozen target's tensors, the same on every rank: never re-sent per forward
            known = inspect.signature(DistributedDataParallel).parameters
            quiet = {"forward_sync_buffers": False} if "forward_sync_buffers" in known else {"broadcast_buffers": False}
            self.ddp = DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda"
                                               else None, **quiet)
            draft.train_module = self.ddp
        if self.resumed is not None:
            st = self.resumed.state
            saved = self.resumed.optimizer if not self.units else shard_optimizer_state(self.optimizer,
                                                                                         self.resumed.optimizer)
            restore_optimizer(self.optimizer, saved, st.param_groups)
            restore_rng(self.resumed.rng, self.generators)
            self.start_step, self.start_cursor = st.step, st.cursor
            self.saved_step, self.ckpt = st.step, self.resumed.path
        self.argmax_fn = target_argmax_fn(draft.target_info, draft.target_lm_head, self.device) \
            if self.last_index is not None else None
        self.best_metric = self._best_metric()
        best = best_checkpoint(self.run_dir) if self.resumed is not None and self.best_metric else None
        if best is not None:  # the best so far of the run this one continues
            ev = read_state(best).eval or {}
            if isinstance(ev.get(self.best_metric), (int, float)):
                self.best = (self.best_metric, float(ev[self.best_metric]), read_state(best).step)

    def _best_metric(self) -> str | None:
        """The held-out figure ``checkpoints/best`` follows (None without evaluation).

        Raises:
            ConfigError: ``--best-metric`` names a figure this run's evaluation cannot give.
        """
        cfg = self.cfg
        if not cfg.eval_samples:
            return None
        if cfg.best_metric is None:
            return "replay_tau" if self.argmax_fn is not None else self.draft.progress_metric
        if cfg.best_metric in REPLAY_FIGURES and self.argmax_fn is None:  # the name itself: cfg.validate()
            last = self.draft.target_info.num_layers - 1
            raise ConfigError(f"--best-metric {cfg.best_metric} needs the target's last layer {last} in the root "
                              f"(captured: {list(self.settings.contract.layer_ids)}); choose --best-metric "
                              f"{self.draft.progress_metric} or loss")
        return cfg.best_metric

    # ---- register: run directory, journal, registration, tracker, reader, heartbeat, signals ------------

    def register(self) -> None:
        if not self.main:
            self._register_rank()
        else:
            self._register_main()
        self._start()

    def _register_main(self) -> None:
        """Register the consumer (rank 0 of a group: for the whole group, whose other ranks learn the outcome)."""
        cfg, layout = self.cfg, self.layout
        try:
            # a bad --out was refused in setup (nothing in the root); the run directory is created once registered
            # before anything is written: a --reader process ring that cannot be allocated leaves nothing behind
            self.ring = SlotRing(*self._ring_shape(), self.device) if cfg.reader == "process" else None
            self.journal = J.JournalWriter(layout.journal_path("consumer", cfg.consumer_id))
            try:
                reg = registry.register(layout, registry.Registration(
                    consumer_id=cfg.consumer_id, draft=cfg.draft, cursor=self.start_cursor,
                    lookbehind=cfg.lookbehind, lookahead=cfg.lookahead, batch_size=cfg.global_batch, end=self.end,
                    pid=os.getpid(), host=host_id(), pinned=self.pinned,
                    checkpoint_cursor=self.start_cursor if self.resumed is not None else -1,
                    epoch_len=self.epoch_len, out_dir=str(self.run_dir)),
                    check=self._check_resume, live_timeout_s=self.settings.heartbeat_timeout_s)
            except BaseException:
                self.journal.close(remove_if_empty=True)  # a refused start leaves no empty journal behind
                raise
            # a registration write failing for space is retried for up to the heartbeat timeout (then the producer
            # fences a silent consumer anyway) before it ends the run
            handle_class = registry.ConsumerHandle if self.group is None else GroupHandle
            self.handle = handle_class(layout, reg, space_wait_s=self.settings.heartbeat_timeout_s)
            try:  # after registering: a refused start creates no run directory, a refused resume touches no metrics
                _make_run_dir(self.run_dir)
                self._drop_unrecorded()
                resuming = self.resumed is not None or cfg.resume
                self.tracker = RunTracker(self.run_dir, tensorboard=cfg.tensorboard,
                                          resume_step=self.start_step if resuming else None, trackers=cfg.trackers,
                                          run_name=cfg.consumer_id, project=cfg.tracker_project)
            except BaseException as exc:
                self.handle.finish("failed", f"{type(exc).__name__}: {exc}")
                self.journal.close()
                raise
        except BaseException as exc:
            if self.group is not None:  # the other ranks stop with rank 0's reason
                self.group.broadcast(exc if isinstance(exc, Exception) else KeyboardInterrupt())
            raise
        if self.group is not None:
            self.group.broadcast(reg.generation)
        self.reg = reg

    def _register_rank(self) -> None:
        """A rank > 0: wait for rank 0's registration of the group and take a handle on it (its own demand); its
        requests and leases go to its own journal, ``reader-<id>-<token>.jsonl``."""
        cfg, layout = self.cfg, self.layout
        got = self.group.broadcast(None)
        if isinstance(got, BaseException):
            raise got
        reg = registry.read(layout, cfg.consumer_id)
        if reg is None or reg.generation != got or reg.state != "running":
            raise ConsumerFenced(f"consumer {cfg.consumer_id!r}: rank 0 registered generation {got}, the registry "
                                 f"holds {reg.generation if reg else 'none'} ({reg.state if reg else 'missing'})")
        self.journal = J.JournalWriter(layout.journal_path("reader", cfg.consumer_id))
        self.handle = GroupHandle(layout, reg, space_wait_s=self.settings.heartbeat_timeout_s)
        self.reg = reg

    def _start(self) -> None:
        """The client, the reader, the journal's start, the signal handlers, the evaluator, the heartbeat."""
        cfg, layout, reg = self.cfg, self.layout, self.reg
        if self.resumed is not None and self.main:  # one line for the group, as for one process
            log.info("[%s] resumed from %s: step %d, cursor %d", cfg.consumer_id, self.resumed.path, self.start_step,
                     self.start_cursor)
        # the client stack its reader process builds the same way (CacheClient.for_consumer), over this rank's handle
        self.client = CacheClient.for_consumer(layout, self.settings, self.plan, reg, self.journal,
                                               cfg.demand_timeout_s, pin=self.device.type == "cuda",
                                               epoch_len=self.epoch_len, handle=self.handle)
        group = [m for m in cfg.lockstep_group.split(",") if m]
        # a rank reads its own slice of each global batch: grad_accum micro-batches of batch_size positions
        rank = self.dp_rank  # the ranks of a CP group (--cp) read the same slice
        share = cfg.batch_size * cfg.grad_accum
        if self.ring is not None:
            self.reader = self._reader_process(reg, group, self.ring)
        else:
            self.reader = Reader(self.client, reg.cursor + rank * share, share, cfg.lookahead, cfg.prefetch_batches,
                                 end=self.end, group_cursor=(lambda: group_cursor(layout, group)) if group else None,
                                 collate=self._collator(), workers=read_workers(cfg), stride=cfg.global_batch,
                                 step_positions=self.packer.step_positions if self.packer else None)
        # the other ranks' journals (reader-<id>-<token>.jsonl), named in the start event for the run's report
        tokens = self.group.all_gather(this_process().token()) if self.group is not None else []
        if self.main:
            self.journal.emit(J.ConsumerStart(consumer=cfg.consumer_id, pid=os.getpid(), draft=cfg.draft,
                                              block_size=cfg.block_size or 0, batch_size=cfg.global_batch,
                                              lookbehind=cfg.lookbehind, lookahead=cfg.lookahead, cursor=reg.cursor,
                                              step=self.start_step, pinned=self.pinned[1] - self.pinned[0],
                                              epoch_len=self.epoch_len, reader=getattr(self.reader, "token", ""),
                                              ranks=self.world, spec=self.spec, rank_readers=tokens[1:]))
        # SIGTERM / Ctrl-C end the run at the next step boundary: checkpoint, fenced as "cancelled", leases
        # released, journal closed (in the main thread only; the previous handlers come back in close())
        self.shutdown.install()
        self.evaluator = Evaluator(self.draft, self.client, range(*self.pinned), cfg.batch_size, self._collate_eval,
                                   self.argmax_fn, self.stop_req) if cfg.eval_samples and self.main else None
        self.cursor, self.steps_done = reg.cursor, self.start_step
        self.committed, self.t_committed = reg.cursor, time.monotonic()
        self.progress = Progress(cfg.steps, self.start_step, cfg.progress and self.main, cfg.consumer_id)
        self.t_start, self.t_loop = time.time(), time.monotonic()
        if self.main:  # the group's one registration: rank 0 keeps it alive
            threading.Thread(target=self._heartbeat, daemon=True, name="artcache-heartbeat").start()
        self.reader.start()

    def _drop_unrecorded(self) -> None:
        """``--resume`` from step 0: remove the checkpoints the killed incarnation wrote and never recorded
        (:func:`~.restore.unrecorded_checkpoints`; registering fenced it), so no later lookup by cursor finds
        one of them; the steps they hold are trained again from the same state."""
        if not self.unrecorded:
            return
        log.warning("[%s] --resume: the registry recorded none of the checkpoints in %s (%s: the last run was "
                    "killed before recording its first one); continuing from step 0 and replacing them",
                    self.cfg.consumer_id, self.run_dir, ", ".join(p.name for p in self.unrecorded))
        for path in self.unrecorded:
            shutil.rmtree(path, ignore_errors=True)
        for name in ("latest", "best"):  # a pointer left at a removed checkpoint
            link = self.run_dir / "checkpoints" / name
            if link.is_symlink() and not link.exists():
                link.unlink()

    def _check_resume(self, old: registry.Registration | None) -> None:
        """Under the registry lock: a resumed checkpoint must be the one the registry recorded last; a fresh run
        must not start over an earlier run of this id that recorded a checkpoint (:func:`refuse_reused_id`)."""
        if not self.cfg.resume:
            refuse_reused_id(self.cfg.consumer_id, old, self.run_dir)
        if self.unrecorded and (old is None or old.checkpoint_cursor >= 0):
            raise ConfigError(f"--resume: consumer {self.cfg.consumer_id!r} recorded a checkpoint meanwhile "
                              f"(cursor {old.checkpoint_cursor if old else 'absent'}); run --resume again")
        if self.resumed is not None and (old is None or old.checkpoint_cursor != self.start_cursor):
            raise ConfigError(
                f"--resume: consumer {self.cfg.consumer_id!r}'s recorded checkpoint cursor is "
                f"{old.checkpoint_cursor if old else 'absent'}, checkpoint {self.resumed.path} has cursor "
                f"{self.start_cursor}")

    def _heartbeat(self) -> None:
        while not self.beat_stop.wait(self.cfg.heartbeat_s):
            try:
                self.handle.heartbeat()
                self.journal.flush_held()  # events held while the disk was full: written once space is back
            except ConsumerFenced as exc:
                log.error("%s", exc)
                self.fenced.set()
                self.reader.stop.set()
                return
            except Exception as exc:  # a transient filesystem error: try again next beat
                log.warning("heartbeat failed: %s", exc)

    def _collator(self):
        """The reader thread's collate: on the device without host copies (CUDA), else :func:`collate`; packed rows
        (:func:`~artcache.trainers.packing.collate_packed`) with ``--pack-tokens``."""
        if self.packer is not None:
            device, layers, rows, tokens = self.device, self.layers, self.cfg.batch_size, self.cfg.pack_tokens
            return lambda items: Fetched(items, collate_packed(items, device, rows, tokens, layers))
        if self.device.type == "cuda":  # length buckets only help a compiled draft (few shapes)
            return DeviceCollator(self.device, self.layers, self._length_bucket())
        device, layers = self.device, self.layers
        return lambda items: Fetched(items, collate(items, device, layers))

    def _length_bucket(self) -> int:
        """Pad batch lengths to a multiple of this on CUDA when the draft is compiled (few shapes); else 0."""
        speed = getattr(self.draft, "speed", None)
        compiled = self.device.type == "cuda" and speed is not None and speed.compile != "off"
        return self.cfg.length_bucket if compiled else 0

    def _layer_list(self) -> list[int] | None:
        """The captured-layer indices the draft reads (None: every layer, in order)."""
        if self.layers is None:
            return None
        if isinstance(self.layers, slice):
            return list(range(self.layers.start, self.layers.stop))
        return [int(i) for i in self.layers]

    def _ring_shape(self) -> tuple[int, int]:
        """``--reader process``'s ring: ``(slots, slot bytes)``: ``prefetch_batches + 3`` slots, each sized for a
        full batch at the root's max length (padded to the length bucket)."""
        cfg, contract = self.cfg, self.settings.contract
        layers = self._layer_list()
        m = len(contract.layer_ids) if layers is None else len(layers)
        bucket = self._length_bucket()
        tokens = contract.max_length if bucket <= 1 else -(-contract.max_length // bucket) * bucket
        # a slot holds one step's batch of this process: --grad-accum micro-batches of --batch-size
        return cfg.prefetch_batches + 3, slot_bytes(cfg.batch_size * cfg.grad_accum, tokens, m,
                                                    self.draft.target_info.hidden_size,
                                                    batch_itemsize(contract.dtype, self.device.type))

    def _reader_process(self, reg: registry.Registration, group: list[str], ring: SlotRing) -> ProcessReader:
        """``--reader process``: the reader in a child process (:mod:`.reader_process`) over ``ring``
        (:meth:`_ring_shape`, allocated before anything was written)."""
        cfg = self.cfg
        layers = self._layer_list()
        slots, nbytes = self._ring_shape()
        start = Start(root=str(self.layout.root), consumer_id=cfg.consumer_id, generation=reg.generation,
                      start_pos=reg.cursor, batch=cfg.batch_size * cfg.grad_accum, lookahead=cfg.lookahead,
                      depth=cfg.prefetch_batches,
                      end=self.end, workers=read_workers(cfg), demand_timeout_s=cfg.demand_timeout_s,
                      epoch_len=self.epoch_len, layers=layers,
                      hidden_dtype="bfloat16" if self.device.type == "cuda" else None,
                      slots=slots, slot_bytes=nbytes,
                      group=group, length_bucket=self._length_bucket(),
                      log_level=logging.getLogger("artcache").getEffectiveLevel(),
                      beat_s=cfg.heartbeat_s, progress_timeout_s=self.settings.heartbeat_timeout_s)
        return ProcessReader(start, self.device, ring=ring)

    def _collate_eval(self, items: list[Leased], with_last: bool) -> DraftBatch:
        return collate(items, self.device, self.layers, self.last_index if with_last else None)

    # ---- run: the loop ------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Step to ``--steps`` (checkpoints and evaluations on their intervals), then close; the summary."""
        cfg = self.cfg
        evaluating = bool(cfg.eval_samples)
        try:
            if evaluating and cfg.eval_interval and self.start_step == 0:
                # the untrained draft: the baseline every later evaluation is compared with
                self._on_main(lambda: self.evaluate(0))
            for step_index in range(self.start_step, cfg.steps):
                self.step(step_index)
                done = self.steps_done
                if evaluating and cfg.eval_interval and done % cfg.eval_interval == 0 and done < cfg.steps:
                    self._on_main(lambda d=done: self.evaluate(d))  # before a checkpoint of the same step
                if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps and self.saved_step != done:
                    self._on_main(self.checkpoint)
            if evaluating and self.last_eval.get("step") != self.steps_done:
                self._on_main(lambda: self.evaluate(self.steps_done))
            self._check_finite()
            self._final_snapshot()
            self.state = registry.COMPLETED
        except TrainingDiverged as exc:
            self.diverged = True
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        except KeyboardInterrupt:
            self.state, self.error = "cancelled", "interrupted"
            if self.group_stop:  # every rank stopped at this step boundary: they gather its final checkpoint
                self._final_snapshot()
            raise
        except BaseException as exc:
            self.error, self.failure = f"{type(exc).__name__}: {exc}", exc
            raise
        finally:
            self.close()
        if self.save_error is not None:
            raise self.save_error
        return self.summary()

    def _on_main(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (an evaluation, a checkpoint) on the process that writes for the consumer; in a group the
        other ranks wait for it (the slow group), take over what the run loop decides by (the step of the newest
        checkpoint and of the last evaluation) and stop with its error when it fails."""
        if self.group is None:
            fn()
            return
        if self.units:  # --shard full: every rank gathers what rank 0's evaluation and checkpoint read
            self._gather_snapshot()
            with gathered(self.units):
                self._on_main_group(fn)
            return
        self._on_main_group(fn)

    def _on_main_group(self, fn: Callable[[], object]) -> None:
        if self.main:
            try:
                fn()
            except BaseException as exc:
                self.group.broadcast(exc if isinstance(exc, Exception) else KeyboardInterrupt())
                raise
            self.group.broadcast((self.saved_step, self.last_eval.get("step")))
            return
        got = self.group.broadcast(None)
        if isinstance(got, BaseException):
            raise got
        self.saved_step, self.last_eval = got[0], {"step": got[1]}

    def _gather_snapshot(self) -> None:
        """``--shard full``: every rank gathers the full weights and optimizer state of this step (a collective);
        rank 0 keeps them for its checkpoint of the step (:meth:`_checkpoint_tensors`)."""
        if not self.cfg.checkpoints or self.gathered_step == self.steps_done:  # the same on every rank
            return
        weights = gather_weights(self.model.trainable_state_dict(), keep=self.main)
        opt = gather_optimizer(self.optimizer, keep=self.main) if self.cfg.checkpoint_optimizer else None
        self.gathered_step = self.steps_done
        self.snapshot = (self.steps_done, weights, opt) if self.main else None

    def _final_snapshot(self) -> None:
        """``--shard full``, every rank at the end of the run (or at the boundary every rank stopped at): gather
        the state of the final checkpoint :meth:`close` writes on rank 0. Without it (a rank failed) there is no
        final checkpoint, and ``--resume`` continues from the last recorded one."""
        if self.units and self.consistent and self.steps_done > max(self.saved_step, 0) and not self.diverged:
            self._gather_snapshot()

    def _checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer | dict | None]:
        """What :meth:`checkpoint` writes: the trainable weights and the optimizer (None: weights only); under
        ``--shard full`` the full ones every rank gathered for this step (:meth:`_gather_snapshot`).

        Raises:
            CheckpointWriteError: ``--shard full`` and no gathered state of this step (a rank is gone)."""
        opt = self.optimizer if self.cfg.checkpoint_optimizer else None
        if not self.units:
            return self.model.trainable_state_dict(), opt
        if self.snapshot is None or self.snapshot[0] != self.steps_done:
            raise CheckpointWriteError(f"--shard full: the ranks did not gather step {self.steps_done}'s weights "
                                       f"and optimizer state (a rank stopped first); --resume continues from the "
                                       f"last recorded checkpoint {self.ckpt}",
                                       last_good=str(self.ckpt) if self.ckpt else None)
        return self.snapshot[1], self.snapshot[2]

    # ---- step: one batch, one optimizer step, a cursor commit when due ----------------------------------

    def step(self, step_index: int) -> None:
        """One batch, one optimizer step, a cursor commit when due (:meth:`_commit_due`). On CUDA nothing here
        reads device memory back: the batch arrives collated on the device (the reader thread's
        :class:`DeviceCollator`), the metric sums stay on the device until :meth:`_flush_metrics`."""
        t0 = time.monotonic()
        fetched = self._next_batch()
        try:
            # every rank holds its slice or was asked to stop while it waited for it (a demand miss may take long:
            # the slow group); a stop request of any rank stops every rank here, so a signal reaches the ranks
            # waiting in this collective for a peer that waits for data
            if self.group is not None and self.group.any_slow(fetched is None or self.stop_req.is_set()):
                self.group_stop = True
                raise KeyboardInterrupt("signal")
            wait_s = time.monotonic() - t0
            self.wait_total += wait_s
            batch = fetched.wait()
            self.consistent = False  # from the anchor draw on, until the step's cursor is set
            sums, lr = self.train_step(batch, step_index)
        except BaseException:  # a failed step or collective: its batch's leases go, as close() releases the queued
            if fetched is not None:
                self.reader.done(fetched)
            raise
        t_launched = time.monotonic()
        # one past the global batch: this rank's slice starts rank × its share after the batch's first position
        first = fetched.positions[0] - self.dp_rank * self.cfg.batch_size * self.cfg.grad_accum
        # a packed step (one process) consumed the positions its rows hold
        self.cursor = first + self.cfg.global_batch if self.packer is None else fetched.positions[-1] + 1
        # the step no longer needs the batch's bytes: release its leases while its positions are still inside the
        # window (it counts from the committed cursor, <= this one), keep its host buffers until its copies
        # completed (a reader process: hand its slot back), then commit when due
        self.reader.done(fetched)
        if self.group is not None:  # every rank finished the optimizer step: the sums of the whole global batch
            sums = self._reduce(sums)
        self.steps_done, self.consistent = step_index + 1, True
        t_released = time.monotonic()
        if self.group is not None:
            self._commit_group()
        elif self._commit_due():
            self._commit()
        t_committed = time.monotonic()
        if self.main:
            self._record(step_index, sums, lr, wait_s, time.monotonic() - t0)
        t_end = time.monotonic()
        for phase, dt in zip(HOST_PHASES, (wait_s, t_launched - t0 - wait_s, t_released - t_launched,
                                           t_committed - t_released, t_end - t_committed), strict=True):
            self.host_s[phase].append(dt)
        if self.step_hook is not None:
            self.step_hook(step_index)
        if self.device.type != "cuda":  # reading the flag costs nothing off the GPU: caught at its own step
            self._check_finite()

    def _reduce(self, sums: MetricSums | PendingSums) -> MetricSums:
        """All-reduce a step's metric sums over the group (after every rank's optimizer step: the collective also
        tells rank 0 that every rank finished it), with each rank's stop request: any rank asked to stop (SIGTERM,
        Ctrl-C), so all stop at this step boundary (:attr:`group_stop`)."""
        # a draft's sums may name figures only some ranks measured (DSpark's calibration bins): reduce the union
        names = sorted({n for ns in self.group.all_gather(sums_names(sums)) for n in ns})
        vec, layout = sums_vector(sums, self.device, names)
        vec = torch.cat((vec, torch.tensor([float(self.stop_req.is_set())], dtype=torch.float64, device=self.device)))
        torch.distributed.all_reduce(vec)
        self.group_stop = bool(vec[-1] > 0)
        return sums_from_vector(vec[:-1], layout)

    def _commit_group(self) -> None:
        """A group commits after every step: rank 0 commits the cursor every rank's optimizer step consumed (the
        all-reduce of :meth:`_reduce` came after each of them), then tells the others whether it held; a fence
        of the registration stops every rank (ConsumerFenced), and each rank's reader reads on inside the moved
        window."""
        if self.main:
            try:
                self._commit()
            except BaseException as exc:
                self.group.broadcast(exc if isinstance(exc, Exception) else KeyboardInterrupt())
                raise
            self.group.broadcast(None)
        else:
            got = self.group.broadcast(None)
            if isinstance(got, BaseException):
                if isinstance(got, ConsumerFenced):
                    self.fenced.set()
                raise got
            self.committed = self.cursor
            self.reader.authorize(self.cursor)

    def _commit_due(self) -> bool:
        """Whether :meth:`step` commits now (``cfg.commit_interval_s``): after every step with an interval of 0, in a
        lockstep group (the members read by the group's committed cursors) and after the last step; once the
        interval passed since the last commit; and at once when the committed window would hold the reader back.
        The reader keeps up to ``prefetch_batches`` batches queued and reads one more, so it wants positions up to
        ``cursor + (prefetch_batches + 1) × global batch - 1`` (``--grad-accum`` micro-batches of ``--batch-size``), and
        may read only up to ``committed + lookahead``."""
        cfg = self.cfg
        if cfg.commit_interval_s == 0 or cfg.lockstep_group or self.steps_done >= cfg.steps:
            return True
        if time.monotonic() - self.t_committed >= cfg.commit_interval_s:
            return True
        if self.packer is None:
            wanted = min(cfg.lookahead, (cfg.prefetch_batches + 1) * cfg.global_batch - 1)
        else:  # packed steps consume varying positions: the plan says how many the next ones hold
            wanted = min(cfg.lookahead, self.packer.end_after(cfg.prefetch_batches + 1, self.cursor) - self.cursor - 1)
        return self.committed + cfg.lookahead < self.cursor + wanted

    def _commit(self) -> None:
        """Commit ``self.cursor`` (every position before it was trained on) to the registration and let the reader
        read on inside the moved window; nothing when it is committed already. Crash points ``cursor.before-commit``
        and ``cursor.after-commit`` (the n-th arrival is the n-th commit, not the n-th step).

        Raises:
            ConsumerFenced: the registration is no longer this incarnation's (``fenced`` is set; the state is that of
                the last step, consistent and uncommitted).
            OSError: the registration could not be written (after the full-disk retries of
                :class:`~artcache.registry.ConsumerHandle`).
        """
        if self.cursor == self.committed:
            return
        crash_point("cursor.before-commit")
        try:
            self.handle.commit_cursor(self.cursor)  # only after the step that consumed the positions
        except ConsumerFenced:
            self.fenced.set()
            raise
        crash_point("cursor.after-commit")
        self.committed, self.t_committed = self.cursor, time.monotonic()
        self.reader.authorize(self.cursor)

    # ---- divergence: a non-finite loss or gradient stops the run, no checkpoint after it ------------------

    def _watch_finite(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record on the device (no host sync) the first step whose loss or gradient norm is not finite."""
        bad_loss = ~torch.isfinite(loss.detach())
        bad_grad = ~torch.isfinite(grad_norm.detach())
        what = bad_loss.long() + 2 * bad_grad.long()
        if self.bad_step is None:
            self.bad_step = torch.full((), -1, dtype=torch.long, device=what.device)
            self.bad_what = torch.zeros((), dtype=torch.long, device=what.device)
        first = (self.bad_step < 0) & (what > 0)
        self.bad_step = torch.where(first, torch.full_like(self.bad_step, step), self.bad_step)
        self.bad_what = torch.where(first, what, self.bad_what)

    def _check_finite(self) -> None:
        """Read the divergence flag (one host sync): every step off the GPU; on CUDA at each log line, before
        every checkpoint and evaluation and at the end, so divergence is caught within ``--log-every`` steps
        and never checkpointed.

        Raises:
            TrainingDiverged: naming the first non-finite step, what was non-finite and the checkpoint kept.
        """
        if self.bad_step is None or self.diverged:
            return
        step = int(self.bad_step)
        if step < 0:
            return
        self.diverged = True
        what = {1: "loss", 2: "gradient norm", 3: "loss and gradient norm"}[int(self.bad_what)]
        kept = f"the last finite checkpoint {self.ckpt} (step {self.saved_step}) is kept" if self.ckpt else \
            "no checkpoint was written before it"
        raise TrainingDiverged(f"[{self.cfg.consumer_id}] non-finite {what} at step {step} (--lr {self.cfg.lr:g}): "
                               f"training diverged and stopped; {kept}; lower --lr or check the data", step=step)

    def train_step(self, batch: DraftBatch, step_index: int) -> tuple[MetricSums | PendingSums, float]:
        """The compute of one step on ``batch``: the scheduled lr (horizon ``cfg.horizon``), forward, backward,
        clip, the divergence flag (:meth:`_watch_finite`), optimizer step.
        Returns (the step's metric sums, its lr). (``artcache.bench.offline`` times it on batches held in
        memory: the consumer's rate without the cache.)"""
        cfg = self.cfg
        lr = lr_at(step_index, cfg.horizon, cfg.lr, cfg.warmup_frac, cfg.min_lr_frac)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.group is None and cfg.grad_accum == 1:
            loss, sums = self.draft.loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss, sums = self._accumulate(micro_batches(batch, cfg.grad_accum))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        if self.units:  # FSDP2: the norm over every rank's shards, a replicated DTensor
            grad_norm = grad_norm.to_local()
        self._watch_finite(step_index + 1, loss, grad_norm)  # on the device: no host sync
        self.optimizer.step()
        return sums, lr
    def _accumulate(self, micro: list[DraftBatch]) -> tuple[torch.Tensor, MetricSums | PendingSums]:
        """Forward and backward over this rank's micro-batches, leaving in ``.grad`` the gradient of the loss over
        the step's whole global batch (every rank's micro-batches): the draft's loss terms
        (:meth:`~artcache.trainers.draft.Draft.loss_terms`, ``Σ c · num / den``) are normalised by their
        denominators summed over the global batch, never averaged per micro-batch or per rank.

        DFlash (one term): each micro-batch's backward takes ``loss × den`` (its sum), then the gradients are
        scaled by ``world / Σ den`` (DDP or FSDP2 averaged them over the ``world`` ranks). A draft with
        :attr:`~artcache.trainers.draft.Draft.global_denominators` (DSpark: its fused loss rounds a gradient
        scaled by 1 / Σ w; EAGLE-3: one denominator per TTT step): each term's denominators are found first
        (:meth:`~artcache.trainers.draft.Draft.loss_denominators`, else a forward without gradients), summed over
        the micro-batches and the ranks, and the draft divides by them (``loss(batch, denominators=...)``; under
        ``--cp`` each rank's denominators count the blocks it trains, and the gradients are averaged here). DDP
        all-reduces once, in the last micro-batch's backward (``no_sync`` before it); FSDP2 (``--shard full``)
        reduce-scatters once, there (``set_requires_gradient_sync(False)`` before it).

        Returns (the mean loss of the last micro-batch, detached; this rank's metric sums over its micro-batches).
        """
        terms = self.draft.loss_terms()
        world, dev = self.world, self.device
        last = len(micro) - 1

        def sync(k: int):
            if self.units:  # FSDP2: reduce-scatter in the last micro-batch's backward only; the root gathered
                self.units[-1].set_requires_gradient_sync(k == last)
                self.units[-1].unshard()  # for the draft's reads of its parameters outside forward (its loss)
                return nullcontext()
            return self.ddp.no_sync() if self.ddp is not None and k < last else nullcontext()

        def every_param(loss: torch.Tensor) -> torch.Tensor:
            """``loss`` plus 0 × one element of every trainable parameter: each gets a gradient in every backward
            (DDP's buckets wait for all of them; FSDP2 reduce-scatters what has one), also one the batch did not
            use (EAGLE-3's lm_head when no position of a step was kept); the gradients' values are unchanged.
            Under FSDP2 the parameters gathered now (the root's; a layer's got one in its forward)."""
            if self.ddp is None and not self.units:
                return loss
            params = local_params(self.model) if self.units else self.params
            return loss + sum(p.reshape(-1)[:1].sum() for p in params).to(loss.dtype) * 0.0

        total = None
        if not self.draft.global_denominators:
            name = terms[0][0]
            den = torch.zeros((), dtype=torch.float64, device=dev)
            for k, mb in enumerate(micro):
                with sync(k):
                    loss, sums = self.draft.loss(mb)
                    d = denominator(sums, name, dev)
                    every_param(loss * d.to(loss.dtype)).backward()
                den = den + d
                total = sums if total is None else _add_sums(total, sums)
            if self.group is not None:
                torch.distributed.all_reduce(den)
            if self.cp_group is not None:  # --cp: no DDP (nor FSDP2); the ranks' gradients averaged here
                self._average_grads()
            scale = world / den.clamp_min(1e-30)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        else:
            names = [n for n, _ in terms]
            parts = []
            if self.units:  # the denominators' forward may read the root's parameters outside its forward
                self.units[-1].unshard()
            for mb in micro:
                got = self.draft.loss_denominators(mb)
                if got is None:  # counted by a forward without gradients
                    with torch.no_grad():
                        sums = self.draft.loss(mb)[1]
                    got = torch.stack([denominator(sums, n, dev) for n in names])
                parts.append(got.to(device=dev, dtype=torch.float64))
            den = torch.stack(parts).sum(0)
            if self.group is not None:
                torch.distributed.all_reduce(den)
            for k, mb in enumerate(micro):
                with sync(k):
                    loss, sums = self.draft.loss(mb, denominators=den / world)
                    every_param(loss).backward()
                total = sums if total is None else _add_sums(total, sums)
            if self.cp_group is not None:  # --cp: each rank's denominators count its own blocks; averaged here
                self._average_grads()
        return loss.detach(), total

    def _average_grads(self) -> None:
        """Average the trainable parameters' gradients over the group (one all-reduce of their concatenation; a
        missing gradient counts as zeros): what DDP does in backward, for a context-parallel run (``--cp``), whose
        ranks each hold the gradient of every rank's loss through their own part of the computation."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()

    def _check_finite_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Refuse to checkpoint non-finite weights (one host sync, at checkpoint time only). A step whose loss
        and gradient were finite can still overflow the weights in its update (``--lr 1e38``); the next
        step's loss would be NaN, but the checkpoint of this step must not be written.

        Raises:
            TrainingDiverged: naming the step and the first non-finite tensors.
        """
        floats = [(k, v) for k, v in weights.items() if v.is_floating_point()]
        if not floats:
            return
        ok = torch.stack([v.isfinite().all() for _, v in floats]).cpu()
        if bool(ok.all()):
            return
        self.diverged = True
        bad = [k for (k, _), good in zip(floats, ok.tolist(), strict=True) if not good]
        kept = f"the last finite checkpoint {self.ckpt} (step {self.saved_step}) is kept" if self.ckpt else \
            "no checkpoint was written before it"
        step = self.steps_done
        raise TrainingDiverged(f"[{self.cfg.consumer_id}] non-finite weights at step {step} ({', '.join(bad[:3])}"
                               f"{', …' if len(bad) > 3 else ''}; --lr {self.cfg.lr:g}): training diverged and "
                               f"stopped; {kept}; lower --lr or check the data", step=step)

    def _next_batch(self) -> Fetched | None:
        """The reader's next batch; raises what stopped the reader, a signal's request, or a fence. In a group a
        signal's request while the batch is awaited returns None: :meth:`step` stops every rank on it."""
        got = None
        if self.group_stop:  # a rank of the group was asked to stop: all stop at this boundary
            raise KeyboardInterrupt("signal")
        while got is None:
            if self.stop_req.is_set():
                if self.group is not None:
                    return None
                raise KeyboardInterrupt("signal")
            if self.fenced.is_set():  # the heartbeat found the fence and stopped the reader: no batch will come
                raise ConsumerFenced(f"consumer {self.cfg.consumer_id} was fenced")
            try:
                got = self.reader.out.get(timeout=0.2)
            except queue.Empty:
                continue
        if isinstance(got, BaseException):
            raise got
        if self.fenced.is_set():
            raise ConsumerFenced(f"consumer {self.cfg.consumer_id} was fenced")
        return got

    def _record(self, step_index: int, sums: MetricSums | PendingSums, lr: float, wait_s: float,
                step_s: float) -> None:
        """Queue the step's figures; :meth:`_flush_metrics` writes them (at once on a CPU; on CUDA every
        ``--log-every`` steps, before a checkpoint or an evaluation, and at the end)."""
        step = self.steps_done
        rate = (step - self.start_step) / max(1e-9, time.monotonic() - self.t_loop)
        self.pending.append(_StepRecord(step_index, step, self.cursor, sums, lr, wait_s, step_s, time.time(), rate,
                                        self.wait_total))
        if self.device.type != "cuda" or step % self.cfg.log_every == 0 or step == self.cfg.steps:
            self._flush_metrics()
            self._check_finite()  # on CUDA the flag is read here: divergence is caught within --log-every steps
        self.progress.update(rate, self.last_progress, self.wait_total, self.draft.progress_metric)

    def _flush_metrics(self) -> None:
        """Read the queued steps' sums back (one device-to-host copy for all of them) and write each step's
        figures, in step order, into the journal (a Step event with the step's own sums and end time),
        metrics.csv / TensorBoard, the progress bar and the log."""
        if not self.pending:
            return
        cfg, draft = self.cfg, self.draft
        records, self.pending = self.pending, []
        for rec, sums in zip(records, PendingSums.resolve_all([r.sums for r in records]), strict=True):
            self.total = sums if self.total is None else self.total + sums
            s = draft.summary(sums)
            loss = s.get("loss")  # absent when the batch supervised nothing (a zero denominator)
            if loss is not None:
                self.loss_steps += 1
                if len(self.first_losses) < LOSS_ENDS_STEPS:
                    self.first_losses.append(loss)
                self.last_losses.append(loss)
                del self.last_losses[:-LOSS_ENDS_STEPS]
            epoch = self.order.epoch(rec.cursor - 1)  # the epoch of the step's last position
            self.journal.emit(J.Step(consumer=cfg.consumer_id, step=rec.step, cursor=rec.cursor, loss=loss,
                                     wait_s=rec.wait_s, step_s=rec.step_s, lr=rec.lr, t=rec.t, epoch=epoch,
                                     **draft.journal_fields(sums)))
            self.tracker.scalars(rec.step, "train", {**{k: v for k, v in s.items() if k != "blocks"}, "lr": rec.lr,
                                                     "steps_per_s": rec.rate, "wait_s": rec.wait_s,
                                                     "wait_total_s": rec.wait_total, "epoch": epoch})
            self.last_progress = s.get(draft.progress_metric)
            if rec.step % cfg.log_every == 0 or rec.step == cfg.steps:
                shown = s.get("acc", [])[:4]
                acc = " ".join(fmt(a) for a in shown)
                log.info("[%s] step %d/%d (epoch %d) loss %s %s %s1..%d %s trainer wait for batch %.2fs",
                         cfg.consumer_id, rec.step, cfg.steps, epoch, fmt(loss, 3), draft.headline(s),
                         draft.acc_label, len(shown), acc, rec.wait_s)
                self.tracker.flush()

    # ---- evaluate: one pass over the held-out split -------------------------------------------------------

    def evaluate(self, at_step: int) -> None:
        """One pass over the held-out split, logged and tracked; an improved ``best_metric`` (steps > 0)
        moves ``checkpoints/best`` to a checkpoint of this step (written now when there is none)."""
        self._check_finite()
        self._flush_metrics()
        self._commit()  # the registration is current while the evaluation runs (it may take a while)
        t0 = time.monotonic()
        try:
            self.last_eval = self.evaluator.run()
        except InterruptedError:
            raise KeyboardInterrupt("stopped during evaluation") from None
        ev = self.last_eval
        ev["step"] = at_step
        self.tracker.scalars(at_step, "eval", {k: v for k, v in ev.items() if k not in ("step", "samples")})
        self.tracker.flush()
        shown = ev.get("acc", [])[:4]
        log.info("[%s] eval step %d on %d held-out samples: loss %s %s %s1..%d %s (labels: %s) %.1fs",
                 self.cfg.consumer_id, at_step, ev["samples"], fmt(ev.get("loss"), 3), self.draft.headline(ev),
                 self.draft.acc_label, len(shown), " ".join(fmt(a) for a in shown), ev["labels"],
                 time.monotonic() - t0)
        self._maybe_best(at_step)

    def _maybe_best(self, at_step: int) -> None:
        """Point ``checkpoints/best`` at this step's checkpoint when its ``best_metric`` beats the best so far
        (in :func:`~artcache.trainers.draft.figure_rank`'s order: losses and errors minimised, τ and rates
        maximised; step 0, the untrained or seeded draft, is only the baseline)."""
        metric = self.best_metric
        value = self.last_eval.get(metric) if metric else None
        if metric and metric not in self.last_eval and not self.unknown_best_noted:  # not measured: say so, once
            self.unknown_best_noted = True
            figures = ", ".join(figures_of(self.last_eval))
            log.warning("[%s] --best-metric %s is not a figure of this evaluation (figures: %s): checkpoints/best "
                        "is not written until an evaluation reports it", self.cfg.consumer_id, metric, figures)
        if at_step == 0 or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        if self.best is not None and not figure_rank(metric, value) < figure_rank(metric, self.best[1]):
            return
        path = self.ckpt if self.saved_step == at_step and self.ckpt is not None else self.checkpoint()
        point_best(self.run_dir, path)
        self.best = (metric, float(value), at_step)
        log.info("[%s] checkpoints/best -> step %d (%s %.4f)", self.cfg.consumer_id, at_step, metric, value)

    # ---- checkpoint: write, record the cursor, point latest, prune --------------------------------------

    def checkpoint(self, final: bool = False) -> Path:
        """Write a checkpoint of (steps done, cursor) and record it. ``final``: the exit checkpoint, recorded
        also after a fence as long as no other process registered this id since
        (:meth:`~artcache.registry.ConsumerHandle.record_final_checkpoint`), so ``--resume`` continues from it."""
        cfg = self.cfg
        self._flush_metrics()  # the journal and metrics.csv hold every step the checkpoint covers
        self._check_finite()  # a diverged state is never checkpointed: the last finite one stays latest
        weights, optimizer = self._checkpoint_tensors()
        self._check_finite_weights(weights)
        path = save_checkpoint(self.run_dir, step=self.steps_done, cursor=self.cursor,
                               weights=weights, optimizer=optimizer,
                               generators=self.generators, extra_tensors=self.draft.extra_tensors(),
                               state=self._checkpoint_state())
        self.tracker.flush()  # metrics.csv holds every step the checkpoint covers (a SIGKILL later loses none)
        crash_point("checkpoint.before-record")
        # the resume point moves only once the directory is complete; it may not pass the committed cursor (a
        # final checkpoint commits its cursor with it)
        if final:
            self.handle.record_final_checkpoint(self.cursor)
            self.committed = self.cursor
        else:
            self._commit()
            self.handle.record_checkpoint(self.cursor)
        crash_point("checkpoint.after-record")
        point_latest(self.run_dir, path)
        best = best_checkpoint(self.run_dir)
        prune(self.run_dir, cfg.keep_checkpoints, path, *([best] if best is not None else []))
        self.saved_step, self.ckpt = self.steps_done, path
        log.info("[%s] checkpoint %s (step %d, cursor %d)", cfg.consumer_id, path, self.steps_done, self.cursor)
        return path

    def _checkpoint_state(self) -> dict:
        """The :class:`~artcache.trainers.checkpoint.CheckpointState` fields the consumer records (``step``,
        ``cursor``, ``format`` and ``param_groups`` are added by ``save_checkpoint``)."""
        cfg, contract, draft = self.cfg, self.settings.contract, self.draft
        return {"consumer_id": cfg.consumer_id, "draft": cfg.draft, "draft_config": jsonable(draft.config_dict()),
                "run": run_settings(cfg),
                "schedule": {"kind": "linear-warmup-cosine", "base_lr": cfg.lr, "warmup_frac": cfg.warmup_frac,
                             "min_lr_frac": cfg.min_lr_frac, "total_steps": cfg.horizon, "next_step": self.steps_done},
                "eval": self.last_eval if self.last_eval.get("step") == self.steps_done else None,
                "steps_planned": cfg.steps,
                "plan_id": self.settings.plan_id, "contract_id": contract.contract_id,
                "target_name": contract.target_name, "target_path": self.settings.target_path,
                "target_weights_digest": contract.target_weights_digest, "dtype": contract.dtype,
                "layer_convention": contract.layer_convention, "final_norm": draft.target_info.final_norm,
                "layer_ids": list(draft.needed_layer_ids), "pinned": list(self.pinned),
                "generation": self.handle.generation, "saved_at": time.time()}

    # ---- close: stop the threads, release, final checkpoint, finish the registration ----------------------

    def close(self) -> None:
        """Stop the threads, release every lease still held, finish (rank 0: checkpoint, commit, the registration's
        end, the journal); the previous signal handlers come back last, so a stop signal during the cleanup (the
        launcher's SIGTERM to a group whose other rank failed) only asks to stop and never kills it half-way."""
        try:
            self._close()
        finally:
            self.shutdown.restore()

    def _close(self) -> None:
        cfg = self.cfg
        self.progress.close()
        self.reader.stop.set()
        self.beat_stop.set()
        self.reader.join(timeout=5)
        self.reader.drain()
        if not self.main:  # a rank > 0 released its own leases; rank 0 finishes the group's registration
            self.journal.close()
            return
        try:
            self._flush_metrics()  # the steps trained since the last read-back (before the final checkpoint)
        except Exception as exc:  # the device failed: the figures are lost, the run's error is in flight
            log.error("[%s] the last steps' metrics could not be read back: %s", cfg.consumer_id, exc)
            self.pending = []
        # also on a failure between steps (e.g. CaptureTimeout when the producer is gone) or a fence (a stopped
        # or swapped-out process the producer gave up on): the state is a consistent step, so --resume continues
        # from here instead of the last --save-every checkpoint. Not after a checkpoint write failed (its error
        # names the last good one; a second try at once would fail the same way), nor after divergence (the last
        # finite checkpoint stays latest)
        gathered_final = not self.units or (self.snapshot is not None and self.snapshot[0] == self.steps_done)
        if not gathered_final and cfg.checkpoints and self.consistent and self.steps_done > max(self.saved_step, 0):
            log.warning("[%s] --shard full: no final checkpoint of step %d (the ranks did not gather its state: the "
                        "run stopped on a failure); --resume continues from %s", cfg.consumer_id, self.steps_done,
                        self.ckpt or "the start")
        if cfg.checkpoints and self.consistent and self.steps_done > max(self.saved_step, 0) and gathered_final \
                and not isinstance(self.failure, CheckpointWriteError) and not self.diverged:
            try:
                self.checkpoint(final=True)
            except Exception as exc:  # never mask the error in flight; a completed run without it failed
                self.save_error = exc
                log.error("[%s] the final checkpoint failed: %s: %s", cfg.consumer_id, type(exc).__name__, exc)
                if self.state == registry.COMPLETED:
                    self.state, self.error = "failed", f"checkpoint: {type(exc).__name__}: {exc}"
        if self.consistent and self.committed < self.cursor and not self.fenced.is_set():
            try:  # no final checkpoint committed it (checkpoints off, or it failed): the last step's cursor
                self._commit()
            except Exception as exc:  # never mask the error in flight
                log.error("[%s] the last cursor commit failed: %s: %s", cfg.consumer_id, type(exc).__name__, exc)
        self.handle.finish(self.state, self.error)
        self.journal.emit(J.ConsumerEnd(consumer=cfg.consumer_id, state=self.state, steps=self.steps_done,
                                        cursor=self.cursor, error=self.error))
        self.journal.close()
        try:
            self.tracker.close()
        except OSError as exc:  # a full --out: one line, never a traceback over the run's own error (break test)
            log.error("[%s] the run's last metrics could not be written to %s: %s", cfg.consumer_id, self.run_dir,
                      exc)

    def summary(self) -> dict:
        """What :func:`run_consumer` returns (keys in its docstring)."""
        cfg, first, last, n = self.cfg, self.first_losses, self.last_losses, self.loss_steps
        # every loss this process logged when it logged fewer than 2 x LOSS_ENDS_STEPS (the two lists then overlap)
        first_loss, final_loss, k = loss_ends(first + last[max(0, len(first) + len(last) - n):])
        summary = self.draft.summary(self.total) if self.total is not None else {}
        out = {"consumer_id": cfg.consumer_id, "draft": cfg.draft, "batch_size": cfg.batch_size,
               "state": self.state, "steps_planned": cfg.steps, "steps": self.steps_done, "cursor": self.cursor,
               "resumed_from_step": self.start_step if self.resumed is not None else None,
               "seconds": time.monotonic() - self.t_loop,  # a duration: the monotonic clock, never the wall
               # artcache.report.loss_ends over the losses this process logged; None when it trained none
               # (e.g. --resume of a run that had already completed)
               "first_loss": first_loss, "final_loss": final_loss, "loss_ends_steps": k, "loss_steps": n,
               "tau": summary.get("tau"), "checkpoint": str(self.ckpt) if self.ckpt else None,
               "best": {"metric": self.best[0], "value": self.best[1], "step": self.best[2]} if self.best else None,
               "vocab_coverage": self.init.coverage if self.init is not None else None,
               "run_dir": str(self.run_dir), "wait_s": self.wait_total,
               "host_ms_per_step": host_ms_per_step(self.host_s),
               # the epoch of the last position trained on (0-based) and the training samples per epoch
               "epoch": self.order.epoch(self.cursor - 1) if self.cursor else 0, "epoch_len": self.epoch_len,
               "ranks": self.world, "cp": cfg.cp, "grad_accum": cfg.grad_accum, "global_batch": cfg.global_batch,
               "shard": cfg.shard}
        if "sim_acc_len" in summary:
            out["sim_acc_len"] = summary["sim_acc_len"]
        if self.last_eval:
            out["eval"] = self.last_eval
        return out


@dataclass
class _StepRecord:
    """A trained step whose figures wait for :meth:`Session._flush_metrics` (``t``: its end, epoch s)."""

    step_index: int
    step: int
    cursor: int
    sums: MetricSums | PendingSums
    lr: float
    wait_s: float
    step_s: float
    t: float
    rate: float
    wait_total: float


def _add_sums(a: MetricSums | PendingSums, b: MetricSums | PendingSums) -> MetricSums | PendingSums:
    """Two micro-batches' sums of one draft (a :class:`PendingSums` pair stays on its device)."""
    if isinstance(a, PendingSums) and isinstance(b, PendingSums) and a.names == b.names:
        return PendingSums(a.names, a.values + b.values)
    return (a.resolve() if isinstance(a, PendingSums) else a) + (b.resolve() if isinstance(b, PendingSums) else b)


def fmt(value, digits: int = 2) -> str:
    """A figure for a log line; ``-`` for one that is absent (a zero denominator)."""
    return "-" if value is None else f"{value:.{digits}f}"


def _check_run_dir(run_dir: Path) -> None:
    """``run_dir``, or where it would be created (its nearest existing ancestor), must be a writable directory.
    Nothing is created: a start refused later (a duplicate consumer id, a bad resume) leaves no empty
    ``--out`` behind; :func:`_make_run_dir` creates it once the registration holds.

    Raises:
        ConfigError: naming ``--out`` and why it cannot be the run directory.
    """
    why = unwritable_dir(run_dir)
    if why is not None:
        raise ConfigError(f"--out {str(run_dir)!r} cannot be the run directory (it {why}); accepted: a writable "
                          "directory, existing or creatable (created if missing)")


def _make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and missing parents) after :func:`_check_run_dir` and the registration.

    Raises:
        ConfigError: naming ``--out`` and the error (the path changed since the check).
    """
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise ConfigError(f"--out {str(run_dir)!r} cannot be the run directory ({exc.strerror or exc}); give a "
                          "writable directory path (created if missing)") from None
