"""Value ranges declared on typed config fields (``Annotated[int, msgspec.Meta(ge=1)]``) and the one message
a value outside them gives: ``<name> <value> is invalid: accepted <what>`` (ConfigError, exit 2).

msgspec checks the ranges when it converts a table into a struct (``msgspec.convert``); a struct built
directly (``ConsumerConfig(steps=0)``, as the CLI does) is checked by :func:`check_ranges`. A finite float is
declared as one ``<=`` the largest float (:data:`FINITE`): msgspec then refuses ``inf`` and ``nan``.
"""

from __future__ import annotations

import re
import sys
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

_AT = re.compile(r"\s*-\s*at\s*`\$(.*)`\s*$")


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


def field_message(cls: type, field: str, value: Any, problem: str, name: str) -> str:
    """The one-line message for ``cls.field = value`` failing msgspec's ``problem``: the range message when
    the field declares a range the number is outside of, else ``<name>: <problem>``."""
    t = next((f.type for f in mi.type_info(cls).fields if f.name == field), None)
    while isinstance(t, mi.UnionType):
        t = next((x for x in t.types if not isinstance(x, mi.NoneType)), None)
    if not isinstance(t, (mi.IntType, mi.FloatType)) or not is_range_error(problem, value):
        return f"{name}: {problem}"
    return range_message(name, value, describe_number(t, field.endswith("_s")))


def check_ranges(obj: msgspec.Struct, name_of: Callable[[str], str] = str) -> None:
    """Check the declared ranges of a struct built directly (its fields are not checked then).

    Raises:
        ConfigError: ``<name_of(field)> <value> is invalid: accepted <what>`` for the first field outside its
            range (a field of a nested struct is named by its own name, ``max_queue``).
    """
    try:
        msgspec.convert(msgspec.to_builtins(obj), type(obj))
    except msgspec.ValidationError as exc:
        where, problem = path_of(exc)
        owner, *inner, field = [obj, *where.split(".")]
        for seg in inner:  # a nested struct's field (ProducerConfig.limits.max_queue): named by its own name
            owner = getattr(owner, seg, None)
        name = name_of(field) if owner is obj else field
        raise ConfigError(field_message(type(owner), field, getattr(owner, field, None), problem, name)) from None


__all__ = ["FINITE", "Count", "NonNegative", "Positive", "bounds", "check_ranges", "describe_number",
           "field_message", "is_range_error", "path_of", "range_message"]
