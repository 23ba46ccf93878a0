"""Role processes on this machine: the one launcher behind ``artcache run`` (artcache/app/experiments.py) and
the bench (artcache/bench/run.py, artcache/bench/offline.py); each role is ``artcache producer|consume --spec FILE``
(:func:`cli_argv`; the spec file: :mod:`artcache.rolespec`). A :class:`Role` is one producer or consumer process
started with its output in a log file; it is polled, signalled, waited for and terminated here, so every
launcher stops its processes by the same rule: SIGTERM (the role's first signal: it asks to stop,
:mod:`artcache.shutdown`), then SIGKILL when it has not exited within the grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path


def cli_argv(*args: str) -> list[str]:
    """``python -m artcache ARGS``, with this interpreter."""
    return [sys.executable, "-m", "artcache", *args]


def role_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with unbuffered Python output (so a role's log is current) and ``extra``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


class Role:
    """One role process, stdout and stderr into ``log`` (created or truncated).

    Args:
        name: the role's name (consumer id, ``producer``). argv: its command line. env: its environment
            (default :func:`role_env`).
        new_session: start it in a session of its own, so a terminal's Ctrl-C reaches only the launcher, which
            forwards one SIGTERM (a second signal could interrupt a consumer while it writes its final
            checkpoint); False: it shares the launcher's process group and gets the terminal's signals too.

    Attributes:
        popen: the process. code: its exit status once :meth:`poll` saw it exit (None before).
        ended: ``time.time()`` when :meth:`poll` first saw it exit. announced: for the launcher's own use.
    """

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str] | None = None, *,
                 new_session: bool = True) -> None:
        self.name, self.log = name, Path(log)
        with open(self.log, "wb") as fh:
            self.popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                          env=dict(env) if env is not None else role_env(),
                                          start_new_session=new_session)
        self.code: int | None = None
        self.ended = 0.0
        self.announced = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        if self.code is None:
            self.code = self.popen.poll()
            if self.code is not None:
                self.ended = time.time()
        return self.code

    def running(self) -> bool:
        return self.poll() is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` unless it has exited."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit; its exit status. Raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        self.popen.wait(timeout=timeout)
        return self.poll()

    def terminate(self, grace_s: float) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``grace_s`` seconds (or when a KeyboardInterrupt, a
        forced stop of the launcher, comes meanwhile); its exit status. Nothing is sent to an exited role."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                self.kill()
        return self.poll()

    def kill(self) -> int:
        """SIGKILL (unless it has exited) and reap it; its exit status."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        return self.poll()

    def tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of its log."""
        return self.log.read_text(errors="replace")[-n:]


def wait_for_file(path: Path, role: Role, timeout: float, poll_s: float = 0.2) -> None:
    """Wait until ``path`` is a file (e.g. the root's ``artcache.json`` a producer writes when it is ready).

    Raises:
        RuntimeError: the role exited first (with its exit status and the tail of its log).
        TimeoutError: ``timeout`` seconds passed.
    """
    t0 = time.monotonic()
    while not Path(path).is_file():
        if role.poll() is not None:
            raise RuntimeError(f"{role.name} exited with {role.code} before writing {path}:\n{role.tail(3000)}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{role.name} did not write {path} within {timeout:.0f}s")
        time.sleep(poll_s)


def stop_all(roles: Iterable[Role], grace_s: float) -> None:
    """Terminate every role still running (:meth:`Role.terminate`) and reap every one."""
    for role in roles:
        role.terminate(grace_s)


def kill_all(roles: Iterable[Role]) -> None:
    """SIGKILL every role still running and reap it."""
    for role in roles:
        role.kill()


__all__ = ["Role", "cli_argv", "kill_all", "role_env", "stop_all", "wait_for_file"]
