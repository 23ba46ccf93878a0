"""A consumer's settings: :class:`ConsumerConfig` (the ``artcache consume`` flags), the window syntax and
the LR schedule, and the settings that define a run (``--resume`` refuses when one differs)."""

from __future__ import annotations

import math
import re
from typing import Literal

import msgspec

from artcache.errors import ConfigError
from artcache.layout import check_id
from artcache.trainers import COMPILE_MODES, DRAFT_NAMES, LOSS_IMPLS

__all__ = ["FLAGS", "RUN_FIELDS", "ConsumerConfig", "lr_at", "parse_window", "run_settings"]


class ConsumerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One consumer's settings (CLI flags map onto these fields).

    Attributes:
        cache: the cache root (made by ``artcache producer``). consumer_id: unique per root.
        draft: draft algorithm (a name in :data:`artcache.trainers.DRAFT_NAMES`: ``dflash``, ``eagle3``, ``dspark``), built by
            :func:`artcache.trainers.draft.build_draft`.
        lookbehind, lookahead: window in positions; lookahead must be >= batch_size.
        block_size (B), num_anchors (N per sequence), draft_layers (DFlash; default: the largest n
            whose layer ids the root captures, one per captured layer on a DFlash-only root).
        batch_size: sequences (= positions) per optimizer step. steps: optimizer steps to run; they may
            run past one pass over the plan: position ``p`` is epoch ``p // E`` over the training part of
            the plan (its first ``E`` samples, all but the held-out split), each later epoch reshuffled by
            the plan's seed (:class:`artcache.plan.EpochOrder`).
        epochs: run this many passes over the training part instead of ``steps``: ``steps = epochs × E //
            batch_size`` (0: use ``steps``).
        lr, warmup_frac, min_lr_frac, weight_decay, grad_clip: AdamW with linear warmup and cosine
            decay to ``min_lr_frac × lr`` (DFlash recipe: lr 6e-4, warmup 4 %, clip 1.0).
        seed: draft init and anchor sampling. device: ``cpu`` or ``cuda[:i]``.
        threads: torch CPU threads (0 = torch default). out_dir: run directory (checkpoints).
        demand_timeout_s: give up waiting for one position after this long.
        heartbeat_s: heartbeat period. prefetch_batches: batches read ahead (inside the lookahead).
        log_every: print a metrics line every this many steps.
        lockstep_group: comma-separated consumer ids (this one included) that share one cursor: a
            position is read only once every running member committed the batches before it (the
            bench's ``lockstep`` baseline). Empty (default): the consumer advances on its own.
        layer_ids: an explicit ordered view (output-of-layer ids) replacing the draft's formula. DFlash:
            any ids (context layers = their count); EAGLE-3: three auxiliary ids then ``L - 1``.
        ttt_steps: EAGLE-3 training-time-test unroll steps. draft_vocab: EAGLE-3 pruned draft vocabulary.
        markov_rank, markov_head: DSpark's Markov head (rank r, 0 = none; ``vanilla`` or ``gated``).
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
        progress: show a progress bar on stderr (only when it is a TTY).
        tensorboard: write TensorBoard scalars when the package is installed (metrics.csv always).
        compile: ``torch.compile`` the draft's forward (and the lm_head loss's per-chunk body): ``auto``
            (= ``off`` for now), ``off``, ``on``, ``graphs`` (with CUDA graphs; CUDA only).
        loss_impl: the lm_head cross-entropy (:mod:`artcache.trainers.lm_head_ce`): ``auto``
            (``chunked`` bf16 on CUDA, ``reference`` on a CPU), ``reference``, ``chunked``, ``liger``.
        length_bucket: with ``--compile on|graphs`` on CUDA, pad each batch's length T up to a multiple
            of this many positions so the compiled draft sees few distinct shapes (padding is never
            supervised); 0 = the batch's longest sample. Ignored otherwise (batches stay exactly as long
            as their longest sample).

    On CUDA the training step reads nothing back to the host; its metrics are read back every
    ``log_every`` steps (docs/training.md, "GPU speed").
    """

    cache: str
    consumer_id: str = "dflash-0"
    draft: Literal[DRAFT_NAMES] = "dflash"  # the registered drafts (artcache.trainers.ADAPTERS)
    lookbehind: int = 64
    lookahead: int = 256
    block_size: int = 16
    num_anchors: int = 64
    draft_layers: int | None = None
    batch_size: int = 2
    steps: int = 100
    epochs: int = 0
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    threads: int = 0
    out_dir: str = ""
    demand_timeout_s: float = 600.0
    heartbeat_s: float = 2.0
    prefetch_batches: int = 2
    log_every: int = 10
    lockstep_group: str = ""
    layer_ids: list[int] | None = None
    ttt_steps: int = 7
    draft_vocab: int = 32000
    markov_rank: int = 256
    markov_head: Literal["vanilla", "gated"] = "vanilla"
    save_every: int = 0
    keep_checkpoints: int = 3
    checkpoint_optimizer: bool = True
    checkpoints: bool = True
    resume: bool = False
    init_from: str = ""
    eval_samples: int = 0
    eval_interval: int = 0
    eval_anchors: int = 0
    progress: bool = True
    tensorboard: bool = True
    compile: Literal[COMPILE_MODES] = "auto"
    loss_impl: Literal[LOSS_IMPLS] = "auto"
    length_bucket: int = 64

    def validate(self) -> None:
        check_id(self.consumer_id, "consumer id")
        flags = {"num_anchors": "--anchors"}  # fields whose CLI flag has another name
        if self.block_size < 2:  # before the generic >= 1 checks: one message for 0, 1 and negatives
            raise ConfigError(f"--block-size {self.block_size} is invalid: it must be >= 2 (the anchor and at "
                              "least one MASK slot)")
        for name in ("batch_size", "steps", "num_anchors", "prefetch_batches", "log_every",
                     "ttt_steps", "draft_vocab"):
            if getattr(self, name) < 1:
                flag = flags.get(name, "--" + name.replace("_", "-"))
                raise ConfigError(f"{flag} {getattr(self, name)} is invalid: it must be >= 1")
        for name in ("save_every", "keep_checkpoints", "eval_samples", "eval_interval", "eval_anchors",
                     "length_bucket", "epochs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: it must be >= 0")
        if self.markov_rank < 0:
            raise ConfigError(f"--markov-rank {self.markov_rank} is invalid: it must be >= 0 (0: no Markov head)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"--draft-layers {self.draft_layers} is invalid: it must be >= 1 (or left out: one "
                              "draft layer per captured layer the formula selects)")
        if self.save_every and not self.checkpoints:
            raise ConfigError(f"--save-every {self.save_every} needs checkpoints, but this run writes none "
                              "(checkpoints = false); leave --save-every at 0 or turn checkpoints on")
        if self.eval_interval and not self.eval_samples:
            raise ConfigError(f"--eval-interval {self.eval_interval} needs a held-out split: pass --eval-samples N")
        if self.resume and self.init_from:
            raise ConfigError("--resume and --init-from exclude each other: --resume continues a run with its "
                              "optimizer and cursor, --init-from starts a new run from another draft's weights")
        if self.lookbehind < 0 or self.lookahead < 0:
            raise ConfigError(f"window {self.lookbehind}:{self.lookahead}: both sides must be >= 0")
        if self.lookahead < self.batch_size:
            raise ConfigError(
                f"lookahead {self.lookahead} is smaller than one batch ({self.batch_size} positions): the "
                f"consumer could never read a whole batch; use --window {self.lookbehind}:{self.batch_size} "
                "or larger, or a smaller --batch-size")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.lockstep_group:
            for member in self.lockstep_group.split(","):
                check_id(member, "lockstep group member")
            if self.consumer_id not in self.lockstep_group.split(","):
                raise ConfigError(f"lockstep group {self.lockstep_group!r} must list this consumer's id "
                                  f"{self.consumer_id!r}")


def default_block_size(draft: str) -> int:
    """Block size B when none is given: DSpark's 7 (DeepSpec), else DFlash's 16."""
    return 7 if draft == "dspark" else 16


def default_anchors(draft: str, device: str) -> int:
    """Anchors per sequence when none is given: DSpark 512 on a GPU and 64 on a CPU, else 64."""
    if draft == "dspark":
        return 512 if str(device).startswith("cuda") else 64
    return 64


def parse_window(text: str) -> tuple[int, int]:
    """``"64:256"`` → (lookbehind 64, lookahead 256). Raises ConfigError naming the bad value."""
    m = re.fullmatch(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*", text)
    if m is None:
        raise ConfigError(f"--window {text!r} is not LOOKBEHIND:LOOKAHEAD with two non-negative integers, e.g. 64:256")
    return int(m.group(1)), int(m.group(2))


def lr_at(step: int, total: int, base: float, warmup_frac: float, min_frac: float) -> float:
    """Linear warmup over ceil(warmup_frac·total) steps, then cosine decay to min_frac·base."""
    warm = max(1, math.ceil(warmup_frac * total))
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


#: Settings that define a run: ``--resume`` refuses when one differs from the checkpoint's.
RUN_FIELDS = ("draft", "block_size", "num_anchors", "batch_size", "steps", "lr", "warmup_frac", "min_lr_frac",
              "weight_decay", "grad_clip", "seed", "eval_samples", "epochs")
#: The CLI flag of run fields, naming them in a refused ``--resume`` (others are named by their field).
FLAGS = {"num_anchors": "--anchors", "block_size": "--block-size", "batch_size": "--batch-size",
         "steps": "--steps", "lr": "--lr", "seed": "--seed", "eval_samples": "--eval-samples", "draft": "--draft",
         "epochs": "--epochs"}


def run_settings(cfg: ConsumerConfig) -> dict:
    """The run-defining settings (:data:`RUN_FIELDS`) of ``cfg``, as a checkpoint's ``run`` records them."""
    return {k: getattr(cfg, k) for k in RUN_FIELDS}
