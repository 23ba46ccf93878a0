"""A consumer group (gloo, 2 ranks) fails like one process: one line for bad input a rank finds, the rank that
stopped making progress named (not its peer), leases released by a rank that leaves on a failed collective; and
the run report counts every rank's requests. The launcher's logic without gloo:
tests/unit/test_consumer_group_launch.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artcache import journal as J
from artcache import registry
from artcache.app.experiments import committed_work, consumer_events
from artcache.layout import CacheLayout
from tests.distributed.test_consumer_group_distributed import DRAFT_FLAGS, consume, root  # noqa: F401


def _events(cache: Path, pattern: str) -> dict[str, list]:
    return {p.name: list(J.iter_file(p)) for p in CacheLayout(cache).journal.glob(pattern)}


def _count(events: list, kind: type) -> int:
    return sum(isinstance(e, kind) for e in events)


@pytest.mark.timeout(300)
def test_regression_bad_input_a_rank_finds_is_one_line_exit_2(root, tmp_path):  # noqa: F811
    """Bug: bad input only the ranks find (a layer id the draft refuses) printed one line per rank and a GroupFailed
    line, exit 1, where one process prints one line and exits 2. Now the group prints the one line naming the bad
    value and what is accepted, exits 2 and registers nothing."""
    proc = consume(root, tmp_path, "bad", "dflash", 2, "--nproc", "2", "--layer-ids", "99", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("artcache: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "[99]" in errors[0] and "accepted" in errors[0], proc.stderr[-3000:]
    assert "GroupFailed" not in proc.stderr and "Traceback" not in proc.stderr and "rank 1:" not in proc.stderr
    assert registry.read(CacheLayout(root), "bad") is None and not (tmp_path / "runs" / "bad").exists()


@pytest.mark.timeout(300)
def test_regression_the_run_report_counts_every_rank(root, tmp_path):  # noqa: F811
    """Bug: the run report (``artcache run``, ``artcache report``) read a group's requests from rank 0's journal
    only (the other ranks journal theirs as ``reader-<id>-<token>.jsonl``): half of a 2-rank group's requests, where
    ``inspect`` counts all. Now rank 0's start event names the other ranks' journals and the report reads them."""
    consume(root, tmp_path, "report", "dflash", 2, "--nproc", "2", steps=3)
    (start_journal,) = CacheLayout(root).journal.glob("consumer-report-*.jsonl")
    readers = _events(root, "reader-report-*.jsonl")
    everyone = _events(root, "*-report-*.jsonl")
    total = sum(_count(evs, J.Request) for evs in everyone.values())
    assert len(readers) == 1 and _count(next(iter(readers.values())), J.Request) > 0
    assert committed_work(consumer_events(start_journal))["requests"] == total


def _start_group(cache: Path, tmp_path: Path, cid: str) -> tuple[subprocess.Popen, Path, list[int]]:
    """A 2-rank DFlash group of many steps; returns it with its log and the ranks' pids once step 3 is logged."""
    log = tmp_path / f"{cid}.log"
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(cache), "--id", cid, "--draft", "dflash",
            *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", "400", "--window", "0:16", "--threads", "1",
            "--log-every", "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard",
            "--group-timeout", "10", "--nproc", "2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = log.read_text()
        pids = re.search(r"started a group of 2 ranks \(pids (\d+), (\d+)\)", text)
        if pids and "step 3/" in text:
            return proc, log, [int(pids[1]), int(pids[2])]
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the group logged no step 3 in 120 s: {log.read_text()[-3000:]}")


@pytest.mark.timeout(300)
def test_regression_a_stopped_rank_is_named_not_its_peer(root, tmp_path):  # noqa: F811
    """Bug: a rank stopped with SIGSTOP made its healthy peer's collective time out, and the group failed naming the
    healthy rank (exit status 1) after its gloo traceback. Now the launcher sees the stopped rank's beat go silent,
    stops the group within about ``--group-timeout`` and names that rank and how long it made no progress."""
    proc, log, pids = _start_group(root, tmp_path, "stopped")
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    text = log.read_text()
    line = next(line for line in text.splitlines() if line.startswith("artcache: error:"))
    assert rc == 1 and time.monotonic() - t0 < 60, text[-3000:]
    assert f"rank 1 (pid {pids[1]})" in line and "no progress" in line, line
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.timeout(300)
def test_regression_a_rank_leaving_on_a_failed_collective_releases_its_leases(root, tmp_path):  # noqa: F811
    """Bug: when rank 1 was killed, rank 0 left through its failed collective while the launcher's SIGTERM arrived
    (its handlers already restored) and the step's batch was never released: its leases stayed held under its
    dead pid until the launcher reclaimed them as holder-dead. Now rank 0 releases every lease it took and ends
    its registration itself; only the killed rank's leases are reclaimed."""
    proc, log, pids = _start_group(root, tmp_path, "killed")
    os.kill(pids[1], signal.SIGKILL)
    rc = proc.wait(timeout=120)
    assert rc == 1, log.read_text()[-3000:]
    reg = registry.read(CacheLayout(root), "killed")  # the launcher's diagnosis, not rank 0's broken collective
    assert reg.state == "failed" and reg.reason.startswith(f"rank 1 (pid {pids[1]}) ended with signal SIGKILL"), reg
    (rank0,) = _events(root, "consumer-killed-*.jsonl").values()
    (rank1,) = _events(root, "reader-killed-*.jsonl").values()
    assert _count(rank0, J.LeaseAcquire) == _count(rank0, J.LeaseRelease) > 0
    assert _count(rank0, J.ConsumerEnd) == 1
    reclaimed = sum(_count(evs, J.LeaseExpire) for evs in _events(root, "launcher-killed-*.jsonl").values())
    assert reclaimed == _count(rank1, J.LeaseAcquire) - _count(rank1, J.LeaseRelease)


@pytest.fixture(scope="module")
def unpublished(tmp_path_factory) -> Path:
    """A root whose plan has no published position (no producer running): every demand waits."""
    from artcache.producer import ProducerConfig, prepare_root

    path = tmp_path_factory.mktemp("unpublished") / "cache"
    prepare_root(ProducerConfig(cache=str(path), target="random:tiny-llama", dataset="synthetic", max_length=32,
                                max_samples=24, layer_ids=list(range(8)), device="cpu"))
    return path


@pytest.mark.timeout(300)
def test_regression_sigterm_stops_a_group_waiting_for_data(unpublished, tmp_path):
    """Bug: SIGTERM to a group whose ranks waited for data (positions not yet published) was ignored until the
    demand wait timed out (``--demand-timeout``, default 600 s): the group then failed with CaptureTimeout and the
    registration ``failed``, where one process exits 143 within a second, cancelled. A rank waiting for its batch
    did not act on its stop request, and a rank waiting for it in a collective could not. Now the group exits 143
    within seconds, with its summary, and the registration is ``cancelled``."""
    cid = "waiting"
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(unpublished), "--id", cid, "--draft",
            "dflash", *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", "40", "--window", "2:8", "--threads",
            "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard", "--group-timeout", "30",
            "--demand-timeout", "120", "--nproc", "2", "--json"]
    log = tmp_path / f"{cid}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    layout = CacheLayout(unpublished)
    try:
        deadline = time.monotonic() + 120
        # both ranks wait: the registration holds the demand of each rank's slice (positions 0-1 and 2-3)
        while time.monotonic() < deadline:
            reg = registry.read(layout, cid)
            if reg is not None and {0, 2} <= set(reg.demand):
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        else:
            raise AssertionError(f"the ranks never waited for data: {log.read_text()[-3000:]}")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 143 and took < 20, (proc.returncode, took, text[-3000:])
    assert "GroupFailed" not in text and "CaptureTimeout" not in text, text[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["state"] == "cancelled"
    assert registry.read(layout, cid).state == "cancelled"


@pytest.mark.timeout(300)
def test_regression_bad_layer_ids_or_out_are_refused_before_ranks_start(root, tmp_path):  # noqa: F811
    """Bug: with ``--nproc 2`` a bad ``--layer-ids 1,99`` or an ``--out`` that is a file was found only by the ranks
    the launcher had started: stderr held "started a group", "rank N ... ended with exit status 2" and (for the
    file) a "checkpoints: ... free space needed under <the file>" line before the error. Now the launcher checks
    both before any rank starts: stderr is the one error line, exit 2, as for one process (which no longer sizes
    checkpoints under a file either)."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for extra, needle in ((["--layer-ids", "1,99"], "[99]"), (["--out", str(afile)], "regular file")):
        for nproc in ("2", "1"):
            proc = consume(root, tmp_path, "badinput", "dflash", 2, *extra, "--nproc", nproc, check=False)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (nproc, proc.stderr[-3000:])
            assert lines[0].startswith("artcache: error: ") and needle in lines[0] and "accepted" in lines[0], lines
    assert registry.read(CacheLayout(root), "badinput") is None and not (tmp_path / "runs" / "badinput").exists()


@pytest.mark.timeout(300)
def test_regression_a_resumed_group_says_so_once(root, tmp_path):  # noqa: F811
    """Bug: ``--resume`` of a 2-rank group logged "resumed from <checkpoint>: step N, cursor C" twice (once per
    rank), where one process logs it once. Now only rank 0 logs it."""
    flags = ("--nproc", "2", "--save-every", "1", "--lr-total-steps", "4")
    consume(root, tmp_path, "again", "dflash", 2, *flags, steps=1)
    proc = consume(root, tmp_path, "again", "dflash", 2, *flags, "--resume", steps=2)
    assert proc.stderr.count("resumed from") == 1, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step 1, cursor 4" in proc.stderr


@pytest.mark.timeout(300)
def test_regression_a_second_sigterm_stops_the_group_as_cancelled(root, tmp_path):  # noqa: F811
    """Bug: a second SIGTERM to a group's launcher (passed on to every rank) killed a rank whose handlers were
    already restored, and the launcher took it for a failure: "rank 1 (pid N) ended with signal SIGTERM: stopping the
    other ranks", GroupFailed, exit 1, registration ``failed``, where one process exits 143, cancelled. Now the group
    exits 143 and the registration is ``cancelled``."""
    proc, log, _pids = _start_group(root, tmp_path, "twice")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 143, (rc, text[-3000:])
    assert "GroupFailed" not in text and "stopping the other ranks" not in text, text[-3000:]
    assert registry.read(CacheLayout(root), "twice").state == "cancelled"
