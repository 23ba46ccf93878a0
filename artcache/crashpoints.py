"""Named crash points for kill -9 testing.

``ARTCACHE_CRASH_AT=<point>[:<n>]`` makes the process SIGKILL itself the n-th time (default: the
first) it reaches :func:`crash_point` with that name. The variable is parsed once, at import; when it
is unset a crash point costs one dict lookup. Point names are listed in ``docs/protocol.md``.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "ARTCACHE_CRASH_AT"

#: Every crash point placed in the code (documented in docs/protocol.md, "Crash points").
POINTS = frozenset({
    "publish.after-write",     # temp file written, not yet fsync-ed
    "publish.after-fsync",     # temp file fsync-ed, not yet renamed into objects/
    "publish.after-rename",    # renamed into objects/, directory not yet fsync-ed
    "publish.after-payload",   # remote payload store: the payload is put, its manifest not yet written
    "capture.after-forward",   # producer: forward pass done, nothing of the batch published
    "lease.after-create",      # consumer: lease file created, artifact not yet read
    "evict.after-rename",      # producer: artifact renamed aside into tmp/ (remote store: manifest renamed to
                               # <fp>.pending), not yet unlinked (its payload not yet removed)
    "cursor.before-commit",    # consumer: optimizer step done, cursor not yet committed
    "cursor.after-commit",     # consumer: cursor committed, the batch's leases not yet released
    "checkpoint.before-record",  # consumer: checkpoint directory renamed into place, not yet recorded
    "checkpoint.after-record",   # consumer: checkpoint recorded in the registry, `latest` not yet updated
})


def _parse(value: str | None) -> dict[str, int]:
    if not value:
        return {}
    name, _, count = value.strip().partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown crash point {name!r}; known: {sorted(POINTS)}")
    n = int(count) if count else 1
    if n < 1:
        raise ValueError(f"{ENV}={value!r}: the count must be >= 1")
    return {name: n}


_armed: dict[str, int] = _parse(os.environ.get(ENV))
_lock = threading.Lock()


def crash_point(name: str) -> None:
    """SIGKILL this process if ``name`` is armed and this is its n-th arrival; else return."""
    if name not in _armed:
        return
    with _lock:
        _armed[name] -= 1
        if _armed[name] > 0:
            return
    os.kill(os.getpid(), signal.SIGKILL)


def reload(value: str | None = None) -> None:
    """Re-arm from ``value`` (tests); ``None`` re-reads the environment variable."""
    global _armed
    _armed = _parse(os.environ.get(ENV) if value is None else value)
