"""Value ranges declared on typed config fields (``Annotated[int, msgspec.Meta(ge=1)]``) and the one message
a value outside them gives: ``<name> <value> is invalid: accepted <what>`` (ConfigError, exit 2).

msgspec checks the ranges when it converts a table into a struct (``msgspec.convert``); a struct built
directly (``ConsumerConfig(steps=0)``, as the CLI does) is checked by :func:`check_ranges`, which names a field
the caller's way (the CLI flag it came from, or a config path); a lone value (a flag with no struct field) by
:func:`check_value`. Every range rule of typed input is declared this way: none is checked by hand. A finite float is
declared as one ``<=`` the largest float (:data:`FINITE`): msgspec then refuses ``inf`` and ``nan``.
"""

from __future__ import annotations

import functools
import re
import sys
import typing
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi

from artcache.errors import ConfigError

#: the largest float: ``le=FINITE`` refuses inf (and nan fails every bound)
FINITE = sys.float_info.max
#: an integer >= 1 (a count of steps, samples, layers ...)
Count = Annotated[int, msgspec.Meta(ge=1)]
#: an integer >= 0 (threads: 0 = torch's default; intervals: 0 = never)
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
#: a finite number > 0 (seconds, a learning rate)
Positive = Annotated[float, msgspec.Meta(gt=0, le=FINITE)]
#: a finite number >= 0 (seconds where 0 means "at once" or "never")
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0, le=FINITE)]
#: a plan's tokens per sample (:class:`artcache.plan.PlanSpec`; the producer's flag and ``[data]`` use it too)
MaxLength = Annotated[int, msgspec.Meta(ge=16)]
#: the largest block size B of a blocked draft (DFlash, DSpark): the published recipes use 4 to 16
#: (DFlash arXiv:2602.06036, SpecForge); 64 leaves room to explore, while a draft's cost grows with anchors × B
MAX_BLOCK_SIZE = 64
#: a block size B: the anchor and at least one more slot, at most :data:`MAX_BLOCK_SIZE`
BlockSize = Annotated[int, msgspec.Meta(ge=2, le=MAX_BLOCK_SIZE)]
#: the largest lookbehind or lookahead of a consumer window, in positions (2**24: far past any plan's length;
#: every position of a live window is kept on disk whatever the budget, so a larger window only fills the disk)
MAX_WINDOW = 1 << 24
#: one side of a window ``LOOKBEHIND:LOOKAHEAD`` (positions)
WindowSide = Annotated[int, msgspec.Meta(ge=0, le=MAX_WINDOW)]
#: the largest disk budget, in bytes (2**60 = 1 EiB, beyond any filesystem a cache root lives on)
MAX_DISK_BUDGET = 1 << 60
#: a disk budget in bytes (0: none; the producer then keeps the windows-only rule)
DiskBudget = Annotated[int, msgspec.Meta(ge=0, le=MAX_DISK_BUDGET)]

_AT = re.compile(r"\s*-\s*at\s*`\$(.*)`\s*$")
_WINDOW = re.compile(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*")


def bounds(t: mi.Type) -> str:
    """`` >= 1``, `` > 0 and <= 1`` ... of a constrained int or float type ("" when it has none)."""
    parts = [f"{op} {v:g}" if isinstance(v, float) else f"{op} {v}"
             for op, v in ((">", getattr(t, "gt", None)), (">=", getattr(t, "ge", None)),
                           ("<", getattr(t, "lt", None)), ("<=", getattr(t, "le", None)))
             if v is not None and v != FINITE]
    return (" " + " and ".join(parts)) if parts else ""


def describe_number(t: mi.Type, seconds: bool = False) -> str:
    """What an int or float type accepts: ``an integer >= 1``, ``an integer >= 0 (0 or a positive integer)``,
    ``a finite number > 0``, ``finite seconds > 0``."""
    if isinstance(t, mi.IntType) and bounds(t) == " >= 0":
        return "an integer >= 0 (0 or a positive integer)"
    text = ("an integer" if isinstance(t, mi.IntType) else "seconds" if seconds else "a number") + bounds(t)
    if getattr(t, "le", None) == FINITE:
        text = ("finite " if seconds else "a finite ") + text.removeprefix("a ")
    return text


def path_of(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(dotted path, problem) of a msgspec validation error: ``.experiments[0].lr`` → ``experiments.0.lr``."""
    text = str(exc)
    m = _AT.search(text)
    where = re.sub(r"\[(\d+)\]", r".\1", m.group(1)).lstrip(".") if m else ""
    return where, _AT.sub("", text)


def is_range_error(problem: str, value: Any) -> bool:
    """Whether a msgspec problem is a declared range the (number) value is outside of, not a wrong type."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and ", got " not in problem


def range_message(name: str, value: Any, accepted: str) -> str:
    return f"{name} {value} is invalid: accepted {accepted}"


def value_message(t: mi.Type, value: Any, problem: str, name: str, seconds: bool = False) -> str:
    """The one-line message for ``value`` (of declared type ``t``) failing msgspec's ``problem``: the range
    message when ``t`` declares a range the number is outside of, else ``<name>: <problem>``."""
    while isinstance(t, mi.UnionType):
        t = next((x for x in t.types if not isinstance(x, mi.NoneType)), None)
    if not isinstance(t, (mi.IntType, mi.FloatType)) or not is_range_error(problem, value):
        return f"{name}: {problem}"
    return range_message(name, value, describe_number(t, seconds))


def field_message(cls: type, field: str, value: Any, problem: str, name: str) -> str:
    """:func:`value_message` for ``cls.field = value`` (a field ending ``_s`` holds seconds)."""
    t = next((f.type for f in mi.type_info(cls).fields if f.name == field), None)
    return value_message(t, value, problem, name, field.endswith("_s"))


def check_value(value: Any, declared: Any, name: str, seconds: bool = False) -> None:
    """Check one value against a declared type (``NonNegativeFloat``, ``Count | None`` ...): the check of a
    value that has no struct field, e.g. a CLI flag passed straight to a function (``fsck --observe``).

    Raises:
        ConfigError: ``<name> <value> is invalid: accepted <what>`` (:func:`value_message`).
    """
    try:
        msgspec.convert(msgspec.to_builtins(value), declared)
    except msgspec.ValidationError as exc:
        problem = path_of(exc)[1]
        raise ConfigError(value_message(mi.type_info(declared), value, problem, name, seconds)) from None


def parse_window(text: str, name: str = "--window") -> tuple[int, int]:
    """``"64:256"`` → (lookbehind 64, lookahead 256): the one parser of a window, for the consumer's flag, the
    run config's ``experiments.N.window`` and the bench. Each side is a :data:`WindowSide` (0 … :data:`MAX_WINDOW`
    positions); whether the lookahead holds one batch is the consumer's check (it knows the batch size).

    Raises:
        ConfigError: naming ``name``, the text and what is accepted (not two non-negative ASCII integers, or a
            side beyond :data:`MAX_WINDOW`).
    """
    m = _WINDOW.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(f"{name} {text!r} is not LOOKBEHIND:LOOKAHEAD with two non-negative integers, e.g. 64:256")
    sides = int(m.group(1)), int(m.group(2))
    try:
        msgspec.convert(list(sides), list[WindowSide])
    except msgspec.ValidationError:
        raise ConfigError(f"{name} {text.strip()} is invalid: accepted LOOKBEHIND:LOOKAHEAD, each side "
                          f"{describe_number(mi.type_info(WindowSide))} positions (every position of a live window "
                          "stays on disk)") from None
    return sides


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def check_ranges(obj: msgspec.Struct, name_of: Callable[[str], str] = str) -> None:
    """Check the declared ranges of a struct built directly (its fields are not checked then), field by field
    (so a struct may call it from its own ``__post_init__``); a field holding a struct is checked through.

    ``name_of`` phrases the message the caller's way: it gets the field's dotted path from ``obj``
    (``max_samples``; ``limits.max_queue`` for a nested struct's field) and returns the name to report,
    e.g. the CLI flag the value came from (``--max-samples``, ``--max-queue``) or a config path.

    Raises:
        ConfigError: ``<name_of(path)> <value> is invalid: accepted <what>`` for the first field outside its
            range (fields in declaration order, a nested struct's where it stands).
    """
    _check_fields(obj, name_of, "")


def _check_fields(obj: msgspec.Struct, name_of: Callable[[str], str], prefix: str) -> None:
    hints = _hints(type(obj))
    for field in obj.__struct_fields__:
        value = getattr(obj, field)
        if isinstance(value, msgspec.Struct):
            _check_fields(value, name_of, f"{prefix}{field}.")
        else:
            check_value(value, hints[field], name_of(prefix + field), field.endswith("_s"))


__all__ = ["FINITE", "MAX_BLOCK_SIZE", "MAX_DISK_BUDGET", "MAX_WINDOW", "BlockSize", "Count", "DiskBudget", "MaxLength",
           "NonNegative", "NonNegativeFloat", "Positive", "WindowSide", "bounds", "check_ranges", "check_value",
           "describe_number", "field_message", "is_range_error", "parse_window", "path_of", "range_message",
           "value_message"]
