"""bench/training_curves.py: training seconds and steady rates from metrics.csv rows written per log interval
(a chained run's gap left out), the held-out table, and the CLI's PNG + JSON; torn and damaged
metrics.csv files (also as bench/vllm_served.py reads them)."""

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


def _cli(tmp_path, csv_path):
    png, js = tmp_path / "c.png", tmp_path / "c.json"
    return tc.main(["--metrics", f"d={csv_path}", "--png", str(png), "--json", str(js)]), png, js


def test_regression_a_torn_last_line_is_skipped_counted_and_said(tmp_path, capsys):
    """Regression: a metrics.csv whose last line a killed process cut mid-row gave a TypeError traceback."""
    _run(tmp_path / "m.csv")
    whole = tc.curves({"d": tmp_path / "m.csv"})["d"]
    with open(tmp_path / "m.csv", "a") as f:
        f.write("41,train/lo")  # no line end: the writer was killed mid-row
    code, _png, js = _cli(tmp_path, tmp_path / "m.csv")
    assert code == 0
    err = capsys.readouterr().err
    assert "skipped its torn last line (line 48" in err and str(tmp_path / "m.csv") in err
    got = json.loads(js.read_text())["experiments"]["d"]
    assert got["torn_lines_skipped"] == 1 and got["last_step"] == 40
    assert got["evals"] == whole["evals"] and whole["torn_lines_skipped"] == 0


@pytest.mark.parametrize("bad", ["20,train/loss\r\n", "20,train/loss,1.0,5.0,extra\r\n", "x,train/loss,1.0,5.0\r\n",
                                 "20,train/loss,one,5.0\r\n"])
def test_regression_a_row_damaged_before_the_last_line_is_refused_naming_file_and_line(tmp_path, capsys, bad):
    """Regression: a row with the wrong number of fields (or a non-number) gave a traceback; it is refused with
    one line naming the file and the line, exit 2, nothing written."""
    _run(tmp_path / "m.csv")
    lines = (tmp_path / "m.csv").read_bytes().decode().splitlines(keepends=True)
    lines.insert(5, bad)  # line 6
    (tmp_path / "m.csv").write_bytes("".join(lines).encode())
    code, png, js = _cli(tmp_path, tmp_path / "m.csv")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert str(tmp_path / "m.csv") in err[0] and "line 6 " in err[0] and "step,tag,value,wall_time" in err[0]
    assert not png.exists() and not js.exists()


@pytest.mark.parametrize("evals", ["none", "loss only"])
def test_regression_no_held_out_replay_tau_is_null_never_zero(tmp_path, capsys, evals):
    """Regression: with no ``eval/replay_tau`` rows the summary printed best τ 0 (a made-up figure)."""
    rows = [(s, "train/loss", 5.0 - s / 10, 1000.0 + s) for s in range(1, 11)]
    if evals == "loss only":
        rows.append((10, "eval/loss", 3.0, 1011.0))
    _write(tmp_path / "m.csv", rows)
    code, _png, js = _cli(tmp_path, tmp_path / "m.csv")
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["d"]["best_replay_tau"] is None
    assert json.loads(js.read_text())["experiments"]["d"]["best_replay_tau"] is None
    expected = "no held-out evaluation in " if evals == "none" else "no held-out replay_tau in "
    assert f"{expected}{tmp_path / 'm.csv'}" in err, err


def test_best_replay_tau_is_the_highest_held_out_value(tmp_path, capsys):
    _run(tmp_path / "m.csv")
    code, _png, _js = _cli(tmp_path, tmp_path / "m.csv")
    assert code == 0 and json.loads(capsys.readouterr().out)["d"]["best_replay_tau"] == 1.5


def test_regression_vllm_served_eval_at_skips_a_torn_last_line(tmp_path):
    """Regression: bench/vllm_served.py read metrics.csv with its own csv.DictReader (a torn last line: a
    traceback); it reads through the one reader now."""
    from artcache.bench.vllm_served import eval_at

    _run(tmp_path / "m.csv")
    with open(tmp_path / "m.csv", "a") as f:
        f.write("40,eval/replay_t")
    assert eval_at([tmp_path / "m.csv"], 40) == {"replay_tau": 1.4, "loss": 2.0}


def test_regression_outputs_in_a_missing_directory_and_repeated_names_are_one_line(tmp_path, capsys):
    """--png/--json in a missing directory gave a matplotlib traceback after the JSON
    was written; `--metrics x=a.csv --metrics x=b.csv` silently dropped a.csv. Both are one line, exit 2,
    nothing written."""
    _run(tmp_path / "m.csv")
    m = f"d={tmp_path / 'm.csv'}"
    ok_png, ok_js = tmp_path / "c.png", tmp_path / "c.json"
    for args, needle in (
            (["--metrics", m, "--png", str(tmp_path / "no" / "c.png"), "--json", str(ok_js)], "--png"),
            (["--metrics", m, "--png", str(ok_png), "--json", str(tmp_path / "no" / "c.json")], "--json"),
            (["--metrics", m, "--metrics", m, "--png", str(ok_png), "--json", str(ok_js)], "is given twice")):
        with pytest.raises(SystemExit) as exc:
            tc.main(args)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err and "Traceback" not in err, err
        assert not ok_png.exists() and not ok_js.exists()


def test_regression_json_records_the_arguments_it_ran_with(tmp_path, monkeypatch):
    """Run as `python -m`, the JSON's command had no arguments (argv None)."""
    _run(tmp_path / "m.csv")
    png, js = tmp_path / "c.png", tmp_path / "c.json"
    args = ["--metrics", f"d={tmp_path / 'm.csv'}", "--png", str(png), "--json", str(js)]
    monkeypatch.setattr(tc.sys, "argv", ["training_curves.py", *args])
    assert tc.main() == 0
    assert json.loads(js.read_text())["command"][1:] == ["-m", "artcache.bench.training_curves", *args]


def test_regression_evaluations_without_replay_plot_the_data_tau_and_the_held_out_loss(tmp_path, capsys, monkeypatch):
    """Regression: a DFlash-only run whose root lacked the target's last layer (no ``eval/replay_tau``) gave a
    PNG with empty τ panels and no held-out loss line; now its data-token τ is drawn, labelled so."""
    rows = [(s, "train/loss", 5.0 - s / 10, 1000.0 + s) for s in range(1, 21)]
    rows += [(10, "eval/tau", 1.8, 0.0), (10, "eval/loss", 3.0, 0.0), (20, "eval/tau", 2.4, 0.0),
             (20, "eval/loss", 2.5, 0.0)]
    _write(tmp_path / "m.csv", rows)
    drawn = []

    import matplotlib.axes

    real = matplotlib.axes.Axes.plot

    def spy(self, x, y, *a, **k):
        drawn.append((k.get("label"), list(x), list(y)))
        return real(self, x, y, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    code, png, js = _cli(tmp_path, tmp_path / "m.csv")
    assert code == 0 and png.exists()
    d = json.loads(js.read_text())["experiments"]["d"]
    assert d["best_replay_tau"] is None and d["best_data_tau"] == 2.4 and d["tau_figure"] == "tau"
    assert ("d (τ on data tokens)", [10, 20], [1.8, 2.4]) in drawn
    assert ("d held-out", [10, 20], [3.0, 2.5]) in drawn
    assert json.loads(capsys.readouterr().out)["d"]["best_data_tau"] == 2.4


def test_regression_a_nan_or_inf_evaluation_is_no_best_figure(tmp_path, capsys):
    """A NaN held-out τ before a real one gave ``best_replay_tau`` NaN (``max`` with a NaN
    first) and an inf one ``Infinity``: both invalid in strict JSON."""
    rows = [(s, "train/loss", 5.0 - s / 10, 1000.0 + s) for s in range(1, 41)]
    rows += [(20, "eval/replay_tau", float("nan"), 0.0), (40, "eval/replay_tau", 1.9, 0.0),
             (20, "eval/tau", float("inf"), 0.0), (40, "eval/tau", 2.1, 0.0)]
    _write(tmp_path / "m.csv", rows)
    code, _png, js = _cli(tmp_path, tmp_path / "m.csv")
    assert code == 0
    d = json.loads(js.read_text())["experiments"]["d"]
    assert d["best_replay_tau"] == 1.9 and d["best_data_tau"] == 2.1


def _strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity (not JSON: Python's reader accepts them)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_regression_a_nan_or_inf_evaluation_is_left_out_of_the_evals_table(tmp_path, capsys):
    """A NaN held-out figure (a zero denominator) reached the JSON's evals table as
    ``NaN`` (not JSON; strict readers refuse the file), an inf one as ``Infinity``, and a NaN train loss made the
    row's train_loss_median NaN. A non-finite figure is no figure: left out of its row, as it is no best figure."""
    rows = [(s, "train/loss", 5.0 - s / 10, 1000.0 + s) for s in range(1, 41)]
    rows[29] = (30, "train/loss", float("nan"), 1030.0)
    rows += [(20, "eval/replay_tau", float("nan"), 0.0), (20, "eval/loss", float("inf"), 0.0),
             (40, "eval/replay_tau", 1.9, 0.0), (40, "eval/loss", 2.0, 0.0), (40, "eval/tau", float("-inf"), 0.0)]
    _write(tmp_path / "m.csv", rows)
    code, png, js = _cli(tmp_path, tmp_path / "m.csv")
    assert code == 0 and png.exists()
    d = _strict(js.read_text())["experiments"]["d"]
    assert d["evals"][0] == {"step": 20, "train_seconds": d["evals"][0]["train_seconds"], "train_loss_median": 3.95}
    assert d["evals"][1]["replay_tau"] == 1.9 and d["evals"][1]["loss"] == 2.0 and "tau" not in d["evals"][1]
    assert d["evals"][1]["train_loss_median"] == pytest.approx(3.0)  # steps 1..40 but the NaN at 30: step 20's
    assert d["best_replay_tau"] == 1.9 and d["best_data_tau"] is None
    _strict(capsys.readouterr().out)


def test_regression_a_0_byte_metrics_csv_is_refused_with_one_line(tmp_path, capsys):
    """A 0-byte metrics.csv (not even its header) was read as a run with no rows and
    plotted silently; it is refused with one line naming it, exit 2, nothing written."""
    (tmp_path / "m.csv").write_bytes(b"")
    code, png, js = _cli(tmp_path, tmp_path / "m.csv")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"training_curves: error: metrics file {str(tmp_path / 'm.csv')!r} is empty (0 bytes, not even "
                      "its header); accepted: a metrics.csv with the header step,tag,value,wall_time and its rows")
    assert not png.exists() and not js.exists()


@pytest.mark.parametrize(("flags", "line"), [
    (["--png", "c.pngg"], "--png '{d}/c.pngg': matplotlib writes no 'pngg' image; accepted: a file name ending .avif"),
    (["--title", "cost $a_$"], "--title 'cost $a_$': matplotlib cannot parse its $...$ math; accepted: plain text"),
    (["--gap-s", "-5"], "--gap-s -5.0 is invalid: accepted finite seconds > 0"),
    (["--gap-s", "nan"], "--gap-s nan is invalid: accepted finite seconds > 0"),
])
def test_regression_plot_flags_matplotlib_refuses_are_one_line_before_anything(tmp_path, capsys, flags, line):
    """A --png suffix matplotlib does not write (c.pngg) and a --title whose $...$ math mathtext
    cannot parse gave matplotlib's traceback (dozens of lines for the title); a negative or NaN --gap-s was
    taken, every interval left out (train_seconds 0.0, steady rate null). Each is one line, exit 2, before any
    file is read, nothing written."""
    _run(tmp_path / "m.csv")
    png, js = tmp_path / "c.png", tmp_path / "c.json"
    args = ["--metrics", f"d={tmp_path / 'm.csv'}", "--png", str(png), "--json", str(js), *flags]
    args = [a.replace("c.pngg", str(tmp_path / "c.pngg")) for a in args]
    assert tc.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("training_curves: error: " + line.format(d=tmp_path)) and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]


def test_regression_outputs_are_written_at_their_path_atomically_and_a_full_disk_is_one_line(
        tmp_path, capsys, monkeypatch, full_temp_writes):
    """--png/--json naming a directory, or on a full disk, gave a traceback (the JSON's after the PNG
    was written); --png without a suffix was written to PATH.png, not PATH. A directory is refused (exit 2),
    a full disk is one line (exit 1) with no file or temp file left, a suffix-less --png is a PNG at its path."""


    _run(tmp_path / "m.csv")
    m = f"d={tmp_path / 'm.csv'}"
    (tmp_path / "adir").mkdir()
    for flag in ("--png", "--json"):
        paths = {"--png": str(tmp_path / "c.png"), "--json": str(tmp_path / "c.json"), flag: str(tmp_path / "adir")}
        with pytest.raises(SystemExit) as exc:
            tc.main(["--metrics", m, *(x for k, v in paths.items() for x in (k, v))])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"{flag} '{tmp_path / 'adir'}': is a directory; accepted" in err, err
    assert tc.main(["--metrics", m, "--png", str(tmp_path / "plot"), "--json", str(tmp_path / "c.json")]) == 0
    assert (tmp_path / "plot").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plot.png").exists()
    capsys.readouterr()
    full_temp_writes()
    out = tmp_path / "out"
    out.mkdir()
    assert tc.main(["--metrics", m, "--png", str(out / "c.png"), "--json", str(out / "c.json")]) == 1
    err = capsys.readouterr().err
    assert err == f"training_curves: error: writing {out / 'c.png'} failed: No space left on device\n", err
    assert list(out.iterdir()) == []
