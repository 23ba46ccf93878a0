"""Consumer registrations: ``consumers/<id>.json``, replaced atomically under a per-consumer lock.

A registration carries the consumer's committed cursor, its window, a heartbeat and a generation
number (the fence). Every read-modify-write takes ``locks/consumer-<id>.lock`` so the producer's
fencing and the consumer's heartbeat cannot lose each other's update. A consumer whose generation
or state changed under it has been fenced and must stop (:class:`ConsumerFenced`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import msgspec
from filelock import FileLock

from artcache.errors import ConfigError, ConsumerFenced
from artcache.fsio import atomic_write
from artcache.layout import CacheLayout, host_id, pid_alive

State = Literal["running", "completed", "cancelled", "failed", "expired"]
TERMINAL = frozenset({"completed", "cancelled", "failed", "expired"})


class Registration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One consumer's registration.

    Attributes:
        consumer_id: validated id. draft: draft algorithm name.
        state: ``running`` or a terminal state; only ``running`` windows count.
        generation: bumped on every (re)registration and every fence.
        cursor: committed position: every position < cursor was consumed by an optimizer step.
        lookbehind, lookahead: window = [cursor - lookbehind, cursor + lookahead] (positions).
        batch_size: positions consumed per optimizer step.
        end: exclusive last position the consumer will ever read (its steps × batch size), or -1
            when unbounded; the window is clipped there so nothing past a run's end is prefetched.
        demand: positions the consumer is blocked on now (demand misses).
        heartbeat: time.time() of the last heartbeat (seconds).
    """

    consumer_id: str
    draft: str
    state: State = "running"
    generation: int = 0
    cursor: int = 0
    lookbehind: int = 0
    lookahead: int = 1
    batch_size: int = 1
    end: int = -1
    demand: list[int] = []
    heartbeat: float = 0.0
    pid: int = 0
    host: str = ""
    reason: str = ""

    def window(self) -> tuple[int, int]:
        """Inclusive window [lo, hi] of positions (hi < lo when the consumer is past its end)."""
        hi = self.cursor + self.lookahead
        if self.end >= 0:
            hi = min(hi, self.end - 1)
        return max(0, self.cursor - self.lookbehind), hi

    def readable(self) -> tuple[int, int]:
        """Inclusive range [cursor, hi] the consumer's workers may acquire (and the producer prefetch)."""
        return self.cursor, self.window()[1]

    def window_size(self) -> int:
        return self.lookbehind + self.lookahead + 1

    def is_live(self, now: float, heartbeat_timeout: float) -> bool:
        return self.state == "running" and now - self.heartbeat <= heartbeat_timeout


_enc = msgspec.json.Encoder()


def read(layout: CacheLayout, consumer_id: str) -> Registration | None:
    """The registration, or None if absent. A torn file cannot exist (atomic replace)."""
    try:
        return msgspec.json.decode(layout.consumer_path(consumer_id).read_bytes(), type=Registration)
    except FileNotFoundError:
        return None


def read_all(layout: CacheLayout) -> list[Registration]:
    """All registrations (unreadable files are skipped)."""
    out = []
    for path in sorted(layout.consumers.glob("*.json")):
        try:
            out.append(msgspec.json.decode(path.read_bytes(), type=Registration))
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return out


def _write(layout: CacheLayout, reg: Registration) -> None:
    atomic_write(layout.consumer_path(reg.consumer_id), [_enc.encode(reg)], layout.tmp, durable=False)


def update(layout: CacheLayout, consumer_id: str, fn: Callable[[Registration | None], Registration | None],
           timeout: float = 30.0) -> Registration | None:
    """Read-modify-write under the consumer's lock. ``fn`` returns the new value (None: no write)."""
    with FileLock(layout.consumer_lock(consumer_id), timeout=timeout):
        new = fn(read(layout, consumer_id))
        if new is not None:
            _write(layout, new)
        return new


def register(layout: CacheLayout, reg: Registration) -> Registration:
    """(Re)register: bump the generation past any previous one, state running, heartbeat now."""

    def fn(old: Registration | None) -> Registration:
        if old is not None and old.state == "running" and old.pid and old.host == host_id() \
                and old.pid != reg.pid and pid_alive(old.pid):
            raise ConfigError(
                f"consumer id {reg.consumer_id!r} is already running as pid {old.pid}; "
                "choose another --id")
        return msgspec.structs.replace(
            reg, generation=(old.generation + 1) if old else 1, state="running",
            heartbeat=time.time(), host=host_id())

    return update(layout, reg.consumer_id, fn)


class ConsumerHandle:
    """A consumer's own view of its registration; every write checks the fence first."""

    def __init__(self, layout: CacheLayout, reg: Registration) -> None:
        self.layout = layout
        self.consumer_id = reg.consumer_id
        self.generation = reg.generation
        self.current = reg

    def _modify(self, check: Callable[[Registration], None] | None = None, **changes) -> Registration:
        def fn(old: Registration | None) -> Registration:
            if old is None or old.generation != self.generation or old.state != "running":
                state = old.state if old else "missing"
                reason = old.reason if old else ""
                raise ConsumerFenced(
                    f"consumer {self.consumer_id!r} was fenced (state {state}, generation "
                    f"{old.generation if old else '-'} != {self.generation}) {reason}".strip())
            if check is not None:
                check(old)
            return msgspec.structs.replace(old, heartbeat=time.time(), **changes)

        self.current = update(self.layout, self.consumer_id, fn)
        return self.current

    def heartbeat(self) -> Registration:
        return self._modify()

    def commit_cursor(self, cursor: int) -> Registration:
        """Commit progress after the optimizer step that consumed positions < cursor."""
        def check(old: Registration) -> None:
            # against the registration read under the lock: self.current may be another thread's stale copy
            if cursor < old.cursor:
                raise ValueError(f"cursor may not move backwards ({old.cursor} -> {cursor})")

        return self._modify(check, cursor=cursor)

    def set_demand(self, positions: list[int]) -> Registration:
        return self._modify(demand=sorted(set(positions)))

    def finish(self, state: State, reason: str = "") -> Registration | None:
        """Fence ourselves into a terminal state (generation bumped). No-op if already fenced."""

        def fn(old: Registration | None) -> Registration | None:
            if old is None or old.generation != self.generation:
                return None
            return msgspec.structs.replace(old, state=state, generation=old.generation + 1,
                                           demand=[], reason=reason, heartbeat=time.time())

        return update(self.layout, self.consumer_id, fn)


def fence(layout: CacheLayout, consumer_id: str, state: State, reason: str,
          expect_generation: int | None = None) -> Registration | None:
    """Fence a consumer from outside (producer): bump generation, set a terminal state."""

    def fn(old: Registration | None) -> Registration | None:
        if old is None or old.state in TERMINAL:
            return None
        if expect_generation is not None and old.generation != expect_generation:
            return None
        return msgspec.structs.replace(old, state=state, generation=old.generation + 1, demand=[],
                                       reason=reason)

    return update(layout, consumer_id, fn)
