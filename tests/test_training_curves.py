"""bench/training_curves.py: training seconds and steady rates from metrics.csv rows written per log interval
(a chained run's gap left out), the held-out table, and the CLI's PNG + JSON."""

from __future__ import annotations

import csv
import json

import pytest

from artcache.bench import training_curves as tc


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "tag", "value", "wall_time"])
        w.writerows(rows)


def _run(path):
    """Steps 1-40, log every 10: each interval's rows written within 2 ms, 10 steps per 2 s; a 600 s stop
    (the next piece) after step 20; held-out evals at 0, 20 and 40."""
    rows, wall = [], 1000.0
    for step in range(1, 41):
        if step % 10 == 1 and step > 1:
            wall += 2.0 + (600.0 if step == 21 else 0.0)
        rows.append((step, "train/loss", 5.0 - step / 10, wall + ((step - 1) % 10) * 1e-4))
    for step, tau in ((0, 1.0), (20, 1.5), (40, 1.4)):
        rows += [(step, "eval/replay_tau", tau, 0.0), (step, "eval/loss", 3.0 - step / 40, 0.0)]
    _write(path, rows)


def test_seconds_rates_and_evals(tmp_path):
    _run(tmp_path / "m.csv")
    f = tc.curves({"d": tmp_path / "m.csv"}, gap_s=60.0, window=10)["d"]
    assert f["last_step"] == 40
    # intervals 1->2 and 3->4 counted (2 s each), the 600 s stop between pieces left out
    assert f["train_seconds"] == pytest.approx(4.0, abs=0.01)
    assert f["steady_steps_per_s_median"] == pytest.approx(5.0, rel=0.01)
    assert [e["step"] for e in f["evals"]] == [0, 20, 40]
    assert [e["replay_tau"] for e in f["evals"]] == [1.0, 1.5, 1.4]
    assert f["evals"][1]["train_loss_median"] == pytest.approx(5.0 - 15.5 / 10)


def test_cli_writes_png_and_json_and_refuses_a_missing_csv(tmp_path, capsys):
    _run(tmp_path / "m.csv")
    png, js = tmp_path / "c.png", tmp_path / "c.json"
    assert tc.main(["--metrics", f"d={tmp_path / 'm.csv'}", "--png", str(png), "--json", str(js)]) == 0
    assert png.stat().st_size > 0
    rec = json.loads(js.read_text())
    assert rec["experiments"]["d"]["last_step"] == 40 and "commit" in rec
    with pytest.raises(SystemExit) as exc:
        tc.main(["--metrics", f"d={tmp_path / 'none.csv'}", "--png", str(png), "--json", str(js)])
    assert exc.value.code == 2 and "accepted NAME=CSV" in capsys.readouterr().err
