"""Per-consumer tracking: ``metrics.csv`` always, TensorBoard scalars when available, a progress bar.

Files under the consumer's run directory::

    metrics.csv     step,tag,value,wall_time  (one row per scalar; wall_time = time.time(), seconds)
    tensorboard/    event files (only when the ``tensorboard`` package is importable: the ``track``
                    extra installs it); the same tags as the CSV

Tags: ``train/loss``, ``train/tau`` (acceptance length **including the +1 bonus token**),
``train/acc_<k>``, ``train/lr``, ``train/steps_per_s``, ``train/wait_s`` (time this step waited for
data), ``train/wait_total_s``; ``eval/...`` for held-out evaluations (see artcache.trainers.evaluation).
Every ratio is computed once from summed numerators and denominators (artcache.trainers.draft.MetricSums).

On ``--resume`` from step S, rows with step > S (written by the run that died after its last
checkpoint) are dropped from ``metrics.csv`` and TensorBoard is told to purge them
(``purge_step = S + 1``), so the curve continues without duplicates.

A process killed mid-write leaves a *torn* last line (no line end). Readers
(:func:`read_metrics_file`) skip it and say so; a writer reopening the file cuts it off first, so the
next row never joins it. Any other line that is not a row is damage: readers refuse the file, naming it
and the line.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import sys
import time
from pathlib import Path

import msgspec

from artcache.errors import DataError
from artcache.fsio import atomic_write

log = logging.getLogger("artcache.consumer")

CSV_HEADER = ("step", "tag", "value", "wall_time")


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write event files (needs the ``tensorboard`` package)."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception:  # ImportError, or a broken install (protobuf mismatch): tracking is optional
        return False
    return True


class RunTracker:
    """Writes scalars to ``run_dir/metrics.csv`` (and TensorBoard when asked and available).

    Args:
        run_dir: the consumer's run directory (created if absent).
        tensorboard: write TensorBoard event files if the package is importable.
        resume_step: on resume, the checkpoint's step: later rows are dropped (see module docstring).
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.run_dir / "metrics.csv"
        if resume_step is not None and self.csv_path.is_file():
            _truncate_csv(self.csv_path, resume_step)
        elif self.csv_path.is_file():
            _cut_torn_tail(self.csv_path)
        new = not self.csv_path.is_file() or self.csv_path.stat().st_size == 0
        self._fh = open(self.csv_path, "a", newline="")  # noqa: SIM115 - open for the run, closed in close()
        self._csv = csv.writer(self._fh)
        if new:
            self._csv.writerow(CSV_HEADER)
        self.tb = None
        self.tensorboard_dir: Path | None = None
        if tensorboard and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = self.run_dir / "tensorboard"
            purge = resume_step + 1 if resume_step is not None else None
            self.tb = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge)
        elif tensorboard:
            log.info("tensorboard is not installed (pip install 'artcache[track]'): metrics go to %s only",
                     self.csv_path)

    def scalar(self, step: int, tag: str, value: float) -> None:
        """One scalar. NaN values (a denominator of 0) are written to the CSV as ``nan``."""
        value = float(value)
        self._csv.writerow((step, tag, repr(value) if math.isfinite(value) else str(value), f"{time.time():.3f}"))
        if self.tb is not None:
            self.tb.add_scalar(tag, value, step)

    def scalars(self, step: int, prefix: str, values: dict) -> None:
        """Every number in ``values`` as ``prefix/name``; a list ``acc`` becomes ``prefix/acc_1`` … (a None
        value or entry, a figure with a zero denominator, is left out)."""
        for name, value in values.items():
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (list, tuple)):
                for k, v in enumerate(value, start=1):
                    if isinstance(v, (int, float)) and not isinstance(v, bool):  # None: not measured
                        self.scalar(step, f"{prefix}/{name}_{k}", v)
            elif isinstance(value, (int, float)):
                self.scalar(step, f"{prefix}/{name}", value)

    def flush(self) -> None:
        self._fh.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def _complete_part(data: bytes) -> bytes:
    """``data`` up to and including its last line end (a torn last line, with none, left out)."""
    return data[:data.rfind(b"\n") + 1]


def _cut_torn_tail(path: Path) -> None:
    """Rewrite ``path`` atomically without a torn last line (one with no line end), if it has one."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        atomic_write(path, [_complete_part(data)], path.parent)


def _truncate_csv(path: Path, keep_through_step: int) -> None:
    """Rewrite ``path`` atomically without the rows whose step is > ``keep_through_step`` (and without a
    torn last line)."""
    text = _complete_part(path.read_bytes()).decode(errors="replace")
    out = io.StringIO()
    w = csv.writer(out)
    rows = list(csv.reader(io.StringIO(text)))
    for i, row in enumerate(rows):
        if i == 0 or not row:
            if row:
                w.writerow(row)
            continue
        try:
            if int(row[0]) > keep_through_step:
                continue
        except ValueError:
            continue
        w.writerow(row)
    atomic_write(path, [out.getvalue().encode()], path.parent)  # fsynced, like every atomic write


class MetricsFile(msgspec.Struct, frozen=True, kw_only=True):
    """One ``metrics.csv`` as read by :func:`read_metrics_file`.

    Attributes:
        rows: ``(step, tag, value, wall_time)`` in file order; value as written (``nan`` for a figure with
            a zero denominator), wall_time in seconds since the epoch.
        torn_line: the 1-based line number of a torn last line that was skipped (cut mid-row: no line
            end, as a process killed while writing leaves it), else None.
    """

    rows: list[tuple[int, str, float, float]]
    torn_line: int | None = None


def read_metrics_file(path: str | Path) -> MetricsFile:
    """Every row of a ``metrics.csv`` (``step,tag,value,wall_time``), skipping blank lines and a torn last line.

    Raises:
        DataError: the header is not ``step,tag,value,wall_time``, or a line before the last is not a row
            (another number of fields, a step that is not an integer, a value or wall time that is not a
            number, bytes that are not UTF-8): one line naming the file and the line.
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    complete = _complete_part(data)
    lines = complete.split(b"\n")[:-1]
    torn = len(lines) + 1 if len(complete) < len(data) else None
    rows: list[tuple[int, str, float, float]] = []
    accepted = "accepted rows of step,tag,value,wall_time (an integer, a tag, two numbers); only a torn last line " \
               "(no line end, as a killed writer leaves it) is skipped"
    for n, raw in enumerate(lines, start=1):
        try:
            line = raw.decode().rstrip("\r")
        except UnicodeDecodeError:
            raise DataError(f"metrics file {str(path)!r}: line {n} is not UTF-8 text; {accepted}") from None
        if not line:
            continue
        fields = next(csv.reader([line]))
        if n == 1:
            if tuple(fields) != CSV_HEADER:
                raise DataError(f"metrics file {str(path)!r}: line 1 {line[:80]!r} is not the header "
                                f"{','.join(CSV_HEADER)}")
            continue
        try:
            if len(fields) != len(CSV_HEADER):
                raise ValueError
            rows.append((int(fields[0]), fields[1], float(fields[2]), float(fields[3])))
        except ValueError:
            raise DataError(f"metrics file {str(path)!r}: line {n} {line[:80]!r} is not a metrics row; "
                            f"{accepted}") from None
    return MetricsFile(rows=rows, torn_line=torn)


def read_metrics(path: str | Path) -> list[tuple[int, str, float]]:
    """Rows of a ``metrics.csv`` as ``(step, tag, value)`` (:func:`read_metrics_file`: a torn last line is
    skipped; DataError for a damaged line elsewhere)."""
    return [(s, t, v) for s, t, v, _ in read_metrics_file(path).rows]


class Progress:
    """A progress bar on stderr (tqdm) with steps/s, τ and time spent waiting for data.

    Disabled (every method a no-op) when ``enabled`` is False or stderr is not a TTY; log lines are
    unaffected (while the bar is shown they are printed above it).
    """

    def __init__(self, total: int, initial: int, enabled: bool, desc: str) -> None:
        self.bar = None
        self._redirect = None
        if not enabled or not sys.stderr.isatty():
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        from artcache.logs import progress_bar

        self.bar = progress_bar(total, enabled=True, desc=desc, unit="step", initial=initial, dynamic_ncols=True,
                                smoothing=0.1)
        self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def update(self, steps_per_s: float, tau: float | None, wait_total_s: float, label: str = "tau") -> None:
        if self.bar is None:
            return
        post = {"steps/s": f"{steps_per_s:.2f}", "wait": f"{wait_total_s:.1f}s"}
        if tau is not None and math.isfinite(tau):
            post[label] = f"{tau:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is None:
            return
        self.bar.close()
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
        self.bar = None
