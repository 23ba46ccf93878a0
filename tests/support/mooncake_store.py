"""A Mooncake master and an ``artcache payload-holder`` on loopback, for the ``mooncake`` tests.

:func:`require_mooncake` skips (with the reason) when the ``mooncake`` package or the ``mooncake_master``
binary is missing; ``.ci/mooncake-lane`` installs both. Every process listens on 127.0.0.1 only (the
master's RPC and metrics ports are free ports picked here), and :meth:`MooncakeService.close` stops what it
started, holder before master.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.support.procs import REPO, child_env

#: parametrize a protocol test over the payload backends; the Mooncake one carries the ``mooncake`` marker
#: (excluded by default; ``.ci/mooncake-lane`` runs it) and skips when Mooncake is not installed
PAYLOAD_BACKENDS = ["posix", pytest.param("mooncake", marks=pytest.mark.mooncake)]


def root_settings(backend: str, request, base=None):
    """``base`` (crash_child's fake settings by default) with the payload store of ``backend``: none for
    ``posix``, a fresh namespace on the session's Mooncake service (conftest's ``mooncake_service``)."""
    import msgspec

    from artcache.payload import new_spec
    from tests.support import crash_child as K

    base = base or K.settings()
    if backend == "posix":
        return base
    svc = request.getfixturevalue("mooncake_service")
    return msgspec.structs.replace(base, payload=new_spec(svc.url))


def master_binary() -> str | None:
    """``mooncake_master`` on PATH or beside this interpreter (a venv's bin/)."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    cand = Path(sysconfig.get_path("scripts")) / "mooncake_master"
    return str(cand) if cand.is_file() else None


def _missing(why: str):
    """Skip, or fail where the lane promises Mooncake (``ARTCACHE_REQUIRE_MOONCAKE=1``, .ci/mooncake-lane)."""
    if os.environ.get("ARTCACHE_REQUIRE_MOONCAKE") == "1":
        pytest.fail(why)
    pytest.skip(why)


def require_mooncake() -> str:
    """The master binary; pytest.skip naming what is missing and how to install it otherwise."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        _missing(f"Mooncake is not installed ({exc}): python3 -m pip install mooncake-transfer-engine-non-cuda "
                 "and apt-get install libibverbs1 (.ci/mooncake-lane does both)")
    binary = master_binary()
    if binary is None:
        _missing("the mooncake_master binary is not on PATH (it ships with mooncake-transfer-engine-non-cuda)")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class MooncakeService:
    """``mooncake_master`` on a free loopback port plus one payload holder of ``holder_bytes``.

    Args:
        lease_ms: the master's read lease (``--default_kv_lease_ttl``); its default is 10 s, tests use 1 s.
        client_ttl_s: seconds before the master drops a silent client (and the keys in its segment); its
            default, 10 s: a shorter one drops clients of processes starved of CPU (-601 ILLEGAL_CLIENT).
    """

    def __init__(self, workdir: Path, *, lease_ms: int = 1000, client_ttl_s: int = 10,
                 holder_bytes: int = 256 << 20) -> None:
        self.binary = require_mooncake()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.metrics_port = free_port()
        self.lease_ms, self.client_ttl_s, self.holder_bytes = lease_ms, client_ttl_s, holder_bytes
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.restarts = 0
        self.start_master()
        self.start_holder()

    def start_master(self) -> None:
        with open(self.workdir / f"master-{self.restarts}.log", "wb") as log:
            self.master = subprocess.Popen(
                [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ms}",
                 f"--client_ttl={self.client_ttl_s}"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not _listening(self.port):
            if self.master.poll() is not None or time.monotonic() > deadline:
                master_log = self.workdir / f"master-{self.restarts}.log"
                pytest.fail(f"mooncake_master did not start:\n{master_log.read_text()}")
            time.sleep(0.05)

    def start_holder(self) -> None:
        self.holder_log = self.workdir / f"holder-{time.monotonic_ns()}.log"
        with open(self.holder_log, "wb") as fh:
            self.holder = subprocess.Popen(
                [sys.executable, "-m", "artcache", "payload-holder", "--payload", self.url, "--size",
                 str(self.holder_bytes)], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())
        deadline = time.monotonic() + 60
        while "payload holder ready" not in self.holder_log.read_text(errors="replace"):
            if self.holder.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"payload holder did not start:\n{self.holder_log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)

    def stop_holder(self, sig: int = signal.SIGTERM) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.send_signal(sig)
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        self.holder = None

    def stop_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.terminate()
            try:
                self.master.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait()
        self.master = None

    def restart_master(self) -> None:
        """Stop and start the master on the same port: it forgets every key; the holder re-mounts."""
        self.stop_master()
        self.restarts += 1
        self.start_master()

    def wait_writable(self, timeout_s: float = 30.0) -> None:
        """Until a put succeeds (after a restart the holder's segment is mounted again within ~1 s)."""
        from artcache.payload_mooncake import MooncakeClient

        probe = MooncakeClient(self.url)
        try:
            deadline = time.monotonic() + timeout_s
            key = f"probe-{os.getpid()}-{time.monotonic_ns()}"
            while probe.put_small(key, b"x") != 0:
                if time.monotonic() > deadline:
                    pytest.fail(f"the Mooncake store at {self.url} did not take a put within {timeout_s:.0f}s")
                time.sleep(0.1)
            probe.remove(key)
        finally:
            probe.close()

    def close(self) -> None:
        self.stop_holder()
        self.stop_master()
