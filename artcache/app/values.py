"""Parsers and checks of single values that the CLI flags and the run config share (the lowest module of
``artcache.app``: it imports no other module of it, so :mod:`artcache.app.config` and
:mod:`artcache.app.cli` both import it at module level).

Every function raises :class:`~artcache.errors.ConfigError` (exit 2) with one line naming the value and
what is accepted.
"""

from __future__ import annotations

import re
from fractions import Fraction

import msgspec
import msgspec.inspect as mi

from artcache.errors import ConfigError
from artcache.ranges import DiskBudget, describe_number, range_message


def parse_template_options(items) -> dict:
    """``["enable_thinking=false", "k=3"]`` → ``{"enable_thinking": False, "k": 3}`` (true/false → bool, an
    integer or decimal → number, anything else → string). ConfigError naming a malformed item."""
    out: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise ConfigError(f"--chat-template-option {item!r}: expected NAME=VALUE, e.g. enable_thinking=false")
        low = text.strip().lower()
        if low in ("true", "false"):
            value = low == "true"
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        out[name] = value
    return out


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str | int, flag: str) -> int:
    """``--disk-budget`` text → bytes: an integer or decimal, optionally with K, M, G or T (powers of 1024; a
    trailing ``B``/``iB`` is accepted), rounded down to whole bytes; 0 means none (the producer: the windows-only
    rule; the bench: its scenario's default). The range is
    :data:`~artcache.ranges.DiskBudget`'s (0 … 2**60 bytes).

    Raises:
        ConfigError: naming the value and what is accepted: not such a number, a nonzero value under one byte
            (``0.5`` used to become 0, the default, silently), or more than 2**60 bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", str(text).upper())
        if m is None:
            raise ConfigError(f"--{flag} {text!r} is not accepted: bytes as an integer or decimal, optionally with K, "
                              "M, G or T (powers of 1024), e.g. 500G or 1.5T; 0 for none")
        exact = Fraction(m.group(1)) * _UNITS[m.group(2)]
        value = int(exact)  # whole bytes, rounded down (exact: no float rounding of 1.1T)
        if exact and not value:
            raise ConfigError(range_message(f"--{flag}", str(text).strip(), "0 (none) or at least one byte"))
    try:
        msgspec.convert(value, DiskBudget)
    except msgspec.ValidationError:
        shown = value if isinstance(text, int) else str(text).strip()
        raise ConfigError(range_message(f"--{flag}", shown, f"{describe_number(mi.type_info(DiskBudget))} bytes "
                                        "(2**60; suffixes K, M, G, T: powers of 1024; 0: none)")) from None
    return value


def parse_disk_budget(text: str | int) -> int | str:
    """``artcache producer --disk-budget`` (and ``cache.disk_budget``): ``auto`` (any case) → ``"auto"`` (the
    budget derived from the free space at start), else :func:`parse_bytes` (0: no budget, the windows-only rule).

    Raises:
        ConfigError: as :func:`parse_bytes`, naming ``auto`` among what is accepted.
    """
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bytes(text, "disk-budget")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; or auto (90% of the free space)") from None


def parse_layer_ids(text: str | None) -> list[int] | None:
    """``--layer-ids`` as a list of ints; None when the option was not given. An empty or blank value is
    refused (it used to mean "the default" silently)."""
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--layer-ids {text!r}: expected comma-separated integers, e.g. 1,8,14 "
                          "(leave the option out for the draft's default layers)") from None
    return ids


__all__ = ["parse_bytes", "parse_layer_ids", "parse_template_options"]


def check_device(device: str, what: str = "--device", local: bool = True) -> None:
    """Refuse a device torch cannot use before anything is loaded or written: ``device`` must be ``cpu``, ``cuda``
    or ``cuda:<index>`` and, ``local``, a CUDA device this machine has (a launcher that runs the role elsewhere,
    e.g. Slurm, passes ``local=False``). ``what`` names the setting (``--device``, ``target.device``).

    Raises:
        ConfigError: naming ``what``, the value and what is accepted.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} {device!r} is not accepted: use cpu, cuda or cuda:<index>")
    if dev.type == "cuda" and local:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            fix = f"{what} cpu" if what.startswith("--") else "cpu"
            raise ConfigError(f"{what} {device!r}: no CUDA device is visible; use {fix}")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"{what} {device!r}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1}); use cpu or "
                              "one of those")
def data_flags(data, eval_data: str | None = None) -> dict:
    """The repeatable ``--data PATH[:WEIGHT]`` and ``--eval-data PATH`` → run config paths.

    One ``--data`` without a weight keeps its meaning: ``data.dataset`` (``sharegpt``, ``synthetic`` or a
    data file, which the plan reads as its one source of weight 1: :func:`artcache.plan.as_sources`). Several,
    or one with ``:WEIGHT``, are ``data.sources`` (each a :class:`artcache.data.sources.DataSource`: a dataset
    folder or a parquet / arrow / JSON / JSONL file, its weight after the last colon, default 1). ``--eval-data``
    is ``data.eval``. Nothing given: ``{}``.

    Raises ConfigError for a weight <= 0 or an empty path."""
    from artcache.data.sources import parse_data_arg

    out: dict = {}
    items = [data] if isinstance(data, str) else list(data or ())
    if len(items) == 1 and parse_data_arg(items[0]).path == items[0]:
        out["data.dataset"] = items[0]
    elif items:
        out["data.sources"] = [{"path": s.path, "weight": s.weight} for s in map(parse_data_arg, items)]
    if eval_data:
        out["data.eval"] = {"path": eval_data}
    return out
