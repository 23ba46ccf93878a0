"""Payload put/get bandwidth: a POSIX cache root against Mooncake Store payloads, side by side in one run.

The ``payload`` suite's piece (``artcache bench --suite payload``, :mod:`artcache.bench.suites`): :func:`measure`.
For one artifact shape (at ``--scale full`` Qwen3-8B's, 3072 tokens x 5 layers x 4096 bf16 = 120 MiB), each rep
publishes a fresh fingerprint through ``artcache.store.publish`` (POSIX: temp file, fsync, rename;
Mooncake: hard-pinned put + manifest), reads it back with every check (``store.read``: content hash and,
for Mooncake, the manifest's payload hash) and evicts it (``store.remove``). Beside the artcache path it
times the bare transport with the same bytes: ``write + fsync`` / ``read`` of one file, and Mooncake
``upsert_from`` / ``get_into`` of registered buffers. Medians over the reps; ratios Mooncake / POSIX.

Without a master given, it starts ``mooncake_master`` on a free loopback port (its default 10 s read lease: a
shorter one fails gets slower than it with -707) and one ``artcache payload-holder`` big enough for the run
(evicted payloads wait out the lease), and stops both at the end. Every process talks over 127.0.0.1. Needs
``mooncake-transfer-engine-non-cuda`` (its ``mooncake_master``) and libibverbs1 (``.ci/mooncake-lane``).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from artcache.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalMooncake:
    """``mooncake_master`` + one payload holder on loopback, for the duration of the bench."""

    def __init__(self, workdir: Path, holder_bytes: int) -> None:
        import importlib.util

        # this interpreter's own binary first; the holder runs here, so its package must import here too (another
        # environment's mooncake_master on PATH does not do: the holder failed to start, naming only its log)
        own = Path(sysconfig.get_path("scripts")) / "mooncake_master"
        binary = str(own) if own.is_file() else shutil.which("mooncake_master") or str(own)
        if not Path(binary).is_file() or importlib.util.find_spec("mooncake") is None:
            raise ConfigError("mooncake_master not found: python3 -m pip install "
                              "mooncake-transfer-engine-non-cuda (and libibverbs1)")
        port, metrics = _free_port(), _free_port()
        self.url = f"mooncake://127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []
        with open(workdir / "master.log", "wb") as log:
            self.procs.append(subprocess.Popen(
                [binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={metrics}"], stdout=log, stderr=subprocess.STDOUT))  # its default 10 s read lease
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"mooncake_master did not start; see {workdir / 'master.log'}") from None
                time.sleep(0.05)
        holder_log = workdir / "holder.log"
        with open(holder_log, "wb") as log:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "artcache", "payload-holder", "--payload", self.url,
                 "--size", str(holder_bytes)],
                stdout=log, stderr=subprocess.STDOUT))
        while "payload holder ready" not in holder_log.read_text(errors="replace"):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline + 40:
                self.close()
                raise RuntimeError(f"payload holder did not start; see {holder_log}")
            time.sleep(0.05)

    def close(self) -> None:
        for p in reversed(self.procs):  # the holder first, then the master
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_root(layout, contract, tensors: dict, reps: int) -> dict:
    """publish / read / remove of ``reps`` fresh fingerprints through artcache.store (seconds each)."""
    from artcache import store

    pub, rd, ev = [], [], []
    nbytes = 0
    for i in range(reps + 1):  # the first rep warms up (page cache, connections, staging buffers)
        fp = f"{0xbe0000 + i:040x}"
        t0 = time.perf_counter()
        nbytes = store.publish(layout, fp, contract, tensors)
        t1 = time.perf_counter()
        art = store.read(layout, fp, contract)
        t2 = time.perf_counter()
        assert art.nbytes == nbytes
        del art
        store.remove(layout, fp)
        t3 = time.perf_counter()
        if i:
            pub.append(t1 - t0)
            rd.append(t2 - t1)
            ev.append(t3 - t2)
    store.maintain(layout)
    return {"nbytes": nbytes, "publish_s": _median(pub), "read_s": _median(rd), "evict_s": _median(ev),
            "publish_MBps": nbytes / _median(pub) / 1e6, "read_MBps": nbytes / _median(rd) / 1e6}


def bare_posix(directory: Path, data: torch.Tensor, reps: int) -> dict:
    """write + fsync and read of one file of ``data``'s bytes (no artcache)."""
    path = directory / "bare.bin"
    w, r = [], []
    view = memoryview(data.numpy())
    back = bytearray(len(view))
    for i in range(reps + 1):
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            off = 0
            while off < len(view):
                off += os.write(fd, view[off:])
            os.fsync(fd)
        finally:
            os.close(fd)
        t1 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(back)
        t2 = time.perf_counter()
        assert got == len(view)
        if i:
            w.append(t1 - t0)
            r.append(t2 - t1)
    path.unlink()
    n = len(view)
    return {"write_fsync_MBps": n / _median(w) / 1e6, "read_MBps": n / _median(r) / 1e6}


def bare_mooncake(url: str, data: torch.Tensor, reps: int) -> dict:
    """``upsert_from`` / ``get_into`` of registered buffers, one key (no artcache)."""
    from artcache.payload_mooncake import MooncakeClient

    client = MooncakeClient(url)
    key = f"bench-{os.getpid()}"
    try:
        n = data.numel()
        src = client.staging(n)
        src[:n] = data
        dst = torch.empty(n, dtype=torch.uint8)
        w, r = [], []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            rc = client.upsert_from(key, src, n)  # upsert: the key is under the last get's read lease
            t1 = time.perf_counter()
            got = client.get_into(key, dst)
            t2 = time.perf_counter()
            if rc != 0 or got != n:
                raise RuntimeError(f"bare Mooncake put/get failed: put {rc}, get {got}")
            if i:
                w.append(t1 - t0)
                r.append(t2 - t1)
        return {"put_MBps": n / _median(w) / 1e6, "get_MBps": n / _median(r) / 1e6}
    finally:
        deadline = time.monotonic() + 30
        while client.remove(key) not in (0, -704) and time.monotonic() < deadline:
            time.sleep(0.5)  # the read lease
        client.close()


def measure(work: Path, *, tokens: int = 3072, layers: int = 5, hidden: int = 4096, reps: int = 7,
            payload_url: str = "") -> dict:
    """Publish / read / evict one artifact of ``tokens`` x ``layers`` x ``hidden`` bf16 ``reps`` times (after one
    warm-up) on a POSIX root and on a Mooncake-payload root under ``work`` (removed after), then the bare
    transports with the same bytes. ``payload_url``: an existing master, ``mooncake://HOST:PORT`` with a holder;
    empty: start a loopback master and holder for the run. Returns the report: per path the medians
    (``publish_MBps``, ``read_MBps``, ``evict_s``; MB = 10**6 bytes), ``ratios_mooncake_over_posix``, the artifact
    shape, the load average and the CPUs.

    Raises:
        ConfigError: ``mooncake_master`` is not installed, or ``payload_url`` is not a Mooncake URL.
        RuntimeError: the master or holder did not start, or a bare put/get failed."""
    import msgspec

    from artcache import payload
    from artcache.contract import CaptureContract
    from artcache.layout import CacheLayout
    from artcache.payload import new_spec, parse_payload_url
    from artcache.settings import RootSettings, init_settings

    base = Path(work)
    base.mkdir(parents=True, exist_ok=True)
    contract = CaptureContract(target_name="bench", target_revision="r", target_config_hash="c",
                               target_weights_digest="w", layer_ids=tuple(range(layers)),
                               max_length=tokens, tokenizer_digest="none", template_digest="none")
    g = torch.Generator().manual_seed(0)
    tensors = {"hidden_states": torch.randn(tokens, layers, hidden, generator=g).to(torch.bfloat16),
               "input_ids": torch.randint(0, 32000, (tokens,), generator=g, dtype=torch.int32),
               "loss_mask": torch.ones(tokens, dtype=torch.uint8)}
    raw = tensors["hidden_states"].reshape(-1).view(torch.uint8)
    url = parse_payload_url(payload_url) if payload_url else ""
    # evicted payloads wait out the 10 s read lease: room for every rep's, plus the bare transport's key
    service = None if url else LocalMooncake(base, holder_bytes=(reps + 3) * (raw.numel() + (1 << 20)) + (64 << 20))
    url = url or service.url
    try:
        settings = RootSettings(plan_id="0" * 40, contract=contract, target_path="/nowhere")
        roots = {}
        for name, spec in (("posix", None), ("mooncake", new_spec(url))):
            lay = CacheLayout(base / f"{name}-root")
            shutil.rmtree(lay.root, ignore_errors=True)
            lay.create()
            init_settings(lay, msgspec.structs.replace(settings, payload=spec))
            roots[name] = lay
        report = {"artifact": {"tokens": tokens, "layers": layers, "hidden": hidden, "dtype": "bfloat16"},
                  "reps": reps, "mooncake": url, "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
        # interleaved in one run: POSIX, Mooncake, then the bare transports
        report["posix"] = bench_root(roots["posix"], contract, tensors, reps)
        report["mooncake_payloads"] = bench_root(roots["mooncake"], contract, tensors, reps)
        report["bare_posix"] = bare_posix(base, raw, reps)
        report["bare_mooncake"] = bare_mooncake(url, raw, reps)
        p, m = report["posix"], report["mooncake_payloads"]
        report["ratios_mooncake_over_posix"] = {"publish": m["publish_MBps"] / p["publish_MBps"],
                                                "read": m["read_MBps"] / p["read_MBps"]}
    finally:
        payload.close_all()
        if service:
            service.close()
        for name in ("posix", "mooncake"):
            shutil.rmtree(base / f"{name}-root", ignore_errors=True)
    return report


def format_report(report: dict) -> str:
    """:func:`measure`'s report as the table docs/benchmarks.md shows."""
    a = report["artifact"]
    mib = report["posix"]["nbytes"] / 2**20
    lines = [f"artifact {mib:.1f} MiB ({a['tokens']} tokens x {a['layers']} layers x {a['hidden']}, bf16); "
             f"medians of {report['reps']} reps; load {report['loadavg'][0]:.1f} on {report['cpus']} CPUs",
             f"{'':26s}{'publish MB/s':>14s}{'read MB/s':>12s}{'evict ms':>10s}"]
    for name, key in (("posix root", "posix"), ("mooncake payloads", "mooncake_payloads")):
        r = report[key]
        lines.append(f"{name:26s}{r['publish_MBps']:14.0f}{r['read_MBps']:12.0f}{r['evict_s'] * 1e3:10.1f}")
    bp, bm = report["bare_posix"], report["bare_mooncake"]
    lines.append(f"{'bare file write+fsync/read':26s}{bp['write_fsync_MBps']:14.0f}{bp['read_MBps']:12.0f}")
    lines.append(f"{'bare mooncake put/get':26s}{bm['put_MBps']:14.0f}{bm['get_MBps']:12.0f}")
    rt = report["ratios_mooncake_over_posix"]
    lines.append(f"mooncake / posix: publish {rt['publish']:.2f}x, read {rt['read']:.2f}x")
    return "\n".join(lines)
