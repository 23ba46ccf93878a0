"""The consumer: one draft trainer (DFlash or EAGLE-3) reading target hidden states from an artcache root.

Read it top to bottom: :func:`run_consumer` builds the draft (:mod:`artcache.trainers.drafts`; it reads its own
ordered view of the root's captured layers), restores a checkpoint (``--resume``) or seeds weights
(``--init-from``), registers (window, held-out split pinned, checkpoint cursor), starts a reader
thread that leases positions inside ``[cursor, cursor + lookahead]``, and runs the training loop. The
cursor is committed only after the optimizer step that consumed its positions; leases are released
once the batch is no longer used. Checkpoints (:mod:`artcache.trainers.checkpoint`), held-out evaluation
(:mod:`artcache.trainers.evaluation`) and tracking (:mod:`artcache.trainers.tracking`) hang off the loop; see
docs/training.md.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec
import torch

from artcache import journal as J
from artcache import registry
from artcache.client import CacheClient, Leased
from artcache.crashpoints import crash_point
from artcache.errors import ConfigError, ConsumerFenced, ContractMismatch
from artcache.layout import CacheLayout, check_id, host_id
from artcache.settings import load_settings
from artcache.trainers.drafts import DraftBatch

log = logging.getLogger("artcache.consumer")


class ConsumerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One consumer's settings (CLI flags map onto these fields).

    Attributes:
        cache: the cache root (made by ``artcache producer``). consumer_id: unique per root.
        draft: draft algorithm (``dflash`` or ``eagle3``), built by :func:`artcache.trainers.drafts.build_draft`.
        lookbehind, lookahead: window in positions; lookahead must be >= batch_size.
        block_size (B), num_anchors (N per sequence), draft_layers (DFlash; default: the largest n
            whose layer ids the root captures, one per captured layer on a DFlash-only root).
        batch_size: sequences (= positions) per optimizer step. steps: optimizer steps to run.
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
        save_every: write a checkpoint every this many steps (0: only at the end and on cancellation;
            a checkpoint is always written at the end and when cancelled by Ctrl-C / SIGTERM).
        keep_checkpoints: keep the newest this many checkpoints (0: all).
        resume: continue this consumer id from its checkpoint in ``out_dir`` (the one whose cursor the
            registry recorded); refuses when they differ or the run's settings changed.
        init_from: seed the draft's weights (only) from a checkpoint, a published draft or a run
            directory; strict keys both ways. EAGLE-3 keeps the source's vocab map.
        eval_samples: size E of the held-out split: plan positions ``[len(plan) - E, len(plan))`` are
            evaluated, never trained on (``steps × batch_size`` must stay <= ``len(plan) - E``). 0: off.
        eval_interval: evaluate every this many steps (0: only at the end); needs ``eval_samples``.
        progress: show a progress bar on stderr (only when it is a TTY).
        tensorboard: write TensorBoard scalars when the package is installed (metrics.csv always).
    """

    cache: str
    consumer_id: str = "dflash-0"
    draft: Literal["dflash", "eagle3"] = "dflash"
    lookbehind: int = 64
    lookahead: int = 256
    block_size: int = 16
    num_anchors: int = 64
    draft_layers: int | None = None
    batch_size: int = 2
    steps: int = 100
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
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    init_from: str = ""
    eval_samples: int = 0
    eval_interval: int = 0
    eval_anchors: int = 0
    progress: bool = True
    tensorboard: bool = True

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
        for name in ("save_every", "keep_checkpoints", "eval_samples", "eval_interval", "eval_anchors"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: it must be >= 0")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"--draft-layers {self.draft_layers} is invalid: it must be >= 1 (or left out: one "
                              "draft layer per captured layer the formula selects)")
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


class _Reader(threading.Thread):
    """Leases and reads batches of consecutive positions, never beyond ``cursor + lookahead``.

    It cannot move the window: the trainer commits the cursor and calls :meth:`authorize`.
    Results (lists of :class:`Leased`, or the exception that stopped it) go to ``out``.
    """

    def __init__(self, client: CacheClient, start_pos: int, batch: int, lookahead: int, depth: int,
                 end: int, group_cursor: Callable[[], int] | None = None) -> None:
        super().__init__(daemon=True, name="artcache-reader")
        self.client, self.next_pos, self.batch, self.lookahead = client, start_pos, batch, lookahead
        self.end = end  # exclusive: the consumer never reads at or past its announced end
        self.group_cursor = group_cursor  # lockstep: the group's min committed cursor (registry poll)
        self.out: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self._cond = threading.Condition()
        self._cursor = start_pos

    def authorize(self, cursor: int) -> None:
        with self._cond:
            self._cursor = cursor
            self._cond.notify_all()

    def _authorized(self, p: int) -> bool:
        """p lies inside ``[cursor, cursor + lookahead]`` and, in a lockstep group, below the group's
        min committed cursor + one batch (every member committed the batches before p's)."""
        if p > self._cursor + self.lookahead:
            return False
        return self.group_cursor is None or p < self.group_cursor() + self.batch

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.next_pos + self.batch <= self.end:
                items = []
                for p in range(self.next_pos, self.next_pos + self.batch):
                    with self._cond:
                        while not self._authorized(p) and not self.stop.is_set():
                            self._cond.wait(0.05 if self.group_cursor else 0.1)
                    if self.stop.is_set():
                        break
                    try:
                        items.append(self.client.acquire(p, self.stop))
                    except BaseException:  # the partial batch's leases (regression: leaked on CaptureTimeout)
                        for it in items:
                            self.client.release(it)
                        raise
                if self.stop.is_set():
                    for it in items:
                        self.client.release(it)
                    return
                self.next_pos += self.batch
                while not self.stop.is_set():
                    try:
                        self.out.put(items, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                else:
                    for it in items:
                        self.client.release(it)
        except InterruptedError:
            return
        except BaseException as exc:  # handed to the trainer, which re-raises it
            self.out.put(exc)


def collate(items: list[Leased], device: torch.device, layers: slice | torch.Tensor | None = None,
            last_layer: int | None = None) -> DraftBatch:
    """Pad a batch into a :class:`~artcache.trainers.drafts.DraftBatch` on ``device``.

    ``hidden`` [b, T, m, H] (zeros past each length) holds the draft's *view* of the captured layers:
    ``layers`` indexes the artifact's layer axis (a ``slice`` for a contiguous run, so a batch of one
    stays a view of the read buffer with no host copy; an index tensor otherwise, which copies only
    the m layers read; None = all). ``input_ids`` [b, T] long, ``loss_mask`` and ``valid`` [b, T]
    bool. ``last_layer``: index of output-of-layer L-1 in the artifact, copied to ``last_layer``
    [b, T, H] (held-out replay against the target's argmax), or None.
    """
    from artcache.layer_ids import select_layers

    lengths = [it.artifact.input_ids.shape[0] for it in items]
    t = max(lengths)
    full = items[0].artifact.hidden_states
    first = full if layers is None else select_layers(full, layers)
    b, m, h = len(items), first.shape[1], first.shape[2]
    gpu = device.type == "cuda"
    if b == 1:
        hidden = first[None]
    else:
        hidden = torch.zeros(b, t, m, h, dtype=first.dtype, pin_memory=gpu)
        for i, it in enumerate(items):
            hs = it.artifact.hidden_states
            hidden[i, : lengths[i]] = hs if layers is None else select_layers(hs, layers)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    valid = torch.zeros(b, t, dtype=torch.bool)
    last = torch.zeros(b, t, h, dtype=full.dtype) if last_layer is not None else None
    for i, it in enumerate(items):
        n = lengths[i]
        ids[i, :n] = it.artifact.input_ids.long()
        mask[i, :n] = it.artifact.loss_mask.bool()
        valid[i, :n] = True
        if last is not None:
            last[i, :n] = it.artifact.hidden_states[:, last_layer]
    return DraftBatch(hidden.to(device, non_blocking=gpu), ids.to(device), mask.to(device), valid.to(device),
                      positions=tuple(it.position for it in items),
                      last_layer=last.to(device) if last is not None else None)


#: Settings that define a run: ``--resume`` refuses when one differs from the checkpoint's.
RUN_FIELDS = ("draft", "block_size", "num_anchors", "batch_size", "steps", "lr", "warmup_frac", "min_lr_frac",
              "weight_decay", "grad_clip", "seed", "eval_samples")
_FLAG = {"num_anchors": "--anchors", "block_size": "--block-size", "batch_size": "--batch-size",
         "steps": "--steps", "lr": "--lr", "seed": "--seed", "eval_samples": "--eval-samples", "draft": "--draft"}


def config_diffs(saved: dict, ours: dict) -> list[str]:
    """``"key ours (checkpoint: saved)"`` for each key whose value differs (a missing key reads None),
    sorted by key: what a refused ``--resume`` names instead of printing both configs whole."""
    return [f"{k} {ours.get(k)!r} (checkpoint: {saved.get(k)!r})" for k in sorted(set(saved) | set(ours))
            if saved.get(k) != ours.get(k)]


def _run_settings(cfg: ConsumerConfig) -> dict:
    return {k: getattr(cfg, k) for k in RUN_FIELDS}


def _find_resume(cfg: ConsumerConfig, layout: CacheLayout, settings, run_dir: Path):
    """The checkpoint ``--resume`` continues from: the one in ``run_dir`` whose cursor the registry
    recorded for this consumer id. Raises ConfigError naming what does not match."""
    from artcache.trainers.checkpoint import find_by_cursor, list_checkpoints, load_checkpoint, load_state

    old = registry.read(layout, cfg.consumer_id)
    if old is None:
        raise ConfigError(f"--resume: consumer id {cfg.consumer_id!r} never registered on {layout.root}; "
                          "start it without --resume")
    if old.checkpoint_cursor < 0:
        raise ConfigError(f"--resume: the registry records no checkpoint of consumer {cfg.consumer_id!r} on "
                          f"{layout.root} (it stopped before writing one; use --save-every N); start it again "
                          "without --resume")
    path = find_by_cursor(run_dir, old.checkpoint_cursor)
    if path is None:
        found = []
        for step, p in list_checkpoints(run_dir):
            try:
                found.append(f"step {step} at cursor {load_state(p).get('cursor')}")
            except (OSError, ValueError):
                continue
        raise ConfigError(
            f"--resume: the registry records consumer {cfg.consumer_id!r}'s last checkpoint at cursor "
            f"{old.checkpoint_cursor}, but {run_dir / 'checkpoints'} holds "
            f"{', '.join(found) if found else 'no checkpoint'}; pass the --out directory of that run")
    ck = load_checkpoint(path)
    st = ck.state
    if st.get("consumer_id") != cfg.consumer_id:
        raise ConfigError(f"--resume: checkpoint {path} belongs to consumer {st.get('consumer_id')!r}, "
                          f"not {cfg.consumer_id!r}")
    for key, ours in (("plan_id", settings.plan_id), ("contract_id", settings.contract.contract_id)):
        if st.get(key) != ours:
            raise ConfigError(f"--resume: checkpoint {path} was trained on another cache root ({key} "
                              f"{str(st.get(key))[:12]} != {ours[:12]})")
    saved = st.get("run", {})
    diffs = [f"{_FLAG.get(k, k)} {getattr(cfg, k)!r} (checkpoint: {saved.get(k)!r})" for k in RUN_FIELDS
             if saved.get(k) != getattr(cfg, k)]
    if diffs:
        raise ConfigError(f"--resume continues the same run, but these settings differ from checkpoint {path}: "
                          f"{'; '.join(diffs)}; pass the run's own values or start a new run with --init-from")
    return ck


def _load_weights_strict(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``weights`` into ``model.trainable_state_dict()``; keys must match both ways, shapes exactly.

    Raises:
        ConfigError: missing or unexpected keys, or a shape mismatch (named, up to five of each).
    """
    own = model.trainable_state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [f"{k} {tuple(weights[k].shape)} != {tuple(own[k].shape)}" for k in sorted(set(own) & set(weights))
              if tuple(weights[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s) {unexpected[:5]}")
        if shapes:
            parts.append(f"shape mismatches {shapes[:5]}")
        raise ConfigError(f"{source}: the weights do not fit this draft ({'; '.join(parts)})")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(weights[k].to(dtype=t.dtype, device=t.device))


def _init_source(cfg: ConsumerConfig, settings):
    """(weights, vocab map or None, source dir) for ``--init-from``.

    Raises:
        ConfigError: no weights there, or they belong to another draft.
        ContractMismatch: the source records another target (weights digest) or layer convention.
    """
    import safetensors.torch

    from artcache.trainers.checkpoint import load_state, resolve_weights_dir

    src = resolve_weights_dir(cfg.init_from)
    if (src / "state.json").is_file():
        st = load_state(src)
        if st.get("draft") not in (None, cfg.draft):
            raise ConfigError(f"--init-from {cfg.init_from!r} holds a {st.get('draft')} draft, not {cfg.draft}")
        contract = settings.contract
        for key, ours in (("target_weights_digest", contract.target_weights_digest),
                          ("layer_convention", contract.layer_convention)):
            if st.get(key) not in (None, ours):
                raise ContractMismatch(f"--init-from {cfg.init_from!r} was trained with {key} {st.get(key)!r}; "
                                       f"this cache root has {ours!r}")
    weights = safetensors.torch.load_file(src / "model.safetensors")
    return weights, _vocab_map(weights), src


def _vocab_map(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """An EAGLE-3 draft's own vocab map, saved with its weights (``d2t``, ``t2d``); None for other drafts."""
    return {k: weights[k] for k in ("d2t", "t2d")} if {"d2t", "t2d"} <= set(weights) else None


def _existing_run(run_dir: Path) -> bool:
    from artcache.trainers.checkpoint import list_checkpoints

    return bool(list_checkpoints(run_dir))


def run_consumer(cfg: ConsumerConfig) -> dict:
    """Train one draft on the cache root; returns a summary dict. Raises on failure (after fencing).

    Raises:
        ConfigError / ContractMismatch: bad settings, layers the root does not capture, a resume or
            init source that does not fit (all before registering). Training errors after fencing.
    """
    from artcache.layer_ids import layer_view, view_slice
    from artcache.plan import Plan
    from artcache.producer import quiet_transformers
    from artcache.trainers.checkpoint import (
        point_latest,
        prune,
        restore_optimizer,
        restore_rng,
        save_checkpoint,
    )
    from artcache.trainers.drafts import build_draft
    from artcache.trainers.evaluation import Evaluator, eval_split, target_argmax_fn
    from artcache.trainers.tracking import Progress, RunTracker

    cfg.validate()
    quiet_transformers()
    layout = CacheLayout(Path(cfg.cache).expanduser().absolute())
    settings = load_settings(layout)  # raises CacheRootError for a missing/uninitialised root
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    plan = Plan.load(layout.plan_dir(settings.plan_id))
    end = cfg.steps * cfg.batch_size
    pinned = eval_split(len(plan), cfg.eval_samples, cfg.steps, cfg.batch_size)
    run_dir = Path(cfg.out_dir or Path("runs") / cfg.consumer_id).absolute()

    resume = init = None
    vocab_map = None
    if cfg.resume:
        resume = _find_resume(cfg, layout, settings, run_dir)
        vocab_map = _vocab_map(resume.weights)
    else:
        if _existing_run(run_dir):
            raise ConfigError(f"run directory {run_dir} already holds checkpoints of an earlier run; pass --resume "
                              "to continue it, or another --out for a new run")
        if cfg.init_from:
            init = _init_source(cfg, settings)
            vocab_map = init[1]
    draft = build_draft(cfg, settings, plan, device, vocab_map=vocab_map)
    captured = list(settings.contract.layer_ids)
    view = layer_view(captured, draft.needed_layer_ids, draft=cfg.draft, flag_hint="")
    layers = view_slice(view)
    if isinstance(layers, slice) and layers == slice(0, len(captured)):
        layers = None  # the draft reads every captured layer, in order
    model = draft.model
    if resume is not None:
        saved, ours = resume.state.get("draft_config") or {}, _jsonable(draft.config_dict())
        if saved != ours:
            raise ConfigError(f"--resume: this run builds a draft that differs from checkpoint {resume.path} in "
                              f"{'; '.join(config_diffs(saved, ours))}; pass the run's own draft options or start "
                              "a new run with --init-from")
        _load_weights_strict(model, resume.weights, f"checkpoint {resume.path}")
    elif init is not None:
        _load_weights_strict(model, init[0], f"--init-from {init[2]}")
        log.info("[%s] weights seeded from %s%s", cfg.consumer_id, init[2],
                 " (its own vocab map kept)" if init[1] else "")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                                  fused=True)
    generators = draft.generators()
    start_step, start_cursor = 0, 0
    if resume is not None:
        restore_optimizer(optimizer, resume.optimizer, resume.state["param_groups"])
        restore_rng(resume.rng, generators)
        start_step, start_cursor = int(resume.state["step"]), int(resume.state["cursor"])

    # greedy replay against the target's argmax needs output-of-layer L-1 (un-normed) in the root
    last_id = draft.target_info.num_layers - 1
    last_index = captured.index(last_id) if (cfg.eval_samples and last_id in captured) else None
    argmax_fn = target_argmax_fn(draft.target_info, draft.target_lm_head, device) if last_index is not None \
        else None

    def check_resume(old: registry.Registration | None) -> None:
        if resume is None:
            return
        # under the registry lock: the checkpoint must be the one the registry recorded last
        if old is None or old.checkpoint_cursor != start_cursor:
            raise ConfigError(
                f"--resume: consumer {cfg.consumer_id!r}'s recorded checkpoint cursor is "
                f"{old.checkpoint_cursor if old else 'absent'}, checkpoint {resume.path} has cursor {start_cursor}")

    try:  # before registering or journaling: an unusable --out must leave nothing behind in the root
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise ConfigError(f"--out {str(run_dir)!r} cannot be the run directory ({exc.strerror or exc}); give a "
                          "writable directory path (created if missing)") from None
    journal = J.JournalWriter(layout.journal_path("consumer", cfg.consumer_id))
    try:
        reg = registry.register(layout, registry.Registration(
            consumer_id=cfg.consumer_id, draft=cfg.draft, cursor=start_cursor, lookbehind=cfg.lookbehind,
            lookahead=cfg.lookahead, batch_size=cfg.batch_size, end=end, pid=os.getpid(), host=host_id(),
            pinned=pinned, checkpoint_cursor=start_cursor if resume is not None else -1),
            check=check_resume, live_timeout_s=settings.heartbeat_timeout_s)
    except BaseException:
        journal.close()
        raise
    handle = registry.ConsumerHandle(layout, reg)
    try:  # after registering: a refused resume must not touch the run's metrics
        tracker = RunTracker(run_dir, tensorboard=cfg.tensorboard, resume_step=start_step if resume else None)
    except BaseException as exc:
        handle.finish("failed", f"{type(exc).__name__}: {exc}")
        journal.close()
        raise
    if resume is not None:
        log.info("[%s] resumed from %s: step %d, cursor %d", cfg.consumer_id, resume.path, start_step, start_cursor)
    journal.emit(J.ConsumerStart(consumer=cfg.consumer_id, pid=os.getpid(), draft=cfg.draft,
                                 block_size=cfg.block_size, batch_size=cfg.batch_size,
                                 lookbehind=cfg.lookbehind, lookahead=cfg.lookahead, cursor=reg.cursor,
                                 step=start_step, pinned=pinned[1] - pinned[0]))
    client = CacheClient(layout, settings, plan, handle, journal, cfg.demand_timeout_s, pin=device.type == "cuda")
    group = [m for m in cfg.lockstep_group.split(",") if m]
    reader = _Reader(client, reg.cursor, cfg.batch_size, cfg.lookahead, cfg.prefetch_batches, end=end,
                     group_cursor=(lambda: group_cursor(layout, group)) if group else None)
    fenced = threading.Event()
    beat_stop = threading.Event()
    stop_req = threading.Event()  # a signal asked to stop: finish the current step, then cancel

    def heartbeat():
        while not beat_stop.wait(cfg.heartbeat_s):
            try:
                handle.heartbeat()
            except ConsumerFenced as exc:
                log.error("%s", exc)
                fenced.set()
                reader.stop.set()
                return
            except Exception as exc:  # a transient filesystem error: try again next beat
                log.warning("heartbeat failed: %s", exc)

    def on_signal(signum, _frame):
        if stop_req.is_set():
            raise KeyboardInterrupt(f"signal {signum} (second)")
        stop_req.set()
        log.warning("[%s] signal %d: stopping after the current step (send it again to stop at once)",
                    cfg.consumer_id, signum)

    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM / Ctrl-C end the run at the next step boundary: checkpoint, fenced as "cancelled",
        # leases released, journal closed (the previous handlers come back when the run ends)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous_handlers[sig] = signal.signal(sig, on_signal)

    def collate_eval(items, with_last: bool) -> DraftBatch:
        return collate(items, device, layers, last_index if with_last else None)

    evaluator = Evaluator(draft, client, range(*pinned), cfg.batch_size, collate_eval, argmax_fn, stop_req) \
        if cfg.eval_samples else None
    last_eval: dict = {}

    def evaluate(at_step: int) -> None:
        nonlocal last_eval
        t0 = time.monotonic()
        try:
            last_eval = evaluator.run()
        except InterruptedError:
            raise KeyboardInterrupt("stopped during evaluation") from None
        last_eval["step"] = at_step
        tracker.scalars(at_step, "eval", {k: v for k, v in last_eval.items() if k not in ("step", "samples")})
        tracker.flush()
        shown = last_eval.get("acc", [])[:4]
        acc = " ".join(f"{a:.2f}" for a in shown)
        log.info("[%s] eval step %d on %d held-out samples: loss %.3f %s acc_1..%d %s (labels: %s) %.1fs",
                 cfg.consumer_id, at_step, last_eval["samples"], last_eval["loss"], draft.headline(last_eval),
                 len(shown), acc, last_eval["labels"], time.monotonic() - t0)

    cursor, step, state, error = reg.cursor, start_step, "failed", ""
    saved_step = start_step if resume is not None else -1
    ckpt = resume.path if resume is not None else None
    consistent = True  # model, optimizer and RNG match (step, cursor): safe to checkpoint

    def save() -> Path:
        nonlocal saved_step
        path = save_checkpoint(run_dir, step=step, cursor=cursor, weights=model.trainable_state_dict(),
                               optimizer=optimizer, generators=generators, extra_tensors=draft.extra_tensors(),
                               state={"consumer_id": cfg.consumer_id, "draft": cfg.draft,
                                      "draft_config": _jsonable(draft.config_dict()), "run": _run_settings(cfg),
                                      "schedule": {"kind": "linear-warmup-cosine", "base_lr": cfg.lr,
                                                   "warmup_frac": cfg.warmup_frac, "min_lr_frac": cfg.min_lr_frac,
                                                   "total_steps": cfg.steps, "next_step": step},
                                      "plan_id": settings.plan_id, "contract_id": settings.contract.contract_id,
                                      "target_name": settings.contract.target_name,
                                      "target_path": settings.target_path,
                                      "target_weights_digest": settings.contract.target_weights_digest,
                                      "dtype": settings.contract.dtype,
                                      "layer_convention": settings.contract.layer_convention,
                                      "final_norm": draft.target_info.final_norm,
                                      "layer_ids": list(draft.needed_layer_ids), "pinned": list(pinned),
                                      "generation": handle.generation, "saved_at": time.time()})
        tracker.flush()  # metrics.csv holds every step the checkpoint covers (a SIGKILL later loses none)
        crash_point("checkpoint.before-record")
        handle.record_checkpoint(cursor)  # the resume point moves only once the directory is complete
        crash_point("checkpoint.after-record")
        point_latest(run_dir, path)
        prune(run_dir, cfg.keep_checkpoints, path)
        saved_step = step
        log.info("[%s] checkpoint %s (step %d, cursor %d)", cfg.consumer_id, path, step, cursor)
        return path

    progress = Progress(cfg.steps, start_step, cfg.progress, cfg.consumer_id)
    first_losses, last_losses = [], []
    total = None
    wait_total = 0.0
    t_start = time.time()
    t_loop = time.monotonic()
    beater = threading.Thread(target=heartbeat, daemon=True, name="artcache-heartbeat")
    beater.start()
    reader.start()
    try:
        if evaluator is not None and cfg.eval_interval and start_step == 0:
            evaluate(0)  # the untrained draft: the baseline every later evaluation is compared with
        for step_index in range(start_step, cfg.steps):
            t0 = time.monotonic()
            got = None
            while got is None:
                if stop_req.is_set():
                    raise KeyboardInterrupt("signal")
                try:
                    got = reader.out.get(timeout=0.2)
                except queue.Empty:
                    continue
            if isinstance(got, BaseException):
                raise got
            if fenced.is_set():
                raise ConsumerFenced(f"consumer {cfg.consumer_id} was fenced")
            wait_s = time.monotonic() - t0
            wait_total += wait_s
            batch = collate(got, device, layers)
            lr = lr_at(step_index, cfg.steps, cfg.lr, cfg.warmup_frac, cfg.min_lr_frac)
            for g in optimizer.param_groups:
                g["lr"] = lr
            consistent = False  # from the anchor draw on, until the cursor commit
            loss, sums = draft.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            cursor = got[-1].position + 1
            # the step no longer needs the batch's bytes: release its leases while its positions are
            # still inside the window, then commit (a crash in between leaves nothing outside it)
            for it in got:
                client.release(it)
            crash_point("cursor.before-commit")
            handle.commit_cursor(cursor)  # only after the step that consumed the positions
            crash_point("cursor.after-commit")
            step = step_index + 1
            consistent = True
            reader.authorize(cursor)
            total = sums if total is None else total + sums
            s = draft.summary(sums)
            if step_index - start_step < 5:
                first_losses.append(s["loss"])
            last_losses.append(s["loss"])
            del last_losses[:-5]
            step_s = time.monotonic() - t0
            journal.emit(J.Step(consumer=cfg.consumer_id, step=step, cursor=cursor, loss=s["loss"],
                                wait_s=wait_s, step_s=step_s, lr=lr, **draft.journal_fields(sums)))
            rate = (step - start_step) / max(1e-9, time.monotonic() - t_loop)
            tracker.scalars(step, "train", {**{k: v for k, v in s.items() if k != "blocks"}, "lr": lr,
                                            "steps_per_s": rate, "wait_s": wait_s, "wait_total_s": wait_total})
            progress.update(rate, s.get(draft.progress_metric), wait_total, draft.progress_metric)
            if step % cfg.log_every == 0 or step == cfg.steps:
                shown = s["acc"][:4]
                acc = " ".join(f"{a:.2f}" for a in shown)
                log.info("[%s] step %d/%d loss %.3f %s acc_1..%d %s trainer wait for batch %.2fs",
                         cfg.consumer_id, step, cfg.steps, s["loss"], draft.headline(s), len(shown), acc, wait_s)
                tracker.flush()
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                ckpt = save()
            if evaluator is not None and cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.steps:
                evaluate(step)
        if evaluator is not None and last_eval.get("step") != step:
            evaluate(step)
        state = "completed"
    except KeyboardInterrupt:
        state, error = "cancelled", "interrupted"
        raise
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        progress.close()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        reader.stop.set()
        beat_stop.set()
        reader.join(timeout=5)
        _drain(reader, client)
        save_error = None
        # also on a failure between steps (e.g. CaptureTimeout when the producer is gone): the state is a
        # consistent step, so --resume continues from here instead of the last --save-every checkpoint
        if consistent and step > max(saved_step, 0) and not fenced.is_set():
            try:
                ckpt = save()
            except Exception as exc:  # never mask the error in flight; a completed run without it failed
                save_error = exc
                log.error("[%s] the final checkpoint failed: %s: %s", cfg.consumer_id, type(exc).__name__, exc)
                if state == "completed":
                    state, error = "failed", f"checkpoint: {type(exc).__name__}: {exc}"
        handle.finish(state, error)
        journal.emit(J.ConsumerEnd(consumer=cfg.consumer_id, state=state, steps=step, cursor=cursor,
                                   error=error))
        journal.close()
        tracker.close()
    if save_error is not None:
        raise save_error
    summary = draft.summary(total) if total is not None else {}
    out = {"consumer_id": cfg.consumer_id, "draft": cfg.draft, "steps": step, "cursor": cursor,
           "resumed_from_step": start_step if resume is not None else None,
           "seconds": time.time() - t_start,
           # means over the first / last (up to) 5 steps this process trained; None when it trained none
           # (e.g. --resume of a run that had already completed)
           "first_loss": sum(first_losses) / len(first_losses) if first_losses else None,
           "final_loss": sum(last_losses) / len(last_losses) if last_losses else None,
           "tau": summary.get("tau"), "checkpoint": str(ckpt) if ckpt else None,
           "run_dir": str(run_dir), "wait_s": wait_total}
    if "sim_acc_len" in summary:
        out["sim_acc_len"] = summary["sim_acc_len"]
    if last_eval:
        out["eval"] = last_eval
    return out


def _jsonable(obj):
    """``obj`` as it reads back from JSON (tuples become lists), for comparing with a saved state."""
    import json

    return json.loads(json.dumps(obj, default=str))


def group_cursor(layout: CacheLayout, members: list[str]) -> int:
    """Min committed cursor over a lockstep group's members: one not registered yet counts as 0,
    one in a terminal state (completed, failed, ...) no longer counts."""
    cursors = []
    for member in members:
        reg = registry.read(layout, member)
        if reg is None or reg.state == "running":
            cursors.append(reg.cursor if reg else 0)
    return min(cursors, default=0)


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _drain(reader: _Reader, client: CacheClient) -> None:
    """Release leases of batches the reader fetched but the trainer never used."""
    while True:
        try:
            got = reader.out.get_nowait()
        except queue.Empty:
            return
        if isinstance(got, list):
            for it in got:
                client.release(it)
