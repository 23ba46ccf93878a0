"""Damage a consumer checkpoint's files the way a disk does, for the tests of its content digests.

Each change is one that the file's own reader does not notice: a safetensors file keeps its header (so it
loads, with garbage in a tensor), ``state.json`` stays JSON of the right types.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path


def flip_byte(path: Path) -> int:
    """Change one byte of ``path`` and return its offset: the middle byte of a safetensors file's tensor
    data (inverted; the header's last byte in a file without tensors), or the last digit of ``state.json``'s
    ``step`` (one more, modulo 10)."""
    raw = bytearray(Path(path).read_bytes())
    if Path(path).name == "state.json":
        m = re.search(rb'"step": ([0-9]+)', raw)
        assert m is not None, raw[:200]
        at = m.end(1) - 1
        raw[at] = ord("0") + (raw[at] - ord("0") + 1) % 10
    else:
        (header,) = struct.unpack("<Q", raw[:8])
        start = 8 + header
        # a file without tensors (an optimizer that never stepped) has no data: its header's last byte then
        at = start + (len(raw) - start) // 2 if start < len(raw) else start - 1
        raw[at] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    return at


def truncate(path: Path, nbytes: int = 4) -> None:
    """Cut the last ``nbytes`` bytes of ``path`` (a write the disk lost the end of)."""
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:-nbytes])
