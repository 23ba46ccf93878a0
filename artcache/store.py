"""Artifacts: publish (temp file, fsync, rename), read (verify content hash), quarantine, evict.

An artifact is one safetensors file ``objects/<ab>/<fp>.safetensors`` holding

==================  =====================  ==========================================
tensor              shape, dtype           meaning
==================  =====================  ==========================================
``hidden_states``   [T, m, H], contract    captured layers in ``contract.layer_ids`` order
``input_ids``       [T], int32             token ids
``loss_mask``       [T], uint8             1 where the token is trained on
``last_hidden``     [T, H], contract       optional: post-final-norm hidden state
``target_argmax``   [T], int32             optional: target argmax id at each position
==================  =====================  ==========================================

with string metadata ``artcache_format``, ``fingerprint``, ``contract_id`` and ``content_hash``
(xxh3-128 of the safetensors data section, i.e. every byte after the header).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from artcache import FORMAT_VERSION
from artcache.contract import CaptureContract
from artcache.crashpoints import crash_point
from artcache.errors import ArtifactMissing, IntegrityError, PublishError
from artcache.fsio import atomic_write, check_free_space
from artcache.hashing import digest_bytes
from artcache.layout import CacheLayout, check_real_dir, open_nofollow, unique_suffix

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Artifact:
    """A verified artifact in memory. Tensors are CPU tensors owned by the caller."""

    fingerprint: str
    hidden_states: torch.Tensor  # [T, m, H]
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    nbytes: int
    extras: dict[str, torch.Tensor]


# (integer view, exponent mask) per float dtype: a value is NaN/Inf iff all exponent bits are set.
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}


def all_finite(t: torch.Tensor) -> bool:
    """True if ``t`` has no NaN/Inf. Tests the exponent bits through an integer view: on CPUs without
    native bf16 arithmetic this is ~20x faster than ``torch.isfinite`` on a bf16 tensor."""
    view = _EXPONENT.get(t.dtype)
    if view is None or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    itype, mask = view
    m = torch.tensor(mask, dtype=itype) if itype is torch.int16 and mask > 0x7FFF else mask
    return not bool((t.view(itype) & m).eq_(m).any())


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _tensors_from_buffer(buf, header: dict, data_start: int, fp: str) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over ``buf`` from a parsed safetensors header (offsets bounds-checked)."""
    out = {}
    size = len(buf) - data_start
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[spec["dtype"]]
            shape = [int(d) for d in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"artifact {fp}: bad header entry for {name!r}") from exc
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= size or end - begin != count * itemsize or min(shape, default=1) < 0:
            raise IntegrityError(f"artifact {fp}: tensor {name!r} does not fit its data offsets")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=data_start + begin).view(shape)
    return out


def validate_capture(contract: CaptureContract, tensors: dict[str, torch.Tensor], *,
                     check_values: bool = True) -> None:
    """Check shapes, dtypes and finiteness of a capture before it is published.

    Raises:
        IntegrityError: naming the tensor and what was expected.
    """
    for name in ("hidden_states", "input_ids", "loss_mask"):
        if name not in tensors:
            raise IntegrityError(f"capture lacks tensor {name!r}")
    hs, ids, mask = tensors["hidden_states"], tensors["input_ids"], tensors["loss_mask"]
    want = _DTYPES[contract.dtype]
    if hs.dtype != want:
        raise IntegrityError(f"hidden_states dtype {hs.dtype} != contract dtype {contract.dtype}")
    if hs.dim() != 3 or hs.shape[1] != len(contract.layer_ids):
        raise IntegrityError(
            f"hidden_states shape {tuple(hs.shape)}: expected [T, {len(contract.layer_ids)}, H]")
    t = hs.shape[0]
    if ids.shape != (t,) or ids.dtype != torch.int32:
        raise IntegrityError(f"input_ids must be int32 [{t}], got {ids.dtype} {tuple(ids.shape)}")
    if mask.shape != (t,) or mask.dtype != torch.uint8:
        raise IntegrityError(f"loss_mask must be uint8 [{t}], got {mask.dtype} {tuple(mask.shape)}")
    if t == 0 or t > contract.max_length:
        raise IntegrityError(f"length {t} outside [1, {contract.max_length}]")
    if check_values and not all_finite(hs):
        raise IntegrityError("hidden_states contain NaN or Inf")


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _encode(fp: str, contract: CaptureContract,
            tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """(header bytes, data chunks) of the artifact's safetensors encoding, with ``content_hash`` set.

    Writes the safetensors layout directly (8-byte little-endian header length, JSON header with
    dtype/shape/data_offsets per tensor and string ``__metadata__``, then the raw bytes) so the data
    section is a list of zero-copy views over the tensors: no serialisation copy, one streaming
    hash. Tensors are ordered by decreasing item size, then name (aligned, deterministic); the
    header has sorted keys, so the same fingerprint always gives the same bytes. The result loads
    with ``safetensors`` (tests check this).
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {}
    chunks: list[memoryview] = []
    digest = xxhash.xxh3_128()
    offset = 0
    for name in order:
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _ST_NAMES:
            raise IntegrityError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        digest.update(view)
        chunks.append(view)
    header["__metadata__"] = {"artcache_format": str(FORMAT_VERSION), "fingerprint": fp,
                              "contract_id": contract.contract_id, "content_hash": digest.hexdigest()}
    hjson = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson, chunks


def check_tokens(fp: str, contract: CaptureContract, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Raise IntegrityError unless ``fingerprint(contract, input_ids, loss_mask) == fp``: the artifact holds
    the sample that was requested (its token ids and loss mask), not another one's capture."""
    from artcache.fingerprint import fingerprint

    got = fingerprint(contract, input_ids, loss_mask)
    if got != fp:
        raise IntegrityError(f"artifact {fp}: its token ids / loss mask do not match the requested sample "
                             f"(they fingerprint to {got})")


def _shard_dir(layout: CacheLayout, fp: str, create: bool) -> Path:
    """``objects/<ab>/`` for ``fp``, created if asked; UnsafePath if it is a symbolic link."""
    shard = layout.object_path(fp).parent
    if create:
        shard.mkdir(exist_ok=True)
    check_real_dir(shard)
    return shard


def publish(layout: CacheLayout, fp: str, contract: CaptureContract,
            tensors: dict[str, torch.Tensor], *, durable: bool = True, values_checked: bool = False,
            verify_tokens: bool = False) -> int:
    """Validate and publish one artifact atomically; return its size in bytes.

    A reader sees nothing or the complete file. Publishing a fingerprint that already exists
    replaces it with identical content (same fingerprint ⇒ same bytes).

    Args:
        values_checked: the caller already verified there is no NaN/Inf (the GPU backend checks
            on the device before copying), so the host-side scan is skipped; structure is always checked.
        verify_tokens: also check that ``fp`` is the fingerprint of the tensors' ``input_ids`` and
            ``loss_mask`` under ``contract`` (the producer does; tests with made-up fingerprints do not).

    Raises:
        IntegrityError: the capture failed validation (nothing written).
        PublishError: a write, fsync or rename failed, or space ran out (temp file removed).
        UnsafePath: the shard directory ``objects/<ab>`` is a symbolic link (nothing written).
    """
    validate_capture(contract, tensors, check_values=not values_checked)
    if verify_tokens:
        check_tokens(fp, contract, tensors["input_ids"], tensors["loss_mask"])
    header, chunks = _encode(fp, contract, tensors)
    check_free_space(layout.tmp, len(header) + sum(c.nbytes for c in chunks))
    try:
        _shard_dir(layout, fp, create=True)
    except FileNotFoundError as exc:  # objects/ itself is gone: the root was removed under us
        raise PublishError(f"writing {fp} failed: {exc}", fingerprint=fp, errno_=exc.errno) from exc
    return atomic_write(layout.object_path(fp), [header, *chunks], layout.tmp, durable=durable,
                        fingerprint=fp)


def exists(layout: CacheLayout, fp: str) -> bool:
    return layout.object_path(fp).is_file()


def _parse(buf, fp: str) -> tuple[dict, dict, int]:
    """(header, metadata, data start offset) of a safetensors buffer."""
    if len(buf) < 8:
        raise IntegrityError(f"artifact {fp} is truncated ({len(buf)} bytes)")
    (hlen,) = struct.unpack("<Q", buf[:8])
    if hlen > len(buf) - 8 or hlen > 100 << 20:
        raise IntegrityError(f"artifact {fp} has a bad header length {hlen}")
    try:
        header = json.loads(bytes(buf[8:8 + hlen]))
        meta = header["__metadata__"]
        if not isinstance(header, dict) or not isinstance(meta, dict):
            raise TypeError("header is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"artifact {fp} has an unreadable header: {exc}") from exc
    return header, meta, 8 + hlen


def _read_file(path: Path, pin: bool):
    """The whole file in one buffer: a bytearray, or a page-locked (pinned) host buffer when ``pin``
    (so the tensors over it go to the GPU with a non-blocking copy). Opened ``O_NOFOLLOW``: a symbolic
    link raises UnsafePath."""
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy() if pin else bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf[:got] if got != size else buf


def _verify(buf, fp: str, contract: CaptureContract, verify_tokens: bool,
            check_values: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of an artifact's bytes ``buf`` after every check; IntegrityError naming the failed one."""
    header, meta, start = _parse(buf, fp)
    data = memoryview(buf)[start:]
    if meta.get("fingerprint") != fp:
        raise IntegrityError(f"artifact {fp} carries fingerprint {meta.get('fingerprint')!r}")
    if meta.get("artcache_format") != str(FORMAT_VERSION):
        raise IntegrityError(f"artifact {fp} has format {meta.get('artcache_format')!r}, "
                             f"expected {FORMAT_VERSION}")
    if meta.get("contract_id") != contract.contract_id:
        raise IntegrityError(f"artifact {fp} was captured under another contract")
    if digest_bytes(data) != meta.get("content_hash"):
        raise IntegrityError(f"artifact {fp} failed its content hash")
    tensors = _tensors_from_buffer(buf, header, start, fp)
    # values were checked for NaN/Inf before publication; the content hash proves these are
    # the same bytes, so a read re-checks structure only (verify, offline, re-checks values too)
    validate_capture(contract, tensors, check_values=check_values)
    if verify_tokens:
        check_tokens(fp, contract, tensors["input_ids"], tensors["loss_mask"])
    return tensors


def read(layout: CacheLayout, fp: str, contract: CaptureContract, *, pin: bool = False,
         verify_tokens: bool = False) -> Artifact:
    """Read and verify one artifact.

    Args:
        pin: read into page-locked host memory (for a following non-blocking copy to a GPU).
        verify_tokens: also check that the stored ``input_ids``/``loss_mask`` fingerprint to ``fp``
            under ``contract``, i.e. that the artifact is the capture of the requested sample (consumers
            do; tests that publish made-up fingerprints do not). Cost: one BLAKE2b over 5 bytes/token.

    Returns:
        The artifact; its tensors are zero-copy views over one buffer holding the file (one read,
        no decode copy).

    Raises:
        ArtifactMissing: not published (never captured or evicted): treat as a demand miss.
        IntegrityError: hash, fingerprint, contract, shape or token check failed; the file has been
            moved to ``quarantine/`` so the next request is a demand miss.
        UnsafePath: the artifact or its shard directory is a symbolic link (never followed).
    """
    path = layout.object_path(fp)
    try:
        _shard_dir(layout, fp, create=False)
        buf = _read_file(path, pin)
    except FileNotFoundError as exc:
        raise ArtifactMissing(f"artifact {fp} is not published") from exc
    try:
        tensors = _verify(buf, fp, contract, verify_tokens)
    except IntegrityError:
        quarantine(layout, fp)
        raise
    core = ("hidden_states", "input_ids", "loss_mask")
    return Artifact(fp, tensors["hidden_states"], tensors["input_ids"], tensors["loss_mask"],
                    len(buf), {k: v for k, v in tensors.items() if k not in core})


def verify(layout: CacheLayout, fp: str, contract: CaptureContract, *, verify_tokens: bool = True) -> str | None:
    """Check one published artifact without moving it (``artcache fsck``): None if it passes every check
    of :func:`read` (token check included by default) and has no NaN/Inf (which a read does not re-scan:
    the content hash proves the bytes are those validated at publication, unless a writer skipped that
    validation), else what failed.

    Raises:
        ArtifactMissing: not published. UnsafePath: a symbolic link in its path.
    """
    try:
        _shard_dir(layout, fp, create=False)
        buf = _read_file(layout.object_path(fp), False)
    except FileNotFoundError as exc:
        raise ArtifactMissing(f"artifact {fp} is not published") from exc
    try:
        _verify(buf, fp, contract, verify_tokens, check_values=True)
    except IntegrityError as exc:
        return str(exc)
    return None


def quarantine(layout: CacheLayout, fp: str) -> bool:
    """Move a bad artifact to ``quarantine/<fp>.<unique>``; False if it was already gone."""
    try:
        os.replace(layout.object_path(fp), layout.quarantine / f"{fp}.{unique_suffix()}.safetensors")
        return True
    except FileNotFoundError:
        return False


def remove(layout: CacheLayout, fp: str) -> int:
    """Evict one artifact: rename aside into ``tmp/``, then unlink. Returns bytes freed (0 if gone).

    "Already gone" is success. Readers that already opened the file keep their bytes (POSIX).
    """
    aside = layout.tmp / f"{unique_suffix()}.evict"
    try:
        size = layout.object_path(fp).stat().st_size
        os.replace(layout.object_path(fp), aside)
    except FileNotFoundError:
        return 0
    crash_point("evict.after-rename")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    return size


_FP_NAME = re.compile(r"[0-9a-f]{16,128}")


def list_objects(layout: CacheLayout) -> dict[str, int]:
    """Map fingerprint → size in bytes for every published artifact (one directory walk). Files whose
    names are not ``<fp[:2]>/<fp>.safetensors`` are ignored (regression: a stray file in objects/
    used to stop the producer)."""
    out: dict[str, int] = {}
    try:
        shards = list(os.scandir(layout.objects))
    except FileNotFoundError:
        return out
    for shard in shards:
        if not shard.is_dir(follow_symlinks=False):  # a link planted as a shard is never followed
            continue
        for entry in os.scandir(shard.path):
            name = entry.name
            fp = name[: -len(".safetensors")] if name.endswith(".safetensors") else ""
            if not _FP_NAME.fullmatch(fp) or shard.name != fp[:2]:
                continue  # not an artifact artcache wrote (a stray file): never touched, never counted
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue  # a link (or a directory) with an artifact's name: fsck reports it
                out[fp] = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return out


__all__ = ["Artifact", "PublishError", "check_tokens", "exists", "list_objects", "publish", "quarantine", "read",
           "remove", "validate_capture", "verify"]
