"""The on-disk layout of one cache root, and the only place paths are built.

::

    ROOT/
      artcache.json                      settings every process must agree on (RootSettings)
      plans/<plan_id>/                   the plan (tokens, loss masks, provenance)
      objects/<ab>/<fp>.safetensors      published artifacts
      locks/                             lock files: created once, never deleted
      tmp/                               partial writes: <writer>.<nonce>.<suffix>
      consumers/<id>.json                registrations
      leases/<fp>~<consumer>~<holder>~<nonce>   one file per held lease
      journal/<role>-<id>-<writer>.jsonl accounting events, one writer per file

``<writer>`` and ``<holder>`` are the writing process's identity token ``<host id>-<pid>-<start time>``
(:mod:`artcache.liveness`): unique among every process sharing the root, on any host or pid namespace, and
what orphan cleanup and lease expiry judge liveness by. Names written before identity tokens existed
(``<hostname>.<pid>.<nonce>.<suffix>``, ``<fp>~<consumer>~<hostname>~<pid>~<nonce>``,
``<role>-<id>-<pid>.jsonl``) are still read; their pids are never checked (see :func:`parse_temp_name`).
      quarantine/                        artifacts that failed their content check
      failed/<fp>.json                   fingerprints the producer gave up on (error, attempts)

Path components are built only from hex digests and validated ids (``[A-Za-z0-9_.-]``, 1–64
characters, not starting with a dot); nothing from data or config is used unchecked.

Security: directories a producer creates are mode 0700 (private to its user), or 2770 (group
read/write, setgid so new files keep the root's group) when the root is created group-shared
(``artcache producer --group-shared``). Symbolic links planted *inside* a root are never followed: the
subdirectories are checked with ``lstat`` whenever a root is opened, shard directories before each
artifact read or publication, and files are opened with ``O_NOFOLLOW`` (a link raises
:class:`~artcache.errors.UnsafePath`). The root path itself may be reached through a link.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from artcache.errors import CacheRootError, ConfigError, UnsafePath
from artcache.liveness import ProcessIdentity, dead_reason, from_token, this_process

_HEX = re.compile(r"^[0-9a-f]{16,128}$")
_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
SETTINGS_FILE = "artcache.json"
SUBDIRS = ("plans", "objects", "locks", "tmp", "consumers", "leases", "journal", "quarantine", "failed")
#: Mode of the directories a producer creates: private by default, group-shared (setgid) on request.
PRIVATE_DIR_MODE = 0o700
GROUP_DIR_MODE = 0o2770
#: O_NOFOLLOW where the platform has it (Linux, macOS): opening a symbolic link then fails with ELOOP.
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def check_real_dir(path: Path) -> None:
    """Raise UnsafePath unless ``path`` is a directory and not a symbolic link (``lstat``, never follows).

    A missing ``path`` raises FileNotFoundError."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link inside the cache root; artcache never follows links "
                         "planted in a root (remove it, e.g. with `artcache fsck --fix`)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory")


def dir_mode_in(parent: Path) -> int | None:
    """The mode of a directory artcache creates in ``parent``: :data:`GROUP_DIR_MODE` (2770) when ``parent`` is
    group-shared (setgid with group read/write/search, as ``--group-shared`` makes a cache root's directories),
    :data:`PRIVATE_DIR_MODE` (0700) when ``parent`` gives its group and others nothing (a private cache root's
    directories), else None: the umask's default (a directory of the user's own, e.g. a checkpoint directory).

    Raises OSError as ``os.stat(parent)`` does."""
    mode = stat.S_IMODE(os.stat(parent).st_mode)
    if mode & 0o2070 == 0o2070:
        return GROUP_DIR_MODE
    if mode & 0o077 == 0:
        return PRIVATE_DIR_MODE
    return None


def make_dir(path: Path, exist_ok: bool = False) -> bool:
    """Create directory ``path`` (its parent must exist) with :func:`dir_mode_in` of its parent, set explicitly
    whatever the umask, so every directory under a cache root is 0700, or 2770 in a group-shared one. Returns
    whether this call created it (False: it existed and ``exist_ok``; its mode is left as it is).

    Raises FileExistsError (unless ``exist_ok``) and other OSErrors as ``mkdir`` and ``chmod`` do."""
    mode = dir_mode_in(path.parent)
    try:
        path.mkdir(mode=0o700 if mode is not None else 0o777)
    except FileExistsError:
        if not exist_ok:
            raise
        return False
    if mode is not None:
        os.chmod(path, mode)
    return True


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``; a symbolic link raises UnsafePath instead of
    being followed. Other OSErrors (FileNotFoundError, FileExistsError, ...) propagate unchanged."""
    try:
        return os.open(path, flags | O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link inside the cache root; artcache never follows "
                             "links planted in a root (remove it, e.g. with `artcache fsck --fix`)") from exc
        raise


def check_fingerprint(fp: str) -> str:
    """Return ``fp`` if it is a lower-case hex digest (16–128 chars); raise ConfigError otherwise."""
    if not isinstance(fp, str) or not _HEX.fullmatch(fp):  # fullmatch: "$" would accept a trailing newline
        raise ConfigError(f"invalid fingerprint {fp!r}: expected 16-128 lower-case hex digits")
    return fp


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a safe path component; raise ConfigError naming it otherwise.

    Accepted: 1–64 characters of ``A-Z a-z 0-9 _ . -``, not starting with ``.`` or ``-``.
    """
    if not isinstance(value, str) or not _ID.fullmatch(value) or "~" in value:
        raise ConfigError(
            f"invalid {what} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "(not starting with '.' or '-')")
    return value


def host_id() -> str:
    """This process's host id (16 hex digits: boot id and pid namespace; see :mod:`artcache.liveness`)."""
    return this_process().host


def unique_suffix() -> str:
    """``<writer token>.<nonce>``: unique among all writers sharing a filesystem, on any host."""
    return f"{this_process().token()}.{secrets.token_hex(6)}"


_TEMP = re.compile(r"(?P<token>[0-9a-f]{16}-[0-9]+-[0-9]+)\.[0-9a-f]+(?:\..+)?")
_LEGACY_TEMP = re.compile(r"(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>[0-9]+)\.[0-9a-f]+\.[A-Za-z0-9_]+")
_JOURNAL = re.compile(r"(?P<role>[A-Za-z0-9_]+)-(?P<ident>.+?)-(?:(?P<token>[0-9a-f]{16}-[0-9]+-[0-9]+)|"
                      r"(?P<pid>[0-9]+))\.jsonl")


@dataclass(frozen=True)
class WriterName:
    """The writer a file name records: its identity (None for a pre-identity ``legacy`` name, whose pid
    cannot be checked: any host could have written it) and, for legacy names, the recorded host name/pid."""

    identity: ProcessIdentity | None
    legacy_host: str = ""
    legacy_pid: int = 0


def parse_temp_name(name: str) -> WriterName | None:
    """The writer of a temp file or temp directory name made from :func:`unique_suffix` (``tmp/`` files,
    plan and checkpoint temp directories), or None if ``name`` is not one artcache makes.

    Migration rule: a legacy ``<hostname>.<pid>.<nonce>.<suffix>`` name parses with ``identity=None``; its
    pid is never checked (a host name cannot tell pid namespaces apart), so it is an orphan only when
    observed unchanged for the orphan timeout (see ``Producer.cleanup_orphans``)."""
    m = _TEMP.fullmatch(name)
    if m is not None:
        return WriterName(from_token(m["token"]))
    m = _LEGACY_TEMP.fullmatch(name)
    if m is not None:
        return WriterName(None, m["host"], int(m["pid"]))
    return None


@dataclass(frozen=True)
class TempWriter:
    """What :func:`temp_writer` found out about the writer of a temp name.

    ``state``: ``"foreign"`` (not a name artcache makes: never touched), ``"unknown"`` (another host or pid
    namespace, or a legacy name: its pid cannot be checked from here), ``"live"`` (a process of this host
    that may still be writing it) or ``"dead"`` (its writer on this host is provably gone: an orphan).
    ``writer``: the parsed name (None when foreign); ``reason``: why the writer is gone (``"dead"`` only).
    """

    state: Literal["foreign", "unknown", "live", "dead"]
    writer: WriterName | None = None
    reason: str = ""

    @property
    def orphan(self) -> bool:
        """Whether the temp is a dead writer's, safe for anyone to remove."""
        return self.state == "dead"


def temp_writer(name: str) -> TempWriter:
    """The one test whether a temp file or directory name made from :func:`unique_suffix` (the part after
    any fixed prefix, as :func:`parse_temp_name` takes it) is an orphan of a dead writer.

    A dead writer is only ever one of this host and pid namespace whose pid is gone or reused
    (:func:`artcache.liveness.dead_reason`); a live writer's temp is never an orphan. Asked through
    :func:`artcache.fsio.scan_temps` only: by the one sweep (:func:`artcache.fsio.remove_orphan_parts`: the
    producer's ``tmp/`` sweep, which judges ``"unknown"`` ones by a heartbeat watch, the consumer's checkpoint temp
    sweep, an export's) and by ``fsck`` (``tmp/`` files and plan temp directories).
    """
    writer = parse_temp_name(name)
    if writer is None:
        return TempWriter("foreign")
    ident = writer.identity
    if ident is None or not ident.comparable():
        return TempWriter("unknown", writer)
    why = dead_reason(ident)
    return TempWriter("live", writer) if why is None else TempWriter("dead", writer, why)


def parse_journal_name(name: str) -> tuple[str, str, WriterName] | None:
    """``(role, id, writer)`` of a journal file name (``<role>-<id>-<token>.jsonl``, or the legacy
    ``<role>-<id>-<pid>.jsonl`` with ``identity=None``), or None."""
    m = _JOURNAL.fullmatch(name)
    if m is None:
        return None
    writer = WriterName(from_token(m["token"])) if m["token"] else WriterName(None, "", int(m["pid"]))
    return m["role"], m["ident"], writer


@dataclass(frozen=True)
class CacheLayout:
    """Paths inside one cache root. Constructing it touches nothing on disk."""

    root: Path

    @property
    def settings(self) -> Path:
        return self.root / SETTINGS_FILE

    def sub(self, name: str) -> Path:
        return self.root / name

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    @property
    def consumers(self) -> Path:
        return self.root / "consumers"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def failure_path(self, fp: str) -> Path:
        """``failed/<fp>.json``: the producer gave up on ``fp``; a consumer waiting on it stops."""
        return self.root / "failed" / f"{check_fingerprint(fp)}.json"

    def object_path(self, fp: str) -> Path:
        check_fingerprint(fp)
        return self.objects / fp[:2] / f"{fp}.safetensors"

    def lock_path(self, name: str) -> Path:
        return self.locks / f"{check_id(name, 'lock name')}.lock"

    def fingerprint_lock(self, fp: str, stripes: int = 4096) -> Path:
        """The striped capture lock for ``fp``: ``locks/fp-<stripe>.lock`` (bounded file count)."""
        check_fingerprint(fp)
        return self.locks / f"fp-{int(fp[:8], 16) % stripes:04x}.lock"

    def consumer_path(self, consumer_id: str) -> Path:
        return self.consumers / f"{check_id(consumer_id, 'consumer id')}.json"

    def consumer_lock(self, consumer_id: str) -> Path:
        return self.locks / f"consumer-{check_id(consumer_id, 'consumer id')}.lock"

    def journal_path(self, role: str, ident: str) -> Path:
        check_id(role, "role")
        check_id(ident, "journal id")
        return self.journal / f"{role}-{ident}-{this_process().token()}.jsonl"

    def journal_of(self, role: str, ident: str, pid: int) -> Path | None:
        """The journal file written by process ``pid`` of this host as ``role``/``ident`` (the newest, if that
        pid wrote several), or None."""
        found = []
        me = this_process().host
        for path in self.journal.glob(f"{check_id(role, 'role')}-{check_id(ident, 'journal id')}-*.jsonl"):
            parsed = parse_journal_name(path.name)
            if parsed is None or parsed[0] != role or parsed[1] != ident:
                continue
            w = parsed[2]
            if (w.identity is not None and w.identity.host == me and w.identity.pid == pid) or w.legacy_pid == pid:
                found.append(path)
        return max(found, key=lambda p: p.stat().st_mtime, default=None)

    def tmp_path(self, suffix: str) -> Path:
        return self.tmp / f"{unique_suffix()}.{suffix}"

    def plan_dir(self, plan_id: str) -> Path:
        return self.plans / check_fingerprint(plan_id)

    def create(self, group_shared: bool = False) -> list[Path]:
        """Create the root (and missing parents) and its subdirectories, idempotently.

        The root (if this call creates it) and every subdirectory this call creates get mode 0700,
        or 2770 with ``group_shared`` (set explicitly, whatever the umask); missing parents of the root
        get the umask's default. Existing directories keep their mode.

        Returns the directories this call created, outermost first, so a caller that fails later
        can remove exactly those and leave nothing behind.

        Raises:
            UnsafePath: a subdirectory is a symbolic link or not a directory (what this call had created
                is removed first).
        """
        mode = GROUP_DIR_MODE if group_shared else PRIVATE_DIR_MODE
        missing = []
        p = self.root
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        missing.reverse()
        made_root = bool(missing) and missing[-1] == self.root
        self.root.mkdir(parents=True, exist_ok=True)
        if made_root:
            os.chmod(self.root, mode)
        try:
            for name in SUBDIRS:
                d = self.root / name
                if not os.path.lexists(d):
                    try:
                        d.mkdir(mode=0o700)
                        os.chmod(d, mode)
                        missing.append(d)
                    except FileExistsError:  # another process made it meanwhile
                        pass
                check_real_dir(d)
        except BaseException:  # a failed create leaves nothing of its own behind either
            for path in reversed(missing):
                shutil.rmtree(path, ignore_errors=True)
            raise
        return missing

    def require(self) -> None:
        """Raise CacheRootError unless the root exists and has been initialised by a producer."""
        if self.root.exists() and not self.root.is_dir():
            raise CacheRootError(f"cache root {str(self.root)!r} is a file, not a directory: give the directory "
                                 "`artcache producer --cache` created")
        if not self.root.is_dir():
            raise CacheRootError(
                f"cache root {str(self.root)!r} does not exist; start `artcache producer --cache "
                f"{self.root}` first (it creates and initialises the root)")
        if not self.settings.is_file():
            raise CacheRootError(
                f"cache root {str(self.root)!r} has no {SETTINGS_FILE}: it was not initialised by "
                "`artcache producer`")
        for name in SUBDIRS:
            try:
                check_real_dir(self.root / name)
            except FileNotFoundError:
                raise CacheRootError(f"cache root {str(self.root)!r} is missing {name}/") from None
