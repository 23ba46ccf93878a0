"""Fault injection for real artcache processes (tests only): put this directory first on PYTHONPATH and set

- ``ARTCACHE_FAULTS``: a JSON list of faults, each
  ``{"call": "os.fsync", "errno": "EBUSY", "nth": 2, "times": 1, "path": "objects/", "data": "publish"}``:
  the ``nth`` (1 = first) and the following ``times - 1`` calls of ``call`` (``os.<name>`` or
  ``fcntl.<name>``) whose path argument (a file descriptor is resolved through /proc/self/fd) contains
  ``path`` and, for ``os.write``, whose bytes contain ``data``, fail with ``OSError(errno)`` instead of
  running (``times`` -1: every call from the nth on). ``os.fsync`` of a directory descriptor matches
  ``"path": "<dir>/"`` on the directory's path plus a slash.
- ``ARTCACHE_CLOCK_STEP``: ``"+40@3"``: ``time.time()`` jumps 40 s ahead 3 s after start (an NTP step;
  ``time.monotonic()`` is untouched, as the kernel's is); ``"-40@file:/path"``: 40 s back once ``/path``
  exists (looked at every 0.1 s at most).
- ``ARTCACHE_FAULTS_LOG``: a file that gets one line ``<call> <errno name> <path>`` per injected fault.

Python imports ``sitecustomize`` at start-up from the first directory on sys.path that has one, so this
reaches every process of a test: producer, consumers, and children in other pid namespaces.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import threading
import time

_faults = json.loads(os.environ.get("ARTCACHE_FAULTS", "[]") or "[]")
_log_path = os.environ.get("ARTCACHE_FAULTS_LOG", "")
_lock = threading.Lock()
_real_open = os.open
_real_write = os.write


def _log(call: str, code: int, path: str) -> None:
    if not _log_path:
        return
    fd = _real_open(_log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        _real_write(fd, f"{call} {_errno.errorcode.get(code, code)} {path}\n".encode())
    finally:
        os.close(fd)


def _path_of(arg) -> str:
    if isinstance(arg, int):
        try:
            target = os.readlink(f"/proc/self/fd/{arg}")
        except OSError:
            return ""
        return target + "/" if os.path.isdir(target) else target
    try:
        return os.fsdecode(arg)
    except TypeError:
        return ""


def _wrap(module, name: str, specs: list[dict]) -> None:
    real = getattr(module, name)
    state = [{"seen": 0, **s} for s in specs]

    def wrapper(*args, **kwargs):
        path = _path_of(args[0]) if args else ""
        for s in state:
            if s.get("path") and s["path"] not in path:
                continue
            if s.get("data") and name == "write" and s["data"].encode() not in bytes(args[1]):
                continue
            with _lock:
                s["seen"] += 1
                n, first, times = s["seen"], int(s.get("nth", 1)), int(s.get("times", 1))
            if n >= first and (times < 0 or n < first + times):
                code = getattr(_errno, s["errno"])
                _log(f"{module.__name__}.{name}", code, path)
                raise OSError(code, os.strerror(code), path or None)
        return real(*args, **kwargs)

    wrapper.__wrapped__ = real
    setattr(module, name, wrapper)


def _install() -> None:
    by_call: dict[tuple[str, str], list[dict]] = {}
    for f in _faults:
        mod, _, name = f["call"].partition(".")
        by_call.setdefault((mod, name), []).append(f)
    for (mod, name), specs in by_call.items():
        module = __import__(mod)
        _wrap(module, name, specs)
    step = os.environ.get("ARTCACHE_CLOCK_STEP", "")
    if step:
        delta, _, after = step.partition("@")
        delta_s = float(delta)
        real_time, t0 = time.time, time.monotonic()
        state = {"on": False, "next_look": 0.0}
        trigger = after[len("file:"):] if after.startswith("file:") else ""
        after_s = 0.0 if trigger else float(after or 0)

        def stepped() -> float:
            if not state["on"]:
                now = time.monotonic()
                if trigger:
                    if now >= state["next_look"]:
                        state["next_look"] = now + 0.1
                        state["on"] = os.path.exists(trigger)
                else:
                    state["on"] = now - t0 >= after_s
            return real_time() + (delta_s if state["on"] else 0.0)

        time.time = stepped


_install()
