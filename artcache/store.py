"""Artifacts: publish (temp file, fsync, rename), read (verify content hash), quarantine, evict.

An artifact is one safetensors file ``objects/<ab>/<fp>.safetensors`` holding

==================  =====================  ==========================================
tensor              shape, dtype           meaning
==================  =====================  ==========================================
``hidden_states``   [T, m, H], contract    captured layers in ``contract.layer_ids`` order
``hidden_scales``   [T, m], float32        fp8 contracts only: one scale per token row per layer
                                           (:mod:`artcache.fp8`; ``hidden_states`` holds e4m3fn codes)
``input_ids``       [T], int32             token ids
``loss_mask``       [T], uint8             1 where the token is trained on
``last_hidden``     [T, H], contract       optional: post-final-norm hidden state
``target_argmax``   [T], int32             optional: target argmax id at each position
==================  =====================  ==========================================

with string metadata ``artcache_format``, ``fingerprint``, ``contract_id`` and ``content_hash``
(xxh3-128 of the safetensors data section, i.e. every byte after the header).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import os
import re
import struct
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from artcache import FORMAT_VERSION
from artcache.contract import CaptureContract, stored_bytes_per_token
from artcache.crashpoints import crash_point
from artcache.errors import ArtifactMissing, IntegrityError, PublishError
from artcache.fp8 import SCALES
from artcache.fsio import atomic_write, check_free_space, start_writeback
from artcache.hashing import StreamDigest, digest_bytes
from artcache.layout import CacheLayout, check_real_dir, make_dir, open_nofollow, unique_suffix
from artcache.payload import remote_for

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class IOSettings:
    """How publish and read move an artifact's bytes (docs/benchmarks.md measures each choice).

    Attributes:
        chunk_bytes: bytes per write / read / hash step (8 MiB: few system calls, and a chunk is still
            in the CPU cache when the hash and the copy touch it); writes end on file offsets that are
            multiples of it, so use a multiple of the page size.
        hash_thread: hash on a helper thread beside the write or read (xxhash releases the GIL), for
            artifacts of at least two chunks (a read: two ``tail_bytes`` pieces); else inline, chunk by chunk.
        tail_bytes: a read takes its last ``chunk_bytes`` in pieces of this size, so the hash of the final
            piece, which no read can overlap (the verdict needs the whole digest), is short (1 MiB: ~0.2 ms
            of xxh3 instead of ~1.3 ms for 8 MiB; docs/benchmarks.md, "Parts against the hardware's limits").
        writeback: start the device write of each chunk as soon as it is in the page cache
            (:func:`artcache.fsio.start_writeback`), so the closing fsync waits only for the tail.
        fallocate: reserve the file's blocks before writing (``posix_fallocate``).
        reuse_buffers: CPU reads go into recycled buffers (:class:`ReadBuffers`) instead of fresh
            pages; pinned reads use torch's caching host allocator either way.
        stream: False = the earlier path (hash the whole data section first, then write it in one
            ``write`` per tensor; read the whole file, then hash it): kept to measure against.
    """

    chunk_bytes: int = 8 << 20
    tail_bytes: int = 1 << 20
    hash_thread: bool = True
    writeback: bool = True
    fallocate: bool = False
    reuse_buffers: bool = True
    stream: bool = True


#: the settings publish/read use; :func:`io_settings` swaps them (benchmarks)
IO = IOSettings()


@contextlib.contextmanager
def io_settings(**changes) -> Iterator[IOSettings]:
    """Use ``dataclasses.replace(IO, **changes)`` inside the block (process-wide; for benchmarks)."""
    global IO
    old = IO
    IO = dataclasses.replace(IO, **changes)
    try:
        yield IO
    finally:
        IO = old


@dataclass
class Artifact:
    """A verified artifact in memory. Tensors are CPU tensors owned by the caller.

    ``hidden_states`` is as stored: the contract dtype, i.e. float8_e4m3fn codes for an fp8 contract,
    whose scales are ``hidden_scales`` [T, m] float32 (None otherwise). :meth:`hidden` gives values.
    """

    fingerprint: str
    hidden_states: torch.Tensor  # [T, m, H]
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    nbytes: int
    extras: dict[str, torch.Tensor]
    hidden_scales: torch.Tensor | None = None  # [T, m] float32, fp8 artifacts only

    def hidden(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The hidden states' values [T, m, H]: dequantised into ``dtype`` (default float32) for an fp8
        artifact; else the stored tensor, converted if ``dtype`` is given (no copy when it matches)."""
        if self.hidden_scales is not None:
            from artcache.fp8 import dequantize_rows

            return dequantize_rows(self.hidden_states, self.hidden_scales, dtype or torch.float32)
        return self.hidden_states if dtype is None else self.hidden_states.to(dtype)


# (integer view, mask of the bits below the sign, smallest NaN/Inf pattern) per float dtype: a value is
# NaN or Inf iff its bits below the sign are >= the pattern with every exponent bit set (float8_e4m3fn
# has no Inf; its NaN is S.1111.111)
_NONFINITE = {torch.bfloat16: (np.int16, 0x7FFF, 0x7F80), torch.float16: (np.int16, 0x7FFF, 0x7C00),
              torch.float32: (np.int32, 0x7FFFFFFF, 0x7F800000),
              torch.float8_e4m3fn: (np.uint8, 0x7F, 0x7F)}
_SCAN_BYTES = 1 << 21
_scan_tmp = threading.local()


def all_finite(t: torch.Tensor) -> bool:
    """True if ``t`` has no NaN/Inf. Scans the bits through an integer view, 2 MiB at a time into one
    reused scratch buffer per thread: no allocation (fresh pages cost more than the scan), each chunk
    still in the CPU cache for its second pass, and single-threaded numpy, so a publisher thread never
    contends for torch's intra-op thread pool with the capture beside it (under load that contention
    made a torch scan 30x slower). On CPUs without native bf16 arithmetic ~6x faster than
    ``torch.isfinite`` on a bf16 tensor."""
    view = _NONFINITE.get(t.dtype)
    if view is None or not t.is_contiguous() or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    itype, mask, bad = view
    if t.numel() == 0:
        return True
    flat = t.detach().reshape(-1).view(torch.uint8).numpy().view(itype)
    bufs = getattr(_scan_tmp, "bufs", None)
    if bufs is None:
        bufs = _scan_tmp.bufs = {}
    tmp = bufs.get(itype)
    if tmp is None:
        tmp = bufs[itype] = np.empty(_SCAN_BYTES // np.dtype(itype).itemsize, dtype=itype)
    step = tmp.size
    for i in range(0, flat.size, step):
        chunk = flat[i:i + step]
        out = tmp[: chunk.size]
        np.bitwise_and(chunk, mask, out=out)
        if out.max() >= bad:
            return False
    return True


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def _tensors_from_buffer(buf, header: dict, data_start: int, fp: str) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over ``buf`` from a parsed safetensors header (offsets bounds-checked, and checked to
    be :func:`_data_views`' layout: the header is not under the content hash, so a header whose entries were
    changed consistently, e.g. two tensors' offsets swapped, must not describe the hashed bytes otherwise)."""
    out = {}
    size = len(buf) - data_start
    layout: list[tuple[int, str, int, int]] = []  # (item size, name, begin, end)
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
        layout.append((itemsize, name, begin, end))
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=data_start + begin).view(shape)
    offset = 0
    for _, name, begin, end in sorted(layout, key=lambda e: (-e[0], e[1])):
        if begin != offset:
            raise IntegrityError(f"artifact {fp}: tensor {name!r} begins at data offset {begin}, not {offset} as "
                                 "the writer lays tensors out (by item size, then name): the header is damaged")
        offset = end
    if offset != size:
        raise IntegrityError(f"artifact {fp}: its tensors end at data offset {offset} of {size}: the header is "
                             "damaged")
    return out


def check_scales(scales: torch.Tensor) -> None:
    """Check an fp8 artifact's ``hidden_scales`` (float32 [T, m], :mod:`artcache.fp8`) are finite and >= 0
    (0 is a row of zeros). The one check of scale values: publication, every read (the scales decide every
    dequantised value, and a read does not re-scan values: a writer that skipped validation, or damage
    behind a recomputed content hash, would otherwise be trained on) and ``fsck``. Cost: one pass over
    4·T·m bytes.

    Raises:
        IntegrityError: naming the first bad scale's index and value.
    """
    if scales.numel() == 0:
        return
    if scales.device.type == "cpu":  # one numpy min and max: NaN makes min NaN, which fails ">= 0"
        flat = scales.detach().reshape(-1).numpy()
        if flat.min() >= 0 and flat.max() < np.inf:
            return
    bad = ~(torch.isfinite(scales) & (scales >= 0))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise IntegrityError(f"{SCALES} contain NaN, Inf or a negative scale ({SCALES}{list(idx)} = "
                             f"{float(scales[idx])}; scales must be finite and >= 0)")


def validate_capture(contract: CaptureContract, tensors: dict[str, torch.Tensor], *,
                     check_values: bool = True) -> None:
    """Check shapes, dtypes and finiteness of a capture before it is published, and the structure of one
    read back. ``check_values``: scan ``hidden_states`` for NaN/Inf (publication, ``fsck``; a read skips it,
    the content hash proving the bytes are those scanned). An fp8 capture's scales are always checked
    (:func:`check_scales`).

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
    scales = tensors.get(SCALES)
    if want == torch.float8_e4m3fn:
        m = hs.shape[1]
        if scales is None:
            raise IntegrityError(f"an fp8 capture needs tensor {SCALES!r} (float32 [T, m])")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (t, m):
            raise IntegrityError(f"{SCALES} must be float32 [{t}, {m}], got {scales.dtype} {tuple(scales.shape)}")
        check_scales(scales)
    elif scales is not None:
        raise IntegrityError(f"tensor {SCALES!r} belongs to fp8 captures only (contract dtype {contract.dtype})")
    if check_values and not all_finite(hs):
        raise IntegrityError("hidden_states contain NaN or Inf")


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _data_views(tensors: dict[str, torch.Tensor]) -> tuple[dict, list[memoryview]]:
    """(header entries without metadata, zero-copy byte views of the data section in file order).

    Tensors are ordered by decreasing item size, then name (aligned, deterministic)."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {}
    chunks: list[memoryview] = []
    offset = 0
    for name in order:
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _ST_NAMES:
            raise IntegrityError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        chunks.append(view)
    return header, chunks


def _header_bytes(fp: str, contract: CaptureContract, header: dict, content_hash: str) -> bytes:
    """The safetensors header: 8-byte little-endian length, then JSON with sorted keys and string
    ``__metadata__``, space-padded to a multiple of 8. Its length does not depend on ``content_hash``'s
    value (always 32 hex digits), so it can be sized before the hash is known."""
    meta = {"artcache_format": str(FORMAT_VERSION), "fingerprint": fp, "contract_id": contract.contract_id,
            "content_hash": content_hash}
    hjson = json.dumps({**header, "__metadata__": meta}, separators=(",", ":"), sort_keys=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson


def _encode(fp: str, contract: CaptureContract,
            tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """(header bytes, data chunks) of the artifact's safetensors encoding, with ``content_hash`` set.

    Writes the safetensors layout directly (8-byte little-endian header length, JSON header with
    dtype/shape/data_offsets per tensor and string ``__metadata__``, then the raw bytes) so the data
    section is a list of zero-copy views over the tensors: no serialisation copy. Tensors are ordered by
    decreasing item size, then name (aligned, deterministic); the header has sorted keys, so the same
    fingerprint always gives the same bytes. The result loads with ``safetensors`` (tests check this).
    :func:`publish` writes the same bytes while hashing (:func:`_stream_writer`).
    """
    header, chunks = _data_views(tensors)
    digest = xxhash.xxh3_128()
    for view in chunks:
        digest.update(view)
    return _header_bytes(fp, contract, header, digest.hexdigest()), chunks


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _stream_writer(fp: str, contract: CaptureContract, header: dict, chunks: list[memoryview], io: IOSettings):
    """A writer for :func:`artcache.fsio.atomic_write` that puts the artifact's bytes into the temp file in
    one pass: the data section chunk by chunk at its final offset (sequential ``os.write`` after a seek
    past the header) while each chunk is hashed (on a helper thread beside the write, with
    ``io.hash_thread``) and its device write started (``io.writeback``), then the header, which carries
    the hash, at offset 0. The header's length is known before the hash
    (see :func:`_header_bytes`). Same bytes as :func:`_encode`."""
    start = len(_header_bytes(fp, contract, header, "0" * 32))
    data_bytes = sum(c.nbytes for c in chunks)
    step = max(1, io.chunk_bytes)

    def write(fd: int) -> int:
        if io.fallocate and data_bytes:
            with contextlib.suppress(OSError):  # not every filesystem reserves space; the write still decides
                os.posix_fallocate(fd, 0, start + data_bytes)
        offset = os.lseek(fd, start, os.SEEK_SET)
        # file bytes handed to the device so far end here; the pages the header will cover wait for the fsync
        kicked = start - start % 4096 + 4096
        with StreamDigest(background=io.hash_thread and data_bytes >= 2 * step) as digest:
            for view in chunks:
                i = 0
                while i < view.nbytes:
                    # pieces end on file offsets that are multiples of the step: page-aligned writes, and a
                    # page handed to the device is never written again
                    n = min(view.nbytes - i, step - offset % step)
                    piece = view[i:i + n]
                    digest.update(piece)
                    _write_all(fd, piece)
                    i += n
                    offset += n
                    if io.writeback and offset % step == 0 and offset > kicked:
                        start_writeback(fd, kicked, offset - kicked)
                        kicked = offset
            head = _header_bytes(fp, contract, header, digest.hexdigest())
        if len(head) != start:  # cannot happen (the hash has a fixed width); never write a bad artifact
            raise OSError(errno.EINVAL, f"header of {fp} changed length while hashing")
        _pwrite_all(fd, memoryview(head), 0)
        return start + data_bytes

    return write, start + data_bytes


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
        make_dir(shard, exist_ok=True)  # 0700, or 2770 in a group-shared root, whatever the umask
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
    if (remote := remote_for(layout)) is not None:  # the bytes go to the root's payload store (artcache.payload)
        head, chunks = _encode(fp, contract, tensors)
        return remote.put(fp, [head, *chunks], durable=durable)
    io = IO
    if io.stream:
        header, chunks = _data_views(tensors)
        content, total = _stream_writer(fp, contract, header, chunks, io)
    else:
        head, chunks = _encode(fp, contract, tensors)
        content, total = [head, *chunks], len(head) + sum(c.nbytes for c in chunks)
    check_free_space(layout.tmp, total)
    try:
        _shard_dir(layout, fp, create=True)
    except FileNotFoundError as exc:  # objects/ itself is gone: the root was removed under us
        raise PublishError(f"writing {fp} failed: {exc}", fingerprint=fp, errno_=exc.errno) from exc
    return atomic_write(layout.object_path(fp), content, layout.tmp, durable=durable, fingerprint=fp)


def exists(layout: CacheLayout, fp: str) -> bool:
    if (remote := remote_for(layout)) is not None:
        return remote.exists(fp)
    return layout.object_path(fp).is_file()


_MAX_HEADER = 100 << 20


def _parse(buf, fp: str) -> tuple[dict, dict, int]:
    """(header, metadata, data start offset) of a safetensors buffer."""
    if len(buf) < 8:
        raise IntegrityError(f"artifact {fp} is truncated ({len(buf)} bytes)")
    (hlen,) = struct.unpack("<Q", buf[:8])
    if hlen > len(buf) - 8 or hlen > _MAX_HEADER:
        raise IntegrityError(f"artifact {fp} has a bad header length {hlen}")
    try:
        header = json.loads(bytes(buf[8:8 + hlen]))
        meta = header["__metadata__"]
        if not isinstance(header, dict) or not isinstance(meta, dict):
            raise TypeError("header is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"artifact {fp} has an unreadable header: {exc}") from exc
    return header, meta, 8 + hlen


class ReadBuffers:
    """Recycles the host buffers CPU reads go into.

    A fresh 120 MiB buffer costs more than reading the file into it (the kernel faults in and zeroes
    every page: 84 ms against 23 ms for the copy on the development machine, docs/benchmarks.md). A
    buffer handed out by :meth:`take` comes back here when the last tensor over it is freed (a
    ``weakref.finalize`` on the view the tensors hold), and the next read of a size that fits reuses its
    pages. At most ``max_free_bytes`` of free buffers are kept; a buffer is reused for a request of
    at least half its size.
    """

    def __init__(self, max_free_bytes: int = 1 << 30) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        # buffers handed back by finalizers: a finalizer may run on any thread at any point (inside take(),
        # when an allocation there triggers a collection), so it only appends here, lock-free
        self._returned: collections.deque[np.ndarray] = collections.deque()

    def _collect(self) -> None:  # with self._lock held
        while self._returned:
            self._free.append(self._returned.popleft())
        while self._free and sum(b.nbytes for b in self._free) > self.max_free_bytes:
            self._free.pop(0)  # the oldest goes first

    def take(self, size: int) -> np.ndarray:
        """A uint8 array of exactly ``size`` bytes (contents undefined)."""
        raw = None
        with self._lock:
            self._collect()
            fits = [i for i, b in enumerate(self._free) if size <= b.nbytes <= 2 * size + (1 << 20)]
            if fits:
                raw = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if raw is None:
            raw = np.empty(-(-size // 4096) * 4096 if size else 0, dtype=np.uint8)
        view = raw[:size]
        weakref.finalize(view, self._returned.append, raw)
        return view

    def free_bytes(self) -> int:
        with self._lock:
            self._collect()
            return sum(b.nbytes for b in self._free)


#: the process's recycled CPU read buffers
READ_BUFFERS = ReadBuffers()


def _read_file(path: Path, pin: bool, io: IOSettings | None = None):
    """``(buf, (data_start, digest) | None)``: the whole file in one buffer, and xxh3-128 of the bytes from
    ``data_start`` (after the safetensors header) to the end, computed while reading.

    The buffer is a page-locked (pinned) host buffer when ``pin`` (so tensors over it go to the GPU with a
    non-blocking copy; torch's caching host allocator recycles it), else one of :data:`READ_BUFFERS`
    (``io.reuse_buffers``) or a fresh ``bytearray``. It is filled ``io.chunk_bytes`` at a time, and each
    chunk is hashed right after it lands (on a helper thread with ``io.hash_thread``, while the next chunk
    is read). The digest is None when the header length is unusable (``_parse`` names the fault) or
    ``io.stream`` is off. Opened ``O_NOFOLLOW``: a symbolic link raises UnsafePath."""
    io = io or IO
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if pin:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        elif io.reuse_buffers:
            buf = READ_BUFFERS.take(size)
        else:
            buf = bytearray(size)
        view = memoryview(buf)
        step = max(1, io.chunk_bytes) if io.stream else max(1, size)
        tail = max(1, min(io.tail_bytes, step)) if io.stream else step
        got = 0
        start = None
        with contextlib.ExitStack() as stack:
            digest = None
            while got < size:
                n = f.readinto(view[got:min(size, got + (step if size - got > step else tail))])
                if not n:
                    break
                if start is None and io.stream and got + n >= 8:
                    (hlen,) = struct.unpack("<Q", view[:8])
                    start = 8 + hlen if hlen <= min(size - 8, _MAX_HEADER) else -1
                    if start >= 0:
                        digest = stack.enter_context(
                            StreamDigest(background=io.hash_thread and size - start >= 2 * tail))
                if digest is not None and got + n > start:
                    digest.update(view[max(start, got):got + n])
                got += n
            result = (start, digest.hexdigest()) if digest is not None else None
    return (buf[:got] if got != size else buf), result


def _verify(buf, fp: str, contract: CaptureContract, verify_tokens: bool,
            check_values: bool = False, digest: tuple[int, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of an artifact's bytes ``buf`` after every check; IntegrityError naming the failed one.

    ``digest``: ``(data_start, xxh3-128 of buf[data_start:])`` computed while reading (:func:`_read_file`);
    used when ``data_start`` is where the header says the data begins, else the data is hashed here."""
    header, meta, start = _parse(buf, fp)
    data = memoryview(buf)[start:]
    if meta.get("fingerprint") != fp:
        raise IntegrityError(f"artifact {fp} carries fingerprint {meta.get('fingerprint')!r}")
    if meta.get("artcache_format") != str(FORMAT_VERSION):
        raise IntegrityError(f"artifact {fp} has format {meta.get('artcache_format')!r}, "
                             f"expected {FORMAT_VERSION}")
    if meta.get("contract_id") != contract.contract_id:
        raise IntegrityError(f"artifact {fp} was captured under another contract")
    got = digest[1] if digest is not None and digest[0] == start else digest_bytes(data)
    if got != meta.get("content_hash"):
        raise IntegrityError(f"artifact {fp} failed its content hash")
    tensors = _tensors_from_buffer(buf, header, start, fp)
    # values were checked for NaN/Inf before publication; the content hash proves these are
    # the same bytes, so a read re-checks structure (and fp8 scales, check_scales) only (verify, offline,
    # re-checks values too)
    try:
        validate_capture(contract, tensors, check_values=check_values)
    except IntegrityError as exc:  # it names the tensor; the header (not hashed) may be what lost it
        raise IntegrityError(f"artifact {fp}: {exc}") from exc
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
        IntegrityError: hash, fingerprint, contract, shape, fp8 scale (:func:`check_scales`) or token check
            failed; the file has been moved to ``quarantine/`` so the next request is a demand miss.
        UnsafePath: the artifact or its shard directory is a symbolic link (never followed).
    """
    path = layout.object_path(fp)
    try:
        if (remote := remote_for(layout)) is not None:
            buf, digest = remote.get(fp, pin=pin), None
        else:
            _shard_dir(layout, fp, create=False)
            buf, digest = _read_file(path, pin)
    except FileNotFoundError as exc:
        if isinstance(exc, ArtifactMissing):  # a remote store's miss keeps its reason
            raise
        raise ArtifactMissing(f"artifact {fp} is not published") from exc
    except IntegrityError:
        quarantine(layout, fp)
        raise
    try:
        tensors = _verify(buf, fp, contract, verify_tokens, digest=digest)
    except IntegrityError:
        quarantine(layout, fp)
        raise
    core = ("hidden_states", "input_ids", "loss_mask", SCALES)
    return Artifact(fp, tensors["hidden_states"], tensors["input_ids"], tensors["loss_mask"],
                    len(buf), {k: v for k, v in tensors.items() if k not in core}, tensors.get(SCALES))


def verify(layout: CacheLayout, fp: str, contract: CaptureContract, *, verify_tokens: bool = True) -> str | None:
    """Check one published artifact without moving it (``artcache fsck``): None if it passes every check
    of :func:`read` (token check included by default) and has no NaN/Inf (which a read does not re-scan:
    the content hash proves the bytes are those validated at publication, unless a writer skipped that
    validation), else what failed.

    Raises:
        ArtifactMissing: not published. UnsafePath: a symbolic link in its path.
    """
    try:
        if (remote := remote_for(layout)) is not None:
            buf, digest = remote.get(fp, repair=False), None
        else:
            _shard_dir(layout, fp, create=False)
            buf, digest = _read_file(layout.object_path(fp), False)
    except FileNotFoundError as exc:
        if isinstance(exc, ArtifactMissing):
            raise
        raise ArtifactMissing(f"artifact {fp} is not published") from exc
    except IntegrityError as exc:
        return str(exc)
    try:
        _verify(buf, fp, contract, verify_tokens, check_values=True, digest=digest)
    except IntegrityError as exc:
        return str(exc)
    return None


def quarantine(layout: CacheLayout, fp: str) -> bool:
    """Move a bad artifact to ``quarantine/<fp>.<unique>``; False if it was already gone."""
    if (remote := remote_for(layout)) is not None:
        return remote.quarantine(fp)
    try:
        os.replace(layout.object_path(fp), layout.quarantine / f"{fp}.{unique_suffix()}.safetensors")
        return True
    except FileNotFoundError:
        return False


def remove(layout: CacheLayout, fp: str) -> int:
    """Evict one artifact: rename aside into ``tmp/``, then unlink. Returns bytes freed (0 if gone).

    "Already gone" is success. Readers that already opened the file keep their bytes (POSIX).
    """
    if (remote := remote_for(layout)) is not None:
        return remote.remove(fp)
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
    if (remote := remote_for(layout)) is not None:
        return remote.list_objects()
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


def maintain(layout: CacheLayout) -> dict[str, int]:
    """Payload-store housekeeping, called once per eviction pass (:func:`artcache.eviction.evict_pass`).
    Nothing to do for a POSIX root. A remote root removes the payloads whose removal waited (a read lease)
    and checks that the store still holds this root's payloads; returns the artifacts it found lost
    (fp → bytes: their manifests are withdrawn, so they read as misses and are recaptured on demand)."""
    if (remote := remote_for(layout)) is not None:
        return remote.maintain()
    return {}


__all__ = ["Artifact", "PublishError", "check_scales", "check_tokens", "exists", "list_objects", "maintain", "publish",
           "quarantine", "read", "remove", "validate_capture", "verify"]


#: bytes allowed for one artifact's safetensors header and metadata
ARTIFACT_HEADER_BOUND = 4096


def artifact_bytes_bound(contract: CaptureContract, hidden_size: int, tokens: int | None = None) -> int:
    """Upper bound of one artifact's file size in bytes: ``tokens`` (default ``contract.max_length``) ×
    :func:`artcache.contract.stored_bytes_per_token` (captured layers × ``hidden_size`` × the stored dtype's
    size, fp8: + one fp32 scale per layer, + 4 B of ``input_ids`` + 1 B of ``loss_mask``) +
    :data:`ARTIFACT_HEADER_BOUND`. Qwen3-8B, 3072 tokens, 5 layers, bf16: 125,848,576 B."""
    t = contract.max_length if tokens is None else tokens
    return t * stored_bytes_per_token(contract.dtype, len(contract.layer_ids), hidden_size) + ARTIFACT_HEADER_BOUND
