"""Other "hosts" on one machine for the ``multihost`` lane: each :class:`Host` is a process tree in its own
UTS and PID namespace (``unshare --fork --pid --uts --mount-proc``, see docs/scale-out.md) over the same
directories, so its pids mean nothing to the test process and its host id differs (artcache.liveness).

A host runs an *agent* (this file run as a script, pid 1 of its namespace) that has imported artcache,
torch and tests/support/crash_child.py once and forks children on request, over JSON lines on its stdin/stdout:

- ``spawn``: fork a child running ``crash_child.<fn>(*args)`` (children report through their own files and
  exit); the reply is the child's pid in the host's namespace;
- ``wait`` / ``kill``: the exit status of a child (None on timeout) / SIGKILL it;
- ``call``: run ``module:function(*args, **kwargs)`` in a forked child and return its JSON-able result;
- ``hold``: from the agent itself (alive as long as the host): write a temp file named with its identity,
  register a consumer, beat its heartbeat every 0.5 s, and hold a lease on a fingerprint (a live writer and
  holder that no other host may remove).

:meth:`Host.die` SIGKILLs the agent: the kernel kills every process of the namespace (a dead host).
:func:`unshare_unavailable` says why the lane cannot run here (it needs ``unshare`` and root).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
UNSHARE = ["unshare", "--fork", "--pid", "--mount-proc", "--kill-child=SIGKILL"]


def unshare_unavailable() -> str | None:
    """None if namespaces can be made here, else why not (the multihost lane fails with it)."""
    if shutil.which("unshare") is None:
        return "the multihost lane needs util-linux `unshare` (not found)"
    try:
        res = subprocess.run([*UNSHARE, "--uts", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare --pid --uts` failed here: {exc}"
    if res.returncode != 0:
        return f"`unshare --pid --uts` is not permitted here (it needs root or user namespaces): {res.stderr.strip()}"
    return None


class Host:
    """One "host": an agent in new PID (and, with ``uts``, UTS) namespaces, named ``name``."""

    def __init__(self, name: str, logs: Path, *, uts: bool = True, env: dict[str, str] | None = None) -> None:
        self.name = name
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"host-{name}.log"
        cmd = [*UNSHARE, *(["--uts"] if uts else []), "bash", "-c",
               ('hostname "$0" && ' if uts else "") + 'exec "$1" "$2"', name, sys.executable, str(HERE / "hosts.py")]
        child_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        child_env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [child_env.get("PYTHONPATH")])])
        self._err = open(self.log, "wb")  # noqa: SIM115 - closed in die()
        self.popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                      env=child_env, text=True, bufsize=1)
        self._lock = threading.Lock()
        hello = self._reply()
        self.identity = hello["identity"]  # the agent's ProcessIdentity fields (host id, pid 1, ...)
        self.hostname = hello["hostname"]

    def _reply(self) -> dict:
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"host {self.name}'s agent died; its log:\n{self.log.read_text()[-3000:]}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"host {self.name}: {out['error']}")
        return out

    def request(self, **req) -> dict:
        with self._lock:
            self.popen.stdin.write(json.dumps(req) + "\n")
            self.popen.stdin.flush()
            return self._reply()

    def spawn(self, fn: str, *args) -> int:
        return self.request(op="spawn", fn=fn, args=list(args))["pid"]

    def wait(self, pid: int, timeout: float) -> int | None:
        return self.request(op="wait", pid=pid, timeout=timeout)["code"]

    def kill(self, pid: int) -> None:
        self.request(op="kill", pid=pid)

    def call(self, target: str, *args, **kwargs):
        return self.request(op="call", target=target, args=list(args), kwargs=kwargs)["result"]

    def hold(self, root: Path, consumer_id: str, fp: str) -> dict:
        return self.request(op="hold", root=str(root), consumer=consumer_id, fp=fp)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def die(self) -> None:
        """SIGKILL the agent: every process of the host's namespace dies with it."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self._err.close()


# ---- the agent (runs inside the namespaces) -------------------------------------------------------------

def _agent() -> None:
    import signal
    import traceback

    from artcache.liveness import this_process
    from tests.support import crash_child  # noqa: F401 - imports artcache and torch once; forked children start at once

    children: dict[int, int | None] = {}
    held: list = []

    def send(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    def reap(pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)

    def fork_run(fn) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                fn()
                code = 0
            except BaseException:  # noqa: BLE001 - the child reports and exits
                traceback.print_exc()
                code = 1
            os._exit(code)
        return pid

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    me = this_process()
    send({"identity": {"host": me.host, "pid": me.pid, "start": me.start}, "hostname": me.hostname})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            op = req["op"]
            if op == "spawn":
                fn = getattr(crash_child, req["fn"])
                args = [_thaw(a) for a in req["args"]]
                pid = fork_run(lambda fn=fn, args=args: fn(*args))
                children[pid] = None
                send({"pid": pid})
            elif op == "wait":
                send({"code": reap(req["pid"], req["timeout"])})
            elif op == "kill":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(req["pid"], signal.SIGKILL)
                send({"ok": True})
            elif op == "call":
                import importlib

                mod, _, name = req["target"].partition(":")
                fn = getattr(importlib.import_module(mod), name)
                rfd, wfd = os.pipe()

                def run(fn=fn, req=req, wfd=wfd) -> None:
                    out = fn(*req["args"], **req["kwargs"])
                    os.write(wfd, json.dumps({"result": out}, default=str).encode())

                pid = fork_run(run)
                os.close(wfd)
                with os.fdopen(rfd, "rb") as f:
                    data = f.read()
                code = reap(pid, 600)
                if code != 0 or not data:
                    send({"error": f"call {req['target']} exited {code}"})
                else:
                    send(json.loads(data))
            elif op == "hold":
                held.append(_hold(Path(req["root"]), req["consumer"], req["fp"]))
                send(held[-1][0])
            else:
                send({"error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            send({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


def _thaw(arg):
    """``{"file_barrier": path}`` / ``{"file_event": path}`` → crash_child.FileBarrier / FileEvent (a
    multiprocessing barrier cannot cross into another pid namespace); anything else unchanged."""
    from tests.support import crash_child

    if isinstance(arg, dict) and "file_barrier" in arg:
        return crash_child.FileBarrier(arg["file_barrier"])
    if isinstance(arg, dict) and "file_event" in arg:
        return crash_child.FileEvent(arg["file_event"])
    return arg


def _hold(root: Path, consumer_id: str, fp: str):
    """From the agent: a live temp file, a registered heart-beating consumer and its lease on ``fp``."""
    from artcache import leases, registry
    from artcache.layout import CacheLayout, unique_suffix

    layout = CacheLayout(root)
    temp = layout.tmp / f"{unique_suffix()}.part"
    temp.write_bytes(b"a live writer's partial file")
    reg = registry.register(layout, registry.Registration(consumer_id=consumer_id, draft="holder", lookahead=0,
                                                          end=0, pid=os.getpid()))
    handle = registry.ConsumerHandle(layout, reg)
    lease = leases.acquire(layout, fp, consumer_id)

    def beat() -> None:
        while True:
            time.sleep(0.5)
            handle.heartbeat()

    threading.Thread(target=beat, daemon=True).start()
    return {"temp": temp.name, "lease": lease}, handle


if __name__ == "__main__":
    _agent()
