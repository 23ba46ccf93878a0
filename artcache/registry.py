"""Consumer registrations: ``consumers/<id>.json``, replaced atomically under a per-consumer lock.

A registration carries the consumer's committed cursor, its window, its process identity, a heartbeat
counter and a generation number (the fence). Every read-modify-write takes ``locks/consumer-<id>.lock``
so the producer's fencing and the consumer's heartbeat cannot lose each other's update. A consumer whose
generation or state changed under it has been fenced and must stop (:class:`ConsumerFenced`).

Liveness (:mod:`artcache.liveness`): a reader decides a running registration is dead when its process
(same host id) is gone, or when its heartbeat counter (:meth:`Registration.progress_token`) has not
changed for the timeout on the reader's own monotonic clock. The wall-clock ``heartbeat`` field is for
humans and is never subtracted from another process's clock.

Migration rule: registrations written before identities existed (no ``identity``, ``beat`` 0) stay
readable; their pid is never checked (their ``host`` is a host name, which cannot tell pid namespaces
apart), and their progress token is the wall-clock ``heartbeat`` value, which changes on every beat.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from artcache.errors import CacheRootError, ConfigError, ConsumerFenced, UnsafePath
from artcache.fsio import atomic_write, is_space_error
from artcache.layout import CacheLayout, open_nofollow
from artcache.liveness import HeartbeatWatch, ProcessIdentity, dead_reason, local_identity, this_process
from artcache.locking import cache_lock

log = logging.getLogger("artcache.registry")

State = Literal["running", "completed", "cancelled", "failed", "expired"]
#: The one spelling of "ran to its stop": a consumer's final state (registration and ``consumer_end``), and
#: what ``artcache run`` and ``artcache report`` call an experiment whose checkpoint is at its final step.
COMPLETED: State = "completed"
TERMINAL = frozenset({COMPLETED, "cancelled", "failed", "expired"})


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
        heartbeat: time.time() of the consumer's last write (seconds; for humans: readers never compare it
            with their own clock).
        beat: heartbeat counter, + 1 on every write by the consumer (heartbeat, cursor, demand): what
            readers watch for progress (:meth:`progress_token`).
        identity: the consumer process's identity (None in registrations written before identities).
        pid, host: the consumer's pid and host name (for humans; ``identity`` is what is checked).
        pinned: half-open range ``[lo, hi)`` of positions the consumer reads besides its window (its
            held-out evaluation split; empty when ``lo >= hi``). Pinned positions are retained,
            prefetched after every window position and served on demand, like the window; they count
            in the window union and in the retain bound (:meth:`retain_bound`).
        checkpoint_cursor: the committed cursor of the consumer's latest durable checkpoint (-1: none).
            ``--resume`` continues only from a checkpoint with exactly this cursor.
        epoch_len: training samples per epoch, the plan's first ``epoch_len`` (0: the whole plan);
            position ``p`` reads sample ``plan.order(epoch_len).sample(p)`` (:class:`artcache.plan.EpochOrder`).
        pinned_demand: held-out sample indices (inside ``pinned``) the consumer is blocked on now.
        fenced_from: the generation a fence ended (-1: never fenced); lets that incarnation still record
            its final checkpoint (:meth:`ConsumerHandle.record_final_checkpoint`).
        out_dir: the consumer's run directory (absolute; ``""`` in registrations written before it), where
            ``checkpoint_cursor``'s checkpoint lies: a fresh run of the same id elsewhere is refused while it
            holds checkpoints (``--resume --out`` it, or another ``--id``).
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
    pinned: tuple[int, int] = (0, 0)
    checkpoint_cursor: int = -1
    epoch_len: int = 0
    pinned_demand: list[int] = []
    beat: int = 0
    identity: ProcessIdentity | None = None
    fenced_from: int = -1
    out_dir: str = ""

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

    def pinned_range(self) -> range:
        """The pinned positions (see the class docstring) as a range (empty if none)."""
        lo, hi = self.pinned
        return range(max(0, lo), max(0, lo, hi))

    def may_read(self, position: int) -> bool:
        """Whether ``position`` is readable now: inside ``[cursor, window hi]`` or pinned."""
        lo, hi = self.readable()
        return lo <= position <= hi or position in self.pinned_range()

    def retained_positions(self, period: int | None = None) -> set[int]:
        """Positions the producer must not evict for this consumer: its window plus its pinned range.

        With ``period`` (the plan's length: position p is plan sample p % period) the positions are
        returned modulo ``period``, and the work is bounded by it: a window wider than the plan is every
        sample once, not a set of millions of positions."""
        lo, hi = self.window()
        pinned = self.pinned_range()
        if period is None:
            return set(range(lo, hi + 1)) | set(pinned)
        if hi - lo + 1 >= period:
            return set(range(period))
        return {p % period for p in range(lo, hi + 1)} | {p % period for p in pinned}

    def retain_bound(self) -> int:
        """Upper bound on this consumer's retained artifacts: window size plus pinned positions."""
        return self.window_size() + len(self.pinned_range())

    def progress_token(self) -> tuple[int, int, float]:
        """What changes on every write by this incarnation: (generation, beat counter, wall-clock heartbeat).
        Readers compare it for equality only (a legacy registration's ``beat`` is always 0; its heartbeat
        value still changes on every beat)."""
        return self.generation, self.beat, self.heartbeat

    def dead_reason(self, watch: HeartbeatWatch | None = None) -> str | None:
        """Why this running registration's consumer is provably dead (its process, same host id, is gone;
        or ``watch`` saw no heartbeat progress for its timeout), or None. One observation per call."""
        progress = watch.observe(self.consumer_id, self.progress_token()) if watch is not None else None
        return dead_reason(self.identity, progress)


_enc = msgspec.json.Encoder()


def _read_bytes(path) -> bytes:
    """The file's bytes, opened ``O_NOFOLLOW`` (a link planted in consumers/ raises UnsafePath)."""
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:
        return f.read()


def read(layout: CacheLayout, consumer_id: str) -> Registration | None:
    """The registration, or None if absent. A torn file cannot exist (atomic replace).

    Raises:
        UnsafePath: the registration file is a symbolic link (never followed).
        CacheRootError: the file is not a registration (not JSON, or fields of the wrong type): named, with
            ``artcache fsck --fix``, which moves it to ``quarantine/``."""
    path = layout.consumer_path(consumer_id)
    try:
        return msgspec.json.decode(_read_bytes(path), type=Registration)
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CacheRootError(f"registration {path} of consumer {consumer_id!r} is unreadable ({exc}); "
                             f"`artcache fsck --cache {layout.root} --fix` moves it to quarantine/ (the id then "
                             "starts afresh), or use another --id") from None


def read_all(layout: CacheLayout) -> list[Registration]:
    """All registrations (unreadable files and links are skipped; ``artcache fsck`` reports them)."""
    out = []
    for path in sorted(layout.consumers.glob("*.json")):
        try:
            out.append(msgspec.json.decode(_read_bytes(path), type=Registration))
        except (FileNotFoundError, UnsafePath, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return out


def _write(layout: CacheLayout, reg: Registration) -> None:
    atomic_write(layout.consumer_path(reg.consumer_id), [_enc.encode(reg)], layout.tmp, durable=False)


def update(layout: CacheLayout, consumer_id: str, fn: Callable[[Registration | None], Registration | None],
           timeout: float = 30.0) -> Registration | None:
    """Read-modify-write under the consumer's lock. ``fn`` returns the new value (None: no write)."""
    with cache_lock(layout.consumer_lock(consumer_id), timeout=timeout):
        new = fn(read(layout, consumer_id))
        if new is not None:
            _write(layout, new)
        return new


def register(layout: CacheLayout, reg: Registration, *,
             check: Callable[[Registration | None], None] | None = None,
             live_timeout_s: float | None = None, poll_s: float = 0.2) -> Registration:
    """(Re)register: bump the generation past any previous one, state running, heartbeat now, ``identity``
    the consumer's process (``reg.identity`` if set; else the local process ``reg.pid``, by default this
    one), ``pid`` and ``host`` its pid and host name.

    The generation bump fences any previous holder of the id: its next write raises ConsumerFenced.

    Args:
        check: called under the consumer's lock with the previous registration (or None) before
            anything is written; it raises to refuse (``--resume`` checks the recorded checkpoint).
        live_timeout_s: also refuse a previous holder whose pid cannot be checked from here (another host or
            pid namespace, or a legacy registration) while it is live: its heartbeat counter is watched on
            this process's monotonic clock for up to this many seconds; progress refuses, silence takes over.
        poll_s: period of that watch.

    Raises:
        ConfigError: the id is held by a live process (same host id: its pid is alive; otherwise: its
            heartbeat progressed while watched), or ``check`` refused.
    """
    me = reg.identity or (local_identity(reg.pid) if reg.pid and reg.pid != os.getpid() else this_process())
    watched = _watch_previous(layout, reg.consumer_id, me, live_timeout_s, poll_s) \
        if live_timeout_s is not None else None

    def fn(old: Registration | None) -> Registration:
        if old is not None and old.state == "running":
            ident = old.identity
            if ident is not None and ident.comparable():
                if not ident.same_process(me) and dead_reason(ident) is None:
                    raise ConfigError(
                        f"consumer id {reg.consumer_id!r} is already running as pid {ident.pid}; "
                        "choose another --id")
            elif live_timeout_s is not None and watched is not None and old.progress_token() != watched:
                raise _running_elsewhere(reg.consumer_id, old, "its heartbeat moved while this process waited")
        if check is not None:
            check(old)
        return msgspec.structs.replace(
            reg, generation=(old.generation + 1) if old else 1, state="running", heartbeat=time.time(),
            identity=me, pid=me.pid, host=me.hostname, beat=0, fenced_from=-1, reason="")

    return update(layout, reg.consumer_id, fn)


def _running_elsewhere(consumer_id: str, old: Registration, why: str) -> ConfigError:
    where = old.identity.describe() if old.identity else f"pid {old.pid} on {old.host or 'another host'}"
    return ConfigError(f"consumer id {consumer_id!r} is running as {where} ({why}); stop it first or choose "
                       "another --id")


def _watch_previous(layout: CacheLayout, consumer_id: str, me: ProcessIdentity, timeout_s: float,
                    poll_s: float) -> tuple | None:
    """Outside the lock (the previous holder's heartbeat needs it): for a running previous registration
    whose pid cannot be checked from here, watch its progress token until it changes (ConfigError: it is
    live) or ``timeout_s`` passes on this process's monotonic clock. Returns the silent token, or None
    when there was nothing to watch."""
    old = read(layout, consumer_id)
    if old is None or old.state != "running" or (old.identity is not None and old.identity.comparable()):
        return None
    token = old.progress_token()
    t0 = time.monotonic()
    log.info("consumer id %r is registered running as %s, whose pid cannot be checked from here: watching its "
             "heartbeat for up to %.0fs", consumer_id, old.identity.describe() if old.identity else
             f"pid {old.pid} on {old.host!r}", timeout_s)
    while time.monotonic() - t0 <= timeout_s:
        time.sleep(poll_s)
        cur = read(layout, consumer_id)
        if cur is None or cur.state != "running":
            return None
        if cur.progress_token() != token:
            raise _running_elsewhere(consumer_id, cur, "its heartbeat is progressing")
    return token


#: seconds between a consumer's tries of a registration write that failed for space
SPACE_RETRY_S = 0.5


class ConsumerHandle:
    """A consumer's own view of its registration; every write checks the fence first.

    ``space_wait_s``: a write failing for space (ENOSPC, EDQUOT: :func:`artcache.fsio.is_space_error`) is
    tried again every :data:`SPACE_RETRY_S` for up to this many seconds (logged once) before its
    PublishError is raised: a momentarily full disk does not end a training run. Pass the root's heartbeat
    timeout: a consumer silent for longer is fenced as expired anyway, so waiting longer gains nothing."""

    def __init__(self, layout: CacheLayout, reg: Registration, space_wait_s: float = 30.0) -> None:
        self.layout = layout
        self.consumer_id = reg.consumer_id
        self.generation = reg.generation
        self.current = reg
        self.space_wait_s = space_wait_s

    def _update(self, fn: Callable[[Registration | None], Registration | None]) -> Registration | None:
        """:func:`update`, waiting out a full disk for up to ``space_wait_s`` (see the class docstring)."""
        deadline = time.monotonic() + self.space_wait_s
        noted = False
        while True:
            try:
                return update(self.layout, self.consumer_id, fn)
            except OSError as exc:
                if not is_space_error(exc) or time.monotonic() + SPACE_RETRY_S > deadline:
                    raise
                if not noted:
                    noted = True
                    log.warning("consumer %s: writing its registration failed (%s); trying again every %gs for up "
                                "to %.0fs (free space on %s)", self.consumer_id, exc, SPACE_RETRY_S,
                                self.space_wait_s, self.layout.root)
                time.sleep(SPACE_RETRY_S)

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
            return msgspec.structs.replace(old, heartbeat=time.time(), beat=old.beat + 1, **changes)

        self.current = self._update(fn)
        return self.current

    def heartbeat(self) -> Registration:
        return self._modify()

    def check_live(self) -> None:
        """Raise ConsumerFenced unless the registration on disk is still this incarnation's (same
        generation, state ``running``). Lock-free: registrations are replaced atomically."""
        old = read(self.layout, self.consumer_id)
        if old is None or old.generation != self.generation or old.state != "running":
            raise ConsumerFenced(
                f"consumer {self.consumer_id!r} was fenced (state {old.state if old else 'missing'}, "
                f"generation {old.generation if old else '-'} != {self.generation}); it may not acquire")

    def commit_cursor(self, cursor: int) -> Registration:
        """Commit progress after the optimizer step that consumed positions < cursor."""
        def check(old: Registration) -> None:
            # against the registration read under the lock: self.current may be another thread's stale copy
            if cursor < old.cursor:
                raise ValueError(f"cursor may not move backwards ({old.cursor} -> {cursor})")

        return self._modify(check, cursor=cursor)

    def record_checkpoint(self, cursor: int) -> Registration:
        """Record that a durable checkpoint holds the state after every position < ``cursor``.

        Raises:
            ConsumerFenced: fenced (a fenced incarnation must not move the resume point).
            ValueError: ``cursor`` is past the committed cursor.
        """
        def check(old: Registration) -> None:
            if cursor > old.cursor:
                raise ValueError(f"checkpoint cursor {cursor} is past the committed cursor {old.cursor}")

        return self._modify(check, checkpoint_cursor=cursor)

    def record_final_checkpoint(self, cursor: int) -> Registration:
        """Record the checkpoint a consumer writes as it exits, also after it was fenced.

        A fenced incarnation (the producer fenced it for silence, e.g. a ``SIGSTOP``-ed or swapped-out
        process) still holds a consistent training state. As long as no other process
        has registered the id since (the registration's ``fenced_from`` is this incarnation's generation),
        it may record its checkpoint, and commit its last optimizer step's cursor with it (positions it
        read and trained on before the fence), so ``--resume`` continues from there. The registration stays
        fenced (state, generation and heartbeat unchanged).

        Raises:
            ConsumerFenced: another incarnation registered the id since (its resume point is not ours).
            ValueError: ``cursor`` is behind the committed cursor.
        """
        def fn(old: Registration | None) -> Registration:
            if old is None:
                raise ConsumerFenced(f"consumer {self.consumer_id!r} is no longer registered")
            own = old.generation == self.generation and old.state == "running"
            fenced_own = old.state in TERMINAL and old.fenced_from == self.generation
            if not (own or fenced_own):
                raise ConsumerFenced(
                    f"consumer {self.consumer_id!r} was registered again since (generation {old.generation}, "
                    f"state {old.state}); this incarnation ({self.generation}) may not move its resume point")
            if cursor < old.cursor:
                raise ValueError(f"checkpoint cursor {cursor} is behind the committed cursor {old.cursor}")
            if own:
                return msgspec.structs.replace(old, heartbeat=time.time(), beat=old.beat + 1, cursor=cursor,
                                               checkpoint_cursor=cursor)
            return msgspec.structs.replace(old, cursor=cursor, checkpoint_cursor=cursor)

        self.current = self._update(fn)
        return self.current

    def set_demand(self, positions: list[int] | None, pinned: list[int] | None = None) -> Registration:
        """Replace the demand lists given: training ``positions`` and held-out sample indices ``pinned`` (None: that
        list is left as the registration has it, so two processes of one consumer — the trainer's evaluation and a
        reader process — each write only their own)."""
        changes = {} if positions is None else {"demand": sorted(set(positions))}
        if pinned is not None:
            changes["pinned_demand"] = sorted(set(pinned))
        return self._modify(**changes)

    def finish(self, state: State, reason: str = "") -> Registration | None:
        """Fence ourselves into a terminal state (generation bumped). No-op if already fenced."""

        def fn(old: Registration | None) -> Registration | None:
            if old is None or old.generation != self.generation:
                return None
            return msgspec.structs.replace(old, state=state, generation=old.generation + 1, demand=[],
                                           pinned_demand=[], reason=reason, heartbeat=time.time(),
                                           beat=old.beat + 1, fenced_from=old.generation)

        return self._update(fn)


def fence(layout: CacheLayout, consumer_id: str, state: State, reason: str,
          expect_generation: int | None = None, timeout: float = 30.0) -> Registration | None:
    """Fence a consumer from outside (producer): bump generation, set a terminal state.

    Raises:
        LockTimeout: the consumer's lock stayed held for ``timeout`` seconds (e.g. a paused process
            holding it); nothing was written.
    """

    def fn(old: Registration | None) -> Registration | None:
        if old is None or old.state in TERMINAL:
            return None
        if expect_generation is not None and old.generation != expect_generation:
            return None
        return msgspec.structs.replace(old, state=state, generation=old.generation + 1, demand=[],
                                       pinned_demand=[], reason=reason, fenced_from=old.generation)

    return update(layout, consumer_id, fn, timeout=timeout)
