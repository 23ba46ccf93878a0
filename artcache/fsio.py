"""Durable file primitives: unique temp file, fsync, atomic rename, directory fsync; file modes.

The pattern follows huggingface_hub's download (unique temp name per writer, then rename): a
reader sees either nothing or a complete file, on every POSIX filesystem, whether or not locks work.

Once the rename has happened the file *is* published (readers see it): nothing after it withdraws it.
A failing directory fsync after the rename is retried with backoff and then logged: the file stays, and
a crash before the filesystem syncs the directory can only lose it, which readers see as a miss
(triton #11512: an EBUSY from that fsync used to unlink a finished artifact).

File modes: files artcache writes get ``0o644 & ~umask``, plus the group's read bit in a group-shared
directory (setgid: ``artcache producer --group-shared``), whatever the umask or the writing library
(safetensors creates 0600 files) would give (:func:`share_mode`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import re
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from artcache.crashpoints import crash_point
from artcache.errors import PublishError
from artcache.layout import make_dir, open_nofollow, temp_writer, unique_suffix
from artcache.liveness import HeartbeatWatch

log = logging.getLogger("artcache.fsio")

#: errno values after which retrying the same operation can succeed: transient I/O errors, and ESTALE (an
#: NFS file handle gone stale; the path names the current file again). A read failing so is a miss that
#: recaptures (artcache.client), an eviction failing so is retried on the next pass (artcache.eviction).
RETRYABLE_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE})
#: errno values of a full disk or quota: not retryable at once, but the same write succeeds once space is
#: freed (a producer withdraws such give-ups, a journal holds such events, a registration write waits)
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: errno values with which opening a file for writing says it (or its directory, or the mount) is not writable:
#: :class:`~artcache.errors.NotWritable` (lock files, journals)
NOT_WRITABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: what such a refusal says a root that cannot be written still allows (both commands only read without --fix)
READ_ONLY_ROOT_USE = "a read-only root can only be read, with `artcache inspect` or `artcache fsck` (without --fix)"
#: delays (seconds) between the tries of a directory fsync after a rename
DIR_FSYNC_BACKOFF = (0.05, 0.25, 1.0)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or unlink inside it is durable. Errors propagate as OSError."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to the device now, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the device works while the caller
    writes the next chunk and the closing fsync waits only for the tail. A hint: it makes nothing
    durable (the fsync does), a failure is ignored (the fsync reports real I/O errors), and it is a
    no-op (False) where the call does not exist. On tmpfs it returns at once."""
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def errno_of(exc: BaseException) -> int | None:
    """The errno of an OSError, or the ``os error N`` a ``safetensors.SafetensorError``'s message carries
    (safetensors raises its own error type for a failed write); None when neither says."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    m = re.search(r"os error (\d+)", str(exc))
    return int(m.group(1)) if m else None


def describe_errno(code: int | None, exc: BaseException) -> str:
    """``"ENOSPC: No space left on device"`` for ``code``, else the exception's type and text."""
    if code:
        return f"{errno.errorcode.get(code, 'errno ' + str(code))}: {os.strerror(code)}"
    return f"{type(exc).__name__}: {exc}"


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is an OSError whose errno is in :data:`RETRYABLE_ERRNOS`."""
    return isinstance(exc, OSError) and exc.errno in RETRYABLE_ERRNOS


def is_space_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an OSError (a PublishError, JournalError, ...) for a full disk or quota
    (:data:`SPACE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS


_umask_lock = threading.Lock()


def current_umask() -> int:
    """This process's umask (from /proc/self/status on Linux; else set-and-restore under a lock)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def group_shared(directory: Path) -> bool:
    """Whether ``directory`` is group-shared: setgid with group read/write/search (``--group-shared``)."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_ISGID) and mode & 0o070 == 0o070


def share_mode(directory: Path, base: int = 0o644) -> int:
    """The mode of a file artcache creates in ``directory``: ``base & ~umask``, plus group read when
    ``directory`` is group-shared (:func:`group_shared`)."""
    mode = base & ~current_umask() & 0o777
    return mode | 0o040 if group_shared(directory) else mode


def apply_share_mode(*paths: Path) -> None:
    """chmod each file to :func:`share_mode` of its directory (for files a library created, e.g.
    safetensors' 0600 ones). Raises OSError as chmod does."""
    for path in paths:
        os.chmod(path, share_mode(Path(path).parent))


def space_reserve(fs_bytes: int) -> int:
    """Bytes never to fill on a filesystem of ``fs_bytes``: 64 MiB or 5 % of it, whichever is smaller (so
    a small filesystem can still be used, and a large one is never filled to the last block)."""
    return min(64 << 20, fs_bytes // 20)


def free_space(path: Path) -> tuple[int, int, Path]:
    """(free bytes an unprivileged writer may use, the filesystem's size in bytes, the directory measured)
    for ``path``, or for its nearest existing ancestor when it does not exist yet (a run directory
    made later lands on that filesystem). Raises OSError when nothing on the path can be measured."""
    at = Path(path).absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    st = os.statvfs(at)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, at


def unwritable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be a directory this process writes into, or None when it can: ``path`` itself, or where
    it would be created (its nearest existing ancestor), must be a directory (a link to one counts) writable and
    searchable by this process. Nothing is created or opened. The reason reads after the path: ``"is a regular
    file"``, ``"is not writable"``, ``"cannot be created: /x is a regular file"``..."""
    path = Path(path)
    at = path
    while not os.path.lexists(at) and at != at.parent:
        at = at.parent
    where = "" if at == path else f"cannot be created: {at} "
    if not at.is_dir():
        kind = ("a dangling symbolic link" if at.is_symlink() and not at.exists() else "a regular file"
                if at.is_file() else "not a directory")
        return f"{where}is {kind}"
    if not os.access(at, os.W_OK | os.X_OK):
        return f"{where}is not writable"
    return None


def check_free_space(directory: Path, nbytes: int, reserve: int | None = None) -> None:
    """Raise PublishError(ENOSPC, not retryable) if ``directory`` has < nbytes + reserve free bytes.

    The default reserve is :func:`space_reserve` of the filesystem."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if reserve is None:
        reserve = space_reserve(st.f_blocks * st.f_frsize)
    if free < nbytes + reserve:
        raise PublishError(
            f"not enough free space in {directory}: {free} B free, need {nbytes} B plus a "
            f"{reserve} B reserve", retryable=False, errno_=errno.ENOSPC)


#: the suffix of :func:`atomic_write`'s temp files (``<writer token>.<nonce>.part``)
PART_SUFFIX = ".part"


def scan_temps(directory: Path, *, prefix: str | re.Pattern = "", suffix: str = PART_SUFFIX) -> list[tuple]:
    """The temps in ``directory``: each entry named ``<prefix><name>`` with ``<name>`` ending in ``suffix``, as
    ``(os.DirEntry, artcache.layout.temp_writer(<name>))`` (the verdict on its writer: live, orphan, unknown,
    foreign). ``prefix``: a string, or a compiled pattern matched at the name's start (a plan's temp directory,
    ``.tmp-<plan id[:12]>-``). An unreadable ``directory`` has none. The one reading of temp names in a directory:
    the sweep (:func:`remove_orphan_parts`) and ``artcache fsck``'s report use it."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    out = []
    for entry in entries:
        name = entry.name
        if isinstance(prefix, str):
            rest = name[len(prefix):] if name.startswith(prefix) else None
        else:
            m = prefix.match(name)
            rest = name[m.end():] if m is not None else None
        if rest is not None and name.endswith(suffix):
            out.append((entry, temp_writer(rest)))
    return out


def remove_orphan_parts(directory: Path, *, prefix: str = "", suffix: str = PART_SUFFIX,
                        watch: HeartbeatWatch | None = None, dirs: bool = False,
                        freed: list[int] | None = None) -> int:
    """The one sweep of temps dead writers left in ``directory`` (kill -9, power loss: nothing else removes
    them); returns how many were removed.

    By default: the temp files :func:`atomic_write` leaves (``<writer token>.<nonce>.part``). A temp is an entry
    named ``<prefix><name>`` where ``<name>`` ends with ``suffix`` and is one :func:`artcache.layout.temp_writer`
    parses; it is removed only when its writer is provably dead (a process of this host and pid namespace that is
    gone). A live writer's is never removed. Another host's or pid namespace's, or a legacy name (``"unknown"``:
    its pid cannot be checked from here) is removed only with a ``watch`` (the producer's ``tmp/`` sweep), once
    the watch has seen it unchanged (inode, size, mtime) for its timeout; every name not observed in this pass
    is then pruned from the watch. Regular files are unlinked; a directory (``dirs=True``: an export's temp
    directory) is removed whole; a symbolic link or any other name is left alone.

    ``freed``, when given, gets the bytes each removed entry held appended (a directory's files summed).

    Best effort: an unreadable ``directory`` or an entry that cannot be removed is skipped, never raised."""
    removed = 0
    seen = []
    for entry, verdict in scan_temps(directory, prefix=prefix, suffix=suffix):
        name = entry.name
        try:
            if entry.is_symlink() or not (entry.is_file() or (dirs and entry.is_dir())):
                continue
            if verdict.state == "unknown" and watch is not None:
                st = entry.stat(follow_symlinks=False)
                seen.append(name)
                orphan = watch.observe(name, (st.st_ino, st.st_size, st.st_mtime_ns)).silent
            else:
                orphan = verdict.orphan
            if not orphan:
                continue
            if entry.is_dir(follow_symlinks=False):
                size = sum(f.stat().st_size for f in Path(entry.path).rglob("*") if f.is_file() and not f.is_symlink())
                shutil.rmtree(entry.path)
            else:
                size = entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
            removed += 1
            if freed is not None:
                freed.append(size)
        except OSError:
            continue
    if watch is not None:
        watch.prune(seen)
    if removed:
        log.info("removed %d temp(s) of dead writers in %s", removed, directory)
    return removed


def atomic_write(dest: Path, chunks: Iterable[bytes | memoryview] | Callable[[int], int], tmp_dir: Path, *,
                 durable: bool = True, fingerprint: str | None = None, replace: bool = True) -> int:
    """Write ``chunks`` to ``dest`` atomically; return the number of bytes written.

    ``chunks`` is an iterable of byte chunks written in order, or a writer ``f(fd) -> bytes written``
    that writes the content into the open temp file itself (``artcache.store`` streams artifacts this
    way: positioned writes, hashing beside them, the header last); it may raise only OSError.

    Writes to ``tmp_dir/<writer>.<nonce>.part`` (same filesystem as ``dest``; created
    ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode :func:`share_mode`), fsyncs it, ``os.replace``-s it onto ``dest``
    and fsyncs ``dest``'s directory (when ``durable``). After the rename nothing raises: a failing
    directory fsync is retried (:data:`DIR_FSYNC_BACKOFF`) and then logged, never undone.

    A temp file beside its destination (``tmp_dir`` is ``dest``'s directory: a report, config or checkpoint
    file in the user's directory) is one a kill -9 would leave among the user's files, so such a write first
    removes the ones dead writers left there (:func:`remove_orphan_parts`). A cache root's ``tmp/`` is swept
    by the producer and ``fsck`` instead.

    ``replace=False`` never replaces an existing ``dest`` (a no-clobber ``os.link`` of the temp file; on a
    filesystem without hard links, a check then the rename): an existing one raises PublishError with
    ``errno == EEXIST``.

    Raises:
        PublishError: on any OSError before the rename; the temp file has been removed and ``dest`` is
            untouched. ``retryable`` says whether the same call may succeed later. The message names ``dest``'s
            full path (on a full disk: which filesystem to free space on; the temp file is on the same one).
    """
    if Path(tmp_dir).absolute() == Path(dest).absolute().parent:
        remove_orphan_parts(tmp_dir)
    tmp = tmp_dir / f"{unique_suffix()}{PART_SUFFIX}"
    written = 0
    try:
        # O_EXCL: never an existing name (nor a planted link: O_EXCL does not follow); O_NOFOLLOW besides
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if group_shared(tmp_dir):
                os.fchmod(fd, share_mode(tmp_dir))
            if callable(chunks):
                written = chunks(fd)
            else:
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    while view:
                        n = os.write(fd, view)
                        written += n
                        view = view[n:]
            if fingerprint is not None:  # crash points only on artifact publication
                crash_point("publish.after-write")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if fingerprint is not None:
            crash_point("publish.after-fsync")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if replace:
            os.replace(tmp, dest)
        else:
            _link_no_clobber(tmp, dest)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise PublishError(
            f"writing {dest.absolute()} failed: {exc.strerror or exc}", fingerprint=fingerprint,
            retryable=is_retryable(exc), errno_=exc.errno) from exc
    # published: from here on nothing withdraws it
    if fingerprint is not None:
        crash_point("publish.after-rename")
    if durable:
        fsync_dir_after_rename(dest)
    return written


#: what :func:`publish_dir` does with a ``final`` that already exists
EXISTING = ("keep", "replace", "aside")


@contextlib.contextmanager
def publish_dir(final: Path, *, existing: str = "keep", complete: Callable[[Path], bool] | None = None,
                check: Callable[[Path], None] | None = None, durable: bool = True,
                tmp_name: str | None = None, in_root: bool = False) -> Iterator[Path]:
    """The one way artcache publishes a directory (a plan, a checkpoint, an export, a converted target): the body
    writes its files into a fresh temp directory beside ``final`` (yielded), which then becomes ``final`` in one
    rename, so a reader sees no directory or a complete one.

    The temp directory is ``<final's parent>/<tmp_name or ".tmp-">`` + the writer's identity token
    (:func:`artcache.layout.unique_suffix`), so the one sweep of dead writers' temps (:func:`remove_orphan_parts`
    with ``dirs=True``) can tell a dead writer's from a live one's. ``in_root``: ``final`` lies inside a cache root,
    so its mode is the root's (:func:`artcache.layout.make_dir`: 0700, or 2770 group-shared, whatever the umask);
    otherwise (a checkpoint, an export, a converted target) the umask's default, as the user's own files.
    On a normal exit of the body: with ``durable`` every file in it and then the directory are fsynced; an existing
    ``final`` is handled by ``existing``:

    - ``keep``: another writer published it first. When ``complete(final)`` holds (before the rename, or after
      a failed one) the temp directory is dropped and ``final`` kept; otherwise the rename is tried and its
      error raised.
    - ``replace``: it is removed first (a stale directory of an earlier run, e.g. a checkpoint of the same step).
    - ``aside``: ``check(final)`` may refuse it (raise); it is renamed aside (``.<name>.old-<writer>``),
      restored if the rename fails, and removed once ``final`` is in place.

    Then the temp directory is renamed onto ``final`` and (``durable``) ``final``'s parent fsynced
    (:func:`fsync_dir_after_rename`: after the rename nothing raises).

    Raises:
        whatever the body, ``check`` or the filesystem raised (OSError unwrapped: the caller names what it
        published): the temp directory has been removed, ``final`` is as it was (an aside one restored).
        ValueError: ``existing`` is not one of :data:`EXISTING`.
    """
    if existing not in EXISTING:
        raise ValueError(f"existing {existing!r} is not accepted: one of {', '.join(EXISTING)}")
    final = Path(final)
    tmp = final.parent / f"{tmp_name if tmp_name is not None else '.tmp-'}{unique_suffix()}"
    if in_root:
        make_dir(tmp)  # 0700, or 2770 in a group-shared root
    else:
        tmp.mkdir()
    try:
        yield tmp
        if durable:
            for f in tmp.rglob("*"):
                if f.is_file() and not f.is_symlink():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            fsync_dir(tmp)
        if existing == "keep" and complete is not None and complete(final):
            return
        old = None
        if os.path.lexists(final) and existing != "keep":
            if check is not None:
                check(final)
            if existing == "replace":
                shutil.rmtree(final)
            else:
                old = final.parent / f".{final.name}.old-{unique_suffix()}"
                os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            if old is not None and not os.path.lexists(final):
                os.rename(old, final)
            if existing == "keep" and complete is not None and complete(final):
                return
            raise
        # published: from here on nothing raises (a failing directory fsync is retried, then logged)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if durable:
            fsync_dir_after_rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed; a failure's partial files otherwise


def _link_no_clobber(tmp: Path, dest: Path) -> None:
    """Publish ``tmp`` as ``dest`` unless ``dest`` exists (FileExistsError): a hard link, then ``tmp`` unlinked; on
    a filesystem without hard links, a check then ``os.replace`` (the check and the rename are not one step)."""
    try:
        os.link(tmp, dest)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (EPERM, ENOTSUP, EMLINK ...)
        if os.path.lexists(dest):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dest)) from None
        os.replace(tmp, dest)
        return
    with contextlib.suppress(OSError):  # published: a temp name left over is never an error
        os.unlink(tmp)


def fsync_dir_after_rename(dest: Path) -> bool:
    """fsync ``dest``'s directory after ``dest`` was renamed into it; True once it succeeded.

    Retryable errors are retried after each delay of :data:`DIR_FSYNC_BACKOFF`; a failure that remains is
    logged, not raised: the rename already happened, and undoing it would withdraw a complete file."""
    delays = iter(DIR_FSYNC_BACKOFF)
    while True:
        try:
            fsync_dir(dest.parent)
            return True
        except OSError as exc:
            delay = next(delays, None) if is_retryable(exc) else None
            if delay is None:
                log.warning("%s is in place, but fsync of its directory failed (%s): it is durable once the "
                            "filesystem syncs the directory; a crash before that can only lose it (a miss)",
                            dest, exc.strerror or exc)
                return False
            time.sleep(delay)
