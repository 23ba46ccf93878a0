"""Where a consumer run starts from: ``--resume`` (the checkpoint the registry recorded: weights,
optimizer, RNG, step, cursor) or ``--init-from`` (another draft's weights only), and the checks that
refuse a source that does not fit — all before the consumer registers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from artcache import registry
from artcache.errors import ConfigError, ContractMismatch
from artcache.layout import CacheLayout
from artcache.trainers.checkpoint import (
    Loaded,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_state,
)
from artcache.trainers.draft import Draft

from .config import FLAGS, RUN_FIELDS, ConsumerConfig

__all__ = ["InitSource", "check_same_draft", "config_diffs", "find_resume", "init_source", "jsonable",
           "load_weights_strict", "refuse_existing_run", "vocab_map_of"]


def find_resume(cfg: ConsumerConfig, layout: CacheLayout, settings, run_dir: Path) -> Loaded:
    """The checkpoint ``--resume`` continues from: the one in ``run_dir`` whose cursor the registry
    recorded for this consumer id, read whole.

    Raises:
        ConfigError: the id never registered or recorded no checkpoint, no checkpoint of ``run_dir``
            has the recorded cursor (those found are named), or the checkpoint belongs to another
            consumer id, cache root (plan / contract) or run settings (the differing flags are named).
    """
    old = registry.read(layout, cfg.consumer_id)
    if old is None:
        raise ConfigError(f"--resume: consumer id {cfg.consumer_id!r} never registered on {layout.root}; "
                          "start it without --resume")
    if old.checkpoint_cursor < 0:
        raise ConfigError(f"--resume: the registry records no checkpoint of consumer {cfg.consumer_id!r} on "
                          f"{layout.root} (it stopped before writing one; use --save-every N); start it again "
                          "without --resume")
    path = find_checkpoint(run_dir, cursor=old.checkpoint_cursor)
    if path is None:
        found = []
        for step, p in list_checkpoints(run_dir):
            try:
                found.append(f"step {step} at cursor {read_state(p).cursor}")
            except ConfigError:
                continue
        raise ConfigError(
            f"--resume: the registry records consumer {cfg.consumer_id!r}'s last checkpoint at cursor "
            f"{old.checkpoint_cursor}, but {run_dir / 'checkpoints'} holds "
            f"{', '.join(found) if found else 'no checkpoint'}; pass the --out directory of that run")
    ck = load_checkpoint(path)
    st = ck.state
    if st.consumer_id != cfg.consumer_id:
        raise ConfigError(f"--resume: checkpoint {path} belongs to consumer {st.consumer_id!r}, "
                          f"not {cfg.consumer_id!r}")
    for key, theirs, ours in (("plan_id", st.plan_id, settings.plan_id),
                              ("contract_id", st.contract_id, settings.contract.contract_id)):
        if theirs != ours:
            raise ConfigError(f"--resume: checkpoint {path} was trained on another cache root ({key} "
                              f"{str(theirs)[:12]} != {ours[:12]})")
    diffs = [f"{FLAGS.get(k, k)} {getattr(cfg, k)!r} (checkpoint: {st.run.get(k)!r})" for k in RUN_FIELDS
             if st.run.get(k) != getattr(cfg, k)]
    if diffs:
        raise ConfigError(f"--resume continues the same run, but these settings differ from checkpoint {path}: "
                          f"{'; '.join(diffs)}; pass the run's own values or start a new run with --init-from")
    return ck


def check_same_draft(resume: Loaded, draft: Draft) -> None:
    """The draft this run builds must be the checkpoint's (its recorded ``draft_config``).

    Raises:
        ConfigError: naming only the options that differ (:func:`config_diffs`).
    """
    saved, ours = resume.state.draft_config or {}, jsonable(draft.config_dict())
    if saved != ours:
        raise ConfigError(f"--resume: this run builds a draft that differs from checkpoint {resume.path} in "
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


@dataclass
class InitSource:
    """What ``--init-from`` seeds a draft with: its ``weights``, its own ``vocab_map`` (EAGLE-3) or None,
    and the ``source`` directory they were read from."""

    weights: dict[str, torch.Tensor]
    vocab_map: dict[str, torch.Tensor] | None
    source: Path


def init_source(cfg: ConsumerConfig, settings) -> InitSource:
    """The weights ``--init-from`` names: a checkpoint, a published draft directory or a run directory
    (its ``checkpoints/latest``), found by :func:`~artcache.trainers.checkpoint.find_checkpoint`.

    Raises:
        ConfigError: no weights there, or they belong to another draft.
        ContractMismatch: the source records another target (weights digest) or layer convention.
    """
    src = find_checkpoint(cfg.init_from, published=True)
    if src is None:
        raise ConfigError(f"--init-from {cfg.init_from!r}: no model.safetensors there nor in its checkpoints/latest; "
                          "accepted: a checkpoint directory, a published draft directory or a consumer run directory")
    if (src / "state.json").is_file():
        st = read_state(src)
        if st.draft not in (None, cfg.draft):
            raise ConfigError(f"--init-from {cfg.init_from!r} holds a {st.draft} draft, not {cfg.draft}")
        contract = settings.contract
        for key, theirs, ours in (("target_weights_digest", st.target_weights_digest, contract.target_weights_digest),
                                  ("layer_convention", st.layer_convention, contract.layer_convention)):
            if theirs not in (None, ours):
                raise ContractMismatch(f"--init-from {cfg.init_from!r} was trained with {key} {theirs!r}; "
                                       f"this cache root has {ours!r}")
    weights = safetensors.torch.load_file(src / "model.safetensors")
    return InitSource(weights, vocab_map_of(weights), src)


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
