"""bench/offline.py's two arms (a pre-filled root read with no producer, batches held in memory) measure
the same thing: one process model and flag set, the same warm-up, the same torch threads, the same clock
at the same point and the same measured steps. The timing figures themselves come from the bench's runs
(docs/benchmarks.md), not from here."""

from __future__ import annotations

import subprocess
import sys
import types

import msgspec
import pytest
import torch

from artcache.bench import consumer_speed as cs
from artcache.bench import offline


def _args(tmp_path, **kw):
    base = dict(anchors=8, warmup=2, steps=3, timeout_s=60.0)
    return types.SimpleNamespace(**{**base, **kw})


def test_regression_both_arms_start_the_same_process_with_the_same_warmup(tmp_path):
    """Regression: the root arm ran ``artcache.bench.consume`` (its warm-up applied by the parent to the
    journal's step times) and the memory arm ``artcache.bench.offline --memory`` without ``--warmup``, so
    its worker skipped argparse's default 3 steps whatever ``--warmup`` the run was given. Both arms now
    start the same module with the same flags, ``--warmup`` included; only the arm differs."""
    args = _args(tmp_path, warmup=5)
    cfg = offline.consumer_config(args, tmp_path / "cache", 8, tmp_path / "runs" / "c", "c")
    cmds = {mode: offline.worker_command(mode, cfg, args.warmup, tmp_path / "b", args.timeout_s)
            for mode in offline.MODES}
    assert cmds["root"][:3] == [sys.executable, "-m", "artcache.bench.offline"]
    differ = [i for i, (a, b) in enumerate(zip(cmds["root"], cmds["memory"], strict=True)) if a != b]
    assert len(differ) == 1 and {cmds["root"][differ[0]], cmds["memory"][differ[0]]} == {"root", "memory"}
    for mode, cmd in cmds.items():
        parsed = offline._parser().parse_args(cmd[3:])
        assert (parsed.worker, parsed.warmup) == (mode, 5)
    with pytest.raises(ValueError, match="'disk'.*root, memory"):
        offline.worker_command("disk", cfg, 5, tmp_path / "b", 60.0)
    assert offline.worker_env(1)["OMP_NUM_THREADS"] == "1" == offline.worker_env(1)["MKL_NUM_THREADS"]


def test_measured_window_by_hand():
    # step i+1's train_step runs from i + 0.25 s to i + 1 s (0.75 of each 1 s step), 0.5 CPU s a step
    ends = [(i - 0.75, float(i), 0.5 * i) for i in range(1, 8)]
    m = offline.measured(ends, 3)
    assert m["measured_steps"] == [4, 7] and m["steps_per_s"] == pytest.approx(1.0)
    assert m["cpu_s_per_step"] == pytest.approx(0.5) and m["steps"] == 7
    assert m["train_step_share"] == pytest.approx(0.75)
    # no warm-up: the window still needs a start, the end of step 1
    assert offline.measured(ends, 0)["measured_steps"] == offline.measured(ends, 1)["measured_steps"] == [2, 7]
    empty = offline.measured(ends[:3], 3)
    assert empty["steps_per_s"] == 0.0 == empty["cpu_s_per_step"] == empty["train_step_share"]


def test_release_round_names_a_consumer_that_exited_before_it_was_ready(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match="dflash-b4-root-0 was not ready.*exited"):
        offline.release_round(tmp_path, {4: ("dflash-b4-root-0", gone, None)}, 30.0)
    assert not (tmp_path / "go").exists()
    (tmp_path / "dflash-b4-root-0.ready").touch()
    offline.release_round(tmp_path, {4: ("dflash-b4-root-0", gone, None)}, 30.0)
    assert (tmp_path / "go").exists()


@pytest.fixture()
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_regression_both_arms_time_the_same_steps_with_the_same_threads(tmp_path, torch_threads):
    """Regression: the memory worker set one torch thread itself while the root arm took the consumer's
    ``--threads``, timed ``train_step`` alone by its own loop while the root arm's rate came from the
    journal's Step times. Both arms now run :func:`offline.worker`: the consumer's threads, the end of
    ``Session.train_step`` as the one clock point, the same measured steps."""
    root = tmp_path / "cache"
    cs.make_root(root, 6, torch.device("cpu"), target="random:tiny-llama", seq=32, union=[1, 2, 3, 4, 5])
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (barrier / "go").touch()
    args = _args(tmp_path)
    got = {}
    for mode in offline.MODES:
        cid = f"dflash-b4-{mode}-0"
        cfg = offline.consumer_config(args, root, 4, tmp_path / "runs" / cid, cid)
        cfg = msgspec.structs.replace(cfg, threads=2)
        torch.set_num_threads(1)  # the worker's thread count must be the consumer's, not what it found
        got[mode] = offline.worker(mode, msgspec.json.encode(cfg).decode(), args.warmup, barrier, 30.0)
        assert (barrier / f"{cid}.ready").exists()
    r, m = got["root"], got["memory"]
    assert r["threads"] == m["threads"] == 2
    assert r["measured_steps"] == m["measured_steps"] == [3, 5] and r["steps"] == m["steps"] == 5
    assert r["warmup"] == m["warmup"] == 2 and r["cpu_s_at_go"] > 0 and m["cpu_s_at_go"] > 0
    assert r["steps_per_s"] > 0 and m["steps_per_s"] > 0 and r["cpu_s_per_step"] > 0 and m["cpu_s_per_step"] > 0
    # a share of the window, never past it (no timing asserted: the root arm's loop does work between steps)
    assert 0 < m["train_step_share"] <= 1.0 and 0 < r["train_step_share"] < 1.0


def test_other_cores_by_hand():
    assert offline.other_cores(100.0, 112.0, 4.0, 4.0) == pytest.approx(2.0)  # 12 busy s, 4 ours, over 4 s
    assert offline.other_cores(100.0, 101.0, 3.0, 1.0) == 0.0  # rounding of the readings: never negative
    assert offline.other_cores(None, 112.0, 4.0, 4.0) is None and offline.other_cores(1.0, 2.0, 0.0, 0.0) is None


def test_a_second_run_on_the_same_out_does_not_find_the_last_go(tmp_path):
    first = offline.fresh_barrier(tmp_path, "root", 0)
    (first / "go").touch()
    (first / "dflash-b4-root-0.ready").touch()
    again = offline.fresh_barrier(tmp_path, "root", 0)
    assert again == first and list(again.iterdir()) == []


@pytest.mark.reliability
@pytest.mark.parametrize("pairing", ["round", "process"])
def test_regression_a_whole_run_writes_its_provenance_and_captures_once(tmp_path, pairing):
    """End to end on the tiny random target (one round): ``--fill`` captures every position, the refill and the
    consumers capture nothing, and report.json starts with the provenance every bench JSON carries (regression: the
    H200 reports of session 11 named no command, commit or hardware). ``--pairing process``: each consumer's process
    runs both arms, so both have their figures from the same three processes. The ≥ 0.95 check is load-bound, not
    asserted."""
    import json

    out = tmp_path / "offline"
    subprocess.run([sys.executable, "-m", "artcache.bench.offline", "--out", str(out), "--target", "random:tiny-llama",
                    "--data", "synthetic", "--max-samples", "8", "--max-length", "64", "--steps", "4", "--warmup", "1",
                    "--rounds", "1", "--anchors", "4", "--timeout-s", "600", "--pairing", pairing], check=False,
                   timeout=900, capture_output=True)
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["pairing"] == pairing and set(report["rounds"]) == {"root", "memory"}
    assert all(len(r) == 1 and set(r[0]) == {"B4", "B8", "B16"} and min(r[0].values()) > 0
               for r in report["rounds"].values())
    logs = sorted(p.name for p in (out / "logs").glob("dflash-*.log"))
    assert len(logs) == (3 if pairing == "process" else 6), logs
    assert report["command"][1:3] == ["-m", "artcache.bench.offline"] and "commit" in report
    assert report["hardware"]["cpu_count"] >= 1
    checks = report["checks"]
    assert checks["fill_exit_0"] and checks["refill_captures_nothing"] and checks["no_capture_while_consumers_ran"]
    assert report["fill"]["captures"] == 8 and report["refill"]["captures"] == 0


@pytest.mark.parametrize("flags, says", [(["--blocks", "junk"], "--blocks 'junk'"), (["--rounds", "0"], "--rounds 0"),
                                         (["--steps", "0"], "--steps 0"), (["--blocks", "4,0"], "--blocks 0"),
                                         (["--out", "FILE"], "a file, not a directory")])
def test_regression_bad_flags_are_refused_in_one_line_before_the_fill(tmp_path, capsys, flags, says):
    """Regression: ``--blocks junk`` and ``--out`` naming a file failed by a traceback, ``--rounds 0`` after the
    fill (an empty median), ``--steps 0`` as a consumer 'not ready'. All are refused at once, exit 2, one line."""
    (tmp_path / "FILE").touch()
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    argv = ["--out", str(tmp_path / "out"), "--max-samples", "12", "--steps", "6", "--warmup", "1", *flags]
    assert offline.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and not (tmp_path / "out").exists()
