"""The one way artcache takes a file lock: ``flock`` through ``filelock.UnixFileLock``, never a soft lock.

Why not ``filelock.FileLock``: since filelock 4 it is ``UnixFileLock`` with ``fallback_to_soft=True``,
which on a filesystem whose ``flock`` fails with ENOSYS only *warns* and silently switches to a
marker-file ("soft") lock. A soft lock left by a process killed with SIGKILL is not released by the
kernel, which breaks the protocol's promise that a dead holder never blocks anyone. So every
artcache lock is built here with ``fallback_to_soft=False``: on such a filesystem acquiring raises
:class:`~artcache.errors.LockUnavailable` naming the lock file and pointing at ``artcache verify-fs``.
(Where ``flock`` *succeeds but does nothing* — some NFS/Lustre mounts — correctness still holds, see
docs/protocol.md, "Filesystems".)

``filelock`` must be at least 4.2.1 (the release line with the 2025–2026 symlink/TOCTOU CVE fixes,
CVE-2025-68146 and CVE-2026-22701, and with ``fallback_to_soft``); this is checked at import.
Lock files are opened by filelock with ``O_NOFOLLOW`` and created with ``O_EXCL``; they are created
once and never deleted (deleting a flock file while another process has it open would let two
processes "hold" it).
"""

from __future__ import annotations

import errno
import os
import re

import filelock
from filelock import Timeout, UnixFileLock

from artcache.errors import LockTimeout, LockUnavailable, NotWritable, UnsafePath
from artcache.fsio import NOT_WRITABLE_ERRNOS, READ_ONLY_ROOT_USE

#: The oldest filelock release artcache accepts (see the module docstring).
MIN_FILELOCK = (4, 2, 1)
#: errno values with which ``flock`` says the filesystem does not support it.
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK})
#: Lock files are group-writable: access is controlled by the cache root's directory mode (0700 by
#: default; 2770 with ``--group-shared``), and a group-shared root needs every member to open them.
LOCK_FILE_MODE = 0o660


def parse_version(text: str) -> tuple[int, ...]:
    """``"4.2.1"`` → (4, 2, 1); pre/post-release suffixes are ignored (``"4.3.0rc1"`` → (4, 3, 0)).

    Raises:
        ImportError: ``text`` does not start with a dotted number.
    """
    m = re.match(r"\s*(\d+(?:\.\d+)*)", str(text))
    if m is None:
        raise ImportError(f"cannot read the filelock version {text!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def check_filelock_version(text: str) -> None:
    """Raise ImportError naming the installed and the required version if ``text`` < MIN_FILELOCK."""
    have = parse_version(text)
    need = MIN_FILELOCK
    padded = have + (0,) * (len(need) - len(have))
    if padded < need:
        raise ImportError(
            f"artcache needs filelock >= {'.'.join(map(str, need))} (symlink/TOCTOU CVE fixes and "
            f"fallback_to_soft), but filelock {text} is installed: python3 -m pip install -U 'filelock>=4.2.1'")


check_filelock_version(filelock.__version__)


class CacheLock(UnixFileLock):
    """An exclusive ``flock`` on one lock file; never falls back to a soft lock.

    Construct with :func:`cache_lock`. ``acquire`` raises :class:`LockTimeout` (an artcache error that is
    also a :class:`filelock.Timeout` and a TimeoutError) when the lock stays held past the timeout,
    :class:`LockUnavailable` (an OSError, not retryable) when the filesystem does not support ``flock``,
    :class:`UnsafePath` when the lock file is a symbolic link, and :class:`NotWritable` (a PermissionError)
    when the lock file cannot be opened for writing (a read-only lock file, ``locks/`` directory or mount).
    """

    def acquire(self, *args, **kwargs):
        try:
            return super().acquire(*args, **kwargs)
        except LockTimeout:
            raise
        except Timeout as exc:  # filelock's own: re-raised inside the artcache tree
            raise LockTimeout(self.lock_file, getattr(exc, '_holder', None)) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link planted at the lock's name
                raise UnsafePath(f"lock file {self.lock_file} is a symbolic link; artcache never follows links "
                                 "planted in a cache root (remove it, e.g. with `artcache fsck --fix`)") from exc
            if exc.errno in NOT_WRITABLE_ERRNOS:
                raise NotWritable(
                    f"cannot open lock file {self.lock_file} ({os.strerror(exc.errno)}): every process using a "
                    "cache root needs write access to its locks/ (a group-shared root: the group's rw and umask "
                    f"007); {READ_ONLY_ROOT_USE}", errno_=exc.errno) from exc
            if exc.errno in _UNSUPPORTED:
                raise LockUnavailable(
                    f"cannot lock {self.lock_file}: the filesystem does not support flock "
                    f"({os.strerror(exc.errno)}); artcache never falls back to marker-file locks. "
                    f"Run `artcache verify-fs {os.path.dirname(self.lock_file)}` and use a filesystem "
                    "where it passes", errno_=exc.errno) from exc
            raise


def cache_lock(path: str | os.PathLike, timeout: float = -1, *, thread_local: bool = True) -> CacheLock:
    """A :class:`CacheLock` on ``path`` (created ``O_EXCL|O_NOFOLLOW`` on first use, mode 0660 & ~umask).

    Args:
        timeout: seconds to wait in ``acquire`` (0: try once; negative: wait forever).
        thread_local: as in filelock (False: one hold shared by the threads of this process, so a
            thread other than the acquiring one may release it).
    """
    return CacheLock(str(path), timeout=timeout, mode=LOCK_FILE_MODE, thread_local=thread_local,
                     fallback_to_soft=False)


__all__ = ["MIN_FILELOCK", "CacheLock", "LockTimeout", "LockUnavailable", "Timeout", "cache_lock",
           "check_filelock_version"]
