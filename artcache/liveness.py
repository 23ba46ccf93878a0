"""Process identity and liveness that hold across hosts (and containers, and clock steps).

A process's :class:`ProcessIdentity` is (host id, pid, start time):

- ``host``: 16 hex digits of BLAKE2b over the kernel's boot id (``/proc/sys/kernel/random/boot_id``; the
  machine id, then the host name, where that is missing) and the inode of the process's pid namespace
  (``/proc/self/ns/pid``). Two processes have the same ``host`` exactly when their pids are numbers in one
  pid space: the same kernel boot and the same pid namespace. The host *name* is kept beside it for
  humans (``hostname``) and never compared: containers share it, and a container started with
  ``unshare -pf`` shares it with processes whose pids mean something else.
- ``pid``: the pid in that namespace. ``start``: the process's start time in clock ticks after boot
  (``/proc/<pid>/stat`` field 22), so a reused pid is not taken for the old process (0: unknown).

Liveness is one decision, :func:`is_alive` (:func:`dead_reason` says why not), used by consumer fencing
(producer, ``fsck``, ``register``), lease expiry, temp-file orphan cleanup and give-up markers:

1. a process of the *same host id* (:meth:`ProcessIdentity.comparable`) is dead when its pid no longer
   exists, exists with another start time (reused), or is a zombie;
2. otherwise (another host or pid namespace, or a record written before identities existed) a pid
   says nothing, and a process is dead only when its heartbeat has been *observed not to progress*
   for the timeout: a reader (:class:`HeartbeatWatch`) remembers each holder's heartbeat counter and,
   on its own ``time.monotonic()``, when it last saw it change. No two processes' clocks are ever
   compared, so clock skew between hosts and wall-clock steps (NTP) fence nobody.
3. A silent holder (no progress for the timeout) is dead in either case: a stopped (``SIGSTOP``) or
   hung process is fenced like a dead one.

Anything not proven dead is alive: every cleanup built on this errs towards keeping things.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import msgspec

#: inode of the initial pid namespace (Linux's PROC_PID_INIT_INO)
INIT_PID_NS = 0xEFFFFFFC
_TOKEN = re.compile(r"(?P<host>[0-9a-f]{16})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)")


class ProcessIdentity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who a process is, across hosts (see the module docstring).

    Attributes:
        host: host id: 16 hex digits of BLAKE2b(boot id, pid-namespace inode); equal host ids mean the
            pids are numbers in one pid space.
        pid: process id in that pid namespace.
        start: start time in clock ticks after boot (``/proc/<pid>/stat`` field 22); 0 when unknown.
        hostname: the host name when the identity was taken (for humans only; never compared).
        pid_ns: the pid namespace's inode (for humans; 0 when unknown).
    """

    host: str
    pid: int
    start: int = 0
    hostname: str = ""
    pid_ns: int = 0

    def token(self) -> str:
        """``<host>-<pid>-<start>``: a path component naming this process (temp files, leases, journals)."""
        return f"{self.host}-{self.pid}-{self.start}"

    def comparable(self) -> bool:
        """Whether this process's pid can be checked from here (same host id as the calling process)."""
        return self.host == this_process().host

    def same_process(self, other: ProcessIdentity | None) -> bool:
        """Same host id, pid and start time (names are ignored)."""
        return other is not None and (self.host, self.pid, self.start) == (other.host, other.pid, other.start)

    def describe(self) -> str:
        """``pid 1234 on hostA`` (plus ``(this host)`` when comparable)."""
        where = self.hostname or f"host {self.host}"
        return f"pid {self.pid} on {where}" + (" (this host)" if self.comparable() else "")


def from_token(token: str) -> ProcessIdentity | None:
    """The identity named by :meth:`ProcessIdentity.token` (without the human fields), or None."""
    m = _TOKEN.fullmatch(token)
    if m is None:
        return None
    return ProcessIdentity(host=m["host"], pid=int(m["pid"]), start=int(m["start"]))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (``/proc/self`` is our own pid): else pids
    read from it would be another namespace's numbers (a container without its own /proc mount)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks after boot) from /proc; None if it does not exist; 0 unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    fields = data[data.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    try:
        if fields[0] in (b"Z", b"X"):  # a zombie (or dead) process runs nothing any more
            return None
        return int(fields[19])  # field 22 of stat(5)
    except (IndexError, ValueError):
        return 0


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` of this host (``/proc/<pid>/stat`` field 4); None when it does not exist or
    ``/proc`` shows another pid namespace."""
    if not _proc_is_ours():
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rfind(b")") + 2:].split()[1])
    except (IndexError, ValueError):
        return None


_cache: dict[int, ProcessIdentity] = {}
_cache_lock = threading.Lock()


def this_process() -> ProcessIdentity:
    """This process's identity (computed once per pid: a forked child gets its own)."""
    pid = os.getpid()
    ident = _cache.get(pid)
    if ident is not None:
        return ident
    with _cache_lock:
        boot = _read("/proc/sys/kernel/random/boot_id") or _read("/etc/machine-id") or socket.gethostname()
        ns = _pid_ns_inode()
        host = hashlib.blake2b(f"{boot}\0{ns}".encode(), digest_size=8).hexdigest()
        start = (_start_time(pid) or 0) if _proc_is_ours() else 0
        ident = ProcessIdentity(host=host, pid=pid, start=start, hostname=socket.gethostname(), pid_ns=ns)
        _cache.clear()
        _cache[pid] = ident
    return ident


def local_identity(pid: int) -> ProcessIdentity:
    """The identity of process ``pid`` of this host (start time 0 if it does not exist or is unknown)."""
    me = this_process()
    start = (_start_time(pid) or 0) if _proc_is_ours() else 0
    return ProcessIdentity(host=me.host, pid=pid, start=start, hostname=me.hostname, pid_ns=me.pid_ns)


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists in this process's pid namespace (signal 0; EPERM means it does).
    Says nothing about which process it is: use :func:`is_alive` with an identity."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local_dead_reason(ident: ProcessIdentity) -> str | None:
    if not pid_exists(ident.pid):
        return f"process {ident.pid} is gone"
    if not _proc_is_ours():
        return None
    start = _start_time(ident.pid)
    if start is None:
        return f"process {ident.pid} is gone"
    if ident.start and start and start != ident.start:
        return f"process {ident.pid} is gone (its pid now belongs to another process)"
    return None


@dataclass(frozen=True)
class Progress:
    """What a reader observed of a holder's heartbeat: ``silent_s`` seconds on the reader's own monotonic
    clock since it last saw the counter change (0 when first seen), against ``timeout_s``."""

    silent_s: float
    timeout_s: float

    @property
    def silent(self) -> bool:
        return self.silent_s > self.timeout_s


def dead_reason(identity: ProcessIdentity | None, progress: Progress | None = None) -> str | None:
    """Why the holder is provably dead, or None if it may be alive (the module docstring's rules).

    Args:
        identity: the holder's identity (None: unknown, e.g. a record from before identities existed:
            never pid-checked).
        progress: what this reader observed of the holder's heartbeat (None: nothing observed, so only
            the pid rule applies).
    """
    if identity is not None and identity.comparable():
        reason = _local_dead_reason(identity)
        if reason is not None:
            return reason
    if progress is not None and progress.silent:
        return f"no heartbeat progress for {progress.silent_s:.0f}s (timeout {progress.timeout_s:g}s)"
    return None


def is_alive(identity: ProcessIdentity | None, progress: Progress | None = None) -> bool:
    """False only when the holder is provably dead (:func:`dead_reason`); True otherwise."""
    return dead_reason(identity, progress) is None


class HeartbeatWatch:
    """A reader's memory of heartbeat counters, timed on the reader's own ``time.monotonic()``.

    ``observe(key, counter)`` returns the :class:`Progress` of ``key``: seconds since ``counter`` was last
    seen to change (or since ``key`` was first seen). Any hashable value works as a counter (a
    registration's ``(beat, heartbeat)``, a file's ``(inode, size, mtime_ns)``, a constant for "age since
    first seen"). Thread-safe. Keys not observed by a :meth:`prune` call are forgotten.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._seen: dict[Hashable, tuple[Hashable, float]] = {}
        self._lock = threading.Lock()

    def observe(self, key: Hashable, counter: Hashable) -> Progress:
        now = self.clock()
        with self._lock:
            old = self._seen.get(key)
            if old is None or old[0] != counter:
                self._seen[key] = (counter, now)
                return Progress(0.0, self.timeout_s)
            return Progress(now - old[1], self.timeout_s)

    def prune(self, keep) -> None:
        """Forget every key not in ``keep`` (bounded memory over a long run)."""
        keep = set(keep)
        with self._lock:
            for k in [k for k in self._seen if k not in keep]:
                del self._seen[k]


def in_initial_pid_namespace() -> bool:
    """Whether this process runs in the host's initial pid namespace (not in a container's)."""
    return this_process().pid_ns == INIT_PID_NS


__all__ = ["HeartbeatWatch", "ProcessIdentity", "Progress", "dead_reason", "from_token", "in_initial_pid_namespace",
           "is_alive", "local_identity", "parent_pid", "pid_exists", "this_process"]
