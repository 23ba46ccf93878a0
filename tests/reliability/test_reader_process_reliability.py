"""The reader process under kills and faults (the fast parts: tests/protocol/test_reader_process.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artcache import leases as leases_mod
from artcache.accounting import account
from artcache.layout import CacheLayout
from artcache.liveness import dead_reason
from tests.protocol import test_reader_process as fast_part
from tests.protocol.test_consumer_resume import DATA, Proc, consume_args
from tests.protocol.test_reader_process import _children
from tests.support.procs import wait_until

filled = fast_part.filled  # a fixture of tests/protocol/test_reader_process.py


def _child_of(pid: int, deadline_s: float = 60.0) -> int:
    """The pid of ``pid``'s reader process (by its command line: a start-up may run other short children, e.g.
    ``ldconfig`` for ctypes), once it started."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        for kid in _children(pid):
            try:
                if b"reader_process" in Path(f"/proc/{kid}/cmdline").read_bytes():
                    return kid
            except FileNotFoundError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no reader process within {deadline_s:.0f}s")


def _wait_gone(pid: int, deadline_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {deadline_s:.0f}s later")


def _long_run(cache, cwd, cid: str, steps: int, *extra: str) -> tuple[Proc, int]:
    """A consumer of ``steps`` batches of 1 with ``--reader process``, and its child's pid once it started."""
    args = consume_args(cache, cwd, cid, steps, "--reader", "process", *extra)
    args[args.index("--batch-size") + 1] = "1"
    args[args.index("--window") + 1] = "0:8"
    proc = Proc(cid, args, cwd)
    return proc, _child_of(proc.popen.pid)


def _leases_block(cache, cid: str) -> list[str]:
    """Lease files of ``cid`` whose holder lives: what would keep an artifact from eviction."""
    return [info.name for infos in leases_mod.scan(CacheLayout(cache)).values() for info in infos
            if info.consumer == cid and dead_reason(info.holder) is None]


def test_a_killed_reader_process_fails_the_consumer_in_one_line_and_its_leases_expire(filled, tmp_path):
    """SIGKILL to the child mid-run: the trainer stops with WorkerFailed naming the reader process (exit 1, no
    traceback), its registration says failed, and whatever lease the child held is holder-dead (nothing blocks
    eviction); inspect's invariants hold."""
    proc, child = _long_run(filled, tmp_path, "victim", 200, "--commit-interval", "0")
    try:
        wait_until(lambda: "step 3/" in proc.text(), "three steps", [proc])
        os.kill(child, signal.SIGKILL)
        code = proc.popen.wait(timeout=120)
    finally:
        proc.kill()
    text = proc.text()
    assert code == 1 and "reader process" in text and "Traceback" not in text, (code, text[-3000:])
    reg = json.loads((CacheLayout(filled).consumers / "victim.json").read_bytes())
    assert reg["state"] == "failed", (reg, text[-3000:])
    assert _leases_block(filled, "victim") == []
    violations = account(CacheLayout(filled)).violations
    assert violations == [], (violations, text[-3000:])


def test_a_killed_trainer_takes_its_reader_process_with_it(filled, tmp_path):
    """SIGKILL to the trainer: the child dies too (PR_SET_PDEATHSIG), so no reader is left holding leases or
    reading; ``--resume`` then continues from its last checkpoint with a fresh child and completes."""
    proc, child = _long_run(filled, tmp_path, "orphan", 400, "--save-every", "5")
    try:
        wait_until(lambda: (tmp_path / "runs" / "orphan" / "checkpoints" / "latest").exists(), "a checkpoint",
                   [proc])
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=30)
        _wait_gone(child)
    finally:
        proc.kill()
    assert _leases_block(filled, "orphan") == []
    again, second = _long_run(filled, tmp_path, "orphan", 400, "--save-every", "5", "--resume")
    try:
        assert again.popen.wait(timeout=300) == 0, again.tail()
    finally:
        again.kill()
    assert second != child
    assert json.loads((CacheLayout(filled).consumers / "orphan.json").read_bytes())["state"] == "completed"


def test_sigterm_stops_the_consumer_cleanly_with_its_reader_process(filled, tmp_path):
    """SIGTERM to the trainer (a scheduler's stop): the child ignores the group's signal and is stopped by the
    trainer, which checkpoints and ends as cancelled; no lease is left."""
    proc, child = _long_run(filled, tmp_path, "stopped", 400)
    try:
        wait_until(lambda: "step 3/" in proc.text(), "three steps", [proc])
        proc.popen.send_signal(signal.SIGTERM)
        proc.popen.wait(timeout=120)
        _wait_gone(child)
    finally:
        proc.kill()
    reg = json.loads((CacheLayout(filled).consumers / "stopped.json").read_bytes())
    assert reg["state"] == "cancelled", proc.text()[-3000:]
    assert reg["checkpoint_cursor"] == reg["cursor"] > 0
    assert not any(info.consumer == "stopped" for infos in leases_mod.scan(CacheLayout(filled)).values()
                   for info in infos)
    assert account(CacheLayout(filled)).violations == []


def test_regression_a_trainer_that_is_pid_1_keeps_its_reader_process(filled, tmp_path):
    """In a container the trainer is often pid 1 (Docker without --init, a Kubernetes entry point), and
    the child took a parent pid of 1 for a dead trainer and exited at once (WorkerFailed). It now checks for the
    trainer's own pid. Run in a pid namespace of its own (``unshare``, as root)."""
    import shutil

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a pid namespace")
    from tests.support.procs import child_env

    args = consume_args(filled, tmp_path, "pid1", 4, "--reader", "process", "--json")
    got = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "artcache", *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env())
    if got.returncode != 0 and "unshare" in got.stderr and "Operation not permitted" in got.stderr:
        pytest.skip(f"no pid namespace here: {got.stderr.strip()}")
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.strip().splitlines()[-1])["steps"] == 4


@pytest.fixture(scope="module")
def filled_short_timeout(tmp_path_factory, tiny_target):
    """A filled root (12 samples) whose heartbeat timeout is 4 s: the deadline of a silent reader process."""
    cache = tmp_path_factory.mktemp("reader-stall") / "cache"
    fill = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                           tiny_target.path, "--data", str(DATA), "--max-samples", "12", "--max-length", "128",
                           "--draft-layers", "3", "--threads", "1", "--fill", "--heartbeat-timeout", "4"],
                          capture_output=True, text=True, timeout=600)
    assert fill.returncode == 0, fill.stderr[-2000:]
    return cache


def test_regression_a_stopped_reader_process_fails_the_trainer_past_the_heartbeat_timeout(filled_short_timeout,
                                                                                            tmp_path):
    """A SIGSTOPped ``--reader process`` child stalled its trainer silently and forever: nothing was logged, the
    producer never fenced the consumer (the trainer kept beating) and its window and leases stayed held. The
    trainer now fails in one line naming the child's pid, how long it made no progress and that it is stopped,
    once it sent nothing for the root's heartbeat timeout (4 s here); the stopped child is killed, the registration
    ends failed, no lease of a live holder is left and the accounting balances."""
    cache = filled_short_timeout
    proc, child = _long_run(cache, tmp_path, "stalled", 100000, "--commit-interval", "0")
    try:
        wait_until(lambda: "step 3/" in proc.text(), "three steps", [proc])
        os.kill(child, signal.SIGSTOP)
        t0 = time.monotonic()
        code = proc.popen.wait(timeout=120)
        took = time.monotonic() - t0
        _wait_gone(child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        proc.kill()
    text = proc.text()
    assert code == 1 and "Traceback" not in text, (code, text[-3000:])
    assert f"reader process {child} made no progress for" in text and "stopped (SIGSTOP?)" in text, text[-3000:]
    assert 4 <= took < 60, took
    reg = json.loads((CacheLayout(cache).consumers / "stalled.json").read_bytes())
    assert reg["state"] == "failed", (reg, text[-3000:])
    assert _leases_block(cache, "stalled") == []
    assert account(CacheLayout(cache)).violations == []
