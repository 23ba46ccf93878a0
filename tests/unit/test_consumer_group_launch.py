"""The launcher of a consumer group (``artcache consume --nproc N``) without gloo: what it checks before starting
ranks, how it turns the ranks' ends into one error, how it watches their beats, and the settings a group refuses
(the groups themselves: tests/distributed/test_group_faults_distributed.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from artcache.errors import CacheRootError, ConfigError
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer import group as G
from artcache.trainers.consumer import session as S
from artcache.trainers.consumer.reader_process import failure_of


def test_regression_compile_on_in_a_cuda_group_is_refused_in_one_line(tmp_path, monkeypatch):
    """Bug: ``--compile on --nproc 2`` on CUDA ran silently uncompiled (a group's forward runs through its DDP /
    FSDP2 wrapper, never the compiled draft). Now ``on`` and ``graphs`` are refused in one line naming the value
    and what is accepted (exit 2), for ``--nproc`` and under torchrun; ``auto`` and ``off`` run, and so does ``on``
    in one process (a CPU refuses ``on`` for a group and one process alike: the host step is not compiled)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for mode in ("on", "graphs"):
        with pytest.raises(ConfigError, match=rf"^--compile {mode} and a group of ranks \(--nproc 2\) exclude each "
                                              r"other: .*; accepted --compile off or auto") as got:
            ConsumerConfig(cache=str(tmp_path), device="cuda", nproc=2, lookahead=16, compile=mode).validate()
        assert got.value.exit_code == 2 and "\n" not in str(got.value)
    for mode in ("auto", "off"):
        ConsumerConfig(cache=str(tmp_path), device="cuda", nproc=2, lookahead=16, compile=mode).validate()
    ConsumerConfig(cache=str(tmp_path), device="cuda", compile="on").validate()
    ConsumerConfig(cache=str(tmp_path), device="cpu", nproc=2, lookahead=16, compile="auto").validate()
    with pytest.raises(ConfigError, match=r"^--compile on needs a CUDA device: on cpu"):
        ConsumerConfig(cache=str(tmp_path), device="cpu", nproc=2, lookahead=16, compile="on").validate()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"^--compile on and a group of ranks \(torchrun's WORLD_SIZE 2\)"):
        ConsumerConfig(cache=str(tmp_path), device="cuda", compile="on").validate()


def test_regression_a_group_with_a_missing_root_fails_before_starting_ranks(tmp_path, monkeypatch):
    """Bug: bad input a single process finds before building its draft (a missing cache root) was found by every
    rank of a group after the launcher started them: one line per rank plus a GroupFailed line, exit 1. Now the
    launcher checks it first and raises the one error (exit 2) without starting a rank."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def launch(cfg):
        raise AssertionError("ranks were started for bad input")

    monkeypatch.setattr(S, "launch", launch)
    cfg = ConsumerConfig(cache=str(tmp_path / "missing"), nproc=2, lookahead=16, out_dir=str(tmp_path / "run"))
    with pytest.raises(CacheRootError) as got:
        S.run_consumer(cfg)
    assert got.value.exit_code == 2
    assert not (tmp_path / "run").exists() and not (tmp_path / "missing").exists()


class _Ended:
    """A rank that ended with ``returncode``."""

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode


def test_regression_bad_input_a_rank_found_is_raised_once(tmp_path):
    """Bug: bad input only a rank can find (a layer id the draft refuses) made every rank print its own line and
    the launcher a GroupFailed line (exit 1). Now each rank leaves its error in the launcher's directory and the
    launcher raises rank 0's bad-input error (or the first failing rank's) as one process would (exit 2); an
    operational failure stays a GroupFailed naming the rank's error."""
    bad = ConfigError("--layer-ids [99]: [99] are not output-of-layer ids of a 8-layer target (accepted: 0..7)")
    for r in (0, 1):
        G.rank_file(tmp_path, "error", r).write_bytes(msgspec.json.encode(failure_of(bad)))
    got = G._bad_input(tmp_path, [_Ended(2), _Ended(2)], 1)
    assert isinstance(got, ConfigError) and str(got) == str(bad) and got.exit_code == 2
    # rank 0 was stopped by the launcher's SIGTERM before it finished: rank 1's error
    assert str(G._bad_input(tmp_path, [_Ended(-15), _Ended(2)], 1)) == str(bad)
    # an exit status 1 is no bad input: the GroupFailed message carries the rank's error
    G.rank_file(tmp_path, "error", 1).write_bytes(msgspec.json.encode(failure_of(RuntimeError("gloo: peer gone"))))
    assert G._bad_input(tmp_path, [_Ended(-15), _Ended(1)], 1) is None
    assert G._error_note(tmp_path, 1) == " (RuntimeError: gloo: peer gone)"
    assert G._error_note(tmp_path, 5) == ""


def _beat(path: Path, stop: threading.Event) -> None:
    path.touch()
    while not stop.wait(0.1):
        path.touch()


@pytest.mark.timeout(60)
def test_regression_a_rank_that_stops_beating_is_named(tmp_path):
    """Bug: a rank stopped with SIGSTOP (or otherwise silent) was reported as its healthy peer's failure, once the
    peer's collective timed out. Now the launcher watches each rank's beat file: a rank silent for the group
    timeout fails the group itself, is killed (a stopped process never acts on SIGTERM) and is named with how long
    it was silent; a rank that still beats is not."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    beats = [G.rank_file(tmp_path, "beat", r) for r in range(2)]
    stop = threading.Event()
    threading.Thread(target=_beat, args=(beats[0], stop), daemon=True).start()
    beats[1].touch()  # rank 1 beat once, then went silent
    t0 = time.monotonic()
    try:
        failed = G._watch(procs, 1.5, [], beats)
    finally:
        stop.set()
        for p in procs:
            p.kill()
            p.wait()
    assert failed is not None
    rank, rc, silent = failed
    assert rank == 1 and rc == -9 and silent is not None and "no progress" in silent, failed
    assert procs[0].returncode == -15  # the healthy rank was asked to stop
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_regression_a_rank_killed_by_the_signal_passed_on_is_no_failure(tmp_path):
    """Bug: a second SIGTERM to a group's launcher was passed on to ranks whose handlers were already restored (the
    run had stopped and cleaned up); the rank died of the signal and the launcher reported "rank 1 (pid N) ended
    with signal SIGTERM", a GroupFailed, exit 1, where one process exits 143. Now a rank that ends of a stop signal
    the launcher passed on (or with 128 + it) stopped as one process would: no failure, and the launcher ends as
    Cancelled with that signal."""
    clean = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in (clean, "import time; time.sleep(60)")]
    time.sleep(1.0)  # rank 0's handler installed; rank 1 keeps the default action (dies of SIGTERM)
    threading.Timer(0.2, lambda: signal.raise_signal(signal.SIGTERM)).start()
    forwarded: list[int] = []
    try:
        failed = G._watch(procs, 5.0, forwarded, None)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert forwarded == [signal.SIGTERM]
    assert [p.returncode for p in procs] == [143, -signal.SIGTERM]
    assert failed is None, failed
    assert [G._stopped_by(p.returncode, forwarded) for p in procs] == [signal.SIGTERM] * 2
    assert G._stopped_by(1, forwarded) is None and G._stopped_by(-9, forwarded) is None


def test_regression_the_registration_records_the_rank_that_failed(tmp_path):
    """Bug: after rank 1 of a group was killed (SIGKILL), the registration's failure reason was rank 0's own error
    (gloo's "Connection closed by peer"), while the launcher printed "rank 1 ... ended with signal SIGKILL". Now the
    launcher records its diagnosis as the reason of the registration rank 0 finished as failed; a registration rank
    0 left running is fenced with it, and a failure of rank 0 itself keeps rank 0's own reason."""
    from artcache import registry
    from artcache.layout import CacheLayout

    layout = CacheLayout(tmp_path / "root")
    for sub in ("locks", "consumers", "journal", "leases", "tmp"):
        (layout.root / sub).mkdir(parents=True)
    procs = [_Ended(1), _Ended(-9)]
    procs[0].pid, procs[1].pid = 4242, 4243
    cfg = ConsumerConfig(cache=str(layout.root), consumer_id="g", nproc=2, lookahead=16)

    def write(state: str, reason: str) -> None:
        registry.update(layout, "g", lambda _old: registry.Registration(consumer_id="g", draft="dflash", state=state,
                                                                        generation=3, pid=4242, reason=reason))

    why = "rank 1 (pid 4243) ended with signal SIGKILL"
    write("failed", "RuntimeError: Connection closed by peer")
    G._fence_dead(cfg, procs, "failed", why, peer_failed=True)
    assert registry.read(layout, "g").reason == why
    write("failed", "CaptureTimeout: position 3")
    G._fence_dead(cfg, procs, "failed", "rank 0 (pid 4242) ended with exit status 1", peer_failed=False)
    assert registry.read(layout, "g").reason == "CaptureTimeout: position 3"
    write("running", "")
    G._fence_dead(cfg, procs, "cancelled", "interrupted")
    got = registry.read(layout, "g")
    assert (got.state, got.reason) == ("cancelled", "interrupted")
