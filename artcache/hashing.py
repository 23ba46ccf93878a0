"""Small hashing helpers shared by artcache modules.

- ``digest_bytes`` / ``digest_file``: fast content hashes (xxh3_128, 32 hex chars) for integrity checks.
- ``strong_digest``: blake2b (20 bytes, 40 hex chars) for ids and fingerprints.
- ``canonical_json``: a deterministic JSON encoding (sorted keys) to feed either hash.
"""

from __future__ import annotations

import hashlib
import os
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


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes for ``obj`` (msgspec Structs, dicts, lists, scalars): keys sorted, no spaces."""
    return msgspec.json.encode(msgspec.to_builtins(obj), order="sorted")


def strong_digest(data: bytes | bytearray | memoryview) -> str:
    """blake2b with a 20-byte digest, as 40 lowercase hex characters (ids, fingerprints)."""
    return hashlib.blake2b(bytes(data), digest_size=20).hexdigest()
