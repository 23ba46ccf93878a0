"""Per-consumer tracking: ``metrics.csv`` always, TensorBoard scalars when available, W&B and MLflow runs when
asked for, a progress bar.

Files under the consumer's run directory::

    metrics.csv     step,tag,value,wall_time  (one row per scalar; wall_time = time.time(), seconds)
    tensorboard/    event files (only when the ``tensorboard`` package is importable: the ``track``
                    extra installs it); the same tags as the CSV
    wandb/          W&B's run files (``trackers = ["wandb"]``; unless ``WANDB_DIR`` says where)

Every destination is a :class:`Tracker` (``scalar``, ``flush``, ``close``): :class:`TensorBoardTracker`,
:class:`WandbTracker` (the ``wandb`` extra) and :class:`MlflowTracker` (the ``mlflow`` extra) get the same
scalars as the CSV, under the same tags and steps. W&B and MLflow keep one run per consumer (per experiment
of ``artcache run``), named by its consumer id, in the project / experiment ``tracker_project``: W&B's run
id is derived from the run directory and MLflow's run is found by its ``artcache.run_dir`` tag, so a
``--resume`` continues the same run. Their own settings come from their environment variables (``WANDB_MODE``,
``WANDB_DIR``, ``WANDB_ENTITY``, ``MLFLOW_TRACKING_URI`` ...).

Tags: ``train/loss``, ``train/tau`` (acceptance length **including the +1 bonus token**),
``train/acc_<k>``, ``train/lr``, ``train/steps_per_s``, ``train/wait_s`` (time this step waited for
data), ``train/wait_total_s``; ``eval/...`` for held-out evaluations (see artcache.trainers.evaluation).
Every ratio is computed once from summed numerators and denominators (artcache.trainers.draft.MetricSums).

On ``--resume`` from step S, rows with step > S (written by the run that died after its last
checkpoint) are dropped from ``metrics.csv`` and TensorBoard is told to purge them
(``purge_step = S + 1``), so the curve continues without duplicates. W&B and MLflow cannot delete logged
points: MLflow keeps both values of a step the dead run logged after S; W&B keeps the dead run's and drops
the resumed run's for steps at or below its last logged step.

A process killed mid-write leaves a *torn* last line (no line end). Readers
(:func:`read_metrics_file`) skip it and say so; a writer reopening the file cuts it off first, so the
next row never joins it. Any other line that is not a row is damage: readers refuse the file, naming it
and the line.
"""

from __future__ import annotations

import abc
import csv
import hashlib
import importlib.util
import io
import logging
import math
import os
import sys
import time
from pathlib import Path

import msgspec

from artcache.errors import ConfigError, DataError
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


#: the trackers a consumer may add beside metrics.csv and TensorBoard (``trackers``), and the extra installing each
TRACKERS = {"wandb": "wandb", "mlflow": "mlflow"}


def check_trackers(names) -> None:
    """Refuse an unknown tracker name, or one whose package is not installed, before anything starts.

    Raises:
        ConfigError: ``--tracker NAME`` naming the accepted names, or the extra that installs it.
    """
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"--tracker {name!r} is not accepted; accepted: {', '.join(TRACKERS)} (metrics.csv and "
                              "TensorBoard are always written)")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--tracker {name} needs the {name} package, which is not installed: pip install "
                              f"'artcache[{TRACKERS[name]}]'")


class Tracker(abc.ABC):
    """One destination of a consumer's scalars besides ``metrics.csv``.

    ``scalar(step, tag, value)``: one value (``value`` a float, possibly NaN; ``step`` the optimizer step,
    non-decreasing except on a resume); ``flush()``: hand what is buffered to the backend; ``close()``: flush
    and end the run."""

    name = "tracker"

    @abc.abstractmethod
    def scalar(self, step: int, tag: str, value: float) -> None:
        """Record one value (each backend its own way)."""

    def flush(self) -> None:  # noqa: B027 - a backend with nothing buffered has nothing to hand over
        """Hand what is buffered to the backend (nothing, by default)."""

    def close(self) -> None:
        self.flush()


class TensorBoardTracker(Tracker):
    """Event files under ``run_dir/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``); on a resume from
    step S the points after S are purged (``purge_step = S + 1``)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=resume_step + 1 if resume_step is not None
                                    else None)

    def scalar(self, step: int, tag: str, value: float) -> None:
        self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def run_key(run_dir: Path) -> str:
    """A stable id of a consumer's run: 16 hex digits of the SHA-256 of its absolute run directory (W&B's run
    id, so a ``--resume`` in the same directory continues the same W&B run)."""
    return hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]


class WandbTracker(Tracker):
    """A W&B run (``wandb.init(project, name, id=run_key(run_dir), resume="allow")``), its files under
    ``WANDB_DIR`` or the run directory; ``WANDB_MODE=offline`` keeps it on disk. Scalars of one step are sent as
    one ``run.log(..., step=step)``."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, project: str) -> None:
        import wandb

        kw = {} if os.environ.get("WANDB_DIR") else {"dir": str(run_dir)}
        self.run = wandb.init(project=project, name=run_name, id=run_key(run_dir), resume="allow",
                              settings=wandb.Settings(silent=True, console="off"), **kw)
        self._step: int | None = None
        self._row: dict[str, float] = {}

    def scalar(self, step: int, tag: str, value: float) -> None:
        if self._step is not None and step != self._step:
            self.flush()
        self._step = step
        self._row[tag] = value

    def flush(self) -> None:
        if self._row:
            self.run.log(self._row, step=self._step)
            self._row = {}

    def close(self) -> None:
        self.flush()
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``project`` (created if absent) at ``MLFLOW_TRACKING_URI`` (``mlflow``'s
    default otherwise), named ``run_name`` and tagged ``artcache.run_dir``: a later start in the same run
    directory (a resume) continues that run. Scalars are buffered and sent with ``log_batch`` on ``flush``."""

    name = "mlflow"
    _BATCH = 1000  # MLflow's limit of metrics per log_batch

    def __init__(self, run_dir: Path, run_name: str, project: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        exp_id = self._experiment(project)
        where = str(Path(run_dir).absolute())
        found = self.client.search_runs([exp_id], filter_string=f"tags.`artcache.run_dir` = '{_quoted(where)}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags={
                "artcache.run_dir": where, "artcache.consumer_id": run_name}).info.run_id
        self._pending: list = []

    def _experiment(self, project: str) -> str:
        """The id of experiment ``project``, created if absent. Consumers of one run start together: when another
        one created it first, its id."""
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(project)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(project)
        except MlflowException:
            exp = self.client.get_experiment_by_name(project)
            if exp is None:
                raise
            return exp.experiment_id

    def scalar(self, step: int, tag: str, value: float) -> None:
        from mlflow.entities import Metric

        self._pending.append(Metric(tag, value, int(time.time() * 1000), step))
        if len(self._pending) >= self._BATCH:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self._BATCH], self._pending[self._BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


class RunTracker:
    """Writes scalars to ``run_dir/metrics.csv`` and every :class:`Tracker` asked for.

    Args:
        run_dir: the consumer's run directory (created if absent).
        tensorboard: write TensorBoard event files if the package is importable.
        resume_step: on resume, the checkpoint's step: later rows are dropped (see module docstring).
        trackers: further trackers by name (:data:`TRACKERS`: ``wandb``, ``mlflow``), each one run named
            ``run_name`` in project / experiment ``project``.

    Raises:
        ConfigError: a tracker name not in :data:`TRACKERS`, or its package missing (:func:`check_trackers`).
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_step: int | None = None,
                 trackers=(), run_name: str = "", project: str = "artcache") -> None:
        check_trackers(trackers)
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
        self.trackers: list[Tracker] = []
        self.tensorboard_dir: Path | None = None
        try:
            if tensorboard and tensorboard_available():
                tb = TensorBoardTracker(self.run_dir, resume_step)
                self.tensorboard_dir = tb.dir
                self.trackers.append(tb)
            elif tensorboard:
                log.info("tensorboard is not installed (pip install 'artcache[track]'): metrics go to %s only",
                         self.csv_path)
            name = run_name or self.run_dir.name
            for kind in dict.fromkeys(trackers):
                cls = WandbTracker if kind == "wandb" else MlflowTracker
                self.trackers.append(cls(self.run_dir, name, project))
        except BaseException:
            self.close()
            raise

    def scalar(self, step: int, tag: str, value: float) -> None:
        """One scalar. NaN values (a denominator of 0) are written to the CSV as ``nan``."""
        value = float(value)
        self._csv.writerow((step, tag, repr(value) if math.isfinite(value) else str(value), f"{time.time():.3f}"))
        for t in self.trackers:
            t.scalar(step, tag, value)

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

    @property
    def tb(self):
        """The TensorBoard ``SummaryWriter``, None when TensorBoard is off or not installed."""
        return next((t.writer for t in self.trackers if isinstance(t, TensorBoardTracker)), None)

    def flush(self) -> None:
        self._fh.flush()
        for t in self.trackers:
            t.flush()

    def close(self) -> None:
        """Close the CSV (an OSError raises) and end every tracker's run; a tracker failing to close is logged
        (metrics.csv holds every scalar), never raised over the run's own outcome, and never keeps the others'
        runs open."""
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close()
            except Exception as exc:
                log.error("tracker %s: closing its run failed: %s: %s", t.name, type(exc).__name__, exc)
        self._fh.close()


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
