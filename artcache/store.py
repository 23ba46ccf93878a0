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
import struct
from dataclasses import dataclass

import safetensors.torch
import torch

from artcache import FORMAT_VERSION
from artcache.contract import CaptureContract
from artcache.errors import ArtifactMissing, IntegrityError, PublishError
from artcache.fsio import atomic_write, check_free_space, read_all
from artcache.hashing import digest_bytes
from artcache.layout import CacheLayout, unique_suffix

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


def validate_capture(contract: CaptureContract, tensors: dict[str, torch.Tensor]) -> None:
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
    if not bool(torch.isfinite(hs).all()):
        raise IntegrityError("hidden_states contain NaN or Inf")


def _encode(fp: str, contract: CaptureContract, tensors: dict[str, torch.Tensor]) -> tuple[bytes, memoryview]:
    """Return (header bytes, data section view) of the safetensors encoding with content_hash set."""
    meta = {"artcache_format": str(FORMAT_VERSION), "fingerprint": fp,
            "contract_id": contract.contract_id}
    blob = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    (hlen,) = struct.unpack("<Q", blob[:8])
    data = memoryview(blob)[8 + hlen:]
    header = json.loads(blob[8:8 + hlen])
    header["__metadata__"]["content_hash"] = digest_bytes(data)
    # sorted keys: safetensors writes its metadata map in hash order, which varies between calls;
    # same fingerprint must give the same bytes
    hjson = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson, data


def publish(layout: CacheLayout, fp: str, contract: CaptureContract,
            tensors: dict[str, torch.Tensor], *, durable: bool = True) -> int:
    """Validate and publish one artifact atomically; return its size in bytes.

    A reader sees nothing or the complete file. Publishing a fingerprint that already exists
    replaces it with identical content (same fingerprint ⇒ same bytes).

    Raises:
        IntegrityError: the capture failed validation (nothing written).
        PublishError: a write, fsync or rename failed, or space ran out (temp file removed).
    """
    validate_capture(contract, tensors)
    header, data = _encode(fp, contract, tensors)
    check_free_space(layout.tmp, len(header) + len(data))
    return atomic_write(layout.object_path(fp), (header, data), layout.tmp, durable=durable,
                        fingerprint=fp)


def exists(layout: CacheLayout, fp: str) -> bool:
    return layout.object_path(fp).is_file()


def _parse(buf: bytearray, fp: str) -> tuple[dict, memoryview]:
    if len(buf) < 8:
        raise IntegrityError(f"artifact {fp} is truncated ({len(buf)} bytes)")
    (hlen,) = struct.unpack("<Q", buf[:8])
    if hlen > len(buf) - 8 or hlen > 100 << 20:
        raise IntegrityError(f"artifact {fp} has a bad header length {hlen}")
    try:
        header = json.loads(bytes(buf[8:8 + hlen]))
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"artifact {fp} has an unreadable header: {exc}") from exc
    return meta, memoryview(buf)[8 + hlen:]


def read(layout: CacheLayout, fp: str, contract: CaptureContract) -> Artifact:
    """Read and verify one artifact.

    Returns:
        The artifact with CPU tensors (one read into memory, one decode).

    Raises:
        ArtifactMissing: not published (never captured or evicted): treat as a demand miss.
        IntegrityError: hash, fingerprint, contract or shape check failed; the file has been
            moved to ``quarantine/`` so the next request is a demand miss.
    """
    path = layout.object_path(fp)
    try:
        buf = read_all(path)
    except FileNotFoundError as exc:
        raise ArtifactMissing(f"artifact {fp} is not published") from exc
    try:
        meta, data = _parse(buf, fp)
        if meta.get("fingerprint") != fp:
            raise IntegrityError(f"artifact {fp} carries fingerprint {meta.get('fingerprint')!r}")
        if meta.get("artcache_format") != str(FORMAT_VERSION):
            raise IntegrityError(f"artifact {fp} has format {meta.get('artcache_format')!r}, "
                                 f"expected {FORMAT_VERSION}")
        if meta.get("contract_id") != contract.contract_id:
            raise IntegrityError(f"artifact {fp} was captured under another contract")
        if digest_bytes(data) != meta.get("content_hash"):
            raise IntegrityError(f"artifact {fp} failed its content hash")
        try:
            tensors = safetensors.torch.load(bytes(buf))
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise IntegrityError(f"artifact {fp} is not valid safetensors: {exc}") from exc
        validate_capture(contract, tensors)
    except IntegrityError:
        quarantine(layout, fp)
        raise
    core = ("hidden_states", "input_ids", "loss_mask")
    return Artifact(fp, tensors["hidden_states"], tensors["input_ids"], tensors["loss_mask"],
                    len(buf), {k: v for k, v in tensors.items() if k not in core})


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
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    return size


def list_objects(layout: CacheLayout) -> dict[str, int]:
    """Map fingerprint → size in bytes for every published artifact (one directory walk)."""
    out: dict[str, int] = {}
    try:
        shards = list(os.scandir(layout.objects))
    except FileNotFoundError:
        return out
    for shard in shards:
        if not shard.is_dir():
            continue
        for entry in os.scandir(shard.path):
            name = entry.name
            if name.endswith(".safetensors"):
                try:
                    out[name[: -len(".safetensors")]] = entry.stat().st_size
                except FileNotFoundError:
                    continue
    return out


__all__ = ["Artifact", "PublishError", "exists", "list_objects", "publish", "quarantine", "read",
           "remove", "validate_capture"]
