"""Check that a directory's filesystem gives what the artcache protocol relies on.

:func:`verify_filesystem` runs four checks in a scratch directory under ``path`` (removed afterwards):

- ``flock``: an exclusive ``flock`` held by another process excludes this one (``LOCK_NB`` fails),
  and is free again once that process lets go. (Locks only avoid duplicate work; a filesystem where
  flock is a no-op still works, with duplicate captures.)
- ``o_excl``: ``O_CREAT | O_EXCL`` refuses an existing name (unique temp files, leases).
- ``atomic_replace``: a reader never sees a partial file while another process ``os.replace``-s
  self-checking files of different sizes onto the same name in the same directory.
- ``dir_fsync``: ``fsync`` on a directory file descriptor works (durable rename/unlink).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from artcache.errors import InsufficientSpace
from artcache.fsio import describe_errno, fsync_dir, is_space_error

_LOCK_HOLDER = r"""
import fcntl, sys
f = open(sys.argv[1], "a+b")
fcntl.flock(f.fileno(), fcntl.LOCK_EX)
sys.stdout.write("locked\n"); sys.stdout.flush()
sys.stdin.readline()
fcntl.flock(f.fileno(), fcntl.LOCK_UN)
sys.stdout.write("released\n"); sys.stdout.flush()
sys.stdin.readline()
"""

# each file: 8-byte size, payload of one repeated byte, 8-byte trailer = size again
_REPLACER = r"""
import os, struct, sys, time
d, dest, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
sys.stdout.write("ready\n"); sys.stdout.flush()
end = time.monotonic() + seconds
i = 0
try:
    while time.monotonic() < end:
        n = 1 + (i * 7919) % (1 << 18)
        body = struct.pack("<Q", n) + bytes([i % 251]) * n + struct.pack("<Q", n)
        tmp = os.path.join(d, f"w.{os.getpid()}.{i}.part")
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, dest)
        i += 1
except OSError as exc:  # the parent names the errno (a full disk: no verdict on the filesystem), no traceback
    sys.stdout.write(f"errno {exc.errno}\n"); sys.stdout.flush()
    sys.exit(1)
sys.stdout.write(f"{i}\n"); sys.stdout.flush()
"""


def _check_whole(buf: bytes) -> str | None:
    """None if ``buf`` is one complete file written by the replacer, else what is wrong."""
    if len(buf) < 17:
        return f"short file ({len(buf)} bytes)"
    n = int.from_bytes(buf[:8], "little")
    if len(buf) != n + 16:
        return f"size field {n} but {len(buf)} bytes"
    if int.from_bytes(buf[-8:], "little") != n:
        return "trailer does not match the header"
    body = buf[8:-8]
    if body.count(body[:1]) != n:
        return "payload mixes two writes"
    return None


def check_flock(d: Path, timeout: float = 10.0) -> tuple[bool, str]:
    lock = d / "flock.lock"
    lock.touch()
    child = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(lock)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "locked":
            return False, "the helper process could not take the lock"
        with open(lock, "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                return False, "took an exclusive flock another process holds: flock is a no-op here"
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False, f"flock failed: {exc}"
            child.stdin.write("\n")
            child.stdin.flush()
            if child.stdout.readline().strip() != "released":
                return False, "the helper process did not release the lock"
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        return False, f"lock still held {timeout:.0f}s after the other process released it: {exc}"
                    time.sleep(0.01)
        return True, "an exclusive flock excludes another process and is free after release"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def check_o_excl(d: Path) -> tuple[bool, str]:
    name = d / "excl"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return True, "O_CREAT|O_EXCL refuses an existing name"
    os.close(fd)
    return False, "O_CREAT|O_EXCL opened an existing file"


def check_atomic_replace(d: Path, seconds: float = 1.0) -> tuple[bool, str]:
    dest = d / "replace.bin"
    child = subprocess.Popen([sys.executable, "-c", _REPLACER, str(d), str(dest), str(seconds)],
                             stdout=subprocess.PIPE, text=True)
    reads = missing = 0
    try:
        if child.stdout.readline().strip() != "ready":
            return False, "the writer process did not start"
        while child.poll() is None:
            try:
                with open(dest, "rb") as f:
                    buf = f.read()
            except FileNotFoundError:
                missing += 1
                continue
            reads += 1
            bad = _check_whole(buf)
            if bad is not None:
                return False, f"read {reads} saw a partial or mixed file while it was replaced: {bad}"
        replaced = child.stdout.read().strip()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    if child.returncode != 0 and replaced.startswith("errno "):
        code = int(replaced.split()[1])
        raise OSError(code, f"the writer process: {os.strerror(code)}")
    if child.returncode != 0:
        return False, f"the writer process failed (exit {child.returncode})"
    if reads == 0:
        return False, "no read completed while the writer ran"
    return True, f"{reads} reads during {replaced} replacements, all complete"


def check_dir_fsync(d: Path) -> tuple[bool, str]:
    (d / "f").write_bytes(b"x")
    os.replace(d / "f", d / "g")
    fsync_dir(d)
    return True, "fsync on a directory descriptor works"


CHECKS = {"flock": check_flock, "o_excl": check_o_excl, "atomic_replace": check_atomic_replace,
          "dir_fsync": check_dir_fsync}


def verify_filesystem(path: str | os.PathLike) -> dict:
    """Run every check in a scratch directory under ``path``.

    Returns:
        ``{"path": str, "ok": bool, "checks": {name: {"ok": bool, "detail": str}}}``; a check that
        raised reports ``ok: false`` with the exception in ``detail``.

    Raises:
        FileNotFoundError / PermissionError: ``path`` is missing or not writable.
        InsufficientSpace: ``path``'s filesystem is full (ENOSPC) or the quota spent (EDQUOT), so the checks
            could not run (no verdict on the filesystem); the message names the path and its free bytes.
    """
    root = Path(path).expanduser().absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    checks: dict[str, dict] = {}
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".artcache-verify-", dir=root))
        try:
            for name, fn in CHECKS.items():
                d = scratch / name
                d.mkdir()
                try:
                    ok, detail = fn(d)
                except Exception as exc:  # a check that cannot even run has failed
                    if is_space_error(exc):
                        raise
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                checks[name] = {"ok": ok, "detail": detail}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError as exc:
        if not is_space_error(exc):
            raise
        raise InsufficientSpace(
            f"{root}: no free space on its filesystem ({describe_errno(exc.errno, exc)}; "
            f"{shutil.disk_usage(root).free} bytes free), so the checks could not run: free space there "
            "and rerun `artcache verify-fs`") from exc
    return {"path": str(root), "ok": all(c["ok"] for c in checks.values()), "checks": checks}


__all__ = ["CHECKS", "verify_filesystem"]
