"""Where a consumer run starts from: ``--resume`` (the checkpoint the registry recorded: weights,
optimizer, RNG, step, cursor) or ``--init-from`` (another draft's weights only, any published layout:
:mod:`artcache.trainers.seed`), and the checks that refuse a source that does not fit — all before the
consumer registers, and the same functions in ``artcache run --dry-run``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import torch

from artcache import registry
from artcache.errors import CheckpointCorrupt, ConfigError
from artcache.layout import CacheLayout
from artcache.trainers.checkpoint import (
    CheckpointState,
    Loaded,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_state,
    require_resumable,
    stateless_checkpoints,
)
from artcache.trainers.seed import SeedPlan, SeedSource, map_back, plan_seed, seed_vocab_map

from .config import RUN_DEFAULTS, ConsumerConfig, flag_of, run_settings

__all__ = ["check_run_settings", "check_same_draft", "config_diffs", "find_resume", "jsonable", "load_weights_strict",
           "plan_init", "refuse_existing_run", "refuse_reused_id", "resume_state", "saved_horizon",
           "training_token_counts", "unrecorded_checkpoints", "vocab_map_of", "with_horizon"]

log = logging.getLogger("artcache.consumer")


def resume_state(cfg: ConsumerConfig, layout: CacheLayout, plan_id: str, contract_id: str,
                 run_dir: Path, *, allow_complete: bool = False) -> tuple[Path, CheckpointState] | None:
    """The checkpoint ``--resume`` continues from (the one in ``run_dir`` whose cursor the registry recorded
    for this consumer id) and its state, checked against this run: id, cache root, run settings
    (:func:`check_run_settings`). Reads only ``state.json`` files (``artcache run --dry-run`` calls it too).

    None when the registry records no checkpoint and every checkpoint in ``run_dir`` is one the id's last
    incarnation wrote but was killed before recording (:func:`unrecorded_checkpoints`): the previous checkpoint
    is then none, so the run continues from step 0 in the same ``run_dir`` (the caller removes those).

    Raises:
        ConfigError: the id never registered or recorded no checkpoint (and ``run_dir`` holds none of its
            unrecorded ones), no checkpoint of ``run_dir`` has the recorded cursor (those found are named), or
            the checkpoint belongs to another consumer id, cache root (plan / contract) or run settings (the
            differing flags are named).
        CheckpointCorrupt: a ``state.json`` read does not match the digest it recorded.
    """
    old = registry.read(layout, cfg.consumer_id) if layout.consumers.is_dir() else None
    if old is None:
        raise ConfigError(f"--resume: consumer id {cfg.consumer_id!r} never registered on {layout.root}; "
                          "start it without --resume")
    if old.checkpoint_cursor < 0:
        if unrecorded_checkpoints(old, run_dir, plan_id, contract_id):
            return None
        held = list_checkpoints(run_dir)
        raise ConfigError(f"--resume: the registry records no checkpoint of consumer {cfg.consumer_id!r} on "
                          f"{layout.root} (it stopped before writing one; use --save-every N); " + (
                              f"{run_dir} holds checkpoints of another run: start it again without --resume and "
                              "with another --out" if held else "start it again without --resume"))
    path = find_checkpoint(run_dir, cursor=old.checkpoint_cursor)
    if path is None:
        found, damaged = [], [f"{p.name} (no state.json)" for p in stateless_checkpoints(run_dir)]
        for step, p in list_checkpoints(run_dir):
            try:
                found.append(f"step {step} at cursor {read_state(p).cursor}")
            except (ConfigError, CheckpointCorrupt) as exc:
                damaged.append(f"{p.name} ({exc})")
        held = ', '.join(found) if found else 'no readable checkpoint' if damaged else 'no checkpoint'
        if damaged:  # regression: a damaged recorded checkpoint read as "holds no checkpoint; pass the --out"
            raise ConfigError(
                f"--resume: the registry records consumer {cfg.consumer_id!r}'s last checkpoint at cursor "
                f"{old.checkpoint_cursor}; {run_dir / 'checkpoints'} holds {held}, and {len(damaged)} it cannot "
                f"read: {'; '.join(damaged)}. The recorded checkpoint is probably among those, damaged, so this "
                "run cannot be resumed: start a new run (--init-from an intact checkpoint keeps its weights)")
        raise ConfigError(
            f"--resume: the registry records consumer {cfg.consumer_id!r}'s last checkpoint at cursor "
            f"{old.checkpoint_cursor}, but {run_dir / 'checkpoints'} holds {held}; pass the --out directory of "
            "that run")
    st = read_state(path)
    if st.consumer_id != cfg.consumer_id:
        raise ConfigError(f"--resume: checkpoint {path} belongs to consumer {st.consumer_id!r}, "
                          f"not {cfg.consumer_id!r}")
    for key, theirs, ours in (("plan_id", st.plan_id, plan_id), ("contract_id", st.contract_id, contract_id)):
        if theirs != ours:
            raise ConfigError(f"--resume: checkpoint {path} was trained on another cache root ({key} "
                              f"{str(theirs)[:12]} != {ours[:12]})")
    if not allow_complete:  # before the settings: raising --steps would not make it resumable
        require_resumable(path, st)  # (a complete experiment `artcache run` skips needs no resume)
    check_run_settings(cfg, st, path, allow_complete=allow_complete)
    return path, st


def unrecorded_checkpoints(old: registry.Registration, run_dir: Path, plan_id: str,
                           contract_id: str) -> list[Path]:
    """The checkpoints of ``run_dir`` when the registry (``old``, the id's registration) records none and
    every one of them was written by that registration's last incarnation (same consumer id, plan, capture
    contract and registration generation — the one running, or the one a fence ended), i.e. by a process
    killed between writing its first checkpoint and recording it (``checkpoint.before-record``); else ``[]``.
    No ``--resume`` can continue from such a checkpoint (nothing recorded its cursor), and no other run owns
    it. Reads only ``state.json`` files; an unreadable one makes the answer ``[]``."""
    if old.checkpoint_cursor >= 0:
        return []
    found = [p for _, p in list_checkpoints(run_dir)]
    generations = {old.generation, old.fenced_from}
    for path in found:
        try:
            st = read_state(path)
        except (ConfigError, CheckpointCorrupt):  # what cannot be read is never removed as unrecorded
            return []
        if (st.consumer_id, st.plan_id, st.contract_id) != (old.consumer_id, plan_id, contract_id) \
                or st.generation is None or st.generation not in generations:
            return []
    return found


def saved_horizon(st: CheckpointState) -> int | None:
    """The LR horizon a checkpoint was trained under: its schedule's ``total_steps`` (checkpoints written
    before ``lr_total_steps`` existed recorded ``--steps`` there)."""
    if st.schedule is not None:
        return st.schedule.total_steps
    return st.run.get("lr_total_steps", st.run.get("steps"))


def with_horizon(cfg: ConsumerConfig, st: CheckpointState) -> ConsumerConfig:
    """``cfg`` with ``lr_total_steps`` set to the checkpoint's horizon when not given (``--resume`` keeps the
    schedule; a run is extended by raising ``--steps`` alone)."""
    if cfg.lr_total_steps is not None:
        return cfg
    return msgspec.structs.replace(cfg, lr_total_steps=saved_horizon(st))


def check_run_settings(cfg: ConsumerConfig, st: CheckpointState, path: Path, *, allow_complete: bool = False) -> None:
    """The settings that define a run must be the checkpoint's (:func:`~.config.run_settings`; ``--steps``
    may change: it is the stop), the checkpoint must be below ``--steps``, and steps past the LR horizon
    must not train at LR 0.

    Raises:
        ConfigError: naming each differing flag with both values, a checkpoint at or past ``--steps``
            (at it is accepted with ``allow_complete``: ``artcache run`` recognises a complete
            experiment), or ``--steps`` beyond a horizon whose floor LR is 0.
    """
    cfg = with_horizon(cfg, st)
    saved = dict(st.run)
    saved["lr_total_steps"] = saved_horizon(st)
    for k, v in RUN_DEFAULTS.items():
        saved.setdefault(k, v)
    if saved["nproc"] != cfg.nproc:  # DDP replicas could reshard, but the run's global batch would change
        raise ConfigError(f"--resume: checkpoint {path} was trained by a group of {saved['nproc']} rank(s), this run "
                          f"has {cfg.nproc} (--nproc / WORLD_SIZE); resume with {saved['nproc']} rank(s), or start a "
                          "new run from its weights with --init-from")
    diffs = [f"{flag_of(k)} {v!r} (checkpoint: {saved.get(k)!r})" for k, v in run_settings(cfg).items()
             if k != "steps" and saved.get(k) != v]
    if diffs:
        raise ConfigError(f"--resume continues the same run, but these settings differ from checkpoint {path}: "
                          f"{'; '.join(diffs)}; pass the run's own values or start a new run with --init-from")
    final = cfg.min_lr_frac == 0 and st.step >= cfg.horizon  # its LR reached 0: no step past it would train
    if st.step > cfg.steps or (st.step == cfg.steps and not allow_complete):
        if final:
            more = (f"its LR schedule ended at step {cfg.horizon} (--lr-total-steps) with min_lr_frac 0, so it cannot "
                    "be extended: start a new run from its weights with --init-from")
        elif cfg.min_lr_frac == 0:
            more = (f"raise --steps to extend the run (up to {cfg.horizon}, its --lr-total-steps, while min_lr_frac "
                    "is 0)")
        else:
            more = "raise --steps to extend the run"
        raise ConfigError(f"--resume: checkpoint {path} is at step {st.step}, --steps is {cfg.steps}: nothing left "
                          f"to train; {more}")
    if cfg.steps > cfg.horizon and cfg.min_lr_frac == 0:
        raise ConfigError(f"--steps {cfg.steps} runs past the LR schedule's horizon --lr-total-steps {cfg.horizon} "
                          "with min_lr_frac 0 (a run config's experiments.<name>.consumer.min_lr_frac): the extra "
                          f"steps would train at LR 0; use --steps <= {cfg.horizon}, or start a new run from its "
                          "weights with --init-from (runs you may extend: start them with --lr-total-steps >= the "
                          "final --steps)")


def find_resume(cfg: ConsumerConfig, layout: CacheLayout, settings, run_dir: Path) -> Loaded | None:
    """The checkpoint ``--resume`` continues from (:func:`resume_state`), read whole; None: continue from
    step 0 (only unrecorded checkpoints of this id's last incarnation in ``run_dir``).

    Raises:
        ConfigError: see :func:`resume_state`; an incomplete or unreadable checkpoint.
        CheckpointCorrupt: a file of the checkpoint does not match the digest it recorded
            (:func:`~artcache.trainers.checkpoint.load_checkpoint`).
    """
    found = resume_state(cfg, layout, settings.plan_id, settings.contract.contract_id, run_dir)
    return load_checkpoint(found[0]) if found is not None else None


def check_same_draft(saved: dict | None, ours: dict, path: Path) -> None:
    """The draft this run builds (its ``config_dict``, or the planned one) must be the checkpoint's
    (its recorded ``draft_config``).

    Raises:
        ConfigError: naming only the options that differ (:func:`config_diffs`).
    """
    saved, ours = saved or {}, jsonable(ours)
    if saved != ours:
        raise ConfigError(f"--resume: this run builds a draft that differs from checkpoint {path} in "
                          f"{'; '.join(config_diffs(saved, ours))}; pass the run's own draft options or start "
                          "a new run with --init-from")


def config_diffs(saved: dict, ours: dict) -> list[str]:
    """``"key ours (checkpoint: saved)"`` for each key whose value differs (a missing key reads None),
    sorted by key: what a refused ``--resume`` names instead of printing both configs whole."""
    return [f"{k} {ours.get(k)!r} (checkpoint: {saved.get(k)!r})" for k in sorted(set(saved) | set(ours))
            if saved.get(k) != ours.get(k)]


def jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists), for comparing with a saved state."""
    return json.loads(json.dumps(obj, default=str))


def load_weights_strict(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``weights`` into ``model.trainable_state_dict()``; keys must match both ways, shapes exactly
    (the check of :func:`artcache.trainers.seed.map_back`, with no renames).

    Raises:
        ConfigError: missing or unexpected keys, or a shape mismatch (named, up to five of each).
    """
    own = model.trainable_state_dict()
    map_back({k: tuple(v.shape) for k, v in weights.items()}, {k: tuple(v.shape) for k, v in own.items()}, (), {},
             source)
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(weights[k].to(dtype=t.dtype, device=t.device))


def training_token_counts(plan, eval_samples: int, vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id among the supervised tokens of the plan's **training** samples
    (the held-out split left out): int64 [V] (what a kept vocab map's coverage is measured on)."""
    from artcache.trainers.eagle3.adapter import TrainingTokens
    from artcache.trainers.eagle3.vocab import count_plan_tokens

    return count_plan_tokens(TrainingTokens(plan, len(plan) - eval_samples), vocab_size)


def plan_init(cfg: ConsumerConfig, src: SeedSource, ours: dict, own: dict[str, tuple[int, ...]], info, contract,
              plan) -> SeedPlan:
    """:func:`~artcache.trainers.seed.plan_seed` for this run (the plan's training tokens measure a kept
    vocab map), then its notes logged (a kept map below ``--min-vocab-coverage`` as a warning).

    Raises:
        as :func:`~artcache.trainers.seed.plan_seed`.
    """
    counts = training_token_counts(plan, cfg.eval_samples, info.vocab_size) if seed_vocab_map(src) else None
    planned = plan_seed(src, jsonable(ours), own, cfg, info, contract, counts)
    for note in planned.notes:
        low = cfg.min_vocab_coverage if cfg.min_vocab_coverage is not None else 0.5
        level = logging.WARNING if planned.coverage is not None and planned.coverage < low and "vocab map" in note \
            else logging.INFO
        log.log(level, "[%s] --init-from %s: %s", cfg.consumer_id, src.path, note)
    return planned


def vocab_map_of(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """An EAGLE-3 draft's own vocab map, saved with its weights (``d2t``, ``t2d``); None for other drafts."""
    return {k: weights[k] for k in ("d2t", "t2d")} if {"d2t", "t2d"} <= set(weights) else None


def refuse_existing_run(run_dir: Path) -> None:
    """A fresh run must not start in a run directory that holds checkpoints of an earlier run.

    Raises:
        ConfigError: naming the directory and the two ways on (``--resume``, another ``--out``).
    """
    if list_checkpoints(run_dir):
        raise ConfigError(f"run directory {run_dir} already holds checkpoints of an earlier run; pass --resume "
                          "to continue it, or another --out for a new run")


def refuse_reused_id(consumer_id: str, old, run_dir: Path) -> None:
    """A fresh run (no ``--resume``) of ``consumer_id`` must not start over, from cursor 0, an earlier run of the
    same id on this root that recorded a durable checkpoint (``old``: its registration, or None) in another run
    directory that still holds checkpoints: the root would forget that run's cursor without a word. An earlier
    run without a recorded checkpoint, or whose run directory is gone or empty, leaves nothing to continue (its
    id is taken over as before); its own ``run_dir`` is :func:`refuse_existing_run`'s.

    Raises:
        ConfigError: naming the id, the earlier run's state, cursor and run directory, and the two ways on
            (``--resume --out`` that directory, or another ``--id``).
    """
    if old is None or old.checkpoint_cursor < 0:
        return
    earlier = Path(old.out_dir) if old.out_dir else None
    if earlier is not None and (earlier.absolute() == run_dir.absolute() or not list_checkpoints(earlier)):
        return
    where = f"in {earlier}" if earlier is not None else "in a run directory its registration does not record"
    how = f"pass --resume --out {earlier} to continue it" if earlier is not None else "pass --resume with its --out"
    raise ConfigError(f"consumer id {consumer_id!r} already ran on this cache root ({old.state}, checkpoint at "
                      f"cursor {old.checkpoint_cursor} {where}); a fresh run under --out {run_dir} would start it "
                      f"over from cursor 0: {how}, or choose another --id for a new draft")
