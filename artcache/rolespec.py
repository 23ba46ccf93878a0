"""A role's spec file: the one typed form in which a launcher hands a producer or consumer its settings.

Whoever starts a role (``artcache run``, its Slurm job, ``artcache bench``, the offline bench) builds the role's
settings once, as the role's own typed struct (:class:`artcache.producer.ProducerConfig` for a producer,
:class:`artcache.trainers.consumer.ConsumerConfig` for a consumer; both reject unknown fields), writes them here
with :func:`write_spec` and starts the child with ``--spec FILE`` (``artcache producer --spec``, ``artcache
consume --spec``), which reads them back with :func:`read_spec`. Nothing translates the settings on the way: the
child runs on exactly the struct the launcher built, and records :func:`spec_digest` of it in its journal
(``producer_start.spec``, ``consumer_start.spec``), so a run can check each child got its own.

The file is JSON, written atomically (:func:`artcache.fsio.atomic_write`)::

    {"format": 1, "role": "consumer", "spec": {<the struct's fields, every one, defaults included>}}
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from artcache.errors import ConfigError
from artcache.fsio import atomic_write
from artcache.hashing import digest_bytes

#: the spec file's format (the ``format`` key); a reader refuses any other
SPEC_FORMAT = 1
#: the roles a spec file may name
ROLES = ("producer", "consumer")

S = TypeVar("S", bound=msgspec.Struct)


class _SpecFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: int
    role: str
    spec: msgspec.Raw


def spec_bytes(spec: msgspec.Struct) -> bytes:
    """The canonical JSON of a role's settings: every field, in declaration order (what :func:`spec_digest`
    hashes)."""
    return msgspec.json.encode(spec)


def spec_digest(spec: msgspec.Struct) -> str:
    """The digest (:func:`artcache.hashing.digest_bytes`, hex) of :func:`spec_bytes`: equal for two structs of one
    type exactly when every field is equal."""
    return digest_bytes(spec_bytes(spec))


def write_spec(path: str | Path, role: str, spec: msgspec.Struct) -> Path:
    """Write ``spec`` as role ``role``'s spec file at ``path`` (parents created) and return the path.

    Raises:
        ValueError: ``role`` is not one of :data:`ROLES`.
        PublishError: the file could not be written (``path`` untouched; :func:`artcache.fsio.atomic_write`).
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not accepted: one of {', '.join(ROLES)}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = msgspec.json.format(msgspec.json.encode({"format": SPEC_FORMAT, "role": role,
                                                    "spec": msgspec.Raw(spec_bytes(spec))}))
    atomic_write(p, [body + b"\n"], p.parent)
    return p


def read_spec(path: str | Path, role: str, kind: type[S]) -> S:
    """Role ``role``'s settings from the spec file at ``path``, decoded as ``kind`` (unknown fields refused).

    Raises:
        ConfigError: the file cannot be read, is not a spec file of this format, names another role, or its
            settings do not decode as ``kind`` (one line naming the file, the bad value and what is accepted).
    """
    where = f"--spec {str(path)!r}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read ({exc.strerror or exc}); accepted: a spec file a launcher "
                          "wrote") from None
    try:
        head = msgspec.json.decode(data, type=_SpecFile)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{where} is not a role spec file ({exc}); accepted: JSON with format, role and "
                          "spec") from None
    if head.format != SPEC_FORMAT:
        raise ConfigError(f"{where} has format {head.format}; accepted: {SPEC_FORMAT}")
    if head.role != role:
        raise ConfigError(f"{where} is a {head.role!r} spec; accepted: a {role!r} spec")
    try:
        return msgspec.json.decode(head.spec, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{where}: {exc}; accepted: the fields of {kind.__name__}") from None


__all__ = ["ROLES", "SPEC_FORMAT", "read_spec", "spec_bytes", "spec_digest", "write_spec"]
