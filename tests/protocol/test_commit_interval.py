"""The consumer commits its cursor when due (``--commit-interval``, ``Session._commit_due``), not after every step:
on a ``--fill``-ed root (no producer), the registration's cursor seen after each step, for each rule — every step
with an interval of 0, only when the committed window would hold the reader back, before a checkpoint records its
cursor, after the last step — and the losses of the steps are those of a run that commits every step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from artcache import journal as J
from artcache import registry
from artcache.layout import CacheLayout
from artcache.producer import ProducerConfig, run_producer
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer.session import run_consumer

STEPS, BATCH = 8, 2


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    root = tmp_path_factory.mktemp("commit") / "root"
    cfg = ProducerConfig(cache=str(root), target="random:tiny-llama", dataset="synthetic", max_samples=STEPS * BATCH,
                         max_length=32, draft_layers=3, fill=True, poll_interval_s=0.0)
    assert run_producer(cfg).fill_complete
    return root


def _run(root, tmp_path, cid: str, window: tuple[int, int], interval: float, **kw) -> tuple[list[int], dict]:
    """Train ``cid`` on ``root``; the registration's cursor read after each step, and the summary."""
    layout = CacheLayout(root)
    seen: list[int] = []
    cfg = ConsumerConfig(cache=str(root), consumer_id=cid, draft="dflash", block_size=4, num_anchors=4,
                         batch_size=BATCH, steps=STEPS, lookbehind=window[0], lookahead=window[1], threads=1,
                         out_dir=str(tmp_path / cid), progress=False, tensorboard=False, commit_interval_s=interval,
                         **kw)
    summary = run_consumer(cfg, step_hook=lambda i: seen.append(registry.read(layout, cid).cursor))
    return seen, summary


def _losses(root, cid: str) -> list[float]:
    (path,) = CacheLayout(root).journal.glob(f"consumer-{cid}-*.jsonl")
    return [e.loss for e in J.iter_file(path) if isinstance(e, J.Step)]


def test_interval_0_commits_after_every_step(filled, tmp_path):
    seen, summary = _run(filled, tmp_path, "every", (0, 64), 0.0, checkpoints=False)
    assert seen == [BATCH * (i + 1) for i in range(STEPS)]
    assert summary["cursor"] == STEPS * BATCH


def test_a_pending_commit_waits_for_the_interval_then_the_last_step_commits(filled, tmp_path):
    """A wide window and a long interval: nothing is committed until the last step, whose commit holds every
    position; the steps train on the same batches as with a commit after every step."""
    seen, summary = _run(filled, tmp_path, "lazy", (0, 64), 10.0, checkpoints=False)
    assert seen == [0] * (STEPS - 1) + [STEPS * BATCH]
    reg = registry.read(CacheLayout(filled), "lazy")
    assert (reg.cursor, reg.state) == (STEPS * BATCH, "completed")
    _run(filled, tmp_path, "eager", (0, 64), 0.0, checkpoints=False)
    assert _losses(filled, "lazy") == _losses(filled, "eager")


def test_the_commit_comes_once_the_committed_window_would_hold_the_reader_back(filled, tmp_path):
    """Lookahead 12, batch 2, 2 batches prefetched: the reader wants positions up to ``cursor + 5`` and may read up
    to ``committed + 12``, so a commit falls due once 8 positions are pending (every 4th step), however long the
    interval; between commits the reader was never held back."""
    seen, _ = _run(filled, tmp_path, "window", (0, 12), 10.0, checkpoints=False)
    assert seen == [0, 0, 0, 8, 8, 8, 8, 16]
    for i, committed in enumerate(seen):
        assert committed + 12 >= BATCH * (i + 1) + 5


def test_a_checkpoint_commits_its_cursor_before_recording_it(filled, tmp_path):
    """``--save-every 3`` with a long interval: each checkpoint (after steps 3 and 6) commits first, since the
    registry refuses a checkpoint cursor past the committed one; the final checkpoint commits with its record."""
    seen, summary = _run(filled, tmp_path, "ckpt", (0, 64), 10.0, save_every=3)
    assert seen == [0, 0, 0, 6, 6, 6, 12, 16]
    reg = registry.read(CacheLayout(filled), "ckpt")
    assert (reg.cursor, reg.checkpoint_cursor, summary["steps"]) == (16, 16, STEPS)


def test_commit_interval_out_of_range_is_refused_in_one_line(tmp_path):
    got = subprocess.run([sys.executable, "-m", "artcache", "consume", "--cache", str(tmp_path / "none"),
                          "--commit-interval", "-1"], capture_output=True, text=True, timeout=120)
    assert got.returncode != 0
    assert "commit" in got.stderr and "-1" in got.stderr and "Traceback" not in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1
