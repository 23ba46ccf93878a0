"""Durable file primitives: unique temp file, fsync, atomic rename, directory fsync.

The pattern follows huggingface_hub's download (unique temp name per writer, then rename): a
reader sees either nothing or a complete file, on every POSIX filesystem, whether or not locks work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from artcache.crashpoints import crash_point
from artcache.errors import PublishError
from artcache.layout import open_nofollow, unique_suffix

#: errno values after which retrying the same write can succeed.
RETRYABLE_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT})


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


def is_retryable(exc: OSError) -> bool:
    return exc.errno in RETRYABLE_ERRNOS


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


def atomic_write(dest: Path, chunks: Iterable[bytes | memoryview] | Callable[[int], int], tmp_dir: Path, *,
                 durable: bool = True, fingerprint: str | None = None) -> int:
    """Write ``chunks`` to ``dest`` atomically; return the number of bytes written.

    ``chunks`` is an iterable of byte chunks written in order, or a writer ``f(fd) -> bytes written``
    that writes the content into the open temp file itself (``artcache.store`` streams artifacts this
    way: positioned writes, hashing beside them, the header last); it may raise only OSError.

    Writes to ``tmp_dir/<host>.<pid>.<nonce>.part`` (same filesystem as ``dest``; created
    ``O_CREAT|O_EXCL|O_NOFOLLOW``), fsyncs it,
    ``os.replace``-s it onto ``dest`` and fsyncs ``dest``'s directory (when ``durable``).

    Raises:
        PublishError: on any OSError; the temp file has been removed and ``dest`` is untouched.
            ``retryable`` says whether the same call may succeed later.
    """
    tmp = tmp_dir / f"{unique_suffix()}.part"
    written = 0
    renamed = False
    try:
        # O_EXCL: never an existing name (nor a planted link: O_EXCL does not follow); O_NOFOLLOW besides
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
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
        os.replace(tmp, dest)
        renamed = True
        if fingerprint is not None:
            crash_point("publish.after-rename")
        if durable:
            fsync_dir(dest.parent)
    except OSError as exc:
        try:
            # the directory fsync failed after the rename: withdraw it, nothing counts as published
            os.unlink(dest if renamed else tmp)
        except FileNotFoundError:
            pass
        except OSError:
            pass
        raise PublishError(
            f"writing {dest.name} failed: {exc.strerror or exc}", fingerprint=fingerprint,
            retryable=is_retryable(exc), errno_=exc.errno) from exc
    return written
