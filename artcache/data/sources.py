"""Data sources of a mixed plan: local dataset folders and parquet / arrow / JSON / JSONL files, in either
chat schema, read strictly.

A source (:class:`DataSource`, ``[[data.sources]]`` in a run config) is a path with a mixing weight, a split
and an optional cap on the samples drawn from it. Accepted paths:

- a folder written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with
  ``datasets.load_from_disk``; ``split`` picks the split of a ``DatasetDict``);
- ``*.parquet`` (read with pyarrow into an in-memory ``datasets.Dataset``: nothing is written to the Hugging
  Face cache), ``*.arrow`` (``datasets.Dataset.from_file``);
- ``*.json`` (a JSON list of records, or JSONL) and ``*.jsonl`` (one record per line), UTF-8 (a leading byte
  order mark is skipped), read here so that a bad line is named by its line number;
- ``sharegpt``: the embedded ShareGPT V3 file (cut mid-record upstream; read tolerantly by
  :func:`artcache.data.sharegpt.read_sharegpt`, its dropped tail recorded).

Records (either schema; :func:`record_messages`):

- OpenAI ``messages``: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}]``; an assistant
  turn may carry ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``) with an empty
  or null content, a ``tool`` turn answers one; content given as a list of ``{"type": "text", "text"}``
  parts is joined.
- ShareGPT ``conversations``: ``[{"from": "human"|"gpt"|"system"|..., "value": str}]``
  (:data:`artcache.data.sharegpt.ROLE_MAP`).

Anything else in a record (a turn that is not an object, an unknown role, a content that is neither text
nor text parts) raises :class:`~artcache.errors.DataError` in one line naming the file, the record and
what is accepted. A conversation without an assistant turn is skipped and counted (nothing to supervise).

Nothing here imports ``datasets`` until a folder, parquet or arrow source is read.
"""

from __future__ import annotations

import codecs
import json
import math
from pathlib import Path
from typing import Annotated, Any

import msgspec

from artcache.data.sharegpt import ROLE_MAP, locate_sharegpt, read_sharegpt
from artcache.errors import ConfigError, DataError

#: roles a ``messages`` turn may have
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
#: file suffixes a source may have (a folder is a ``save_to_disk`` dataset)
SUFFIXES = (".parquet", ".arrow", ".json", ".jsonl")
ACCEPTED_RECORD = ("accepted: an object with 'messages' (a list of {role: system|user|assistant|tool, content: "
                   "text}) or 'conversations' (a list of {from: human|gpt|system|..., value: text})")


class DataSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One source of a plan (``[[data.sources]]``, ``data.eval``).

    Attributes:
        path: a ``save_to_disk`` folder, a ``.parquet``/``.arrow``/``.json``/``.jsonl`` file, or ``sharegpt``.
        weight: the share of the plan's training samples drawn from this source, relative to the other
            sources' weights (> 0; ignored for ``data.eval``).
        split: the split of a ``DatasetDict`` folder (a single file or ``Dataset`` folder has only ``train``).
        max_samples: at most this many samples come from this source (None: no cap). For ``data.eval`` it is
            the held-out split's size (None: every usable record).
    """

    path: str
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    split: str = "train"
    max_samples: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"data source path {self.path!r} is invalid: accepted a dataset folder, a "
                              f"{'/'.join(SUFFIXES)} file or 'sharegpt'")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight) or self.weight <= 0:
            raise ConfigError(f"data source {self.path!r}: weight {self.weight!r} is invalid: accepted a number > 0")
        if self.max_samples is not None and (isinstance(self.max_samples, bool) or not isinstance(
                self.max_samples, int) or self.max_samples < 1):
            raise ConfigError(f"data source {self.path!r}: max_samples {self.max_samples!r} is invalid: accepted an "
                              "integer >= 1 or none")


def parse_data_arg(text: str) -> DataSource:
    """``PATH[:WEIGHT]`` (the CLI's repeated ``--data``) → a :class:`DataSource`. A trailing ``:WEIGHT`` is
    taken as the weight only when it parses as a number (so a path with a colon still works).

    Raises ConfigError for an empty path or a weight <= 0."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            weight = float(tail)
        except ValueError:
            return DataSource(path=text)
        return DataSource(path=path, weight=weight)
    return DataSource(path=text)


def resolve_source(source: DataSource) -> Path | str:
    """The source's absolute path (``"sharegpt"`` → the embedded file). Raises ConfigError naming the path
    when it does not exist or is a file of another kind."""
    if source.path == "sharegpt":
        return locate_sharegpt()
    if source.path == "synthetic":
        raise ConfigError("data source 'synthetic' is not accepted as a source (random tokens have no conversations "
                          "to mix or hold out); accepted: 'synthetic' alone as data.dataset (one --data synthetic), or "
                          f"as sources a dataset folder, a {'/'.join(SUFFIXES)} file or 'sharegpt'")
    p = Path(source.path).expanduser()
    if p.is_dir():
        return p.resolve()
    head, colon, weight = source.path.rpartition(":")
    if not p.exists() and colon and head and Path(head).expanduser().exists():
        raise ConfigError(f"data source {source.path!r}: weight {weight!r} after the last ':' is invalid: accepted a "
                          f"number > 0 ({head!r} exists; --data PATH[:WEIGHT])")
    if not p.is_file():
        raise ConfigError(f"data source {source.path!r} does not exist; accepted: a dataset folder (save_to_disk), "
                          f"a {'/'.join(SUFFIXES)} file or 'sharegpt'")
    if p.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"data source {source.path!r}: suffix {p.suffix or '(none)'!r} is not accepted; "
                          f"accepted: a dataset folder (save_to_disk) or a {'/'.join(SUFFIXES)} file")
    return p.resolve()


def source_digest(path: Path) -> str:
    """Content digest of a source: a file's :func:`~artcache.hashing.digest_file`; a folder's strong digest of
    its files' relative names and digests (hidden files and ``*.lock`` left out)."""
    from artcache.hashing import canonical_json, digest_file, strong_digest

    if path.is_file():
        return digest_file(path)
    files = sorted(f for f in path.rglob("*") if f.is_file() and not any(part.startswith(".") for part in
                                                                          f.relative_to(path).parts)
                   and f.suffix != ".lock")
    return strong_digest(canonical_json([[str(f.relative_to(path)), digest_file(f)] for f in files]))


class SourceRecords:
    """The records of one source: ``len()`` and ``[i]`` (a dict, or what the file holds there), plus
    ``where(i)``, the record's name in messages (``file 'x.jsonl' line 4``, ``folder 'd' split train record 3``).

    ``dropped`` counts the records the embedded ShareGPT file's cut tail lost (0 for every other source)."""

    def __init__(self, label: str, records, *, line_numbers: list[int] | None = None, dropped: int = 0) -> None:
        self.label = label
        self._records = records
        self._lines = line_numbers
        self.dropped = dropped

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> Any:
        return self._records[int(i)]

    def where(self, i: int) -> str:
        i = int(i)
        return f"{self.label} line {self._lines[i]}" if self._lines is not None else f"{self.label} record {i}"


def read_source(source: DataSource) -> SourceRecords:
    """Open ``source`` (see the module docstring). Raises ConfigError for a missing path or an unknown
    split, DataError in one line naming the file (and the line or record) for a file that cannot be read."""
    path = resolve_source(source)
    if source.path == "sharegpt":
        read = read_sharegpt(path)
        _only_train(source, "the embedded ShareGPT file")
        return SourceRecords(f"dataset 'sharegpt' ({path.name})", read.records, dropped=read.records_dropped)
    if path.is_dir():
        return _read_folder(source, path)
    suffix = path.suffix.lower()
    _only_train(source, f"file {source.path!r}")
    if suffix in (".json", ".jsonl"):
        return _read_json(source, path)
    return _read_table(source, path, suffix)


def _only_train(source: DataSource, what: str) -> None:
    if source.split != "train":
        raise ConfigError(f"data source {source.path!r}: split {source.split!r} is not accepted: {what} has only "
                          "the split 'train' (splits are the folders of a DatasetDict saved with save_to_disk)")


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _read_folder(source: DataSource, path: Path) -> SourceRecords:
    datasets = _quiet_datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, ValueError, ArrowInvalid ... for a bad folder
        raise DataError(f"data source folder {source.path!r}: not a dataset saved with save_to_disk "
                        f"({_first_line(exc)}); accepted: a Dataset or DatasetDict folder, or a "
                        f"{'/'.join(SUFFIXES)} file") from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise ConfigError(f"data source folder {source.path!r}: no split {source.split!r}; accepted: "
                              f"{', '.join(sorted(ds))}")
        ds = ds[source.split]
    elif source.split != "train":
        _only_train(source, f"folder {source.path!r} (a Dataset, not a DatasetDict)")
    return SourceRecords(f"folder {source.path!r} split {source.split}", ds)


def _read_table(source: DataSource, path: Path, suffix: str) -> SourceRecords:
    datasets = _quiet_datasets()
    try:
        if suffix == ".parquet":  # read in memory: from_parquet would write an arrow copy into the HF cache
            import pyarrow.parquet as pq
            from datasets.table import InMemoryTable

            ds = datasets.Dataset(InMemoryTable(pq.read_table(str(path))))
        else:
            ds = datasets.Dataset.from_file(str(path), in_memory=True)
    except Exception as exc:  # pyarrow's ArrowInvalid and friends: a damaged or foreign file
        kind = "parquet" if suffix == ".parquet" else "arrow (datasets' Arrow stream)"
        raise DataError(f"data source file {source.path!r}: not a readable {kind} file ({_first_line(exc)})") \
            from None
    return SourceRecords(f"file {source.path!r}", ds)


def _read_json(source: DataSource, path: Path) -> SourceRecords:
    label = f"file {source.path!r}"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"data source {label}: cannot read ({exc})") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # a leading UTF-8 BOM is not content
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data source {label}: byte {exc.start + bom} is not UTF-8; accepted: UTF-8 JSON or JSONL "
                        "(a leading byte order mark is allowed)") from None
    body = text.lstrip(" \t\r\n")
    if body.startswith("["):
        try:
            records = json.loads(body)
        except ValueError as exc:
            raise DataError(f"data source {label}: not valid JSON ({exc}); accepted: a JSON list of records or "
                            "JSONL (one record per line)") from None
        return SourceRecords(label, records)
    records, lines = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise DataError(f"data source {label} line {n}: not a JSON record ({exc}); accepted: one JSON object "
                            "per line (JSONL) or a JSON list of records") from None
        lines.append(n)
    if not records:
        raise DataError(f"data source {label}: no records; accepted: a JSON list of records or JSONL")
    return SourceRecords(label, records, line_numbers=lines)


def _content(value: Any, where: str, k: int) -> str | None:
    """A turn's content as text: a string, None, or a list of ``{"type": "text", "text": str}`` parts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DataError(f"data source {where}: turn {k} has a content part of type {kind!r}; accepted: "
                                "text content (a string, or parts of type 'text')")
        return "".join(parts)
    raise DataError(f"data source {where}: turn {k} content is a {type(value).__name__}; accepted: a string or "
                    "a list of text parts")


def record_messages(record: Any, where: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """One record → chat messages for the chat template, in either schema (see the module docstring).

    Returns ``(messages, None)``, or ``(None, reason)`` for a conversation that is well formed but has
    nothing to supervise (``"empty"``: no turns; ``"no_assistant"``). Each message has ``role`` and
    ``content`` (a str; ``""`` for an assistant turn that only calls tools), plus ``tool_calls`` /
    ``tool_call_id`` / ``name`` where the record has them.

    Raises:
        DataError: ``data source <where>: ...; accepted: ...`` for a record of neither schema, a turn that is
            not an object, an unknown role, or a content that is not text.
    """
    if not isinstance(record, dict):
        raise DataError(f"data source {where}: is a {type(record).__name__}, not an object; {ACCEPTED_RECORD}")
    turns, sharegpt = record.get("messages"), False
    if not isinstance(turns, list):
        turns, sharegpt = record.get("conversations"), True
    if not isinstance(turns, list):
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise DataError(f"data source {where}: has no 'messages' or 'conversations' list (keys: {keys}); "
                        f"{ACCEPTED_RECORD}")
    if not turns:
        return None, "empty"
    messages: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"data source {where}: turn {k} is a {type(turn).__name__}, not an object; "
                            f"{ACCEPTED_RECORD}")
        if sharegpt and "from" in turn:
            name, raw = turn.get("from"), turn.get("value")
            role = ROLE_MAP.get(name.strip().lower()) if isinstance(name, str) else None
            if role is None:
                raise DataError(f"data source {where}: turn {k} from {name!r} is not accepted; accepted: "
                                f"{', '.join(ROLE_MAP)}")
        else:
            name, raw = turn.get("role"), turn.get("content")
            role = name if name in MESSAGE_ROLES else None
            if role is None:
                raise DataError(f"data source {where}: turn {k} role {name!r} is not accepted; accepted: "
                                f"{', '.join(MESSAGE_ROLES)}")
        content = _content(raw, where, k)
        message: dict[str, Any] = {"role": role, "content": content or ""}
        calls = turn.get("tool_calls")
        if calls:  # arrow tables give every row the union of keys: a None or [] is "no tool calls"
            if role != "assistant" or not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise DataError(f"data source {where}: turn {k} ({role}) has tool_calls {str(calls)[:60]!r}; "
                                "accepted: a list of tool-call objects on an assistant turn")
            message["tool_calls"] = calls
        elif content is None:
            raise DataError(f"data source {where}: turn {k} ({role}) has no content; accepted: text content "
                            "(null only on an assistant turn with tool_calls)")
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None and not sharegpt:
                message[key] = turn[key]
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant"
    return messages, None


def tool_call_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The strings a chat template that renders tool calls must show: every tool call's function name. Used to
    refuse a template that drops tool calls."""
    out = []
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            name = fn.get("name")
            if isinstance(name, str) and name:
                out.append(name)
    return out


__all__ = ["ACCEPTED_RECORD", "MESSAGE_ROLES", "SUFFIXES", "DataSource", "SourceRecords", "parse_data_arg",
           "read_source", "record_messages", "resolve_source", "source_digest", "tool_call_texts"]
