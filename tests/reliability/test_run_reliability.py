"""`artcache run` killed through crash points (kill -9), then resumed (the rest: tests/protocol/test_run.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from artcache import journal as J
from artcache import registry
from artcache.app.cli import main
from artcache.layout import CacheLayout
from tests.protocol.test_run import DEADLINE_S, artcache_run, base_toml, exp, report_of, write
from tests.support import REPO


def _starts(out: Path, name: str) -> list:
    return [ev for ev in J.read_events(out / "cache" / "journal").events
            if isinstance(ev, J.ConsumerStart) and ev.consumer == name]


# kill -9 through crash points, like tests/reliability/test_crash.py
def test_two_experiments_resume_from_unequal_checkpoints(tiny_target, tmp_path):
    """Run 1: ``a`` is killed after committing step 4, ``b`` after step 2 (a checkpoint every step); the
    healthy ``c`` finishes anyway and the run exits 1. Run 2 resumes ``a`` and ``b``: each continues
    from its own checkpoint and reads exactly the positions from its own cursor to the end, so ``a``'s
    further progress never lets ``b`` skip a position."""
    out = tmp_path / "out"
    run1 = write(tmp_path / "run1.toml", base_toml(tiny_target, out, exp("a", save_every=1), exp("b", save_every=1),
                                                   exp("c")))
    proc = artcache_run(run1, "experiments.a.env.ARTCACHE_CRASH_AT=cursor.after-commit:4",
                        "experiments.b.env.ARTCACHE_CRASH_AT=cursor.after-commit:2")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    r1 = {x["name"]: x for x in report_of(out)["experiments"]}
    assert r1["c"]["state"] == "completed" and r1["c"]["steps_run"] == 6
    assert r1["a"]["exit_code"] == -9 and r1["b"]["exit_code"] == -9
    assert r1["a"]["registration"] == "failed" and r1["b"]["registration"] == "failed"  # fenced by the producer
    # no end record (SIGKILL): the fence settles their state, which stayed "running" before
    assert r1["a"]["state"] == r1["b"]["state"] == "failed", (r1["a"]["error"], r1["b"]["error"])
    assert "FAILED (killed by SIGKILL)" in proc.stdout
    fences = {ev.consumer for ev in J.read_events(out / "cache" / "journal").events if isinstance(ev, J.Fence)}
    assert {"a", "b"} <= fences
    run2 = write(tmp_path / "run2.toml", base_toml(tiny_target, out, exp("a", save_every=1), exp("b", save_every=1)))
    proc = artcache_run(run2, "experiments.a.resume=true", "experiments.b.resume=true")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r2 = report_of(out)
    by = {x["name"]: x for x in r2["experiments"]}
    a, b = by["a"], by["b"]
    assert a["cursor_start"] > b["cursor_start"] > 0, (a, b)
    assert a["start_step"] * 2 == a["cursor_start"] and b["start_step"] * 2 == b["cursor_start"]
    for x in (a, b):
        assert x["state"] == "completed" and x["cursor_end"] == 12 and x["last_step"] == 6
        assert x["steps_run"] == 6 - x["start_step"]
        pid = [ev.pid for ev in _starts(out, x["name"])][-1]
        # journal files are named by the writer's identity token since issue 18 (not by pid): look it up
        path = CacheLayout(out / "cache").journal_of("consumer", x["name"], pid)
        assert path is not None, (x["name"], pid, sorted(p.name for p in (out / "cache" / "journal").iterdir()))
        got = [ev.position for ev in J.iter_file(path) if isinstance(ev, J.Request)]
        assert got == list(range(x["cursor_start"], 12)), (x["name"], got)
    assert r2["shared_production"]["distinct_positions_consumed"] == 12 - b["cursor_start"]
    assert r2["checks"]["accounting_invariants"]


# kill -9 through crash points, like tests/reliability/test_crash.py
def test_full_experiment_list_resumes_skips_the_complete_one_and_extends_by_steps(tiny_target, tmp_path):
    """Keeping the full experiment list while one experiment was complete was refused
    both ways, ``steps`` was both the LR horizon and the stop (a run could not be extended), and a resumed
    run overwrote the run report (the complete experiment disappeared from it).

    Run 1: ``a`` completes (4 steps); ``b`` and ``c`` are killed after committing steps 2 and 4 (a
    checkpoint every step, so their last checkpoints are steps 1 and 3). Run 2, the same file unchanged:
    ``a`` is recognised as complete (its checkpoint is at its final step) and skipped, ``b`` and ``c``
    resume from their own unequal checkpoints and complete. Run 3 extends ``b`` by raising its ``steps``
    alone (``lr_total_steps`` is the horizon). Every report lists all three; ``artcache report`` prints the
    run directory."""
    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(
        tiny_target, out, exp("a", steps=4, save_every=1),
        exp("b", save_every=1, lr_total_steps=8), exp("c", save_every=1, lr_total_steps=8)))
    proc = artcache_run(cfg, "experiments.b.env.ARTCACHE_CRASH_AT=cursor.after-commit:2",
                        "experiments.c.env.ARTCACHE_CRASH_AT=cursor.after-commit:4")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    r1 = {x["name"]: x for x in report_of(out)["experiments"]}
    assert r1["a"]["state"] == "completed" and r1["b"]["exit_code"] == -9 and r1["c"]["exit_code"] == -9

    dry = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(cfg), "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert dry.returncode == 0 and "complete (not started)" in dry.stdout, dry.stdout + dry.stderr
    # the dry run refuses what the consumers would refuse after starting (a changed run setting)
    bad = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(cfg), "--dry-run",
                          "experiments.b.lr=1e-2"], cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    assert bad.returncode == 2 and "--lr 0.01 (checkpoint: 0.0006)" in bad.stderr, bad.stderr

    proc = artcache_run(cfg)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "experiment a complete: its checkpoint is at its final step 4; not started" in proc.stdout
    r2 = report_of(out)
    by = {x["name"]: x for x in r2["experiments"]}
    assert set(by) == {"a", "b", "c"} and len(r2["runs"]) == 2
    assert by["a"]["state"] == registry.COMPLETED and by["a"]["skipped"] and by["a"]["steps_run"] == 4  # its last run's
    # a SIGKILL loses the steps since the last checkpoint (docs/training.md): killed after committing steps 2
    # and 4, before checkpointing them, ``b`` and ``c`` resume from their step-1 and step-3 checkpoints
    assert (by["b"]["start_step"], by["c"]["start_step"]) == (1, 3)
    assert (by["b"]["cursor_start"], by["c"]["cursor_start"]) == (2, 6)
    for x in (by["b"], by["c"]):
        assert x["state"] == "completed" and x["last_step"] == 6 and len(x["history"]) == 1
    assert r2["checks"]["every_experiment_completed"]

    proc = artcache_run(cfg, "experiments.b.steps=8")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r3 = {x["name"]: x for x in report_of(out)["experiments"]}
    assert set(r3) == {"a", "b", "c"} and r3["a"]["skipped"] and r3["c"]["skipped"]
    assert (r3["b"]["start_step"], r3["b"]["last_step"], r3["b"]["cursor_end"]) == (6, 8, 16)
    assert len(r3["b"]["history"]) == 2
    text = CliRunner().invoke(main, ["report", str(out)])
    assert text.exit_code == 0, text.output
    assert text.output.index("Shared production") < text.output.index("Experiments:")
    for name, steps in (("a", "4/4"), ("b", "8/8"), ("c", "6/6")):
        row = next(line for line in text.output.splitlines() if line.strip().startswith(name + " "))
        assert "complete" in row and steps in row, row
    assert CliRunner().invoke(main, ["inspect", "--cache", str(out)]).exit_code == 0  # a run directory too
