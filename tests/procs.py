"""Helpers for tests that run real ``python -m artcache ...`` processes: :class:`Proc` (a CLI subprocess
with its log file), :func:`wait_until`, and the few checks every process test repeats.

A test module sets its own deadline by subclassing (``class Proc(BaseProc): deadline = 300.0``). Deadlines
only bound a hung run (they turn a hang into a failure that shows the process's log)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

import artcache
from artcache import store
from artcache.layout import CacheLayout
from artcache.settings import load_settings

REPO = Path(__file__).resolve().parent.parent
#: the directory the test process imported ``artcache`` from (REPO for a checkout or an editable install; on
#: the GPU machine a link tree that adds the ``artcache.trainers`` / ``artcache.bench`` subpackages): children
#: put it first on PYTHONPATH so they import the same artcache as the test
PACKAGE_ROOT = Path(artcache.__file__).parent.parent  # not resolved: the link tree's own directory
#: characters of a process's log shown when it fails
LOG_TAIL = 4000


def child_env(crash_at: str | None = None, single_thread: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a CLI child: unbuffered output, no tokenizer threads, one OpenMP thread (unless
    ``single_thread`` is false), :data:`PACKAGE_ROOT` first on PYTHONPATH, ``ARTCACHE_CRASH_AT`` only when
    ``crash_at`` is given (an inherited one is dropped), then ``extra``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if single_thread:
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("ARTCACHE_CRASH_AT", None)
    if crash_at:
        env["ARTCACHE_CRASH_AT"] = crash_at
    env.update(extra)
    return env


class Proc:
    """A CLI subprocess (``python -m artcache *args`` in ``cwd``) with its log file, stdout and stderr
    together, at ``cwd/logs/<name>-<ns>.log`` (a restarted process of the same name gets its own log)."""

    #: seconds :meth:`wait` and :func:`wait_until` allow by default
    deadline: float = 240.0
    #: OMP_NUM_THREADS=1 in the child (see :func:`child_env`)
    single_thread: bool = True

    def __init__(self, name: str, args: list[str], cwd: Path, crash_at: str | None = None, *,
                 env: Mapping[str, str] | None = None, prefix: list[str] | None = None) -> None:
        """``prefix``: a command the process runs under (e.g. tests/hosts.py's ``unshare`` for another host)."""
        self.name = name
        self.log = cwd / "logs" / f"{name}-{time.monotonic_ns()}.log"
        self.log.parent.mkdir(exist_ok=True)
        with open(self.log, "wb") as fh:
            self.popen = subprocess.Popen([*(prefix or []), sys.executable, "-m", "artcache", *args], cwd=cwd,
                                          stdout=fh, stderr=subprocess.STDOUT,
                                          env=child_env(crash_at, self.single_thread, **(env or {})))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self) -> str:
        return self.text()[-LOG_TAIL:]

    def wait(self, timeout: float | None = None) -> int:
        timeout = self.deadline if timeout is None else timeout
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not exit within {timeout:.0f}s:\n{self.tail()}")

    def expect(self, code: int) -> None:
        rc = self.wait()
        assert rc == code, f"{self.name} exited {rc}, expected {code}:\n{self.tail()}"

    def terminate_ready_producer(self) -> None:
        """SIGTERM once the producer has installed its handler ('producer ready'), then expect exit 143 (its clean
        shutdown, then ``128 + SIGTERM``). Regression (CI seed 1255956394): a restarted producer whose work had all
        been published by its killed predecessor got SIGTERM while still importing torch, and died of it (-15)."""
        wait_until(lambda: "producer ready" in self.text(), f"{self.name} to be ready", [self])
        self.popen.send_signal(signal.SIGTERM)
        self.expect(128 + signal.SIGTERM)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def wait_until(pred: Callable[[], bool], what: str, procs: Iterable[Proc], timeout: float | None = None,
               poll: float = 0.1) -> None:
    """Poll ``pred`` until true; fail (with the log) if one of ``procs`` exits first, or when ``timeout``
    passes (default: the longest deadline of ``procs``)."""
    procs = list(procs)
    if timeout is None:
        timeout = max((p.deadline for p in procs), default=Proc.deadline)
    t0 = time.monotonic()
    while not pred():
        for p in procs:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited {p.popen.returncode} while waiting for {what}:\n{p.tail()}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll)


def inspect_json(cache: Path) -> dict:
    """``artcache inspect --json`` through the CLI in this process (the command's own code; a child interpreter
    would spend ~3 s importing torch before reading a byte): exit 0, or 3 exactly when it reports violations
    (callers assert on those)."""
    from click.testing import CliRunner

    from artcache.app.cli import main

    res = CliRunner().invoke(main, ["inspect", "--cache", str(cache), "--json"])
    assert res.exit_code in (0, 3), res.output
    acc = json.loads(res.stdout)
    assert (res.exit_code == 3) == bool(acc["violations"])
    return acc


def verify_all_published(cache: Path) -> int:
    """Every file in objects/ reads and verifies; nothing was quarantined. Returns the count."""
    layout = CacheLayout(cache)
    contract = load_settings(layout).contract
    objects = store.list_objects(layout)
    for fp in objects:
        try:
            store.read(layout, fp, contract)
        except FileNotFoundError:  # evicted meanwhile by a live producer: fine
            continue
    assert list(layout.quarantine.iterdir()) == [], "a published artifact failed verification"
    return len(objects)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def token(pid: int) -> str:
    """The identity token of local process ``pid`` (as in its temp, lease and journal names; a dead pid's
    start time is unknown: 0)."""
    from artcache.liveness import local_identity

    return local_identity(pid).token()


def foreign_token(pid: int = 1) -> str:
    """An identity token of another host (a host id no process here has): its pid cannot be checked."""
    return f"{'f' * 16}-{pid}-12345"


FAULTINJECT = Path(__file__).resolve().parent / "faultinject"


def fault_env(faults: list[dict] | None = None, log: Path | None = None, clock_step: str = "") -> dict[str, str]:
    """Environment (for :class:`Proc`'s ``env``) that loads tests/faultinject/sitecustomize.py in the child:
    ``faults`` injected errnos, ``log`` a file listing each injection, ``clock_step`` e.g. ``"+40@3"``."""
    env = {"PYTHONPATH": os.pathsep.join([str(FAULTINJECT), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "ARTCACHE_FAULTS": json.dumps(faults or [])}
    if log is not None:
        env["ARTCACHE_FAULTS_LOG"] = str(log)
    if clock_step:
        env["ARTCACHE_CLOCK_STEP"] = clock_step
    return env


def injected(log: Path) -> list[tuple[str, str, str]]:
    """The faults a child injected: (call, errno name, path) per line of its ``ARTCACHE_FAULTS_LOG``."""
    if not log.exists():
        return []
    return [tuple(line.split(" ", 2)) for line in log.read_text().splitlines() if line]
