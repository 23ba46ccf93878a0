"""Accounting journal: typed events (msgspec), one append-only JSONL file per process.

Each process writes only its own file ``journal/<role>-<id>-<writer>.jsonl`` (``<writer>``: its identity
token, unique across hosts and pid namespaces; see artcache.layout); :func:`read_events` merges all of
them. A torn line (the writer was killed mid-write) is skipped and counted. :func:`read_files` reads each
file up to its last complete line and says where it stopped, so a reader can take one consistent
snapshot and then read only what was appended since (``artcache inspect`` does).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from artcache.errors import ArtcacheError, JournalError, NotWritable
from artcache.fsio import (
    NOT_WRITABLE_ERRNOS,
    READ_ONLY_ROOT_USE,
    group_shared,
    is_retryable,
    is_space_error,
    share_mode,
)
from artcache.layout import open_nofollow

log = logging.getLogger("artcache.journal")


class Event(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True):
    """Base event. ``t`` is wall-clock seconds since the epoch (time.time())."""

    t: float = 0.0


# ---- producer events -------------------------------------------------------------------------
class ProducerStart(Event, tag="producer_start"):
    """``budget_bytes``: the disk budget it keeps the retained artifacts under (0: not recorded, a
    producer older than retention by need); ``policy``: its retention rule (``need`` or ``windows``);
    ``fill``: it captures the whole plan and exits (the root is *filled* from then on: later producers keep
    what it published); ``evict_fill``: it released a filled root's artifacts to its retention rule
    (``--evict-fill``; the root is no longer filled). See :func:`fill_recorded`. ``kept_fill``: artifacts of a
    filled root it keeps whatever its rule (beyond the window bound). ``spec``: :func:`artcache.rolespec.spec_digest`
    of the settings it ran on (its :class:`~artcache.producer.ProducerConfig`)."""

    producer: str
    pid: int
    contract_id: str
    plan_id: str
    budget_bytes: int = 0
    policy: str = ""
    fill: bool = False
    evict_fill: bool = False
    kept_fill: int = 0
    spec: str = ""


class ProducerStop(Event, tag="producer_stop"):
    producer: str
    reason: str


class CaptureBatch(Event, tag="capture_batch"):
    """One forward pass. ``start``/``end`` bound the producer's busy time (seconds since epoch): ``start`` from
    the wall clock, ``end - start`` the pass's duration on the monotonic clock (a wall-clock step between them
    does not change it)."""

    producer: str
    fps: list[str]
    samples: int
    tokens: int
    padded_tokens: int
    start: float
    end: float
    demand: int = 0


class Capture(Event, tag="capture"):
    """One fingerprint captured (before publication)."""

    producer: str
    fp: str
    positions: list[int]
    tokens: int
    recapture: bool = False
    demand: bool = False


class Publish(Event, tag="publish"):
    producer: str
    fp: str
    nbytes: int


class CaptureFailure(Event, tag="capture_failure"):
    """One failed capture attempt of ``fp``. ``stage``: ``publish`` (a journaled ``capture`` that was not
    published; ``attempts`` = writes tried) or ``forward`` (the forward pass failed: no ``capture`` line)."""

    producer: str
    fp: str
    attempts: int
    retryable: bool
    error: str
    stage: str = "publish"


class Coalesced(Event, tag="coalesced"):
    """Requests served by a capture someone else asked for too (or that another producer held)."""

    producer: str
    fp: str
    requesters: int
    reason: str = "shared"


class Evict(Event, tag="evict"):
    """``reason``: why (:data:`artcache.eviction.REASONS`: ``unneeded`` — outside every window and no
    live consumer reads it again; ``needed-later`` — needed, but later than everything the budget
    kept; ``outside-windows`` — the ``windows`` rule)."""

    producer: str
    fp: str
    nbytes: int
    reason: str = ""


class Retained(Event, tag="retained"):
    """Published artifacts after an eviction or publication, against the live window bound and the
    disk budget. ``binding``: the last decision evicted something needed or left a capture out for
    the budget; ``windows_exceed_budget``: the live windows alone held more than the budget."""

    producer: str
    artifacts: int
    nbytes: int
    window_bound: int
    budget: int = 0
    binding: bool = False
    windows_exceed_budget: bool = False


class LeaseExpire(Event, tag="lease_expire"):
    producer: str
    fp: str
    lease: str
    reason: str


class Fence(Event, tag="fence"):
    producer: str
    consumer: str
    generation: int
    state: str
    reason: str


# ---- consumer events -------------------------------------------------------------------------
class ConsumerStart(Event, tag="consumer_start"):
    """A consumer (re)started at ``cursor`` (``step`` optimizer steps already done: > 0 on --resume).
    ``pinned``: positions of its held-out evaluation split, retained besides its window.
    ``epoch_len``: training samples per epoch (0: the whole plan; :class:`artcache.plan.EpochOrder`).
    ``reader``: the identity token of its reader process (``--reader process``), whose journal
    ``reader-<consumer>-<reader>.jsonl`` holds its requests and leases; empty: a reader thread (this journal).
    ``ranks``: the consumer's world size (a torch.distributed group: rank 0 writes this event, each other rank
    journals its own requests and leases as ``reader-<consumer>-<its token>.jsonl``); ``batch_size`` is then the
    positions of one optimizer step over all ranks and micro-batches. ``rank_readers``: those ranks' identity
    tokens, ranks 1 .. ``ranks`` - 1 in order (empty: one process, or a journal written before they were recorded).
    ``spec``: :func:`artcache.rolespec.spec_digest` of the settings it was started with (its
    :class:`~artcache.trainers.consumer.ConsumerConfig` as given, before the draft's defaults are filled in)."""

    consumer: str
    pid: int
    draft: str
    block_size: int
    batch_size: int
    lookbehind: int
    lookahead: int
    cursor: int
    step: int = 0
    pinned: int = 0
    epoch_len: int = 0
    reader: str = ""
    ranks: int = 1
    spec: str = ""
    rank_readers: list[str] = []


class Request(Event, tag="request"):
    """A logical request for one position. ``hit`` = published at first look. ``sample``: the plan
    sample read (-1: not recorded); ``epoch``: the position's epoch; ``held_out``: a read of the
    held-out split (``position`` is then -1: held-out samples have no run position)."""

    consumer: str
    position: int
    fp: str
    hit: bool
    wait_s: float = 0.0
    sample: int = -1
    epoch: int = 0
    held_out: bool = False


class DemandWait(Event, tag="demand_wait"):
    """A consumer started blocking on an unpublished position (a demand miss)."""

    consumer: str
    position: int
    fp: str


class LeaseAcquire(Event, tag="lease_acquire"):
    consumer: str
    fp: str
    lease: str


class LeaseRelease(Event, tag="lease_release"):
    consumer: str
    fp: str
    lease: str


class Quarantined(Event, tag="quarantine"):
    consumer: str
    fp: str
    reason: str


class Step(Event, tag="step"):
    """One optimizer step. Metric fields are numerator/denominator sums of that step."""

    consumer: str
    step: int
    cursor: int
    loss: float | None  # None: the batch supervised nothing (no loss to report)
    tau_sum: float
    blocks: int
    acc_correct: list[int]
    acc_total: list[int]
    wait_s: float
    step_s: float
    lr: float
    epoch: int = 0


class ConsumerEnd(Event, tag="consumer_end"):
    consumer: str
    state: str
    steps: int
    cursor: int
    error: str = ""


EVENT_TYPES = (ProducerStart, ProducerStop, CaptureBatch, Capture, Publish, CaptureFailure, Coalesced,
               Evict, Retained, LeaseExpire, Fence, ConsumerStart, Request, DemandWait, LeaseAcquire,
               LeaseRelease, Quarantined, Step, ConsumerEnd)
AnyEvent = ProducerStart | ProducerStop | CaptureBatch | Capture | Publish | CaptureFailure | Coalesced \
    | Evict | Retained | LeaseExpire | Fence | ConsumerStart | Request | DemandWait | LeaseAcquire \
    | LeaseRelease | Quarantined | Step | ConsumerEnd

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


#: the most bytes of events one writer holds in memory while its filesystem is full (ENOSPC, EDQUOT); an
#: event past it raises JournalError (the process fails clearly instead of growing without bound)
HOLD_MAX_BYTES = 16 << 20
#: seconds between tries to write held events (an ``emit`` or :meth:`JournalWriter.flush_held` in between
#: only queues)
HOLD_RETRY_S = 1.0


class JournalWriter:
    """Append events to one file. Thread-safe; each event is one ``write`` of one line.

    Writes are flushed per event (``os.write`` on an O_APPEND fd), fsync-ed on :meth:`close`.
    A write failing for space (ENOSPC, EDQUOT: :func:`artcache.fsio.is_space_error`) does not raise: the
    event is *held* in memory, in order, with every later one, and written (one ``write``, the lines in
    emit order, their original ``t``) by the first try after space is back (every :data:`HOLD_RETRY_S` on
    ``emit`` or :meth:`flush_held`), at most :data:`HOLD_MAX_BYTES` of them (past it ``emit`` raises
    JournalError). While it holds events the writer keeps an exclusive ``flock`` on its file, so a reader
    can tell a gap of held lines from a lost one (:func:`holding_events`; the kernel drops the lock when
    the process dies). Events still held at :meth:`close` are lost (logged), as a kill would lose them.
    Any other failed write raises :class:`JournalError` (an OSError); lines already written stay readable.
    """

    def __init__(self, path: Path) -> None:
        """Open (create) ``path`` for appending.

        Raises:
            NotWritable: the file, its directory or the mount is not writable (EACCES, EPERM, EROFS: a
                read-only root); the message names the path. UnsafePath: ``path`` is a symbolic link.
        """
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: a link planted at this name is refused (UnsafePath), never appended through
            self._fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            if exc.errno in NOT_WRITABLE_ERRNOS and not isinstance(exc, ArtcacheError):
                raise NotWritable(f"cannot open journal {path} for writing ({os.strerror(exc.errno)}): every "
                                  "process using a cache root needs write access to its journal/ (a group-shared "
                                  f"root: the group's rw and umask 007); {READ_ONLY_ROOT_USE}",
                                  errno_=exc.errno) from exc
            raise
        if group_shared(path.parent):  # readable by the group whatever the umask
            with contextlib.suppress(OSError):
                os.fchmod(self._fd, share_mode(path.parent))
        self._lock = threading.Lock()
        self._torn = False  # a failed write left a fragment without its newline at the end
        self._held: list[bytes] = []  # lines not written for space, in emit order
        self._held_bytes = 0
        self._next_try = 0.0  # time.monotonic() of the next try to write them

    @property
    def held(self) -> int:
        """Events held in memory for a full filesystem (0: every event emitted is in the file)."""
        return len(self._held)

    def emit(self, event: Event, *, hold: bool = True) -> None:
        """Append one event as one line (or hold it, in order, while the filesystem is full).

        Args:
            hold: False: a write failing for space raises JournalError too (a process's first line: a
                process that cannot journal its start does not start).

        Raises:
            JournalError: the write failed for another reason than space (``retryable`` per errno), or
                more than :data:`HOLD_MAX_BYTES` are held. The file stays readable: a partial line is
                truncated away, or (if that fails too) terminated by the next successful write so readers
                skip it as one torn line instead of merging it with the next event.
        """
        if not event.t:
            event.t = time.time()
        line = _encoder.encode(event) + b"\n"
        with self._lock:
            if self._fd < 0:
                return
            if self._held:  # after the held lines, never before them
                if self._held_bytes + len(line) > HOLD_MAX_BYTES:
                    raise JournalError(
                        f"journal {self.path.name}: {len(self._held)} events ({self._held_bytes} B) are held in "
                        f"memory since the filesystem filled up, no room for a {type(event).__name__} event: "
                        "free space on the cache root's filesystem", retryable=False, errno_=errno.ENOSPC)
                self._held.append(line)
                self._held_bytes += len(line)
                if time.monotonic() >= self._next_try:
                    self._write_held()
                return
            try:
                self._write(line)
            except OSError as exc:
                if not (hold and is_space_error(exc)):
                    raise JournalError(f"journal {self.path.name}: writing a {type(event).__name__} event "
                                       f"failed: {exc.strerror or exc}", retryable=is_retryable(exc),
                                       errno_=exc.errno) from exc
                self._held, self._held_bytes = [line], len(line)
                self._next_try = time.monotonic() + HOLD_RETRY_S
                with contextlib.suppress(OSError):  # readers: these lines are held, not lost
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                log.warning("journal %s: %s; holding events in memory (at most %d MiB) and writing them once "
                            "space is back", self.path.name, exc.strerror or exc, HOLD_MAX_BYTES >> 20)

    def flush_held(self) -> bool:
        """Try to write the held events now (no more often than every :data:`HOLD_RETRY_S`); True when none
        is held any more. Cheap when none is: callers call it on every pass of their loop.

        Raises:
            JournalError: writing them failed for another reason than space (they stay held)."""
        with self._lock:
            if not self._held or self._fd < 0:
                return not self._held
            if time.monotonic() < self._next_try:
                return False
            return self._write_held()

    def _write_held(self) -> bool:
        """Under the lock: write every held line in one write; True if written (False: still no space)."""
        try:
            self._write(b"".join(self._held))
        except OSError as exc:
            self._next_try = time.monotonic() + HOLD_RETRY_S
            if is_space_error(exc):
                return False
            raise JournalError(f"journal {self.path.name}: writing {len(self._held)} held events failed: "
                               f"{exc.strerror or exc}", retryable=is_retryable(exc), errno_=exc.errno) from exc
        log.info("journal %s: space is back, wrote the %d event(s) held in memory", self.path.name, len(self._held))
        self._held, self._held_bytes = [], 0
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def _write(self, line: bytes) -> None:
        """Under the lock: append ``line`` (whole lines) or raise OSError with the file as before the call
        (a partial write cut back; if that fails, the fragment is terminated by the next write)."""
        data = (b"\n" + line) if self._torn else line
        view = memoryview(data)
        start = None
        try:
            start = os.fstat(self._fd).st_size
            while view:  # a short write (e.g. the disk filled up) must not leave half a line
                view = view[os.write(self._fd, view):]
            self._torn = False
        except OSError:
            if start is not None:  # else nothing was written (fstat failed first)
                # part of the line may have reached the file (a short write, then the error):
                # cut it back; if that fails, the next write terminates the fragment first
                was_torn, self._torn = self._torn, True
                with contextlib.suppress(OSError):
                    if os.fstat(self._fd).st_size != start:
                        os.ftruncate(self._fd, start)
                    if os.fstat(self._fd).st_size == start:  # as before this call
                        self._torn = was_torn
            raise

    def close(self, *, remove_if_empty: bool = False) -> None:
        """Write what is held (one last try), fsync and close. ``remove_if_empty``: also unlink the file if
        nothing was ever written to it (a refused start must not leave an empty journal behind)."""
        with self._lock:
            if self._fd >= 0:
                if self._held:
                    with contextlib.suppress(JournalError):
                        self._write_held()
                    if self._held:
                        log.error("journal %s: %d event(s) held in memory for a full filesystem are lost (no "
                                  "space for them at exit); `artcache inspect` counts this process as killed",
                                  self.path.name, len(self._held))
                empty = False
                with contextlib.suppress(OSError):
                    empty = os.fstat(self._fd).st_size == 0
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
                if remove_if_empty and empty:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def holding_events(path: Path) -> bool:
    """Whether a live writer holds events of journal ``path`` in memory for a full filesystem (its exclusive
    ``flock``, :class:`JournalWriter`): the file then lacks lines that will follow, not lost ones."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops our shared lock too
    return False


class JournalReadResult(msgspec.Struct):
    """What :func:`read_events` read: every event (time order), the number of files, the torn lines skipped,
    and ``corrupt``: (file, line number from 1) of each damaged line (:func:`_scan`), also skipped."""

    events: list
    files: int
    torn_lines: int
    corrupt: list[tuple[Path, int]] = []


def _decode(line: bytes) -> Event:
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError:
        # msgspec writes non-finite floats (a diverged step's NaN loss) as null: read them back as NaN
        raw = msgspec.json.decode(line)
        if not isinstance(raw, dict) or None not in raw.values():
            raise
        return msgspec.convert({k: math.nan if v is None else v for k, v in raw.items()}, AnyEvent)


def iter_file(path: Path) -> Iterator[Event | None]:
    """Yield events of one journal file; ``None`` for an undecodable (torn) line."""
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield _decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                yield None


def _scan(lines: list[bytes]) -> tuple[list, int, list[int]]:
    """Decode one journal file's ``lines``: (events, torn lines, line numbers from 1 of damaged lines).

    A line that does not decode is *torn* when it is the last line (a writer killed mid-line can only leave
    its last line short: each process appends to its own file) or a cut-off event (``Input data was
    truncated``: a failed write's fragment that :class:`JournalWriter` terminated before its next line).
    Any other undecodable line with complete lines after it is *damaged*: nothing artcache writes leaves one
    (an edit or disk corruption), and the events it held are lost to the accounting."""
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    events, torn, damaged = [], 0, []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(_decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if i == last or "truncated" in str(exc):
                torn += 1
            else:
                damaged.append(i + 1)
    return events, torn, damaged


class JournalFile(msgspec.Struct):
    """One journal file as read by :func:`read_files`: its events (torn and damaged lines skipped, torn ones
    counted), ``end``: the byte offset after its last complete line (an incomplete last line is left for
    later), and ``corrupt``: line numbers of damaged lines (:func:`_scan`), counted from where this read began
    (from 1 when the file was read whole)."""

    path: Path
    events: list
    torn_lines: int
    end: int
    corrupt: list[int] = []


def read_files(journal_dir: Path, since: dict[str, int] | None = None) -> list[JournalFile]:
    """Every journal file, each read from ``since[name]`` (default 0) up to its last complete line.

    An incomplete last line (being written right now, or left by a writer killed mid-line) is not read:
    it is left for a later call (``end`` stops before it). Files are in name order."""
    out = []
    files = sorted(journal_dir.glob("*.jsonl")) if journal_dir.is_dir() else []
    for path in files:
        start = (since or {}).get(path.name, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            continue
        cut = data.rfind(b"\n") + 1
        events, torn, corrupt = _scan(data[:cut].splitlines())
        out.append(JournalFile(path=path, events=events, torn_lines=torn, end=start + cut, corrupt=corrupt))
    return out


def fill_recorded(events) -> bool:
    """Whether a root whose journal events (in time order) are ``events`` is *filled*: the latest producer start
    that either filled the root (``fill``) or released its fill (``evict_fill``) filled it. A producer on a
    filled root keeps every artifact published when it starts, whatever its retention rule, unless
    ``--evict-fill`` (:class:`artcache.producer.Producer`)."""
    filled = False
    for ev in events:
        if isinstance(ev, ProducerStart) and (ev.fill or ev.evict_fill):
            filled = ev.fill and not ev.evict_fill
    return filled


def read_events(journal_dir: Path) -> JournalReadResult:
    """All events of all journal files, sorted by time."""
    events: list = []
    torn = 0
    corrupt: list[tuple[Path, int]] = []
    files = sorted(journal_dir.glob("*.jsonl")) if journal_dir.is_dir() else []
    for path in files:
        with open(path, "rb") as f:
            got, n, bad = _scan(f.read().splitlines())
        events += got
        torn += n
        corrupt += [(path, line) for line in bad]
    events.sort(key=lambda e: e.t)
    return JournalReadResult(events=events, files=len(files), torn_lines=torn, corrupt=corrupt)
