"""A consumer's settings: :class:`ConsumerConfig` (the ``artcache consume`` flags), the window syntax and
the LR schedule, and the settings that define a run (``--resume`` refuses when one differs)."""

from __future__ import annotations

import math
import os
from typing import Annotated, Literal

import msgspec

from artcache.errors import ConfigError
from artcache.layout import check_id
from artcache.ranges import BlockSize, Count, NonNegative, Positive, WindowSide, check_ranges, parse_window
from artcache.trainers import COMPILE_MODES, DRAFT_NAMES, LOSS_IMPLS

__all__ = ["FLAGS", "INIT_OVERRIDES", "RUN_DEFAULTS", "RUN_FIELDS", "ConsumerConfig", "check_anchors",
           "check_best_metric", "check_cp", "check_draft_options", "check_rank_devices", "default_anchors",
           "default_block_size",
           "draft_options", "flag_of", "lr_at", "parse_window", "run_settings"]


#: the longest ``--commit-interval`` (seconds): a third of the producer's rate window
#: (:class:`artcache.eviction.RateEstimator`, 30 s), so a consumer between two commits never reads as stopped there
MAX_COMMIT_INTERVAL_S = 10.0


class ConsumerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One consumer's settings (CLI flags map onto these fields).

    Attributes:
        cache: the cache root (made by ``artcache producer``). consumer_id: unique per root.
        draft: draft algorithm (a name in :data:`artcache.trainers.DRAFT_NAMES`: ``dflash``, ``eagle3``,
            ``dspark``), built by :func:`artcache.trainers.draft.build_draft`.
        lookbehind, lookahead: window in positions, each 0 … :data:`~artcache.ranges.MAX_WINDOW`;
            lookahead must be >= batch_size.
        block_size (B, 2 … :data:`~artcache.ranges.MAX_BLOCK_SIZE`), num_anchors (N per sequence; a given N
            at most the root's ``max_length``, :func:`check_anchors`), draft_layers (DFlash; default: the
            largest n whose layer ids the root captures, one per captured layer on a DFlash-only root).
        batch_size: sequences (= positions) per optimizer step. steps: optimizer steps to run (the stop;
            raise it to extend a run); they may run past one pass over the plan: position ``p`` is epoch
            ``p // E`` over the training part of the plan (its first ``E`` samples, all but the held-out
            split), each later epoch reshuffled by the plan's seed (:class:`artcache.plan.EpochOrder`).
        epochs: run this many passes over the training part instead of ``steps``: ``steps = epochs × E //
            batch_size`` (0: use ``steps``).
        lr_total_steps: the LR schedule's horizon in steps (None: ``steps`` for a fresh run, the
            checkpoint's horizon for ``--resume``), so a run is extended by raising ``steps`` alone.
        lr, warmup_frac, min_lr_frac, weight_decay, grad_clip: AdamW with linear warmup and cosine
            decay to ``min_lr_frac × lr`` (DFlash recipe: lr 6e-4, warmup 4 %, clip 1.0).
        seed: draft init and anchor sampling. device: ``cpu`` or ``cuda[:i]``.
        threads: torch CPU threads (0 = torch default). out_dir: run directory (checkpoints).
        demand_timeout_s: give up waiting for one position after this long.
        heartbeat_s: heartbeat period. prefetch_batches: batches read ahead (inside the lookahead).
        read_workers: positions of one batch leased and read at once by the reader thread's pool
            (``--read-workers``, default 1: one after another). More hide per-file latency on a slow or network
            filesystem; on a local, page-cached root the H200 measured no gain from 4 (docs/training.md, "GPU
            speed").
        reader: where the reader runs (``--reader``): ``thread`` (default), beside the trainer in its interpreter;
            ``process``, a child process of its own that leases, reads, verifies and collates into a shared-memory
            ring the trainer steps on without a copy (:mod:`.reader_process`; Linux), so the reader's Python never
            holds the trainer's GIL (docs/training.md, "The reader in a process of its own").
        commit_interval_s: commit the cursor at most this often (seconds, 0 … :data:`MAX_COMMIT_INTERVAL_S`; 0: after
            every step). A commit is a locked read and atomic rewrite of the consumer's registration (about 1.1 ms
            of the trainer thread's time on a CPU core; docs/training.md, "Cursor commits"), 4 % of a 25 ms step
            when paid every step. The
            cursor is also committed at once whenever the committed window would hold the reader back (it reads
            only inside ``[committed cursor, committed cursor + lookahead]``), before every checkpoint and
            evaluation, after the last step, and after every step in a lockstep group. Trained positions not yet
            committed lie behind the local cursor and inside the window (the lookbehind counts from the committed
            cursor), so a pending commit retains more, never less. After a SIGKILL the registration's cursor may
            lag the last trained step by up to this long; ``--resume`` continues from the checkpoint's recorded
            cursor either way.
        log_every: print a metrics line every this many steps.
        lockstep_group: comma-separated consumer ids (this one included) that share one cursor: a
            position is read only once every running member committed the batches before it (the
            bench's ``lockstep`` baseline). Empty (default): the consumer advances on its own.
        layer_ids: an explicit ordered view (output-of-layer ids) replacing the draft's formula. DFlash:
            any ids (context layers = their count); EAGLE-3: three auxiliary ids then ``L - 1``.
        ttt_steps: EAGLE-3 training-time-test unroll steps. draft_vocab: EAGLE-3 pruned draft vocabulary.
        markov_rank, markov_head: DSpark's Markov head (rank r, 0 = none; ``vanilla`` or ``gated``).
        min_vocab_coverage: EAGLE-3 with ``init_from``: the least share of the plan's supervised training
            tokens the seed's own vocab map must cover (default 0.5); ``keep_vocab_map`` trains below it
            (with a warning naming the figure). Either one given without ``init_from`` is refused.
        init_overrides: differences from the ``init_from`` source to accept (``block_size``,
            ``mask_token``, ``target``); any other difference is refused (:mod:`artcache.trainers.seed`).
        Draft options (``block_size`` … ``keep_vocab_map``, ``eval_anchors``, ``markov_*``) are None when
            not given; a draft refuses another draft's option (:attr:`~artcache.trainers.draft.Draft.options`)
            and :meth:`resolved` fills in its own defaults.
        save_every: write a checkpoint every this many steps (0: only at the end and on cancellation;
            a checkpoint is always written at the end and when cancelled by Ctrl-C / SIGTERM).
        keep_checkpoints: keep the newest this many checkpoints (0: all). Before step 1 the consumer checks
            that the checkpoints on disk at once (``keep_checkpoints + 1`` while one is written, at most the
            ones this run writes) fit in the free space under ``out_dir``, and refuses to start otherwise.
        checkpoint_optimizer: save the optimizer and RNG state with the weights (``--checkpoint-optimizer``,
            the default; what ``--resume`` needs). False: weights-only checkpoints (a third of the bytes
            with AdamW over fp32 weights), which ``--init-from`` and export read and ``--resume`` refuses.
        checkpoints: write checkpoints at all. False: none, not even the final one (``artcache bench --save
            none``: a throughput run whose drafts are thrown away); the run can be neither resumed nor exported.
        resume: continue this consumer id from its checkpoint in ``out_dir`` (the one whose cursor the
            registry recorded); refuses when they differ or the run's settings changed.
        init_from: seed the draft's weights (only) from a checkpoint, a published draft or a run
            directory; strict keys both ways. EAGLE-3 keeps the source's vocab map.
        eval_samples: size of the held-out split: the plan's last ``eval_samples`` samples are evaluated and
            never trained on, however many epochs the run walks. 0: off.
        eval_interval: evaluate every this many steps (0: only at the end); needs ``eval_samples``.
        best_metric: the held-out figure ``checkpoints/best`` follows (None: ``replay_tau`` when the root
            captures layer ``L - 1``, else the draft's acceptance figure), in
            :func:`~artcache.trainers.draft.figure_rank`'s order (losses and errors minimised).
            It must be one of the figures the draft's evaluation gives
            (:meth:`~artcache.trainers.draft.Draft.held_out_figures`; :func:`check_best_metric`).
        progress: show a progress bar on stderr (only when it is a TTY).
        tensorboard: write TensorBoard scalars when the package is installed (metrics.csv always).
        trackers: further trackers of the same scalars (``--tracker``): ``wandb`` and / or ``mlflow`` (the extras of
            those names), one run per consumer named by its id (:mod:`artcache.trainers.tracking`).
        tracker_project: the W&B project and the MLflow experiment the runs go to.
        compile: ``torch.compile`` the draft's forward (and the lm_head loss's per-chunk body): ``auto``
            (``on`` on CUDA when ``steps`` >= :data:`~artcache.trainers.speed.AUTO_COMPILE_MIN_STEPS`, else
            ``off``), ``off``, ``on``, ``graphs`` (with CUDA graphs; CUDA only). A group of ranks on CUDA refuses
            ``on`` and ``graphs``: its forward runs through its DDP / FSDP2 wrapper, uncompiled (``auto`` there
            compiles the loss's per-chunk body only).
        loss_impl: the lm_head cross-entropy (:mod:`artcache.trainers.lm_head_ce`): ``auto``
            (``chunked`` bf16 on CUDA, ``reference`` on a CPU), ``reference``, ``chunked``, ``liger``.
        length_bucket: with ``--compile on|graphs`` on CUDA, pad each batch's length T up to a multiple
            of this many positions so the compiled draft sees few distinct shapes (padding is never
            supervised); 0 = the batch's longest sample. Ignored otherwise (batches stay exactly as long
            as their longest sample).
        nproc: ranks of this consumer (``--nproc``; a ``torch.distributed`` group, one consumer to the cache:
            :mod:`.group`). ``artcache consume --nproc N`` starts the N ranks itself; under ``torchrun`` it is the
            environment's ``WORLD_SIZE`` (a different ``--nproc`` is refused). Each rank trains on ``batch_size``
            sequences per micro-batch on its own device (``cuda:LOCAL_RANK`` on CUDA, or ``devices``).
        devices: the CUDA device indices of the group's ranks, rank r on ``cuda:devices[r]`` (one per rank, each
            once; needs a ``cuda`` device). ``artcache run`` fills it in for an experiment of several ranks
            (``experiments.X.consumer.devices``, else GPUs after the producer's). ``[]``: rank r on
            ``cuda:LOCAL_RANK`` (torchrun), or on its task's own GPU under Slurm (:mod:`.group`).
        grad_accum: micro-batches per optimizer step on each rank (``--grad-accum K``): a step consumes one global
            batch of ``nproc × grad_accum × batch_size`` positions (:attr:`global_batch`) and its update is the one
            step over the whole global batch would make (the loss is normalised over the global batch). The LR
            schedule, ``steps``, ``save_every``, ``eval_interval`` and ``log_every`` count optimizer steps.
        group_timeout_s: a group's collective timeout in seconds (``--group-timeout``; ``init_process_group``'s
            ``timeout``): a rank that stops answering stops the others within this long instead of the
            backend's 30 minutes. Waits that may legitimately be long (a rank's demand miss, rank 0's evaluation
            or checkpoint) have their own, longer timeout (:mod:`.group`).
        shard: how a group holds the draft (``--shard``): ``none`` (every rank a full copy of the weights, their
            gradients and AdamW state; DistributedDataParallel averages the gradients) or ``full`` (FSDP2: each
            rank holds ``1 / nproc`` of each; :mod:`.shard`), for a draft whose training state does not fit one
            device. The same updates either way; ``full`` needs a group (``nproc`` >= 2, or torchrun's
            ``WORLD_SIZE`` >= 2): one process is refused.
        pack_tokens: packing (:mod:`artcache.trainers.packing`): each of the step's ``batch_size`` rows holds
            consecutive plan positions back to back, up to this many tokens; a step consumes as many positions as
            its rows hold (at most ``lookahead``), decided from the plan alone. Must be at least the root's max
            length (a sample is never truncated or split). 0 = off: one position per row, padded.
        cp: context parallelism (``--cp N``, every draft): each sequence is split across N ranks of the group
            (:mod:`artcache.trainers.dflash.cp`: each rank holds ``ceil(T / N)`` positions of the context and the
            blocks anchored there; the context's keys/values are all-gathered per layer; EAGLE-3,
            :mod:`artcache.trainers.eagle3.cp`: each rank's positions are its TTT queries, the step-0 keys/values
            all-gathered once per forward). ``nproc`` is the world
            size, data-parallel ranks × ``cp``: ``nproc / cp`` groups of ``cp`` ranks each read their own slice of
            the global batch, the ``cp`` ranks of a group the same positions. 1 = off.

    On CUDA the training step reads nothing back to the host; its metrics are read back every
    ``log_every`` steps (docs/training.md, "GPU speed").
    """

    cache: str
    consumer_id: str = "dflash-0"
    draft: Literal[DRAFT_NAMES] = "dflash"  # the registered drafts (artcache.trainers.ADAPTERS)
    lookbehind: WindowSide = 64
    lookahead: WindowSide = 256
    # DFlash options: None = not given (the draft's default, Draft.options); B >= 2: the anchor and one MASK slot
    block_size: BlockSize | None = None
    num_anchors: Count | None = None
    draft_layers: Count | None = None
    batch_size: Count = 2
    steps: Count = 100
    epochs: NonNegative = 0
    lr_total_steps: Count | None = None
    lr: Positive = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    threads: NonNegative = 0
    out_dir: str = ""
    demand_timeout_s: Positive = 600.0
    heartbeat_s: float = 2.0
    prefetch_batches: Count = 2
    read_workers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    commit_interval_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_COMMIT_INTERVAL_S)] = 0.25
    reader: Literal["thread", "process"] = "thread"
    log_every: Count = 10
    lockstep_group: str = ""
    layer_ids: list[int] | None = None
    ttt_steps: Count | None = None  # EAGLE-3 options: None = not given (Draft.options)
    draft_vocab: Count | None = None
    markov_rank: NonNegative | None = None  # DSpark options (0: no Markov head)
    markov_head: Literal["vanilla", "gated"] | None = None
    min_vocab_coverage: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # a share of supervised tokens
    keep_vocab_map: bool | None = None
    init_overrides: list[str] = []
    save_every: NonNegative = 0
    keep_checkpoints: NonNegative = 3
    checkpoint_optimizer: bool = True
    checkpoints: bool = True
    resume: bool = False
    init_from: str = ""
    eval_samples: NonNegative = 0
    eval_interval: NonNegative = 0
    eval_anchors: NonNegative | None = None
    best_metric: str | None = None
    progress: bool = True
    tensorboard: bool = True
    trackers: list[Literal["wandb", "mlflow"]] = []
    tracker_project: str = "artcache"
    compile: Literal[COMPILE_MODES] = "auto"
    loss_impl: Literal[LOSS_IMPLS] = "auto"
    length_bucket: NonNegative = 64
    nproc: Count = 1
    devices: list[NonNegative] = []
    grad_accum: Count = 1
    group_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    shard: Literal["none", "full"] = "none"
    pack_tokens: NonNegative = 0
    cp: Count = 1

    def validate(self) -> None:
        """Check every setting; a draft option another draft owns is refused naming both drafts.

        Raises:
            ConfigError: naming the flag, the bad value and what is accepted.
        """
        check_id(self.consumer_id, "consumer id")
        check_draft_options(self)
        check_ranges(self, flag_of)  # the ranges declared on the fields (artcache.ranges)
        if self.trackers:
            from artcache.trainers.tracking import check_trackers

            check_trackers(self.trackers)
            if not self.tracker_project:
                raise ConfigError("--tracker-project '' is invalid: accepted a W&B project / MLflow experiment name")
        bad = [o for o in self.init_overrides if o not in INIT_OVERRIDES]
        if bad:
            raise ConfigError(f"--init-override {bad[0]!r} is not accepted: one of {', '.join(INIT_OVERRIDES)} "
                              "(layer ids, sizes and the vocab map are never overridden)")
        if self.init_overrides and not self.init_from:
            raise ConfigError(f"--init-override {','.join(self.init_overrides)} needs --init-from")
        # the seed's vocab map is what these two judge: without a seed they would be accepted and do nothing
        for field in ("min_vocab_coverage", "keep_vocab_map"):
            if getattr(self, field) not in (None, False) and not self.init_from:
                value = getattr(self, field)
                raise ConfigError(f"{flag_of(field)}{'' if value is True else f' {value}'} needs --init-from (it "
                                  "judges the seed's own vocab map; a fresh or resumed run has none to judge): "
                                  "leave it out, or pass --init-from")
        if self.best_metric is not None and not self.eval_samples:
            raise ConfigError(f"--best-metric {self.best_metric} needs a held-out split: pass --eval-samples N")
        check_best_metric(self)
        if self.reader == "process" and not hasattr(os, "memfd_create"):
            raise ConfigError("--reader process needs Linux (memfd_create); use --reader thread here")
        if self.save_every and not self.checkpoints:
            raise ConfigError(f"--save-every {self.save_every} needs checkpoints, but this run writes none "
                              "(checkpoints = false); leave --save-every at 0 or turn checkpoints on")
        for field in ("eval_interval", "eval_anchors"):  # both only shape the held-out evaluation
            if getattr(self, field) and not self.eval_samples:
                raise ConfigError(f"{flag_of(field)} {getattr(self, field)} needs a held-out split: pass "
                                  "--eval-samples N")
        if (not self.resume and self.lr_total_steps is not None and self.steps > self.lr_total_steps
                and self.min_lr_frac == 0):
            raise ConfigError(f"--lr-total-steps {self.lr_total_steps} is below --steps {self.steps}: the LR schedule "
                              f"ends at step {self.lr_total_steps} and the {self.steps - self.lr_total_steps} steps "
                              "after it would train at LR 0; accepted: --lr-total-steps >= --steps (left out, "
                              "the horizon is --steps)")
        if self.resume and self.init_from:
            raise ConfigError("--resume and --init-from exclude each other: --resume continues a run with its "
                              "optimizer and cursor, --init-from starts a new run from another draft's weights")
        check_cp(self)
        if self.lookahead < self.global_batch:
            what = f"{self.batch_size} positions" if self.global_batch == self.batch_size else \
                f"{self.global_batch} positions: --nproc {self.nproc}{f' / --cp {self.cp}' if self.cp > 1 else ''} x " \
                f"--grad-accum {self.grad_accum} x " \
                f"--batch-size {self.batch_size}"
            raise ConfigError(
                f"lookahead {self.lookahead} is smaller than one batch ({what}): the "
                f"consumer could never read a whole batch; use --window {self.lookbehind}:{self.global_batch} "
                "or larger, or a smaller --batch-size")
        if self.devices:
            check_rank_devices(self.devices, self.nproc, self.device)
        if self.nproc > 1 and self.lockstep_group:
            raise ConfigError(f"--lockstep-group {self.lockstep_group!r} and --nproc {self.nproc} exclude each other: "
                              "a lockstep baseline is a set of one-process consumers")
        if self.shard == "full" and self.nproc == 1 and _world() in (None, 1):  # torchrun's WORLD_SIZE: a group
            raise ConfigError("--shard full shards the draft over the ranks of a group and this consumer has one: "
                              "pass --nproc N (N >= 2) or run it under torchrun, or leave --shard at none")
        if self.compile in ("on", "graphs") and not self.device.startswith("cuda"):  # as SpeedOptions.for_device
            # refuses it when the consumer starts; here so `artcache run` refuses it before anything is written
            raise ConfigError(f"--compile {self.compile} needs a CUDA device: on {self.device} the consumer runs the "
                              "host step, which is not compiled; accepted --compile off or auto")
        group = self.nproc > 1 or _world() not in (None, 1)
        if group and self.compile in ("on", "graphs") and self.device.startswith("cuda"):
            ranks = f"--nproc {self.nproc}" if self.nproc > 1 else f"torchrun's WORLD_SIZE {_world()}"
            raise ConfigError(f"--compile {self.compile} and a group of ranks ({ranks}) exclude each other: a "
                              "group's forward runs through its DDP / FSDP2 "
                              "wrapper, which is not compiled; accepted --compile off or auto (the loss's "
                              "per-chunk body only)")
        if self.nproc > 1 and self.reader == "process":
            raise ConfigError(f"--reader process and --nproc {self.nproc} exclude each other: each rank of a group "
                              "reads with its own reader thread; use --reader thread")
        if self.pack_tokens and self.reader == "process":
            raise ConfigError(f"--pack-tokens {self.pack_tokens} runs with --reader thread only (the reader process "
                              "reads fixed batches of positions); use --reader thread or --pack-tokens 0")
        if self.pack_tokens and self.lockstep_group:
            raise ConfigError(f"--pack-tokens {self.pack_tokens} and a lockstep group exclude each other (members "
                              "move by whole batches of positions); leave one of them out")
        if self.pack_tokens and (self.nproc > 1 or self.grad_accum > 1):
            raise ConfigError(f"--pack-tokens {self.pack_tokens} runs in one process with --grad-accum 1 (a group's "
                              "ranks and micro-batches split whole batches of positions); leave --nproc and "
                              "--grad-accum at 1 or --pack-tokens at 0")
        if self.lockstep_group:
            for member in self.lockstep_group.split(","):
                check_id(member, "lockstep group member")
            if self.consumer_id not in self.lockstep_group.split(","):
                raise ConfigError(f"lockstep group {self.lockstep_group!r} must list this consumer's id "
                                  f"{self.consumer_id!r}")

    def resolved(self) -> ConsumerConfig:
        """This config with the draft's own options that were not given set to its defaults
        (:attr:`~artcache.trainers.draft.Draft.options`); other drafts' options stay None. ``lr_total_steps``
        is left as given (None on ``--resume``: the checkpoint's horizon; see :func:`schedule_horizon`)."""
        defaults = draft_options(self.draft)
        fill = {k: v for k, v in defaults.items() if getattr(self, k) is None and v is not None}
        if "num_anchors" in defaults and self.num_anchors is None:  # DSpark's default depends on the device
            fill["num_anchors"] = default_anchors(self.draft, self.device)
        return msgspec.structs.replace(self, **fill) if fill else self

    @property
    def global_batch(self) -> int:
        """Positions one optimizer step consumes: ``nproc / cp × grad_accum × batch_size`` (the ``cp`` ranks of a
        context-parallel group share their positions)."""
        return self.nproc // self.cp * self.grad_accum * self.batch_size

    @property
    def horizon(self) -> int:
        """The LR schedule horizon: ``lr_total_steps``, else ``steps``."""
        return self.lr_total_steps if self.lr_total_steps is not None else self.steps


def default_block_size(draft: str) -> int | None:
    """Block size B when none is given (the draft's ``options``): DSpark's 7 (DeepSpec), DFlash's 16; None
    for a draft without blocks (EAGLE-3)."""
    return draft_options(draft).get("block_size")


def default_anchors(draft: str, device: str) -> int | None:
    """Anchors per sequence when none is given: DSpark 512 on a GPU and 64 on a CPU
    (:func:`artcache.trainers.dspark.config.default_anchors`), else the draft's ``options`` (DFlash 64);
    None for a draft without anchors (EAGLE-3)."""
    if draft == "dspark":
        from artcache.trainers.dspark.config import default_anchors as dspark_anchors

        return dspark_anchors(device)
    return draft_options(draft).get("num_anchors")


def _world() -> int | None:
    from .group import env_world

    return env_world()


def lr_at(step: int, total: int, base: float, warmup_frac: float, min_frac: float) -> float:
    """Linear warmup over ceil(warmup_frac·total) steps, then cosine decay to min_frac·base."""
    warm = max(1, math.ceil(warmup_frac * total))
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


#: Settings every draft's run is defined by: ``--resume`` refuses when one differs from the checkpoint's.
#: ``steps`` is not one (a run is extended by raising it); the LR horizon ``lr_total_steps`` is.
RUN_FIELDS = ("draft", "batch_size", "lr_total_steps", "lr", "warmup_frac", "min_lr_frac", "weight_decay",
              "grad_clip", "seed", "eval_samples", "grad_accum", "nproc", "pack_tokens", "cp")
#: what a checkpoint written before a :data:`RUN_FIELDS` entry existed had instead (compared as this)
RUN_DEFAULTS = {"grad_accum": 1, "nproc": 1, "pack_tokens": 0, "cp": 1}

def read_workers(cfg: ConsumerConfig) -> int:
    """The reader's pool size: ``cfg.read_workers``, never more than the batch (a batch's positions are what it
    reads at once)."""
    return max(1, min(cfg.read_workers, cfg.batch_size))


#: The accepted ``--init-override`` values (see :mod:`artcache.trainers.seed`).
INIT_OVERRIDES = ("block_size", "mask_token", "target")
#: CLI flags whose name is not the field's (``--x-y`` for ``x_y`` otherwise).
FLAGS = {"num_anchors": "--anchors", "out_dir": "--out", "consumer_id": "--id", "demand_timeout_s": "--demand-timeout",
         "commit_interval_s": "--commit-interval", "group_timeout_s": "--group-timeout",
         "init_overrides": "--init-override", "trackers": "--tracker",
         "lookbehind": "--window LOOKBEHIND", "lookahead": "--window LOOKAHEAD"}


def check_rank_devices(devices: list[int], nproc: int, device: str, where: str = "devices") -> None:
    """Refuse a rank device list that is not one CUDA index per rank, each once.

    Raises:
        ConfigError: naming ``where``, the list, and what is accepted.
    """
    if not device.startswith("cuda"):
        raise ConfigError(f"{where} {list(devices)} needs a cuda device (device is {device!r}): on a CPU every rank "
                          "runs on the cpu; leave it out, or use device cuda")
    if len(devices) != nproc:
        raise ConfigError(f"{where} {list(devices)} gives {len(devices)} GPU(s) for {nproc} rank(s) (nproc): "
                          "accepted one CUDA index per rank")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"{where} {list(devices)} names a GPU twice: accepted one GPU per rank, each once")


def flag_of(field: str) -> str:
    """The ``artcache consume`` flag of a :class:`ConsumerConfig` field."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def draft_options(draft: str) -> dict:
    """Draft ``draft``'s own options and their defaults (its adapter's ``options``)."""
    from artcache.trainers.draft import draft_class

    return dict(draft_class(draft).options)


def check_draft_options(cfg: ConsumerConfig) -> None:
    """Refuse an option given for a draft that does not use it (``--ttt-steps`` on DFlash, ``--block-size``
    on EAGLE-3): it would be accepted and silently ignored.

    Raises:
        ConfigError: naming the option, the draft it belongs to and the draft given.
    """
    from artcache.trainers import DRAFT_NAMES

    own = draft_options(cfg.draft)
    for field in sorted({f for name in DRAFT_NAMES for f in draft_options(name)} - set(own)):
        if getattr(cfg, field) is not None:
            users = [name for name in DRAFT_NAMES if field in draft_options(name)]
            raise ConfigError(f"{flag_of(field)} {getattr(cfg, field)!r} is an option of the {' and '.join(users)} "
                              f"draft{'s' * (len(users) > 1)}; the {cfg.draft} draft does not use it: leave it out")


def check_cp(cfg: ConsumerConfig) -> None:
    """``--cp N`` (context parallelism): what it composes with.

    Raises:
        ConfigError: ``--nproc`` not a multiple of N, ``--shard full``, ``--pack-tokens``, a lockstep group, or
            ``--reader process`` with N > 1 (one line naming the value and what is accepted).
    """
    n = cfg.cp
    if n == 1:
        return
    if cfg.nproc % n:
        raise ConfigError(f"--cp {n} does not divide --nproc {cfg.nproc}: --nproc is the world size, data-parallel "
                          f"ranks x --cp; accepted --nproc a multiple of {n} (e.g. --nproc {n} --cp {n})")
    if cfg.shard == "full":
        raise ConfigError(f"--cp {n} and --shard full exclude each other (a context-parallel group averages whole "
                          "gradients after the backward); leave one of them out")
    if cfg.pack_tokens:
        raise ConfigError(f"--cp {n} and --pack-tokens {cfg.pack_tokens} exclude each other (the split context has "
                          "no per-document attention); leave one of them out")
    if cfg.lockstep_group or cfg.reader == "process":
        raise ConfigError(f"--cp {n} runs with --reader thread and no lockstep group (its ranks are a "
                          "torch.distributed group); leave --lockstep-group and --reader process out")


def check_best_metric(cfg: ConsumerConfig) -> None:
    """Refuse a ``--best-metric`` the draft's held-out evaluation never reports (a typo such as ``replay-tau``
    trained the whole run, then only warned at the first evaluation): the name must be one of
    :meth:`~artcache.trainers.draft.Draft.held_out_figures` of ``cfg.draft`` at its block size. Whether the
    greedy-replay figures are measured (the root captures layer ``L - 1``) is the session's check.

    Raises:
        ConfigError: naming the value, the draft and the figures its evaluation gives.
    """
    if cfg.best_metric is None:
        return
    from artcache.trainers.draft import describe_direction, describe_figures, draft_class

    cls = draft_class(cfg.draft)
    block_size = cfg.block_size if cfg.block_size is not None else default_block_size(cfg.draft)
    if cfg.best_metric not in cls.held_out_figures(block_size):
        raise ConfigError(f"--best-metric {cfg.best_metric!r} is not a held-out figure of the {cfg.draft} draft; "
                          f"accepted: {describe_figures(cls, block_size)} ({describe_direction()})")


def check_anchors(num_anchors: int | None, max_length: int, name: str = "--anchors",
                  limit: str = "the root's tokens per sample, its producer's --max-length") -> None:
    """A given anchor count must fit the plan's samples: an anchor is a position of one sample, so more anchors
    per sequence than its ``max_length`` tokens are never drawn, only allocated (``--anchors 100000000`` died
    allocating terabytes). None (not given: the draft's default) is not checked. ``limit`` says where
    ``max_length`` comes from.

    Raises:
        ConfigError: ``<name> <value> is invalid: accepted an integer >= 1 and <= <max_length> (<limit>)``.
    """
    if num_anchors is not None and num_anchors > max_length:
        raise ConfigError(f"{name} {num_anchors} is invalid: accepted an integer >= 1 and <= {max_length} ({limit}: "
                          "more anchors than positions are never drawn)")


def run_settings(cfg: ConsumerConfig) -> dict:
    """The run-defining settings of ``cfg`` as a checkpoint's ``run`` records them: :data:`RUN_FIELDS`
    (``lr_total_steps`` as the effective horizon) plus the draft's own ``run_options`` (DFlash: block
    size, anchors)."""
    from artcache.trainers.draft import draft_class

    out = {k: getattr(cfg, k) for k in RUN_FIELDS}
    out["lr_total_steps"] = cfg.horizon
    out["steps"] = cfg.steps  # recorded (the stop), never compared
    out.update({k: getattr(cfg, k) for k in draft_class(cfg.draft).run_options})
    return out
