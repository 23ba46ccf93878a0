"""Consumer tracking: metrics.csv (always), TensorBoard scalars (when installed), resume truncation, and the
progress bar (only on a terminal)."""

from __future__ import annotations

import io
import math
import sys

import pytest

from artcache.trainers.tracking import Progress, RunTracker, read_metrics, tensorboard_available
from tests.support import REPO


def test_csv_rows_and_lists(tmp_path):
    t = RunTracker(tmp_path, tensorboard=False)
    t.scalars(1, "train", {"loss": 2.5, "acc": [0.5, float("nan")], "tau_includes_bonus": True, "labels": "x"})
    t.scalar(2, "train/loss", 2.0)
    t.close()
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [(s, tag) for s, tag, _ in rows] == [(1, "train/loss"), (1, "train/acc_1"), (1, "train/acc_2"),
                                                (2, "train/loss")]
    assert rows[0][2] == 2.5 and math.isnan(rows[2][2])
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "step,tag,value,wall_time"
    assert not (tmp_path / "tensorboard").exists()


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    t = RunTracker(tmp_path, tensorboard=False)
    for step in range(1, 8):
        t.scalar(step, "train/loss", 10.0 - step)
    t.close()
    t = RunTracker(tmp_path, tensorboard=False, resume_step=4)  # the dead run got to step 7, its checkpoint is 4
    for step in range(5, 9):
        t.scalar(step, "train/loss", 100.0 + step)
    t.close()
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [s for s, _, _ in rows] == list(range(1, 9))
    assert [v for _, _, v in rows] == [9.0, 8.0, 7.0, 6.0, 105.0, 106.0, 107.0, 108.0]


@pytest.mark.skipif(not tensorboard_available(), reason="tensorboard is not installed (artcache[track])")
def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = RunTracker(tmp_path, tensorboard=True)
    t.scalars(3, "eval", {"tau": 2.5, "acc": [0.25]})
    t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"eval/tau", "eval/acc_1"}
    ev = acc.Scalars("eval/tau")
    assert [(e.step, e.value) for e in ev] == [(3, 2.5)]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    p = Progress(10, 0, True, "c")
    assert p.bar is None  # not a TTY: off
    p.update(1.0, 2.0, 0.5)
    p.close()
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    p = Progress(10, 4, False, "c")
    assert p.bar is None  # --no-progress
    p = Progress(10, 4, True, "c")
    p.update(2.5, 1.75, 3.25)
    p.close()
    out = tty.getvalue()
    assert "5/10" in out and "steps/s=2.50" in out and "tau=1.75" in out and "wait=3.2s" in out


def test_regression_read_metrics_skips_a_torn_last_line_and_refuses_damage_elsewhere(tmp_path):
    """Regression: a torn last line (killed mid-row) broke the readers with a traceback; a damaged line before
    the last must be refused, naming the file and the line."""
    from artcache.errors import DataError
    from artcache.trainers.tracking import read_metrics_file

    t = RunTracker(tmp_path, tensorboard=False)
    for step in (1, 2):
        t.scalar(step, "train/loss", 3.0 - step)
    t.close()
    path = tmp_path / "metrics.csv"
    with open(path, "a") as f:
        f.write("3,train/loss,0.")
    got = read_metrics_file(path)
    assert [r[:3] for r in got.rows] == [(1, "train/loss", 2.0), (2, "train/loss", 1.0)] and got.torn_line == 4
    assert read_metrics_file(tmp_path / "metrics.csv").rows[0][3] > 0  # wall time, seconds
    path.write_text("step,tag,value,wall_time\n1,train/loss,2.0\n2,train/loss,1.0,5.0\n")
    with pytest.raises(DataError, match=r"metrics\.csv'?: line 2 '1,train/loss,2\.0' is not a metrics row"):
        read_metrics(path)
    path.write_text("step,tag,value\n")
    with pytest.raises(DataError, match="line 1 .* is not the header step,tag,value,wall_time"):
        read_metrics(path)


@pytest.mark.parametrize("resume_step", [None, 2])
def test_regression_a_writer_reopening_a_torn_file_cuts_the_torn_line_off(tmp_path, resume_step):
    """Regression: a row appended after a torn last line joined it (``2,eval/replay_ta3,train/loss,...``),
    damage in the middle of the file; reopening cuts the torn line off first (resume or not)."""
    t = RunTracker(tmp_path, tensorboard=False)
    for step in (1, 2):
        t.scalar(step, "train/loss", 3.0 - step)
    t.close()
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,eval/replay_ta")  # killed mid-row, at a step the resume keeps
    t = RunTracker(tmp_path, tensorboard=False, resume_step=resume_step)
    t.scalar(3, "train/loss", 0.5)
    t.close()
    assert read_metrics(tmp_path / "metrics.csv") == [(1, "train/loss", 2.0), (2, "train/loss", 1.0),
                                                       (3, "train/loss", 0.5)]


# ---- W&B and MLflow beside TensorBoard ------------------------------------------------------------------

def _have(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


needs_wandb = pytest.mark.skipif(not _have("wandb"), reason="wandb is not installed (artcache[wandb])")
needs_mlflow = pytest.mark.skipif(not _have("mlflow"), reason="mlflow is not installed (artcache[mlflow])")


@pytest.fixture()
def offline_trackers(tmp_path, monkeypatch):
    """W&B offline under tmp_path/wandb, an MLflow file store at tmp_path/mlruns; returns (wandb dir, mlflow uri)."""
    wandb_dir, uri = tmp_path / "wandb", f"file://{tmp_path / 'mlruns'}"
    wandb_dir.mkdir()
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
                 "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(k, v)
    return wandb_dir, uri


def _log_steps(t: RunTracker, steps, base: float = 0.0) -> None:
    for step in steps:
        t.scalars(step, "train", {"loss": base + 1.0 / step, "acc": [0.5, float("nan")], "lr": 1e-3 * step})
    t.scalars(steps[-1], "eval", {"tau": 2.25, "loss": float("nan")})


@needs_wandb
@needs_mlflow
@pytest.mark.skipif(not tensorboard_available(), reason="tensorboard is not installed (artcache[track])")
def test_wandb_and_mlflow_get_the_scalars_tensorboard_gets(tmp_path, offline_trackers):
    """One run per consumer on each tracker, named by its id, with exactly TensorBoard's (and metrics.csv's) tags,
    steps and values, NaN included; a resume in the same run directory continues the same runs."""
    from tests.support.tracker_runs import mlflow_runs, same_points, tensorboard_scalars, wandb_runs

    wandb_dir, uri = offline_trackers
    runs = {}
    for name in ("exp-a", "exp-b"):
        runs[name] = tmp_path / "runs" / name
        t = RunTracker(runs[name], tensorboard=True, trackers=["wandb", "mlflow"], run_name=name, project="artcache")
        _log_steps(t, [1, 2, 3], base=len(name))
        t.close()
    wb, ml = wandb_runs(wandb_dir), mlflow_runs(uri)
    assert set(wb) == set(ml) == {"exp-a", "exp-b"}
    for name, run_dir in runs.items():
        tb = tensorboard_scalars(run_dir / "tensorboard")
        csv = {}
        for step, tag, v in read_metrics(run_dir / "metrics.csv"):
            csv.setdefault(tag, []).append((step, v))
        assert same_points(tb, csv)
        assert set(tb) == {"train/loss", "train/acc_1", "train/acc_2", "train/lr", "eval/tau", "eval/loss"}
        assert same_points(wb[name]["scalars"], tb), (wb[name]["scalars"], tb)
        assert same_points(ml[name]["scalars"], tb), (ml[name]["scalars"], tb)
        assert wb[name]["project"] == "artcache" and ml[name]["status"] == "FINISHED"
        assert ml[name]["tags"]["artcache.run_dir"] == str(run_dir.absolute())
    # a resume from step 3 in exp-a's run directory: the same W&B run id and the same MLflow run, continued
    t = RunTracker(runs["exp-a"], tensorboard=True, resume_step=3, trackers=["wandb", "mlflow"], run_name="exp-a")
    _log_steps(t, [4, 5])
    t.close()
    wb2, ml2 = wandb_runs(wandb_dir), mlflow_runs(uri)
    assert wb2["exp-a"]["id"] == wb["exp-a"]["id"] and ml2["exp-a"]["id"] == ml["exp-a"]["id"]
    assert len(ml2) == 2 and [s for s, _ in ml2["exp-a"]["scalars"]["train/loss"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in sorted(wb2["exp-a"]["scalars"]["train/loss"])] == [1, 2, 3, 4, 5]
    assert same_points(ml2["exp-a"]["scalars"], tensorboard_scalars(runs["exp-a"] / "tensorboard"))


def test_trackers_are_checked_before_anything_starts(tmp_path, monkeypatch):
    from artcache.errors import ConfigError
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.tracking import check_trackers

    with pytest.raises(ConfigError, match=r"--tracker 'swanlab' is not accepted; accepted: wandb, mlflow"):
        check_trackers(["swanlab"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError, match=r"--tracker wandb needs the wandb package, which is not installed: pip "
                                          r"install 'artcache\[wandb\]'"):
        ConsumerConfig(cache=str(tmp_path), trackers=["wandb"]).validate()
    with pytest.raises(ConfigError):
        RunTracker(tmp_path / "r", tensorboard=False, trackers=["wandb"])
    assert not (tmp_path / "r" / "wandb").exists()


@needs_wandb
@needs_mlflow
@pytest.mark.skipif(not tensorboard_available(), reason="tensorboard is not installed (artcache[track])")
@pytest.mark.timeout(900)
def test_artcache_run_keeps_one_tracker_run_per_experiment(tiny_target, tmp_path, offline_trackers):
    """``artcache run`` with two experiments asking for W&B (offline) and MLflow (file store): each experiment
    has one run on each, named by it, holding the scalars its TensorBoard files hold."""
    import json
    import os
    import subprocess

    from tests.support.tracker_runs import mlflow_runs, same_points, tensorboard_scalars, wandb_runs

    repo = REPO
    out, (wandb_dir, uri) = tmp_path / "out", offline_trackers
    exps = "".join(f"""
[[experiments]]
name = "{name}"
block_size = 4
anchors = 4
batch_size = 2
steps = 3
lr = {lr}
window = "2:8"
threads = 1
log_every = 1
[experiments.consumer]
progress = false
trackers = ["wandb", "mlflow"]
""" for name, lr in (("lr-hi", 1e-3), ("lr-lo", 1e-4)))
    (tmp_path / "run.toml").write_text(f"""
out = "{out}"
[target]
name = "{tiny_target.path}"
threads = 1
[data]
dataset = "{repo / 'tests' / 'data' / 'tiny_sharegpt.json'}"
max_length = 96
max_samples = 12
[capture]
draft_layers = 3
[cache]
done_grace_s = 1.0
demand_timeout_s = 300.0
{exps}""")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(tmp_path / "run.toml")], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all(x["state"] == "completed" for x in json.loads((out / "report.json").read_text())["experiments"])
    wb, ml = wandb_runs(wandb_dir), mlflow_runs(uri)
    assert set(wb) == set(ml) == {"lr-hi", "lr-lo"}
    for name in ("lr-hi", "lr-lo"):
        tb = tensorboard_scalars(out / "experiments" / name / "tensorboard")
        assert "train/loss" in tb and [s for s, _ in tb["train/loss"]] == [1, 2, 3]
        assert same_points(wb[name]["scalars"], tb) and same_points(ml[name]["scalars"], tb)
    assert wb["lr-hi"]["scalars"]["train/lr"] != wb["lr-lo"]["scalars"]["train/lr"]
