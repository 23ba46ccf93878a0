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
"""

from __future__ import annotations

import csv
import io
import logging
import math
import sys
import time
from pathlib import Path

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


def _truncate_csv(path: Path, keep_through_step: int) -> None:
    """Rewrite ``path`` atomically without the rows whose step is > ``keep_through_step``."""
    text = path.read_text()
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


def read_metrics(path: Path) -> list[tuple[int, str, float]]:
    """Rows of a ``metrics.csv`` as (step, tag, value)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return [(int(r[0]), r[1], float(r[2])) for r in rows[1:] if r]


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
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr,
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
