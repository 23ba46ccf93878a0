"""Consumer tracking: metrics.csv (always), TensorBoard scalars (when installed), resume truncation, and the
progress bar (only on a terminal)."""

from __future__ import annotations

import io
import math
import sys

import pytest

from artcache.trainers.tracking import Progress, RunTracker, read_metrics, tensorboard_available


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
