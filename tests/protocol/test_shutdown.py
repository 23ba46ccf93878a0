"""artcache.shutdown: the one signal rule of the producer, the consumer and ``artcache run``: the
first SIGINT/SIGTERM asks to stop, the second forces (KeyboardInterrupt), the previous handlers come back
when the block ends. Real signals sent to a real subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from artcache.shutdown import GracefulShutdown

CHILD = r"""
import os, signal, sys, time
from artcache.shutdown import GracefulShutdown

mode = sys.argv[1]
def prev(signum, frame):
    print("previous handler", signum, flush=True)
signal.signal(signal.SIGTERM, prev)
signal.signal(signal.SIGINT, prev)
with GracefulShutdown("child") as sd:
    print("ready", flush=True)
    try:
        while not sd.requested.is_set():
            time.sleep(0.01)
        print("asked", sd.signum, sd.forced, flush=True)
        if mode == "force":
            while True:  # ignores the request: only a second signal ends this
                time.sleep(0.01)
    except KeyboardInterrupt as exc:
        print("forced", sd.forced, exc, flush=True)
print("restored", signal.getsignal(signal.SIGTERM) is prev, signal.getsignal(signal.SIGINT) is prev, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # now the previous handler's
time.sleep(0.5)
print("end", flush=True)
"""


def _start(mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _line(p: subprocess.Popen) -> str:
    return p.stdout.readline().strip()


def test_first_signal_asks_and_the_previous_handlers_come_back():
    p = _start("ask")
    p.send_signal(signal.SIGTERM)
    assert _line(p) == f"asked {int(signal.SIGTERM)} False"
    assert _line(p) == "restored True True"
    assert _line(p) == f"previous handler {int(signal.SIGTERM)}"
    assert _line(p) == "end"
    assert p.wait(timeout=30) == 0


def test_second_signal_forces():
    p = _start("force")
    p.send_signal(signal.SIGINT)
    assert _line(p) == f"asked {int(signal.SIGINT)} False"
    time.sleep(0.2)
    assert p.poll() is None  # the request alone does not stop a loop that ignores it
    p.send_signal(signal.SIGTERM)
    assert _line(p) == f"forced True signal {int(signal.SIGTERM)} (second)"
    assert _line(p) == "restored True True"
    assert _line(p) == f"previous handler {int(signal.SIGTERM)}"
    assert p.wait(timeout=30) == 0
    assert "second signal (SIGTERM): stopping at once" in p.stderr.read()


def test_an_event_set_before_any_signal_is_not_a_first_signal():
    """The producer's stop_event may be set by its own loop (--exit-when-done, a publisher error): a signal
    then still only asks; only a second signal forces."""
    ev = threading.Event()
    ev.set()
    sd = GracefulShutdown("t", event=ev)
    sd._handle(signal.SIGTERM, None)
    assert sd.signum == signal.SIGTERM and not sd.forced
    with pytest.raises(KeyboardInterrupt):
        sd._handle(signal.SIGTERM, None)
    assert sd.forced


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    got = []
    t = threading.Thread(target=lambda: got.append(GracefulShutdown("t").install()))
    t.start()
    t.join()
    assert got == [False] and signal.getsignal(signal.SIGTERM) is before


def test_restore_is_idempotent_and_on_request_is_called():
    before = signal.getsignal(signal.SIGINT)
    seen = []
    with GracefulShutdown("t", signals=(signal.SIGINT,), on_request=seen.append) as sd:
        assert signal.getsignal(signal.SIGINT) == sd._handle
        sd._handle(signal.SIGINT, None)
        assert seen == [signal.SIGINT] and sd.requested.is_set()
    sd.restore()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("after_import", ["click", "numpy", "torch._functorch", "torch.nn"])
def test_regression_ctrl_c_while_the_cli_imports_is_one_line(tmp_path, after_import):
    """A Ctrl-C in the first second or two of any command (while the command line's modules, torch among them,
    were still being imported) printed a ~26-line KeyboardInterrupt traceback from the imports and exited 1;
    later it printed one line. At any time it is that one line, ``artcache: cancelled by SIGINT (exit 130)``,
    and exit 130. The SIGINT is sent once ``-X importtime`` reports ``after_import`` imported, so it lands while
    the imports run."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "artcache", "inspect", "--cache",
                             str(tmp_path / "root")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.rstrip().endswith(f"| {after_import}") or line.rstrip().endswith(f" {after_import}"):
                proc.send_signal(signal.SIGINT)
                break
        else:
            pytest.fail(f"{after_import} was never imported: {''.join(lines[-5:])}")
        rest = proc.stderr.read()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = [ln for ln in rest.splitlines() if not ln.startswith("import time:")]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest[-3000:]
    assert said == ["artcache: cancelled by SIGINT (exit 130)"] and rc == 130, (rc, said)
