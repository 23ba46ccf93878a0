"""Small hashing helpers shared by artcache modules.

- ``digest_bytes`` / ``digest_file``: fast content hashes (xxh3_128, 32 hex chars) for integrity checks.
- ``StreamDigest``: the same hash over a stream of chunks, optionally on a helper thread beside the
  caller's writes or reads (artifact publication and reads hash while they do I/O).
- ``strong_digest``: blake2b (20 bytes, 40 hex chars) for ids and fingerprints.
- ``canonical_json``: a deterministic JSON encoding (sorted keys) to feed either hash.
- ``record_digest`` / ``sealed`` / ``check_record`` / ``file_record`` / ``check_file``: the ``digests`` record
  a JSON file that decides what is trained or served carries of itself and of the files beside it
  (``artcache.json``, a plan's ``plan.json``, an export's ``export.json`` of its ``model.safetensors``; a
  checkpoint's ``state.json`` records the same shape, ``trainers/checkpoint.py``).
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


#: the algorithm of every content digest artcache records: artifacts' ``content_hash``, and the ``digests``
#: record of ``artcache.json``, ``plan.json`` and checkpoints' ``state.json`` (:func:`digest_bytes`)
DIGEST_ALGORITHM = "xxh3_128"


def record_digest(doc: dict) -> str:
    """``digests.state`` of a decoded JSON document ``doc`` that records its own digest: :func:`digest_bytes`
    of its :func:`canonical_json` with ``digests.state`` left out (so it survives re-indentation and key
    order, not a changed value). ``doc["digests"]`` must be a dict."""
    body = {**doc, "digests": {k: v for k, v in doc["digests"].items() if k != "state"}}
    return digest_bytes(canonical_json(body))


def sealed(doc: dict, files: dict[str, dict] | None = None) -> dict:
    """``doc`` (JSON types, as a reader decodes it) with its ``digests`` record: ``{"algorithm":
    DIGEST_ALGORITHM, "files": files, "state": record_digest(...)}``; ``files`` maps a file name beside the
    document to ``{"size": bytes, "digest": hex}`` (:func:`digest_bytes` of its bytes; ``{}`` for none)."""
    doc = {**doc, "digests": {"algorithm": DIGEST_ALGORITHM, "files": dict(files or {})}}
    doc["digests"]["state"] = record_digest(doc)
    return doc


def check_record(doc: dict) -> str | None:
    """What is wrong with the ``digests`` record of a decoded document ``doc``, or None when it matches the
    document (file records are checked by their reader, :func:`check_file`). A document without the key (or
    with null: written before records existed) is None too: the caller says it is unverified.

    A damaged record (not an object, another algorithm, no ``state``, a ``files`` that is not an object of
    ``{size, digest}``) is a problem, like a mismatch: a reader must not mistake it for an old file."""
    rec = doc.get("digests")
    if rec is None:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("state"), str) or not isinstance(rec.get("files"), dict):
        return f"its digests record is damaged ({str(rec)[:80]})"
    if rec.get("algorithm") != DIGEST_ALGORITHM:
        return f"its digests record names algorithm {rec.get('algorithm')!r}, not {DIGEST_ALGORITHM!r}"
    for name, entry in rec["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("digest"), str)):
            return f"its digests record of {name!r} is damaged ({str(entry)[:80]})"
    got = record_digest(doc)
    if got != rec["state"]:
        return f"its content does not match its recorded digest (recorded {rec['state']}, computed {got})"
    return None


def file_record(path: str | os.PathLike[str]) -> dict:
    """``{"size": bytes, "digest": hex}`` of the file at ``path`` (:func:`digest_file`, read once in 8 MiB
    pieces): the entry a ``digests`` record keeps for a file beside its document (:func:`sealed`).

    Raises ``FileNotFoundError``/``OSError`` unchanged."""
    return {"size": os.path.getsize(path), "digest": digest_file(path)}


def check_file(doc: dict, name: str, data: bytes | bytearray | memoryview | os.PathLike[str]) -> str | None:
    """What is wrong with file ``name``'s bytes ``data`` (or the file at path ``data``, read in pieces) against
    ``doc``'s ``digests`` record (checked with :func:`check_record` first), or None when they match or ``doc``
    records no digests (an older file). Raises ``OSError`` from reading a path unchanged."""
    rec = doc.get("digests")
    if rec is None:
        return None
    entry = rec["files"].get(name)
    if entry is None:
        return f"its digests record has no entry for {name}"
    size = os.path.getsize(data) if isinstance(data, os.PathLike) else memoryview(data).nbytes
    if size != entry["size"]:
        return f"{name} is {size} bytes, {entry['size']} recorded"
    got = digest_file(data) if isinstance(data, os.PathLike) else digest_bytes(data)
    if got != entry["digest"]:
        return f"{name} does not match its recorded digest (recorded {entry['digest']}, computed {got})"
    return None
