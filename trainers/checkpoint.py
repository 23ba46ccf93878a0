"""Checkpoints without pickle: safetensors for tensors, JSON for everything else, atomic per directory.

Layout of ``<run_dir>/checkpoints/step-<N>/`` (N zero-padded to 8 digits)::

    model.safetensors       trainable draft weights (never the frozen target embedding/lm_head)
    optimizer.safetensors   optimizer state tensors, keys ``state.<param index>.<state name>``
    rng.safetensors         RNG states as uint8 tensors: ``torch_cpu``, ``cuda.<i>`` (each visible GPU),
                            ``generator.<name>`` (the draft's own generators, e.g. DFlash anchors)
    extra.safetensors       draft tensors that are not trained but belong to it (EAGLE-3 ``d2t``,
                            ``t2d``); absent when the draft has none
    state.json              format, step, committed cursor, consumer id, draft, draft config, the run's
                            settings, optimizer param groups, LR schedule state, plan / contract ids

Nothing is ever unpickled: tensors come from safetensors, the rest from JSON.

``state.json`` is read as a :class:`CheckpointState` (typed; see its docstring for how fields a
reader does not know, and fields an older checkpoint lacks, are handled).

Atomicity: the directory is written under a unique temp name beside it (every file fsynced), renamed
into place and the parent directory fsynced, so a crash leaves either no ``step-<N>`` or a complete
one. ``latest`` is a symlink replaced atomically after the rename (a convenience: ``--resume`` looks
the checkpoint up by the cursor the registry recorded). :func:`find_checkpoint` is the one lookup
every reader uses (``--resume`` by cursor, ``--init-from``, ``artcache export``, ``artcache run``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import safetensors.torch
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.fsio import fsync_dir
from artcache.layout import unique_suffix

log = logging.getLogger("artcache.consumer")

#: state.json ``format``; bump when the layout above changes.
CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"step-([0-9]{8})")


class Schedule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The LR schedule a checkpoint was trained under (:func:`artcache.trainers.consumer.lr_at`).

    Attributes:
        kind: ``"linear-warmup-cosine"``. base_lr: peak LR. warmup_frac, min_lr_frac: as the consumer's
        flags. total_steps: the run's ``--steps``. next_step: the step the schedule continues at.
    """

    kind: str
    base_lr: float
    warmup_frac: float
    min_lr_frac: float
    total_steps: int
    next_step: int


class CheckpointState(msgspec.Struct, kw_only=True):
    """A checkpoint's ``state.json``: everything that is not a tensor.

    Unknown fields are **ignored** (not forbidden): a ``state.json`` written by a newer artcache of the
    same ``format`` still loads here, and callers may store extra keys (``save_checkpoint(state=...)``).
    Fields an older checkpoint lacks read as their default (None / empty); only ``step`` and ``cursor``
    are required. ``schedule`` is written only by the consumer, so its struct forbids unknown fields.
    ``format`` is checked (== :data:`CHECKPOINT_FORMAT`) only where the whole checkpoint is restored
    (:func:`load_checkpoint`); metadata readers (export, ``artcache run``'s preflight) do not need it.

    Attributes:
        format: layout version. step: optimizer steps done. cursor: the committed cursor (positions).
        consumer_id, draft: who trained it and which draft (a key of ``artcache.trainers.ADAPTERS``).
        draft_config: the draft's ``config_dict()`` (with ``layer_ids``).
        run: the run-defining consumer settings (``RUN_FIELDS``: ``--resume`` refuses when one differs).
        schedule: the LR schedule. param_groups: the optimizer's param groups (JSON lists for tuples).
        plan_id, contract_id: the cache root it walked. target_name, target_path, target_weights_digest,
        dtype (hidden-state dtype), layer_convention, final_norm: the target identity it was trained on.
        layer_ids: the draft's layer view (output-of-layer ids). pinned: the held-out range ``[lo, hi)``.
        generation: the registration generation that wrote it. saved_at: ``time.time()`` of the save.
    """

    format: int | None = None
    step: int
    cursor: int
    consumer_id: str | None = None
    draft: str | None = None
    draft_config: dict[str, Any] | None = None
    run: dict[str, Any] = msgspec.field(default_factory=dict)
    schedule: Schedule | None = None
    param_groups: list[dict[str, Any]] = msgspec.field(default_factory=list)
    plan_id: str | None = None
    contract_id: str | None = None
    target_name: str | None = None
    target_path: str | None = None
    target_weights_digest: str | None = None
    dtype: str | None = None
    layer_convention: str | None = None
    final_norm: str | None = None
    layer_ids: list[int] | None = None
    pinned: list[int] | None = None
    generation: int | None = None
    saved_at: float | None = None

    @property
    def view_layer_ids(self) -> list[int] | None:
        """The layer ids the draft read: its ``draft_config.layer_ids``, else the top-level ``layer_ids``
        (None when neither is recorded)."""
        return (self.draft_config or {}).get("layer_ids") or self.layer_ids or None


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list[dict]]:
    """Flatten ``optimizer.state_dict()``: tensors ``state.<param index>.<name>`` (CPU, contiguous; a
    non-tensor state value becomes a 0-d tensor) and the JSON-serialisable param groups."""
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{idx}.{name}"] = t.detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list[dict]) -> None:
    """Inverse of :func:`optimizer_tensors`. JSON lists become tuples where the optimizer's own group
    holds a tuple (``betas``).

    Raises:
        ConfigError: the saved groups or state do not fit this optimizer's parameters.
    """
    state: dict[int, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise ConfigError(f"optimizer.safetensors has an unexpected key {key!r}")
        state.setdefault(int(parts[1]), {})[parts[2]] = t
    current = optimizer.param_groups
    if len(groups) != len(current):
        raise ConfigError(f"checkpoint has {len(groups)} optimizer param groups, this draft {len(current)}")
    fixed = []
    for saved, cur in zip(groups, current, strict=True):
        g = dict(saved)
        for k, v in g.items():
            if isinstance(v, list) and isinstance(cur.get(k), tuple):
                g[k] = tuple(v)
        fixed.append(g)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": fixed})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError(f"the checkpoint's optimizer state does not fit this draft: {exc}") from exc
    for idx, st in state.items():  # load_state_dict does not check shapes
        p = _param_by_index(optimizer, idx)
        for name, t in st.items():
            if t.dim() > 0 and p is not None and tuple(t.shape) != tuple(p.shape):
                raise ConfigError(f"optimizer state {name!r} of parameter {idx} has shape {tuple(t.shape)}, "
                                  f"the parameter {tuple(p.shape)}")


def _param_by_index(optimizer: torch.optim.Optimizer, idx: int):
    i = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            if i == idx:
                return p
            i += 1
    return None


def rng_tensors(generators: dict[str, torch.Generator]) -> dict[str, Tensor]:
    """RNG states as uint8 tensors: torch's CPU generator, every CUDA device's (when CUDA is in use)
    and the named generators."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = st.cpu()
    for name, gen in generators.items():
        out[f"generator.{name}"] = gen.get_state()
    return out


def restore_rng(tensors: dict[str, Tensor], generators: dict[str, torch.Generator]) -> None:
    """Inverse of :func:`rng_tensors`. Raises ConfigError if a named generator's state is missing."""
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda and torch.cuda.is_available():
        states = [tensors[k] for k in cuda]
        n = torch.cuda.device_count()
        if len(states) != n:
            log.warning("checkpoint holds %d CUDA RNG states, %d devices are visible: restoring the first %d",
                        len(states), n, min(n, len(states)))
        for i, st in enumerate(states[:n]):
            torch.cuda.set_rng_state(st, i)
    for name, gen in generators.items():
        key = f"generator.{name}"
        if key not in tensors:
            raise ConfigError(f"checkpoint has no state for the {name!r} generator")
        gen.set_state(tensors[key])


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def save_checkpoint(run_dir: Path, *, step: int, cursor: int, weights: dict[str, Tensor],
                    optimizer: torch.optim.Optimizer, generators: dict[str, torch.Generator],
                    extra_tensors: dict[str, Tensor], state: dict) -> Path:
    """Write ``run_dir/checkpoints/step-<step>`` atomically and return its path (``latest`` is not
    touched: see :func:`point_latest`).

    Args:
        weights: the trainable tensors (``trainable_state_dict()``), any device.
        generators: named generators whose states are saved (besides torch's CPU / CUDA ones).
        extra_tensors: non-trained draft tensors (EAGLE-3 vocab map); may be empty.
        state: JSON-serialisable metadata (draft config, run settings, ids, schedule): the fields of
            :class:`CheckpointState` (extra keys are kept in the file); ``step``, ``cursor``, ``format``
            and the optimizer's param groups are added.

    Raises:
        msgspec.ValidationError: ``state`` holds a :class:`CheckpointState` field of the wrong type
            (nothing is written).
    """
    final = step_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{unique_suffix()}"
    tmp.mkdir()
    try:
        safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                                    tmp / "model.safetensors")
        opt_tensors, groups = optimizer_tensors(optimizer)
        safetensors.torch.save_file(opt_tensors, tmp / "optimizer.safetensors")
        safetensors.torch.save_file(rng_tensors(generators), tmp / "rng.safetensors")
        names = ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
        if extra_tensors:
            safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in extra_tensors.items()},
                                        tmp / "extra.safetensors")
            names.append("extra.safetensors")
        doc = {**state, "format": CHECKPOINT_FORMAT, "step": step, "cursor": cursor, "param_groups": groups}
        text = json.dumps(doc, indent=1, default=str)
        msgspec.json.decode(text, type=CheckpointState)  # what is written reads back (ValidationError if not)
        (tmp / "state.json").write_text(text)
        for name in names:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # a previous run's directory of the same step (a fresh run in an old --out)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def point_latest(run_dir: Path, ckpt: Path) -> None:
    """Point ``run_dir/checkpoints/latest`` at ``ckpt`` (relative symlink, replaced atomically)."""
    parent = Path(run_dir) / "checkpoints"
    tmp_link = parent / f".latest-{unique_suffix()}"
    os.symlink(Path(ckpt).name, tmp_link)
    os.replace(tmp_link, parent / "latest")
    fsync_dir(parent)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories of a run, (step, path), ascending by step."""
    parent = Path(run_dir) / "checkpoints"
    if not parent.is_dir():
        return []
    out = []
    for p in parent.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / "state.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def prune(run_dir: Path, keep: int, protect: Path) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints (0: keep all); never ``protect``. Returns the removed."""
    if keep <= 0:
        return []
    ckpts = [p for _, p in list_checkpoints(run_dir)]
    removed = []
    for p in ckpts[:-keep]:
        if p.resolve() != Path(protect).resolve():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def find_checkpoint(path: str | Path, *, cursor: int | None = None, published: bool = False) -> Path | None:
    """The checkpoint directory ``path`` names (resolved), or None: the one lookup of every reader.

    Without ``cursor``: the first of ``path`` (a ``step-N`` directory), ``path/latest`` (a
    ``checkpoints/`` directory) and ``path/checkpoints/latest`` (a run directory) that holds
    ``model.safetensors`` and ``state.json`` — or only ``model.safetensors`` with ``published`` (a
    draft directory without a checkpoint state is accepted: ``--init-from``).

    With ``cursor``: ``path`` is a run directory; the newest of its complete checkpoints whose
    committed cursor is ``cursor`` (``--resume`` finds the checkpoint the registry recorded; one whose
    ``state.json`` is unreadable is skipped).
    """
    if cursor is not None:
        for _, p in reversed(list_checkpoints(Path(path))):
            try:
                if read_state(p).cursor == cursor:
                    return p
            except ConfigError:
                continue
        return None
    p = Path(path).expanduser()
    for cand in (p, p / "latest", p / "checkpoints" / "latest"):
        if (cand / "model.safetensors").is_file() and (published or (cand / "state.json").is_file()):
            return cand.resolve()
    return None


@dataclass
class Loaded:
    """A checkpoint read back: ``state`` (state.json), ``weights``, ``optimizer`` tensors, ``rng``
    tensors and ``extra`` tensors (empty when the checkpoint has none)."""

    path: Path
    state: CheckpointState
    weights: dict[str, Tensor]
    optimizer: dict[str, Tensor]
    rng: dict[str, Tensor]
    extra: dict[str, Tensor]


def load_checkpoint(path: Path) -> Loaded:
    """Read every file of a checkpoint directory (safetensors and JSON only).

    Raises:
        ConfigError: a file is missing or unreadable, or the format is unknown.
    """
    path = Path(path)
    state = read_state(path)
    if state.format != CHECKPOINT_FORMAT:
        raise ConfigError(f"checkpoint {path} has format {state.format!r}; this artcache reads {CHECKPOINT_FORMAT}")
    try:
        extra = path / "extra.safetensors"
        return Loaded(path, state, safetensors.torch.load_file(path / "model.safetensors"),
                      safetensors.torch.load_file(path / "optimizer.safetensors"),
                      safetensors.torch.load_file(path / "rng.safetensors"),
                      safetensors.torch.load_file(extra) if extra.is_file() else {})
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"checkpoint {path} is incomplete or unreadable: {exc}") from exc


def read_state(checkpoint: str | Path) -> CheckpointState:
    """A checkpoint directory's ``state.json`` as a :class:`CheckpointState`.

    Raises:
        ConfigError: the file is missing, not JSON, or not a checkpoint state (the message names the
            checkpoint and the field at fault).
    """
    path = Path(checkpoint) / "state.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=CheckpointState)
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"checkpoint {Path(checkpoint)}: state.json is unreadable or not a checkpoint state "
                          f"({exc})") from exc
