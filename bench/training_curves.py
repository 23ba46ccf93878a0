"""Training curves of one or more experiments from their ``metrics.csv`` files: held-out greedy-replay τ
(incl. the +1 bonus token) and loss against steps and against training seconds, as a PNG and a JSON table.

    python -m artcache.bench.training_curves --metrics dflash=RUN/experiments/dflash/metrics.csv \\
        --metrics eagle3=... --png docs/img/curves.png --json bench/results/curves.json

``metrics.csv`` rows are ``step,tag,value,wall_time`` (:mod:`artcache.trainers.tracking`); a resumed run
appends to the same file. On CUDA a log interval's rows are written together once the GPU has finished
its steps (the sync-free step reads its metrics back every ``--log-every`` steps), so the wall time of a row
is when its interval ended. Training seconds count the wall time between consecutive ``train/loss`` rows,
leaving out gaps longer than ``--gap-s`` (the time between two pieces of a chained run, when nothing ran),
so each process's first interval (start-up, compile warm-up, the first capture) is not counted; where
several experiments share one GPU they are that experiment's seconds on the shared device. The steady rate
is the median over intervals of steps / seconds between two such writes.

A torn last line (cut mid-row by a killed process) is skipped and counted (``torn_lines_skipped``, and a line
on stderr); a file damaged anywhere else, or empty (0 bytes), is refused with one line naming it and the line
(exit 2, nothing written). So is, before any file is read, a ``--gap-s`` that is not finite seconds > 0, a ``--png``
whose suffix names no format matplotlib writes (``png`` when it has none; written at that exact path), a ``--title``
whose ``$...$`` math matplotlib cannot parse, or a ``--png``/``--json`` that is a directory; both are written
atomically (a full disk: one line, exit 1, no partial file). A NaN or inf held-out figure (a zero denominator) is
no figure: it is left out of its evaluation's row in the JSON (which has no NaN) and never a best figure. An
experiment without held-out evaluations (or without ``replay_tau`` among them) has ``best_replay_tau`` null, and
stderr says so: never a 0. Where an experiment's evaluations have no
``replay_tau`` (the root did not capture the target's last layer) but a τ on the held-out data tokens
(DFlash / DSpark ``tau``, incl. the +1 bonus), that τ is plotted instead, labelled "τ on data tokens",
and ``best_data_tau`` holds its highest value; the JSON's ``tau_figure`` says which one each plot shows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from artcache.bench.provenance import record
from artcache.errors import ConfigError, DataError, PublishError
from artcache.fsio import atomic_write
from artcache.ranges import Positive, check_value
from artcache.trainers.tracking import CSV_HEADER, read_metrics_file

__all__ = ["curves", "main", "read_metrics", "steady_rate", "training_seconds"]


def read_metrics(path: str | Path) -> tuple[dict[str, list[tuple[int, float, float]]], int | None]:
    """``({tag: [(step, value, wall_time), ...]}, torn_line)``: rows sorted by step (a step logged twice,
    e.g. replayed after a resume, keeps its last row); ``torn_line`` is the line number of a torn last line
    that was skipped, else None (:func:`artcache.trainers.tracking.read_metrics_file`).

    Raises:
        DataError: the file is empty (0 bytes: not even the header), or a line other than a torn last one is not
            a metrics row (names the file and the line).
    """
    if Path(path).stat().st_size == 0:  # regression: a 0-byte file was read as a run with no rows, silently
        raise DataError(f"metrics file {str(path)!r} is empty (0 bytes, not even its header); accepted: a "
                        f"metrics.csv with the header {','.join(CSV_HEADER)} and its rows")
    f = read_metrics_file(path)
    by_tag: dict[str, dict[int, tuple[float, float]]] = {}
    for step, tag, value, wall in f.rows:
        by_tag.setdefault(tag, {})[step] = (value, wall)
    return {t: [(s, v, w) for s, (v, w) in sorted(rows.items())] for t, rows in by_tag.items()}, f.torn_line


def training_seconds(rows: list[tuple[int, float, float]], gap_s: float) -> dict[int, float]:
    """Step -> seconds trained up to it: the sum of wall-time deltas between consecutive rows, a delta over
    ``gap_s`` (a stop between pieces) or below 0 counted as 0."""
    out, total, prev = {}, 0.0, None
    for step, _v, wall in rows:
        if prev is not None and 0 <= wall - prev <= gap_s:
            total += wall - prev
        out[step], prev = total, wall
    return out


def steady_rate(rows: list[tuple[int, float, float]], gap_s: float, burst_s: float = 0.5) -> float | None:
    """Median over write intervals of (steps between two writes) / (seconds between them): rows less than
    ``burst_s`` apart are one write (an interval's rows are written within milliseconds), intervals over
    ``gap_s`` are left out; None with fewer than two writes."""
    writes: list[tuple[float, int]] = []  # (wall time of a write's last row, its last step)
    for step, _v, wall in rows:
        if writes and 0 <= wall - writes[-1][0] < burst_s:
            writes[-1] = (wall, step)
        else:
            writes.append((wall, step))
    rates = [(s1 - s0) / (w1 - w0) for (w0, s0), (w1, s1) in zip(writes, writes[1:], strict=False)
             if 0 < w1 - w0 <= gap_s and s1 > s0]
    return statistics.median(rates) if rates else None


def _at(seconds: dict[int, float], step: int) -> float:
    earlier = [s for s in seconds if s <= step]
    return seconds[max(earlier)] if earlier else 0.0


def curves(metrics: dict[str, Path], gap_s: float = 60.0, window: int = 100) -> dict:
    """Per experiment: every held-out evaluation (step, training seconds, held-out figures, the median train
    loss over the ``window`` steps before it), the median train steps/s, ``best_replay_tau`` (the highest
    held-out ``replay_tau``; None when no evaluation reported one), ``best_data_tau`` (the highest held-out
    ``tau`` on data tokens, incl. the +1 bonus; None without one), ``tau_figure`` (``"replay_tau"``, else
    ``"tau"``, else None: what :func:`plot` draws) and ``torn_lines_skipped`` (0 or 1).

    Raises:
        DataError: a file is damaged other than by a torn last line (:func:`read_metrics`).
    """
    out = {}
    for name, path in metrics.items():
        m, torn = read_metrics(path)
        train = m.get("train/loss", [])
        secs = training_seconds(train, gap_s)
        evals = sorted({s for t, rows in m.items() if t.startswith("eval/") for s, _, _ in rows})
        table = []
        for step in evals:
            row = {"step": step, "train_seconds": round(_at(secs, step), 1)}
            for t, rows in m.items():
                if t.startswith("eval/") and "_per_step" not in t and not t.startswith("eval/acc_"):
                    v = next((v for s, v, _ in rows if s == step), None)
                    if v is not None and math.isfinite(v):  # NaN / inf: no figure, left out (JSON has neither)
                        row[t[5:]] = v
            recent = [v for s, v, _ in train if step - window < s <= step and math.isfinite(v)]
            row["train_loss_median"] = statistics.median(recent) if recent else None
            table.append(row)
        # a NaN or inf evaluation is no figure, left out of the table above (regression: max() with a NaN first
        # gave best NaN; the table itself carried NaN: both invalid JSON)
        taus = [e["replay_tau"] for e in table if "replay_tau" in e]
        data_taus = [e["tau"] for e in table if "tau" in e]
        out[name] = {"metrics_csv": str(path), "last_step": train[-1][0] if train else 0,
                     "train_seconds": round(secs[train[-1][0]], 1) if train else 0.0,
                     "steady_steps_per_s_median": steady_rate(train, gap_s), "evals": table,
                     "best_replay_tau": max(taus) if taus else None,
                     "best_data_tau": max(data_taus) if data_taus else None,
                     "tau_figure": "replay_tau" if taus else "tau" if data_taus else None,
                     "torn_lines_skipped": int(torn is not None)}
        if torn is not None:
            print(f"{name}: {path}: skipped its torn last line (line {torn}, cut mid-row as a killed writer leaves it)",
                  file=sys.stderr)
        if not taus:
            held = sorted({k for e in table for k in e if k not in ("step", "train_seconds", "train_loss_median")})
            print(f"{name}: no held-out evaluation in {path}: best_replay_tau null" if not table else
                  f"{name}: no held-out replay_tau in {path} (its evaluations report {', '.join(held) or 'nothing'}): "
                  "best_replay_tau null", file=sys.stderr)
    return out


def check_plot_args(png: Path, title: str) -> str:
    """The image format of ``--png`` (its suffix; ``png`` when it has none), refusing what :func:`plot` cannot
    write before anything is read: a format matplotlib does not write, or a ``--title`` it cannot draw (a
    ``$...$`` math span mathtext does not parse).

    Raises:
        ConfigError: one line naming the flag, its value and what is accepted.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    formats = sorted(FigureCanvasAgg(fig).get_supported_filetypes())
    fmt = png.suffix[1:].lower() or "png"
    if fmt not in formats:
        raise ConfigError(f"--png {str(png)!r}: matplotlib writes no {fmt!r} image; accepted: a file name ending "
                          f"{', '.join('.' + f for f in formats)} (or none: png)")
    fig.text(0, 0, title)
    try:
        fig.canvas.draw()
    except ValueError:  # mathtext's parse error, many lines
        raise ConfigError(f"--title {title!r}: matplotlib cannot parse its $...$ math; accepted: plain text, "
                          r"math mathtext parses between two $, or \$ for a dollar sign") from None
    return fmt


def plot(figures: dict, title: str, fmt: str = "png") -> bytes:
    """Three panels: held-out τ (each experiment's ``tau_figure``: greedy replay, else τ on the data tokens,
    said in its label) against steps, held-out and train loss against steps, held-out τ against training
    seconds. Returns the image in format ``fmt`` (the caller writes it)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=110)
    for i, (name, f) in enumerate(figures.items()):
        key, c = f.get("tau_figure"), f"C{i}"
        label = {"replay_tau": name, "tau": f"{name} (τ on data tokens)"}.get(key, f"{name} (no held-out τ)")
        ev = [e for e in f["evals"] if key in e] if key else []
        ax.plot([e["step"] for e in ev], [e[key] for e in ev], "o-", color=c, label=label)
        cx.plot([e["train_seconds"] for e in ev], [e[key] for e in ev], "o-", color=c, label=label)
        held = [e for e in f["evals"] if "loss" in e]
        bx.plot([e["step"] for e in held], [e["loss"] for e in held], "o-", color=c, label=f"{name} held-out")
        tr = [e for e in f["evals"] if e.get("train_loss_median") is not None]
        bx.plot([e["step"] for e in tr], [e["train_loss_median"] for e in tr], ":", color=c, label=f"{name} train")
    ax.set(xlabel="optimizer step", ylabel="held-out τ, greedy replay unless labelled (incl. +1 bonus)", title=title)
    bx.set(xlabel="optimizer step", ylabel="loss", yscale="log", title="held-out (solid) vs train (dotted) loss")
    cx.set(xlabel="training seconds (shared GPU)", ylabel="held-out τ, greedy replay unless labelled (incl. +1 bonus)",
           title="τ against training time")
    for a in (ax, bx, cx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", action="append", required=True, metavar="NAME=CSV")
    ap.add_argument("--png", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--title", default="held-out greedy-replay τ")
    ap.add_argument("--gap-s", type=float, default=60.0)
    ap.add_argument("--note", default="", help="free text recorded in the JSON (hardware, where it ran)")
    args = list(sys.argv[1:] if argv is None else argv)  # recorded in the JSON as given
    a = ap.parse_args(args)
    metrics = {}
    for spec in a.metrics:
        name, sep, p = spec.partition("=")
        if not sep or not name or not Path(p).is_file():
            ap.error(f"--metrics {spec!r}: accepted NAME=CSV with an existing metrics.csv file")
        if name in metrics:
            ap.error(f"--metrics {spec!r}: the name {name!r} is given twice; accepted: one NAME per curve")
        metrics[name] = Path(p)
    for flag, out in (("--png", a.png), ("--json", a.json)):
        if not out.parent.is_dir() or out.is_dir():
            ap.error(f"{flag} {str(out)!r}: " + ("is a directory" if out.is_dir() else
                     f"its directory {str(out.parent)!r} does not exist") + "; accepted: a file path in an existing "
                     "directory")
    try:
        check_value(a.gap_s, Positive, "--gap-s", seconds=True)
        fmt = check_plot_args(a.png, a.title)
        figures = curves(metrics, a.gap_s)
    except (ConfigError, DataError) as exc:
        print(f"training_curves: error: {exc}", file=sys.stderr)
        return exc.exit_code
    doc = json.dumps({**record("artcache.bench.training_curves", args), "note": a.note, "experiments": figures},
                     indent=1, allow_nan=False) + "\n"
    image = plot(figures, a.title, fmt)  # drawn before anything is written
    try:  # the PNG before the JSON: a plot that fails leaves no JSON claiming it
        atomic_write(a.png, [image], a.png.parent, durable=False)
        atomic_write(a.json, [doc.encode()], a.json.parent, durable=False)
    except PublishError as exc:  # a full or read-only filesystem (atomic_write left no temp file)
        print(f"training_curves: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({n: {"last_step": f["last_step"], "train_seconds": f["train_seconds"],
                          "steady_steps_per_s": f["steady_steps_per_s_median"],
                          "best_replay_tau": f["best_replay_tau"], "best_data_tau": f["best_data_tau"]}
                      for n, f in figures.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
