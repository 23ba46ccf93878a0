"""The offline bench under kills and whole runs (the fast parts: tests/protocol/test_bench_offline.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("pairing", ["round", "process", "steps"])
def test_regression_a_whole_run_writes_its_provenance_and_captures_once(tmp_path, pairing):
    """End to end on the tiny random target (one round): ``--fill`` captures every position, the refill and the
    consumers capture nothing, and report.json starts with the provenance every bench JSON carries (regression: the
    reports named no command, commit or hardware). ``--pairing process``: each consumer's process
    runs both arms, so both have their figures from the same three processes. The ≥ 0.95 check is load-bound, not
    asserted."""
    import json

    out = tmp_path / "offline"
    subprocess.run([sys.executable, "-m", "artcache.bench.offline", "--out", str(out), "--target", "random:tiny-llama",
                    "--data", "synthetic", "--max-samples", "8", "--max-length", "64", "--steps", "4", "--warmup", "1",
                    "--rounds", "1", "--anchors", "4", "--timeout-s", "600", "--pairing", pairing,
                    *(["--chunk", "5"] if pairing == "steps" else [])], check=False,
                   timeout=900, capture_output=True)
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["pairing"] == pairing and set(report["rounds"]) == {"root", "memory"}
    assert all(len(r) == 1 and set(r[0]) == {"B4", "B8", "B16"} and min(r[0].values()) > 0
               for r in report["rounds"].values())
    logs = sorted(p.name for p in (out / "logs").glob("dflash-*.log"))
    assert len(logs) == (6 if pairing == "round" else 3), logs
    assert report["command"][1:3] == ["-m", "artcache.bench.offline"] and "commit" in report
    assert report["hardware"]["cpu_count"] >= 1
    checks = report["checks"]
    assert checks["fill_exit_0"] and checks["refill_captures_nothing"] and checks["no_capture_while_consumers_ran"]
    assert report["fill"]["captures"] == 8 and report["refill"]["captures"] == 0


def _worker_pid(barrier, cid: str, timeout_s: float) -> int:
    """The pid of the bench worker ``cid`` of the round whose barrier directory is ``barrier`` (from /proc: the
    worker's command line names both, the consumer through its spec file), once that round's go is written."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while not (barrier / "go").exists():
        assert time.monotonic() < deadline, f"no go under {barrier} within {timeout_s} s"
        time.sleep(0.02)
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # its settings are its spec file, named by its consumer id (bench.offline writes specs/<cid>.consumer.json)
        if str(barrier).encode() in argv and any(a.endswith(f"/{cid}.consumer.json".encode()) for a in argv):
            return int(proc.name)
    raise AssertionError(f"no process of {cid} under /proc")


def _start_bench(out):
    """The whole bench as a child process (tiny random target, one round of 60 steps: long enough to signal)."""
    argv = ["--out", str(out), "--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "64",
            "--max-length", "32", "--steps", "60", "--warmup", "1", "--rounds", "1", "--anchors", "4",
            "--timeout-s", "120"]
    return subprocess.Popen([sys.executable, "-m", "artcache.bench.offline", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(300)
def test_regression_a_worker_killed_after_the_go_ends_the_bench_in_one_line(tmp_path):
    """End to end with the bench's own workers (tiny random target, 24-40 s on 2 cores, hence the reliability lane):
    SIGKILL one consumer right after its round's go. Regression: the other two trained to their end, then the
    parent ended in a traceback. Now the parent stops the other two at once and exits 1 with one line naming the
    worker, its exit status and its log; no worker outlives it and the stopped ones printed no figures."""
    import os
    import signal

    out = tmp_path / "offline"
    bench = _start_bench(out)
    try:
        barrier = out / "barriers" / "root-0"
        os.kill(_worker_pid(barrier, "dflash-b16-root-0", 200), signal.SIGKILL)
        _, err = bench.communicate(timeout=120)
    finally:
        bench.kill()
    logs = out / "logs"
    assert bench.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: worker dflash-b16-root-0 exited -9 (log {logs / 'dflash-b16-root-0.log'}); "
                          "stopped dflash-b4-root-0, dflash-b8-root-0"), err
    for cid in ("dflash-b4-root-0", "dflash-b8-root-0"):  # stopped before their end: no figures printed
        assert not any(ln.startswith("{") for ln in (logs / f"{cid}.log").read_text().splitlines())
    with pytest.raises(AssertionError, match="no process"):
        _worker_pid(barrier, "dflash-b4-root-0", 1)
    assert not (out / "report.json").exists()


@pytest.mark.timeout(300)
def test_regression_sigterm_to_the_bench_stops_its_workers(tmp_path):
    """Regression: SIGTERM to the bench's own process killed it at once and left the round's three workers running
    to their end. Now it stops them (SIGTERM, then SIGKILL) and exits 130 saying so; no worker outlives it."""
    import os
    import signal

    out = tmp_path / "offline"
    bench = _start_bench(out)
    try:
        barrier = out / "barriers" / "root-0"
        pids = [_worker_pid(barrier, f"dflash-b{b}-root-0", 200) for b in (4, 8, 16)]
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    lines = err.strip().splitlines()  # the signal's log line (artcache.shutdown), then the bench's own
    assert bench.returncode == 130 and len(lines) == 2 and "SIGTERM" in lines[0], err
    assert lines[1].startswith("error: stopped by a signal"), err
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        from pathlib import Path

        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
        assert status == "Z", f"worker {pid} outlived the bench (state {status})"
