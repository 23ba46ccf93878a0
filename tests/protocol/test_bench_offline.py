"""bench/offline.py's two arms (a pre-filled root read with no producer, batches held in memory) measure
the same thing: one process model and flag set, the same warm-up, the same torch threads, the same clock
at the same point and the same measured steps. The timing figures themselves come from the bench's runs
(docs/benchmarks.md), not from here."""

from __future__ import annotations

import sys
import types

import msgspec
import pytest
import torch

from artcache.bench import consumer_speed as cs
from artcache.bench import offline
from artcache.errors import WorkerFailed
from artcache.launch import Role
from artcache.rolespec import write_spec


def _args(tmp_path, **kw):
    base = dict(anchors=8, warmup=2, steps=3, timeout_s=60.0)
    return types.SimpleNamespace(**{**base, **kw})


def test_regression_both_arms_start_the_same_process_with_the_same_warmup(tmp_path):
    """Regression: the root arm ran ``artcache.bench.consume`` (its warm-up applied by the parent to the
    journal's step times) and the memory arm ``artcache.bench.offline --memory`` without ``--warmup``, so
    its worker skipped argparse's default 3 steps whatever ``--warmup`` the run was given. Both arms now
    start the same module with the same flags, ``--warmup`` included; only the arm differs."""
    args = _args(tmp_path, warmup=5)
    cfg = write_spec(tmp_path / "c.json", "consumer",
                     offline.consumer_config(args, tmp_path / "cache", 8, tmp_path / "runs" / "c", "c"))
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


def _role(tmp_path, name: str, code: str) -> Role:
    """A real worker process running ``code`` (its log under ``tmp_path``), in this test's process group."""
    return Role(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", new_session=False)


SLEEP = "import time; time.sleep(120)"


def test_release_round_names_a_consumer_that_exited_before_it_was_ready(tmp_path):
    gone = _role(tmp_path, "dflash-b4-root-0", "raise SystemExit(3)")
    gone.wait(30)
    with pytest.raises(WorkerFailed, match=r"dflash-b4-root-0 exited 3 before it was ready.*dflash-b4-root-0\.log"):
        offline.release_round(tmp_path, {4: gone}, 30.0)
    assert not (tmp_path / "go").exists()
    (tmp_path / "dflash-b4-root-0.ready").touch()
    offline.release_round(tmp_path, {4: gone}, 30.0)
    assert (tmp_path / "go").exists()


def test_regression_a_dead_worker_stops_the_others_and_is_named_in_one_line(tmp_path):
    """Regression: a worker killed after the go left the other two training to their end (the parent waited on each
    in turn), then the parent raised a traceback holding the dead one's log tail. Now the parent stops the others
    (SIGTERM, then SIGKILL) as soon as one dies and raises one line: the worker, its exit status, its log."""
    roles = {b: _role(tmp_path, f"dflash-b{b}-root-0", SLEEP) for b in (4, 8, 16)}
    try:
        roles[8].popen.kill()  # SIGKILL, as an OOM killer would
        with pytest.raises(WorkerFailed) as got:
            offline.wait_round(roles, 120.0)
        msg = str(got.value)
        assert "\n" not in msg and msg.startswith(f"worker dflash-b8-root-0 exited -9 (log {roles[8].log})")
        assert "stopped dflash-b4-root-0, dflash-b16-root-0" in msg and got.value.exit_code == 1
        assert all(r.popen.poll() is not None for r in roles.values())  # none left running
    finally:
        for r in roles.values():
            r.kill()


def test_regression_a_round_past_its_timeout_stops_every_worker(tmp_path):
    """Regression: ``p.wait(timeout)`` raised TimeoutExpired at the first worker past the timeout and left it and
    the ones after it running. Now every worker is stopped and the error is one line."""
    roles = {b: _role(tmp_path, f"dflash-b{b}-memory-0", SLEEP) for b in (4, 8)}
    try:
        with pytest.raises(WorkerFailed, match=r"^the workers did not finish within --timeout-s 0.3; stopped "
                                               r"dflash-b4-memory-0, dflash-b8-memory-0$"):
            offline.wait_round(roles, 0.3)
        assert all(r.popen.poll() is not None for r in roles.values())
    finally:
        for r in roles.values():
            r.kill()


def test_wait_round_returns_when_every_worker_exited_0(tmp_path):
    roles = {b: _role(tmp_path, f"w{b}", "print('{\"steps\": 1}')") for b in (4, 8)}
    offline.wait_round(roles, 60.0)
    assert [offline.figures_of(r) for r in roles.values()] == [{"steps": 1}, {"steps": 1}]
    with pytest.raises(WorkerFailed, match="w9 exited 0 but printed no figures"):
        offline.figures_of(_role(tmp_path, "w9", "pass"))


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
        got[mode] = offline.worker(mode, write_spec(tmp_path / f"{cid}.json", "consumer", cfg), args.warmup, barrier,
                                   30.0)
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


@pytest.mark.parametrize("flags, says", [(["--blocks", "junk"], "--blocks 'junk'"), (["--rounds", "0"], "--rounds 0"),
                                         (["--steps", "0"], "--steps 0"), (["--blocks", "4,0"], "--blocks 0"),
                                         (["--out", "FILE"], "a file, not a directory"),
                                         (["--commit-interval", "-1"], "--commit-interval -1 is not accepted"),
                                         (["--pairing", "steps", "--chunk", "4"], "--chunk 4 is not accepted"),
                                         (["--chunk", "6"], "--chunk 6 is not accepted with --pairing round"),
                                         (["--pairing", "steps", "--chunk", "5", "--steps", "1", "--warmup", "2"],
                                          "it measures 0 steps per arm")])
def test_regression_bad_flags_are_refused_in_one_line_before_the_fill(tmp_path, capsys, flags, says):
    """Regression: ``--blocks junk`` and ``--out`` naming a file failed by a traceback, ``--rounds 0`` after the
    fill (an empty median), ``--steps 0`` as a consumer 'not ready'. All are refused at once, exit 2, one line."""
    (tmp_path / "FILE").touch()
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    argv = ["--out", str(tmp_path / "out"), "--max-samples", "12", "--steps", "6", "--warmup", "1", *flags]
    assert offline.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_regression_a_second_run_on_the_same_out_is_refused_before_the_fill(tmp_path, capsys):
    """Regression: a second run on the same ``--out`` filled, then failed late: its consumers found the first run's
    checkpoints in ``runs/`` and the parent read only "not ready: exited" (the reason was in a worker log). ``--out``
    holds the first run's report and logs, results to keep, so the run is refused at once (exit 2, one line naming
    the directory and what to do) and nothing there is touched."""
    out = tmp_path / "out"
    (out / "runs" / "dflash-b4-root-0" / "checkpoints").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    argv = ["--out", str(out), "--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "4",
            "--max-length", "32", "--steps", "2", "--warmup", "1", "--rounds", "1", "--blocks", "4"]
    assert offline.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out} is not accepted: it holds an earlier run (runs, report.json)" in err
    assert "give another --out, or remove" in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and (out / "report.json").read_text() == "{}"
    (tmp_path / "empty").mkdir()
    offline.check_out(tmp_path / "missing")  # a directory to be made, or an empty one: accepted
    offline.check_out(tmp_path / "empty")


@pytest.mark.parametrize("warmup, steps, measured", [(0, 1, 0), (0, 2, 1), (1, 1, 1), (3, 20, 20)])
def test_regression_a_run_that_measures_no_step_is_refused_at_parse_time(tmp_path, capsys, warmup, steps, measured):
    """Regression: ``--warmup 0 --steps 1`` ran the fill and every round, then divided by zero in ``summarize``: the
    window starts at the end of step max(warmup, 1), so no step was measured. Refused at parse time (exit 2, one
    line, nothing written); the fewest steps :func:`offline.measured` counts decide what is accepted."""
    ends = [(i - 0.5, float(i), 0.1 * i) for i in range(1, warmup + steps + 1)]
    assert offline.measured_steps(warmup, steps) == measured  # the count measured() itself times:
    assert offline.measured(ends, warmup)["measured_steps"] == [window_start := max(warmup, 1) + 1, warmup + steps]
    assert warmup + steps - window_start + 1 == measured
    assert (offline.measured(ends, warmup)["steps_per_s"] > 0) == (measured >= offline.MIN_MEASURED)
    args = offline._parser().parse_args(["--out", str(tmp_path / "out"), "--warmup", str(warmup),
                                         "--steps", str(steps), "--max-samples", "40"])
    if measured >= offline.MIN_MEASURED:
        offline.check_args(args)
        return
    argv = ["--out", str(tmp_path / "out"), "--warmup", str(warmup), "--steps", str(steps), "--max-samples", "40"]
    assert offline.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--warmup 0 --steps 1 is not accepted: it measures 0 steps" in err
    assert "--steps at least 2" in err and not (tmp_path / "out").exists()


def _fake_sysfs(root, cores: dict[int, tuple[int, int]]):
    for cpu, (package, core) in cores.items():
        top = root / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text(f"{package}\n")
        (top / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_group_smt_siblings_and_pinned_workers_never_share_one(tmp_path):
    """8 logical CPUs, 4 cores of 2 SMT siblings (CPU i and i+4, as Linux numbers them); a CPU without topology is a
    core of its own. Each of 3 workers gets 2 CPUs of cores no other worker uses (the first core left over); with too
    few cores, none are pinned."""
    sysfs = _fake_sysfs(tmp_path, {i: (0, i % 4) for i in range(8)})
    cores = offline.physical_cores(set(range(8)) | {9}, sysfs)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7], [9]]
    sets = offline.cpu_sets(2, 2, cores)
    assert sets == [[1, 2], [3, 9]]
    used = [c for s in sets for c in s]
    assert len({next(i for i, core in enumerate(cores) if c in core) for c in used}) == len(used)
    assert offline.cpu_sets(3, 2, cores) is None  # 5 cores for 6 CPUs
    assert offline.cpu_sets(1, 2, cores[:2]) == [[0, 1]]  # exactly enough: the first core is used too


def test_regression_a_failed_fill_ends_the_bench_before_any_round(tmp_path, capsys):
    """Regression: a --fill that failed (here: a target that does not exist) was recorded and the rounds ran on the
    unfilled root, failing later in a worker. The bench now stops after the fill, exit 1, one line naming its log."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--target", str(tmp_path / "no-such-target"), "--data", "synthetic",
            "--max-samples", "4", "--max-length", "32", "--steps", "2", "--warmup", "1", "--rounds", "1"]
    assert offline.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "artcache producer --fill (fill) exited 2" in err, err
    assert str(out / "logs" / "fill.log") in err and not (out / "runs").exists() and not (out / "barriers").exists()


def test_interleaved_windows_leave_out_each_switch_and_pool_the_rest():
    """Chunks of one arm, each step 1 s of wall time (0.9 s inside train_step) and 2 CPU s: the first chunk's window
    starts after max(warmup, handover) steps, every later chunk's after ``handover``; the rates pool the windows."""
    def chunk(t0: float, n: int) -> list[tuple[float, float, float]]:
        return [(t0 + i + 0.1, t0 + i + 1.0, 2.0 * (t0 + i + 1.0)) for i in range(n)]

    got = offline.interleaved([chunk(0, 8), chunk(100, 8), chunk(200, 2)], warmup=4, handover=3)
    # counted: 8 - 4, 8 - 3, and none of a chunk no longer than the handover
    assert got["measured_steps"] == [9, 3] and got["steps"] == 18
    assert got["steps_per_s"] == pytest.approx(1.0) and got["cpu_s_per_step"] == pytest.approx(2.0)
    assert got["train_step_share"] == pytest.approx(0.9)
    slow = offline.interleaved([chunk(0, 8), [(100 + 2 * i + 0.1, 100 + 2 * i + 2.0, 0.0) for i in range(8)]], 3, 3)
    assert slow["steps_per_s"] == pytest.approx(10 / (5 + 10))  # 5 steps in 5 s, then 5 in 10 s


def test_regression_interleaved_steps_counts_what_interleaved_measures():
    """``--pairing steps --steps 1 --warmup 2 --chunk 5`` passed the checks, counted 0 steps
    per arm and ended in a ZeroDivisionError after the rounds. The count the check uses is the one :func:`interleaved`
    measures, for every split of a run into chunks."""
    def chunk(n: int) -> list[tuple[float, float, float]]:
        return [(i + 0.5, i + 1.0, 0.0) for i in range(n)]

    for warmup, steps, k in [(2, 1, 5), (3, 20, 5), (3, 150, 12), (0, 7, 5), (5, 30, 6)]:
        n = warmup + steps
        sizes = [k] * (n // k) + ([n % k] if n % k else [])
        got = offline.interleaved([chunk(m) for m in sizes], warmup, 3)["measured_steps"][0]
        assert offline.interleaved_steps(warmup, steps, k, 3) == got, (warmup, steps, k)
