"""Small hashing helpers shared by artcache modules.

- ``digest_bytes`` / ``digest_file``: fast content hashes (xxh3_128, 32 hex chars) for integrity checks.
- ``StreamDigest``: the same hash over a stream of chunks, optionally on a helper thread beside the
  caller's writes or reads (artifact publication and reads hash while they do I/O).
- ``strong_digest``: blake2b (20 bytes, 40 hex chars) for ids and fingerprints.
- ``canonical_json``: a deterministic JSON encoding (sorted keys) to feed either hash.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from typing import Any

import msgspec
import xxhash

_DEFAULT_CHUNK = 8 * 1024 * 1024


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    """xxh3_128 of ``data`` as 32 lowercase hex characters."""
    return xxhash.xxh3_128_hexdigest(data)


def digest_file(path: str | os.PathLike[str], chunk: int = _DEFAULT_CHUNK) -> str:
    """xxh3_128 of a file's bytes, read in ``chunk``-byte pieces; 32 lowercase hex characters.

    Raises ``FileNotFoundError``/``OSError`` from ``open`` unchanged; ``ValueError`` if ``chunk`` < 1.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 byte, got {chunk}")
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


class StreamDigest:
    """xxh3_128 over chunks fed in order, as 32 lowercase hex characters (equal to :func:`digest_bytes` of
    their concatenation).

    With ``background=True`` the chunks are hashed on a helper thread while the caller goes on (xxhash
    releases the GIL): a caller that writes chunk i while chunk i is hashed, or reads chunk i + 1 while
    chunk i is hashed, pays max(I/O, hash) instead of their sum. A chunk must stay unchanged until
    :meth:`hexdigest` returns. Use it as a context manager (or call :meth:`close`), so the helper thread
    ends when the caller fails midway.

    Raises:
        RuntimeError: :meth:`update` after :meth:`hexdigest` or :meth:`close`.
    """

    def __init__(self, background: bool = False) -> None:
        self._h = xxhash.xxh3_128()
        self._q: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        if background:
            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="artcache-hash", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._q is not None
        while (chunk := self._q.get()) is not None:
            if self._error is None:
                try:
                    self._h.update(chunk)
                except BaseException as exc:  # handed to hexdigest()
                    self._error = exc

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise RuntimeError("StreamDigest.update after hexdigest/close")
        if self._q is None:
            self._h.update(chunk)
        else:
            self._q.put(chunk)

    def close(self) -> None:
        """Stop the helper thread (waits for the chunks already fed). Idempotent."""
        if not self._closed:
            self._closed = True
            if self._q is not None and self._thread is not None:
                self._q.put(None)
                self._thread.join()

    def hexdigest(self) -> str:
        """The digest of every chunk fed; waits for the helper thread. Re-raises its error, if any."""
        self.close()
        if self._error is not None:
            raise self._error
        return self._h.hexdigest()

    def __enter__(self) -> StreamDigest:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes for ``obj`` (msgspec Structs, dicts, lists, scalars): keys sorted, no spaces."""
    return msgspec.json.encode(msgspec.to_builtins(obj), order="sorted")


def strong_digest(data: bytes | bytearray | memoryview) -> str:
    """blake2b with a 20-byte digest, as 40 lowercase hex characters (ids, fingerprints)."""
    return hashlib.blake2b(bytes(data), digest_size=20).hexdigest()
