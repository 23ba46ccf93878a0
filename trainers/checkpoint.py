"""Checkpoints without pickle: safetensors for tensors, JSON for everything else, atomic per directory.

Layout of ``<run_dir>/checkpoints/step-<N>/`` (N zero-padded to 8 digits)::

    model.safetensors       trainable draft weights (never the frozen target embedding/lm_head)
    optimizer.safetensors   optimizer state tensors, keys ``state.<param index>.<state name>``
                            (absent from a weights-only checkpoint)
    rng.safetensors         RNG states as uint8 tensors: ``torch_cpu``, ``cuda.<i>`` (each visible GPU),
                            ``generator.<name>`` (the draft's own generators, e.g. DFlash anchors)
                            (absent from a weights-only checkpoint)
    extra.safetensors       draft tensors that are not trained but belong to it (EAGLE-3 ``d2t``,
                            ``t2d``); absent when the draft has none
    state.json              format, step, committed cursor, consumer id, draft, draft config, the run's
                            settings, optimizer param groups, LR schedule state, plan / contract ids

Nothing is ever unpickled: tensors come from safetensors, the rest from JSON.

A **weights-only** checkpoint (``save_checkpoint(optimizer=None)``; the consumer's
``--no-checkpoint-optimizer``) holds no optimizer or RNG state and records ``resumable: false``: it can
seed a new run (``--init-from``) or be exported, never be resumed (:func:`load_checkpoint` refuses it,
naming ``--init-from``). For a DFlash or EAGLE-3 draft trained in fp32 with AdamW it is a third of the
full checkpoint (AdamW keeps two moments of every parameter's size).

Size before writing: :func:`checkpoint_size` gives the bytes a checkpoint of a draft will take
(exact tensor bytes, bounded safetensors headers, a bound for ``state.json``), computable before step 1
(the optimizer state AdamW will hold, from the parameters); :func:`check_checkpoint_space` refuses a
run whose checkpoints cannot fit in the free space of its run directory's filesystem
(:class:`~artcache.errors.InsufficientSpace`), counting the checkpoints on disk at once
(:func:`peak_checkpoints`).

``state.json`` is read as a :class:`CheckpointState` (typed; see its docstring for how fields a
reader does not know, and fields an older checkpoint lacks, are handled).

**Content digests.** ``state.json`` records (``digests``, :class:`Digests`) the size and xxh3_128 digest
(:func:`artcache.hashing.digest_file`, the hash artifacts carry) of every tensor file written beside it, and
a digest of its own content. Every reader checks them before it uses anything: :func:`read_state` the
``state.json`` digest (so also ``find_checkpoint(cursor=...)``, ``checkpoints/best``'s record and
``artcache report``), :func:`load_checkpoint` (``--resume``) every tensor file, :func:`read_weights`
(``artcache export``, ``artcache calibrate``) and :func:`artcache.trainers.seed.read_seed` (``--init-from``)
the weight files (``model`` and ``extra``) they read; a mismatch, a missing recorded file or an unrecorded
tensor file raises :class:`~artcache.errors.CheckpointCorrupt` naming the file and both digests
(:func:`verify_checkpoint`). A checkpoint written before digests were recorded (no ``digests`` key) still loads,
with one warning per checkpoint and process that it is unverified; a damaged record (its key name, its type, a key
it lacks) is :class:`~artcache.errors.CheckpointCorrupt` (:func:`_check_digest_record`). Writing costs one read
pass over the tensor bytes just written (see :func:`save_checkpoint`); reading costs one streaming read of each
file checked before it is loaded. A file of an existing checkpoint is replaced only through :func:`replace_file`
(``artcache calibrate``), which keeps the record true at every instant.

Atomicity: the directory is written under a unique temp name beside it (every file fsynced), renamed
into place and the parent directory fsynced, so a crash leaves either no ``step-<N>`` or a complete
one. ``latest`` is a symlink replaced atomically after the rename (a convenience: ``--resume`` looks
the checkpoint up by the cursor the registry recorded). :func:`find_checkpoint` is the one lookup
every reader uses (``--resume`` by cursor, ``--init-from``, ``artcache export``, ``artcache run``).
A write that fails (ENOSPC mid-file, EIO at fsync, ...) removes its temp directory, leaves ``latest``
and every earlier checkpoint as they were, and raises :class:`~artcache.errors.CheckpointWriteError`
naming the errno and the last good checkpoint (never a bare ``SafetensorError``).
Files get ``0o644 & ~umask`` (plus group read in a setgid directory; artcache.fsio.share_mode): safetensors
alone writes 0600, and a teammate could not export a checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import safetensors.torch
import torch
from torch import Tensor

from artcache.errors import (
    ArtcacheError,
    CheckpointCorrupt,
    CheckpointWriteError,
    ConfigError,
    InsufficientSpace,
    IntegrityError,
)
from artcache.fsio import (
    RETRYABLE_ERRNOS,
    apply_share_mode,
    atomic_write,
    describe_errno,
    errno_of,
    free_space,
    fsync_dir,
    publish_dir,
    remove_orphan_parts,
    space_reserve,
)
from artcache.hashing import DIGEST_ALGORITHM, digest_bytes, digest_file, file_record, record_digest
from artcache.layout import unique_suffix
from artcache.report import format_bytes

log = logging.getLogger("artcache.consumer")

#: state.json ``format``; bump when the layout above changes. (The ``digests`` record is an optional field:
#: an older artcache reads a checkpoint that has it, this one reads a checkpoint without it, unverified.)
CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"step-([0-9]{8})")
#: the tensor files a checkpoint may hold (``extra`` optional; ``optimizer`` and ``rng`` not weights-only)
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "extra.safetensors")
#: the tensor files holding the draft's weights: what ``--init-from``, export and calibrate read
WEIGHT_FILES = ("model.safetensors", "extra.safetensors")


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


class FileDigest(msgspec.Struct, kw_only=True):
    """One file's record in :class:`Digests`: ``size`` in bytes and ``digest`` (:data:`DIGEST_ALGORITHM`, hex)."""

    size: Annotated[int, msgspec.Meta(ge=0)]
    digest: str


class Digests(msgspec.Struct, kw_only=True):
    """``state.json``'s ``digests``: what :func:`verify_checkpoint` checks the checkpoint's files against.

    Attributes:
        algorithm: :data:`DIGEST_ALGORITHM`. files: file name (``model.safetensors``, ...) -> its
            :class:`FileDigest`, for every tensor file of the checkpoint. state: the digest of ``state.json``'s
            own content: :func:`artcache.hashing.canonical_json` of the decoded document with this field left out
            (so it survives re-indentation, not a changed value). replacing: file name -> the record the file had
            before a :func:`replace_file` that may have been interrupted (either content is accepted; empty
            once the replacement is complete).
    """

    algorithm: str
    files: dict[str, FileDigest]
    state: str
    replacing: dict[str, FileDigest] = msgspec.field(default_factory=dict)


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
        resumable: False for a weights-only checkpoint (no ``optimizer.safetensors`` / ``rng.safetensors``):
            ``--init-from`` and export read it, ``--resume`` refuses it. Older checkpoints (no field) are full.
        eval: the held-out evaluation of this step (the draft's summary, ``step``), when one ran at it.
        steps_planned: the run's ``--steps`` (its stop) when it was saved.
        digests: the content digests of the checkpoint's files (:class:`Digests`); None in a checkpoint
            written before they were recorded (read unverified, with a warning).
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
    resumable: bool = True
    eval: dict[str, Any] | None = None
    steps_planned: int | None = None
    digests: Digests | None = None

    @property
    def view_layer_ids(self) -> list[int] | None:
        """The layer ids the draft read: its ``draft_config.layer_ids``, else the top-level ``layer_ids``
        (None when neither is recorded)."""
        return (self.draft_config or {}).get("layer_ids") or self.layer_ids or None


def optimizer_tensors(optimizer: torch.optim.Optimizer | dict) -> tuple[dict[str, Tensor], list[dict]]:
    """Flatten ``optimizer.state_dict()`` (or such a dict itself: a sharded group's gathered state,
    :func:`artcache.trainers.consumer.shard.gather_optimizer`): tensors ``state.<param index>.<name>`` (CPU,
    contiguous; a non-tensor state value becomes a 0-d tensor) and the JSON-serialisable param groups."""
    sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
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
                    optimizer: torch.optim.Optimizer | dict | None, generators: dict[str, torch.Generator],
                    extra_tensors: dict[str, Tensor], state: dict) -> Path:
    """Write ``run_dir/checkpoints/step-<step>`` atomically and return its path (``latest`` is not
    touched: see :func:`point_latest`).

    Args:
        weights: the trainable tensors (``trainable_state_dict()``), any device.
        optimizer: its state (or its ``state_dict()``, :func:`optimizer_tensors`) is saved
            (``optimizer.safetensors``) with the RNG states; None writes a
            **weights-only** checkpoint (no optimizer, no RNG; ``resumable: false``).
        generators: named generators whose states are saved (besides torch's CPU / CUDA ones).
        extra_tensors: non-trained draft tensors (EAGLE-3 vocab map); may be empty.
        state: JSON-serialisable metadata (draft config, run settings, ids, schedule): the fields of
            :class:`CheckpointState` (extra keys are kept in the file); ``step``, ``cursor``, ``format``,
            ``resumable``, the optimizer's param groups and ``digests`` are added.

    Digests (``state.json``'s ``digests``, :class:`Digests`): safetensors writes each tensor file itself, so
    its bytes cannot be hashed on their way out; each is read back once instead, in 8 MiB pieces (from the
    page cache: it was just written), and hashed with xxh3_128 before the fsyncs. The cost is one extra read
    of the checkpoint's tensor bytes at memory speed (GB/s: 0.06 s for a 256 MiB model file beside its 0.9 s
    save on a 2-core CPU box; small beside the fsync that writes the bytes to the device) and one piece of
    memory, never a whole file. ``state.json`` grows by about 100 bytes per file,
    well within :data:`STATE_JSON_BOUND` (what :func:`checkpoint_size` predicts is unchanged).

    Raises:
        CheckpointWriteError: a write, fsync or rename failed (ENOSPC, EIO, ... also when safetensors
            reports it): the temp directory is gone, ``latest`` and earlier checkpoints are untouched;
            the message names the errno and :func:`last_good_checkpoint`.
        msgspec.ValidationError: ``state`` holds a :class:`CheckpointState` field of the wrong type
            (nothing is written).
    """
    final = step_dir(run_dir, step)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # a previous run's directory of the same step (a fresh run in an old --out) is replaced
        with publish_dir(final, existing="replace") as tmp:
            safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                                        tmp / "model.safetensors")
            names = ["model.safetensors", "state.json"]
            groups: list[dict] = []
            if optimizer is not None:
                opt_tensors, groups = optimizer_tensors(optimizer)
                safetensors.torch.save_file(opt_tensors, tmp / "optimizer.safetensors")
                safetensors.torch.save_file(rng_tensors(generators), tmp / "rng.safetensors")
                names += ["optimizer.safetensors", "rng.safetensors"]
            if extra_tensors:
                safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in extra_tensors.items()},
                                            tmp / "extra.safetensors")
                names.append("extra.safetensors")
            files = {name: file_record(tmp / name) for name in names if name != "state.json"}  # one read pass
            doc = {**state, "format": CHECKPOINT_FORMAT, "step": step, "cursor": cursor, "param_groups": groups,
                   "resumable": optimizer is not None, "digests": {"algorithm": DIGEST_ALGORITHM, "files": files}}
            text = _state_text(doc)
            msgspec.json.decode(text, type=CheckpointState)  # what is written reads back (ValidationError if not)
            (tmp / "state.json").write_text(text)
            apply_share_mode(*(tmp / name for name in names))
    except BaseException as exc:
        if isinstance(exc, (OSError, safetensors.SafetensorError)) and not isinstance(exc, ArtcacheError):
            raise _write_error(run_dir, final, exc) from exc
        raise
    return final


def _state_digest(doc: dict) -> str:
    """:attr:`Digests.state` of a decoded ``state.json`` document: the digest of its canonical JSON with
    ``digests.state`` left out (:func:`artcache.hashing.record_digest`, the record plans and roots carry too)."""
    return record_digest(doc)


def _state_text(doc: dict) -> str:
    """``doc`` as the text of ``state.json``; when it records ``digests``, their ``state`` digest is
    (re)computed over the document as a reader decodes it (``default=str`` applied, JSON types)."""
    if isinstance(doc.get("digests"), dict):
        decoded = msgspec.json.decode(json.dumps(doc, default=str))
        doc = {**doc, "digests": {**doc["digests"], "state": _state_digest(decoded)}}
    return json.dumps(doc, indent=1, default=str)


def write_state(checkpoint: str | Path, doc: dict) -> None:
    """Replace an existing checkpoint's ``state.json`` with ``doc`` (a JSON object, as :func:`read_document`
    returns it), atomically (:func:`artcache.fsio.atomic_write`). When ``doc`` records ``digests``, their
    ``state`` digest is recomputed, so the record stays true; the ``files`` records are written as given
    (changing a tensor file goes through :func:`replace_file`). A ``doc`` without ``digests`` (a checkpoint
    written before they were recorded) stays without.

    Raises:
        msgspec.ValidationError: ``doc`` is not a :class:`CheckpointState` (nothing is written).
        PublishError: the write failed (``state.json`` is unchanged).
    """
    ckpt = Path(checkpoint)
    text = _state_text(doc)
    msgspec.json.decode(text, type=CheckpointState)
    atomic_write(ckpt / "state.json", [text.encode()], ckpt)


def replace_file(checkpoint: str | Path, name: str, data: bytes) -> None:
    """Replace the tensor file ``name`` of an existing checkpoint with ``data`` (its whole content) and its
    record in ``state.json`` (``artcache calibrate`` adds the temperatures to ``extra.safetensors`` so).

    Three atomic writes, so the record is true at every instant a crash can stop it: ``state.json`` with the
    new record and the old one under :attr:`Digests.replacing`, the file, then ``state.json`` without
    ``replacing``. A checkpoint without digests gets only the file (it stays unverified). Costs one hash of
    ``data`` (xxh3_128) and two ``state.json`` writes.

    Raises:
        ConfigError / CheckpointCorrupt: ``state.json`` is unreadable or does not match its digest.
        PublishError: a write failed (what was written before it stays consistent).
    """
    ckpt = Path(checkpoint)
    doc, _ = read_document(ckpt)
    digests = doc.get("digests")
    if not isinstance(digests, dict):
        atomic_write(ckpt / name, [data], ckpt)
        return
    kept = {k: v for k, v in digests.items() if k not in ("state", "replacing")}
    old = digests.get("files", {}).get(name)
    files = {**digests.get("files", {}), name: {"size": len(data), "digest": digest_bytes(data)}}
    pending = {**kept, "files": files, **({"replacing": {name: old}} if old is not None else {})}
    write_state(ckpt, {**doc, "digests": pending})
    atomic_write(ckpt / name, [data], ckpt)
    write_state(ckpt, {**doc, "digests": {**kept, "files": files}})


def _write_error(run_dir: Path, final: Path, exc: BaseException) -> CheckpointWriteError:
    code = errno_of(exc)
    reason = describe_errno(code, exc)
    last = last_good_checkpoint(run_dir)
    if last is None:
        where = "this run has no earlier checkpoint"
    else:
        try:
            st = read_state(last)
            where = (f"the last good checkpoint is {last} (step {st.step}, cursor {st.cursor}"
                     f"{'' if st.resumable else ', weights only'})")
        except (ConfigError, IntegrityError):
            where = f"the last good checkpoint is {last}"
    hint = "; free space on that filesystem before resuming" if code in (errno.ENOSPC, errno.EDQUOT) else ""
    return CheckpointWriteError(f"checkpoint {final} could not be written ({reason}); nothing was published "
                                f"and checkpoints/latest is unchanged: {where}{hint}", errno_=code,
                                last_good=str(last) if last else None, retryable=code in RETRYABLE_ERRNOS)


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``run_dir/checkpoints/latest`` points at when it is complete, else the newest
    complete one (:func:`list_checkpoints`), else None: what a failed write leaves usable."""
    latest = Path(run_dir) / "checkpoints" / "latest"
    if latest.is_symlink() and (latest / "state.json").is_file() and (latest / "model.safetensors").is_file():
        return latest.resolve()
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def _point(run_dir: Path, name: str, ckpt: Path) -> None:
    """Point ``run_dir/checkpoints/<name>`` at ``ckpt``: a relative symlink made under a temp name
    (``.<name>-<writer>.<nonce>``) and renamed over the old one, then the directory fsynced.

    Raises:
        CheckpointWriteError: the link could not be made, renamed or made durable (ENOSPC, EROFS, EIO, ...):
            ``ckpt`` itself is complete (``last_good``); the temp link is removed, ``<name>`` is unchanged
            (or, when only the fsync failed, may point at ``ckpt`` already). The message names both.
    """
    parent = Path(run_dir) / "checkpoints"
    link = parent / name
    before = os.readlink(link) if link.is_symlink() else None
    tmp_link = parent / f".{name}-{unique_suffix()}"
    try:
        os.symlink(Path(ckpt).name, tmp_link)
        os.replace(tmp_link, link)
        fsync_dir(parent)
    except OSError as exc:
        if isinstance(exc, ArtcacheError):
            raise
        try:
            os.unlink(tmp_link)
        except FileNotFoundError:
            pass
        except OSError as gone:
            log.warning("the temp link %s could not be removed: %s", tmp_link, gone)
        code = errno_of(exc)
        now = os.readlink(link) if link.is_symlink() else None
        where = f"it points at {now}" if now is not None else "there is none"
        raise CheckpointWriteError(
            f"checkpoint {ckpt} is complete, but checkpoints/{name} could not be pointed at it "
            f"({describe_errno(code, exc)}); {where}{' as before' if now == before else ''}. --resume finds "
            f"{Path(ckpt).name} by the cursor the registry recorded; export or --init-from it by its path"
            f"{'; free space on that filesystem' if code in (errno.ENOSPC, errno.EDQUOT) else ''}",
            errno_=code, last_good=str(ckpt), retryable=code in RETRYABLE_ERRNOS) from exc


def point_latest(run_dir: Path, ckpt: Path) -> None:
    """Point ``run_dir/checkpoints/latest`` at ``ckpt`` (relative symlink, replaced atomically).

    Raises:
        CheckpointWriteError: the link could not be replaced (see :func:`_point`; nothing is left behind)."""
    _point(run_dir, "latest", ckpt)


def point_best(run_dir: Path, ckpt: Path) -> None:
    """Point ``run_dir/checkpoints/best`` at ``ckpt`` (relative symlink, replaced atomically): the checkpoint
    whose held-out figure was best so far. :func:`prune` never removes it.

    Raises:
        CheckpointWriteError: the link could not be replaced (see :func:`_point`; nothing is left behind)."""
    _point(run_dir, "best", ckpt)


def best_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint ``run_dir/checkpoints/best`` points at, or None."""
    link = Path(run_dir) / "checkpoints" / "best"
    if not link.is_symlink() and not link.is_dir():
        return None
    target = link.resolve()
    return target if (target / "state.json").is_file() else None


def remove_orphan_temps(run_dir: Path) -> tuple[int, int]:
    """Remove the temp directories (``checkpoints/.tmp-<writer>.<nonce>``) that :func:`save_checkpoint`
    left when its process died mid-save (kill -9, power loss: nothing else removes them, and each holds up
    to a whole checkpoint's bytes). Only those whose writer is a dead process on this host are removed; a
    live writer's, another host's and a name artcache does not make are left alone, so it is safe before
    the run directory is this consumer's. The consumer calls it before sizing its checkpoints' free space.

    Returns:
        (directories removed, bytes they held).
    """
    freed: list[int] = []
    removed = remove_orphan_parts(Path(run_dir) / "checkpoints", prefix=".tmp-", suffix="", dirs=True, freed=freed)
    return removed, sum(freed)


def _step_dirs(run_dir: Path) -> list[tuple[int, Path, bool]]:
    """The one walk of a run's ``checkpoints/``: every ``step-N`` directory (no symlink), (step, path, whether
    it holds ``state.json``), ascending by step."""
    parent = Path(run_dir) / "checkpoints"
    if not parent.is_dir():
        return []
    out = []
    for p in parent.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out.append((int(m.group(1)), p, (p / "state.json").is_file()))
    return sorted(out)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories of a run, (step, path), ascending by step."""
    return [(step, p) for step, p, has_state in _step_dirs(run_dir) if has_state]


def stateless_checkpoints(run_dir: Path) -> list[Path]:
    """``step-N`` directories of a run that :func:`list_checkpoints` leaves out because they hold no
    ``state.json`` (written partly, or damaged by hand), ascending by step: what a lookup that found nothing
    names so the user is not told the run holds no checkpoint."""
    return [p for _, p, has_state in _step_dirs(run_dir) if not has_state]


def prune(run_dir: Path, keep: int, *protect: Path) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints (0: keep all); never one of ``protect`` (``latest``,
    ``best``). Returns the removed."""
    if keep <= 0:
        return []
    ckpts = [p for _, p in list_checkpoints(run_dir)]
    keep_paths = {Path(x).resolve() for x in protect}
    removed = []
    for p in ckpts[:-keep]:
        if p.resolve() not in keep_paths:
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

    Raises:
        CheckpointCorrupt: with ``cursor``, a ``state.json`` read before the match does not match its digest
            (its cursor cannot be trusted, so the lookup cannot say the checkpoint is not the one).
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


def require_resumable(path: Path, state: CheckpointState) -> None:
    """Refuse to resume a weights-only checkpoint (``resumable: false``).

    Raises:
        ConfigError: naming the checkpoint and the ``--init-from`` that seeds a new run from it.
    """
    if not state.resumable:
        raise ConfigError(f"checkpoint {path} is weights-only (written with --no-checkpoint-optimizer: no optimizer "
                          f"or RNG state), so it cannot be resumed, only seeded from: start a new run with "
                          f"--init-from {path}")


def load_checkpoint(path: Path) -> Loaded:
    """Read every file of a checkpoint directory (safetensors and JSON only), to resume from it, each checked
    against its recorded digest first (:func:`verify_checkpoint`: one streaming read of each file).

    Raises:
        ConfigError: a file is missing or unreadable, the format is unknown, or the checkpoint is
            weights-only (``resumable: false``: it cannot be resumed, only seeded from with ``--init-from``).
        CheckpointCorrupt: a file (``state.json`` included) does not match its recorded digest, or is missing.
    """
    path = Path(path)
    state = read_state(path)
    if state.format != CHECKPOINT_FORMAT:
        raise ConfigError(f"checkpoint {path} has format {state.format!r}; this artcache reads {CHECKPOINT_FORMAT}")
    require_resumable(path, state)
    verify_checkpoint(path, state)
    try:
        extra = path / "extra.safetensors"
        return Loaded(path, state, safetensors.torch.load_file(path / "model.safetensors"),
                      safetensors.torch.load_file(path / "optimizer.safetensors"),
                      safetensors.torch.load_file(path / "rng.safetensors"),
                      safetensors.torch.load_file(extra) if extra.is_file() else {})
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"checkpoint {path} is incomplete or unreadable: {exc}") from exc


def read_state(checkpoint: str | Path) -> CheckpointState:
    """A checkpoint directory's ``state.json`` as a :class:`CheckpointState`, checked against the digest of
    its content it records (:attr:`Digests.state`; none in a checkpoint written before digests were).

    Raises:
        ConfigError: the file is missing, not JSON, or not a checkpoint state (the message names the
            checkpoint and the field at fault).
        CheckpointCorrupt: its content does not match its recorded digest, or its ``digests`` record is damaged
            (under a damaged key name, not an object, lacking a key: :func:`_check_digest_record`), which is
            never read as a checkpoint written before digests were.
    """
    return read_document(checkpoint)[1]


def read_document(checkpoint: str | Path) -> tuple[dict, CheckpointState]:
    """(``state.json`` as decoded JSON, as :class:`CheckpointState`), checked as :func:`read_state` does: the
    document keeps the keys the struct does not know (what :func:`write_state` writes back)."""
    ckpt = Path(checkpoint)
    path = ckpt / "state.json"
    try:
        doc = msgspec.json.decode(path.read_bytes())
        digests = doc.get("digests") if isinstance(doc, dict) else None
        if isinstance(doc, dict):
            _check_digest_record(path, doc)
        if isinstance(digests, dict):  # checked before a field is trusted
            actual = _state_digest(doc)
            if actual != digests["state"]:
                raise CheckpointCorrupt(_mismatch(path, f"{digests['state']}", actual) + " (of its decoded content, "
                                        "digests.state left out)" + _CORRUPT_HINT)
        return doc, msgspec.convert(doc, CheckpointState)
    except (OSError, msgspec.DecodeError) as exc:  # ValidationError is a DecodeError
        raise ConfigError(f"checkpoint {ckpt}: state.json is unreadable or not a checkpoint state "
                          f"({exc})") from exc


#: the keys every ``digests`` record holds (what :func:`save_checkpoint` and :func:`write_state` write)
_DIGEST_KEYS = ("algorithm", "files", "state")


def _check_digest_record(path: Path, doc: dict) -> None:
    """Refuse a ``state.json`` whose ``digests`` record is damaged rather than absent. Only a checkpoint
    written before digests were recorded may be read unverified, and such a one has no ``digests`` key and
    nothing like it (every artcache since writes the record with all of :data:`_DIGEST_KEYS`). A record
    under another key (its name damaged: ``digezts``), a ``digests`` that is not an object (``null``), or
    one that lacks a key of the record would otherwise read as such an old checkpoint, or skip the check of
    ``state.json`` itself.

    Raises:
        CheckpointCorrupt: naming the file and what is wrong with the record.
    """
    if "digests" not in doc:
        known = set(CheckpointState.__struct_fields__)
        for key, value in doc.items():
            if key not in known and isinstance(value, dict) and {"algorithm", "files"} <= set(value):
                raise CheckpointCorrupt(
                    f"checkpoint file {path} records its content digests under the key {key!r}, not 'digests' "
                    f"(the key name is damaged, so nothing can be verified){_CORRUPT_HINT}")
        return
    digests = doc["digests"]
    json_type = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
                 list: "an array"}
    problem = (f"is not an object but {json_type.get(type(digests), type(digests).__name__)}"
               if not isinstance(digests, dict) else
               "lacks " + ", ".join(repr(k) for k in _DIGEST_KEYS if k not in digests)
               if not set(_DIGEST_KEYS) <= set(digests) else "")
    if problem:
        raise CheckpointCorrupt(f"checkpoint file {path}: its 'digests' record {problem}, so nothing can be "
                                f"verified{_CORRUPT_HINT}")


def _mismatch(path: Path, expected: str, actual: str) -> str:
    recorded = "the digest it records" if path.name == "state.json" else "the digest its state.json recorded"
    return f"checkpoint file {path} does not match {recorded}: expected {DIGEST_ALGORITHM} {expected}, actual {actual}"


_CORRUPT_HINT = ("; the file is corrupt or truncated and nothing was loaded from it: restore it from a copy, or "
                 "resume / seed / export another checkpoint")
#: checkpoints already warned about as unverified in this process (one warning each)
_UNVERIFIED_WARNED: set[str] = set()


def verify_checkpoint(checkpoint: str | Path, state: CheckpointState, names: Iterable[str] = TENSOR_FILES) -> bool:
    """Check the files ``names`` of a checkpoint against the digests its ``state.json`` recorded
    (:class:`Digests`), before any of them is loaded. A name the record holds must exist with the recorded
    size and digest (or, after an interrupted :func:`replace_file`, the previous ones); a name it does not
    hold must not exist (an optional file: ``extra.safetensors``, a weights-only checkpoint's optimizer).
    ``state`` is :func:`read_state`'s (which checked ``state.json`` itself).

    Cost: one streaming read of each file checked (8 MiB pieces, xxh3_128 at memory speed; the loader then
    finds the bytes in the page cache), nothing held beyond one piece.

    Returns:
        True when verified; False for a checkpoint written before digests were recorded: its files are
        used unverified, said in one warning per checkpoint and process.

    Raises:
        CheckpointCorrupt: one line naming the file and the expected and actual digest (and sizes), a
            missing recorded file, or an unrecorded tensor file.
        ConfigError: the record names a hash this artcache does not compute, or a file cannot be read.
    """
    ckpt = Path(checkpoint)
    digests = state.digests
    if digests is None:
        key = str(ckpt.resolve())
        if key not in _UNVERIFIED_WARNED:
            _UNVERIFIED_WARNED.add(key)
            log.warning("checkpoint %s records no content digests (written before artcache recorded them): its "
                        "files are used unverified", ckpt)
        return False
    if digests.algorithm != DIGEST_ALGORITHM:
        raise ConfigError(f"checkpoint {ckpt} records {digests.algorithm!r} digests; this artcache checks "
                          f"{DIGEST_ALGORITHM!r}")
    for name in names:
        f = ckpt / name
        want = digests.files.get(name)
        if want is None:
            if f.exists():
                raise CheckpointCorrupt(f"checkpoint file {f} is not among the files its state.json records "
                                        f"({', '.join(sorted(digests.files))}){_CORRUPT_HINT}")
            continue
        try:
            size, actual = f.stat().st_size, digest_file(f)
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(f"checkpoint file {f} is missing: its state.json records it ({want.size:,} B, "
                                    f"{DIGEST_ALGORITHM} {want.digest}){_CORRUPT_HINT}") from exc
        except OSError as exc:
            raise ConfigError(f"checkpoint {ckpt} is incomplete or unreadable: {name}: {exc}") from exc
        accepted = [want] + ([digests.replacing[name]] if name in digests.replacing else [])
        if not any(size == w.size and actual == w.digest for w in accepted):
            expected = " or ".join(f"{w.digest} ({w.size:,} B)" for w in accepted)
            raise CheckpointCorrupt(_mismatch(f, expected, f"{actual} ({size:,} B)") + _CORRUPT_HINT)
    return True


def read_weights(checkpoint: str | Path) -> tuple[CheckpointState, dict[str, Tensor], dict[str, Tensor]]:
    """(``state.json``, ``model.safetensors``'s tensors, ``extra.safetensors``'s ({} when it has none)) of a
    checkpoint directory, their digests checked first (:func:`verify_checkpoint` of :data:`WEIGHT_FILES`):
    what ``artcache export`` and ``artcache calibrate`` read. Safetensors and JSON only.

    Raises:
        ConfigError: ``state.json`` or a tensor file is unreadable.
        CheckpointCorrupt: a file read does not match its recorded digest.
    """
    ckpt = Path(checkpoint)
    state = read_state(ckpt)
    verify_checkpoint(ckpt, state, WEIGHT_FILES)
    try:
        weights = safetensors.torch.load_file(ckpt / "model.safetensors")
        extra_path = ckpt / "extra.safetensors"
        extra = safetensors.torch.load_file(extra_path) if extra_path.is_file() else {}
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"checkpoint {ckpt} is unreadable: {exc}") from exc
    return state, weights, extra


# ---- sizes: what checkpoints will take on disk, known before step 1 ---------------------------------------

#: bytes allowed for ``state.json`` (run settings, draft config, param groups: a few KiB in practice)
STATE_JSON_BOUND = 1 << 20
#: safetensors dtype names are at most this long (``F8_E4M3``, ``BF16``, ``F32``)
_DTYPE_NAME_MAX = 8


def safetensors_bytes(tensors: Mapping[str, Tensor]) -> int:
    """Upper bound of the size of the safetensors file ``safetensors.torch.save_file(tensors)`` writes,
    in bytes: the tensors' data exactly (``numel × element_size``; meta tensors work) plus the 8-byte
    length and a bound of the JSON header (``{"name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},..}``,
    padded to 8 bytes; the bound over-counts by at most 26 bytes per tensor). An empty mapping is 0
    (no file is written for it)."""
    if not tensors:
        return 0
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    offset_digits = len(str(data))
    header = 2 + 7  # braces, padding to a multiple of 8
    for name, t in tensors.items():
        shape = ",".join(str(d) for d in t.shape)
        header += (len(json.dumps(name)) + len(':{"dtype":"","shape":[],"data_offsets":[,]},') + _DTYPE_NAME_MAX
                   + len(shape) + 2 * offset_digits)
    return 8 + header + data


def adamw_state_specs(params: Sequence[Tensor], *, amsgrad: bool = False) -> dict[str, Tensor]:
    """Meta tensors of the state torch's Adam / AdamW holds after its first step, keyed as
    :func:`optimizer_tensors` saves them: per parameter i (in order) ``state.i.step`` (0-d float32),
    ``state.i.exp_avg`` and ``state.i.exp_avg_sq`` (the parameter's shape and dtype), and
    ``state.i.max_exp_avg_sq`` with ``amsgrad``. Lets a checkpoint be sized before step 1."""
    out = {}
    for i, p in enumerate(params):
        out[f"state.{i}.step"] = torch.empty((), dtype=torch.float32, device="meta")
        names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
        for name in names:
            out[f"state.{i}.{name}"] = torch.empty(p.shape, dtype=p.dtype, device="meta")
    return out


class CheckpointSize(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes one checkpoint of a draft takes on disk (upper bounds; the tensor data exact).

    Attributes:
        weights: ``model.safetensors``. extra: ``extra.safetensors`` (0: none). optimizer:
        ``optimizer.safetensors`` (0: weights-only). rng: ``rng.safetensors`` (0: weights-only).
        state: ``state.json`` (:data:`STATE_JSON_BOUND`).
    """

    weights: int
    extra: int = 0
    optimizer: int = 0
    rng: int = 0
    state: int = STATE_JSON_BOUND

    @property
    def total(self) -> int:
        return self.weights + self.extra + self.optimizer + self.rng + self.state

    @property
    def weights_only(self) -> int:
        """What the same checkpoint takes without optimizer and RNG state."""
        return self.weights + self.extra + self.state


def checkpoint_size(weights: Mapping[str, Tensor], extra_tensors: Mapping[str, Tensor],
                    optimizer_state: Mapping[str, Tensor] | None,
                    generators: Mapping[str, torch.Generator] | None = None) -> CheckpointSize:
    """The :class:`CheckpointSize` of ``save_checkpoint`` with these tensors.

    Args:
        weights, extra_tensors: as ``save_checkpoint`` takes them (any device, meta included).
        optimizer_state: the optimizer's tensors as saved (:func:`optimizer_tensors`, or before step 1
            :func:`adamw_state_specs`); None for a weights-only checkpoint (no optimizer, no RNG).
        generators: the named generators whose states are saved with the optimizer.
    """
    if optimizer_state is None:
        return CheckpointSize(weights=safetensors_bytes(weights), extra=safetensors_bytes(extra_tensors))
    rng = rng_tensors(dict(generators or {}))
    if torch.cuda.is_available() and not any(k.startswith("cuda.") for k in rng):
        # CUDA not initialised yet: the save will hold every visible device's Philox state (16 bytes)
        rng.update({f"cuda.{i}": torch.empty(16, dtype=torch.uint8, device="meta")
                    for i in range(torch.cuda.device_count())})
    return CheckpointSize(weights=safetensors_bytes(weights), extra=safetensors_bytes(extra_tensors),
                          optimizer=safetensors_bytes(optimizer_state), rng=safetensors_bytes(rng))


def planned_saves(start_step: int, steps: int, save_every: int, best_every: int = 0) -> int:
    """Most checkpoints a run from ``start_step`` to ``steps`` writes: one at every multiple of ``save_every``
    or of ``best_every`` strictly between them (0: none), and the final one (at ``steps``, or when
    cancelled earlier). ``best_every``: the evaluation interval of a run that follows ``checkpoints/best``
    (an evaluation that beats the best so far checkpoints its step; at most every one does)."""
    if steps <= start_step:
        return 0
    def multiples(e: int) -> int:  # of e in (start_step, steps), in constant time (--steps may be huge)
        return (steps - 1) // e - start_step // e

    every = [e for e in (save_every, best_every) if e > 0]
    both = math.lcm(*every) if len(every) == 2 else 0
    return sum(multiples(e) for e in every) - (multiples(both) if both else 0) + 1


def peak_checkpoints(keep: int, saves: int, existing: int = 0, best: bool = False) -> int:
    """Most checkpoint directories of a run on disk at once: ``existing`` ones plus ``saves`` new ones,
    each written before the older ones are pruned to the newest ``keep`` (0: all kept) — so
    ``keep + 1`` while one is being written, never more than exist in all. ``best``: the run follows
    ``checkpoints/best``, which :func:`prune` never removes, so an older best outside the newest ``keep``
    is one more (``keep + 2``)."""
    if saves <= 0:
        return existing
    total = existing + saves
    return total if keep <= 0 else max(existing + 1, min(keep + 1 + int(best), total))


def check_checkpoint_space(run_dir: Path, size: CheckpointSize, *, keep: int, saves: int, existing: int = 0,
                           best: bool = False, what: str = "this run") -> int:
    """Refuse a run whose checkpoints cannot fit: the bytes the new checkpoints need at their peak
    (:func:`peak_checkpoints` minus the ``existing`` ones, already on disk, × ``size.total``) plus the
    filesystem's reserve (:func:`artcache.fsio.space_reserve`) must be free under ``run_dir`` (or its
    nearest existing ancestor). Returns the bytes needed (0 when nothing will be written).

    Raises:
        InsufficientSpace: one line naming the bytes needed and free and the ways to need less
            (``--keep-checkpoints``, ``--no-checkpoint-optimizer``, another ``--out``).
    """
    count = peak_checkpoints(keep, saves, existing, best) - existing
    needed = count * size.total
    if needed <= 0:
        return 0
    free, fs_size, at = free_space(Path(run_dir))
    reserve = space_reserve(fs_size)
    if needed + reserve <= free:
        return needed
    ways = []
    if count > 1:
        ways.append("a smaller --keep-checkpoints (K keeps K + 1 on disk while one is written, K + 2 with an "
                    "older checkpoints/best) or a larger --save-every")
    if size.optimizer:
        ways.append(f"--no-checkpoint-optimizer (weights-only, {format_bytes(size.weights_only)} each; such a "
                    "checkpoint cannot be resumed, only seeded from)")
    ways.append("another --out on a filesystem with more free space")
    raise InsufficientSpace(
        f"checkpoints of {what} need {needed:,} B ({format_bytes(needed)}: {count} × {format_bytes(size.total)}, "
        f"--keep-checkpoints {keep} and {saves} written by this run) under {run_dir}, but {at} has "
        f"{free:,} B ({format_bytes(free)}) free, {format_bytes(reserve)} of it kept in reserve; pass "
        + ", or ".join(ways))
