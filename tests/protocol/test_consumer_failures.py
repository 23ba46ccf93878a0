"""A consumer that fails between steps keeps its work (real processes on the tiny random target).

Regressions:
- a consumer whose producer disappeared failed with CaptureTimeout **without a checkpoint** (default
  ``--save-every 0``: every step lost, ``--resume`` refused) and leaked the lease of the partial batch;
- after a SIGKILL, ``metrics.csv`` lacked rows of steps a checkpoint already covered (it was flushed only
  every ``--log-every`` steps), so the resumed run's curve had a hole.
Deadlines only bound a hung run.
"""

from __future__ import annotations

import signal

from artcache import leases, registry
from artcache.layout import CacheLayout
from artcache.trainers.checkpoint import read_state
from artcache.trainers.tracking import read_metrics
from tests.protocol.test_consumer_resume import BATCH, DATA, Proc, consume_args
from tests.support.procs import wait_until

STEPS = 8
# The capture-timeout run needs more positions than the producer can publish ahead of the cursor
# (lookahead 8 of --window 2:8) before it is killed; with 8 steps a slow 2-core CI machine let the
# producer publish all 16 positions first and the consumer finished.
TIMEOUT_STEPS = 18


def producer(cache, tiny_target, tmp_path, name: str) -> Proc:
    return Proc(name, ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(DATA),
                       "--max-samples", "40", "--max-length", "128", "--draft-layers", "3", "--threads", "1"], tmp_path)


def test_regression_capture_timeout_checkpoints_and_releases_leases(tmp_path, tiny_target):
    """A consumer whose producer disappeared failed with CaptureTimeout without a checkpoint (every step lost,
    ``--resume`` refused) and leaked the lease of its partial batch; it now checkpoints and releases them."""
    cache = tmp_path / "cache"
    layout = CacheLayout(cache)
    prod = producer(cache, tiny_target, tmp_path, "producer")
    procs = [prod]
    try:
        wait_until(lambda: (cache / "artcache.json").is_file(), "the producer to initialise the root", procs)
        args = consume_args(cache, tmp_path, "x", TIMEOUT_STEPS)
        args[args.index("--demand-timeout") + 1] = "3"
        x = Proc("x", args, tmp_path)
        procs.append(x)
        wait_until(lambda: (r := registry.read(layout, "x")) is not None and r.cursor >= 2 * BATCH,
                   "the consumer to step", procs)
        prod.kill()  # the producer is gone: the consumer runs out of published positions and times out
        assert x.wait() != 0
        assert "CaptureTimeout" in x.text()
        reg = registry.read(layout, "x")
        assert reg.state == "failed" and 0 < reg.cursor < TIMEOUT_STEPS * BATCH
        assert reg.checkpoint_cursor == reg.cursor, "no checkpoint of the committed steps"
        latest = (tmp_path / "runs" / "x" / "checkpoints" / "latest").resolve()
        assert read_state(latest).cursor == reg.cursor
        held = [info.name for infos in leases.scan(layout).values() for info in infos if info.consumer == "x"]
        assert held == [], f"leases left by the failed consumer: {held}"

        prod2 = producer(cache, tiny_target, tmp_path, "producer-2")
        x2 = Proc("x-resumed", [*consume_args(cache, tmp_path, "x", TIMEOUT_STEPS), "--resume"], tmp_path)
        procs += [prod2, x2]
        x2.expect(0)
        assert registry.read(layout, "x").cursor == TIMEOUT_STEPS * BATCH
        prod2.terminate_ready_producer()
    finally:
        for p in procs:
            p.kill()


def test_regression_metrics_cover_every_checkpointed_step_after_sigkill(tmp_path, tiny_target):
    """After a SIGKILL, metrics.csv lacked rows of steps a checkpoint already covered (flushed only every
    ``--log-every`` steps), so the resumed run's curve had a hole."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    # the root initialised here, as the producer would: the consumer starts beside the producer, not after it
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    prod = producer(cache, tiny_target, tmp_path, "producer")
    procs = [prod]
    try:
        # --commit-interval 0: the 5th cursor commit is the 5th step (the default commits when due)
        args = consume_args(cache, tmp_path, "m", STEPS, "--save-every", "2", "--commit-interval", "0")
        args[args.index("--log-every") + 1] = "100"  # no log-driven flush before the kill
        m = Proc("m", args, tmp_path, crash_at="cursor.after-commit:5")
        procs.append(m)
        assert m.wait() == -signal.SIGKILL, m.text()[-3000:]
    finally:
        for p in procs:
            p.kill()
    rows = read_metrics(tmp_path / "runs" / "m" / "metrics.csv")
    steps = sorted({step for step, tag, _ in rows if tag == "train/loss"})
    assert steps[:4] == [1, 2, 3, 4], steps  # step 4 is checkpointed: its rows must be on disk
