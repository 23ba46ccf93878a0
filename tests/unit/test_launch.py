"""artcache.launch: the one launcher of ``artcache run`` and the bench. Real processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from artcache.launch import Role, kill_all, stop_all, wait_for_file

SLEEP = "import time; print('up', flush=True); time.sleep(60)"
IGNORE_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
               "time.sleep(60)")
ASKS = ("import signal, sys, time\n"
        "def bye(*_):\n    print('asked', flush=True); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, bye); print('up', flush=True); time.sleep(60)")


def _up(role: Role) -> None:
    t0 = time.time()
    while "up" not in role.log.read_text():
        assert role.poll() is None and time.time() - t0 < 30, role.tail()
        time.sleep(0.05)


def test_role_logs_its_output_in_its_own_session(tmp_path):
    r = Role("r", [sys.executable, "-c", "import os; print('hello', os.getsid(0) == os.getpid())"], tmp_path / "r.log")
    assert r.wait(timeout=30) == 0 and r.code == 0 and r.ended > 0
    assert r.tail().strip() == "hello True"
    shared = Role("s", [sys.executable, "-c", "import os; print(os.getsid(0) == os.getpid())"], tmp_path / "s.log",
                  new_session=False)
    assert shared.wait(timeout=30) == 0 and shared.tail().strip() == "False"


def test_terminate_sends_sigterm_first(tmp_path):
    r = Role("r", [sys.executable, "-c", ASKS], tmp_path / "r.log")
    _up(r)
    assert r.terminate(grace_s=30) == 3 and "asked" in r.tail()


def test_terminate_escalates_to_sigkill_after_the_grace(tmp_path):
    r = Role("r", [sys.executable, "-c", IGNORE_TERM], tmp_path / "r.log")
    _up(r)
    t0 = time.monotonic()
    assert r.terminate(grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 20
    assert r.terminate(grace_s=0.5) == -signal.SIGKILL  # an exited role: nothing sent, same status


def test_stop_all_and_kill_all_reap_every_role(tmp_path):
    roles = [Role(f"r{i}", [sys.executable, "-c", SLEEP], tmp_path / f"r{i}.log") for i in range(2)]
    done = Role("done", [sys.executable, "-c", "pass"], tmp_path / "done.log")
    done.wait(timeout=30)
    for r in roles:
        _up(r)
    stop_all([*roles, done], grace_s=30)
    assert [r.code for r in roles] == [-signal.SIGTERM] * 2 and done.code == 0
    more = Role("m", [sys.executable, "-c", SLEEP], tmp_path / "m.log")
    kill_all([more])
    assert more.code == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(more.pid, 0)


def test_wait_for_file(tmp_path):
    target = tmp_path / "ready"
    writer = Role("w", [sys.executable, "-c", f"import time; time.sleep(0.3); open({str(target)!r}, 'w').close(); "
                        "time.sleep(60)"], tmp_path / "w.log")
    wait_for_file(target, writer, timeout=30, poll_s=0.05)
    writer.kill()
    dead = Role("producer", [sys.executable, "-c", "print('boom'); raise SystemExit(4)"], tmp_path / "d.log")
    with pytest.raises(RuntimeError, match=r"producer exited with 4 before writing .*\n.*boom"):
        wait_for_file(tmp_path / "never", dead, timeout=30, poll_s=0.05)
    slow = Role("slow", [sys.executable, "-c", SLEEP], tmp_path / "s.log")
    with pytest.raises(TimeoutError, match="slow did not write"):
        wait_for_file(tmp_path / "never", slow, timeout=0.3, poll_s=0.05)
    slow.kill()
