"""How ``artcache consume`` ends, on a real process with real signals: a finished run prints a short summary for a
person (the JSON line with ``--json``) and exits 0; SIGTERM exits 143 and Ctrl-C (SIGINT) 130, each after the final
checkpoint, with a summary naming the signal and no click ``Aborted!``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import child_env

from artcache import registry
from artcache.layout import CacheLayout

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """A root filled by ``artcache producer --fill`` (random tiny target, 24 synthetic samples): consumers read it
    with no producer running."""
    cache = tmp_path_factory.mktemp("consume-exit") / "cache"
    fill = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                           "random:tiny-llama", "--data", "synthetic", "--max-samples", "24", "--max-length", "64",
                           "--draft-layers", "3", "--threads", "1", "--fill"], capture_output=True, text=True,
                          timeout=600, env=child_env())
    assert fill.returncode == 0, fill.stderr[-2000:]
    return cache


def _consume(cache: Path, tmp_path: Path, cid: str, steps: int, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(cache), "--id", cid, "--block-size", "4",
            "--window", "0:8", "--anchors", "4", "--steps", str(steps), "--batch-size", "1", "--threads", "1",
            "--log-every", "1", "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "runs" / cid), *extra]
    return subprocess.Popen(args, stdout=open(tmp_path / f"{cid}.out", "w"), stderr=open(tmp_path / f"{cid}.err", "w"),
                            env=child_env(), cwd=tmp_path)


def _signalled(cache: Path, tmp_path: Path, cid: str, sig: int, *extra: str) -> tuple[int, str, str]:
    """A long consume, stopped by ``sig`` once it logged three steps: (exit status, stdout, stderr)."""
    proc = _consume(cache, tmp_path, cid, 100_000, *extra)
    err = tmp_path / f"{cid}.err"
    try:
        deadline = time.monotonic() + 400
        while "step 3/" not in err.read_text():
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    return code, (tmp_path / f"{cid}.out").read_text(), err.read_text()


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_regression_a_signalled_consume_exits_128_plus_the_signal_with_a_summary(filled, tmp_path, sig, status):
    """A consume stopped by SIGTERM or Ctrl-C checkpointed correctly but ended with click's ``Aborted!`` on stderr,
    exit 1 (the status of a failure) and no summary. Now: exit 143 (SIGTERM) / 130 (SIGINT), a short summary on
    stdout naming the signal, the step and the checkpoint to resume from, no ``Aborted!``."""
    cid = f"sig{int(sig)}"
    code, out, err = _signalled(filled, tmp_path, cid, sig)
    name = signal.Signals(sig).name
    assert code == status, (code, out, err[-3000:])
    assert "Aborted!" not in err and "Aborted!" not in out and "Traceback" not in err, err[-3000:]
    assert f"{cid} (dflash): stopped by {name} at step " in out and "/100000" in out, out
    assert "--resume" in out and "checkpoint " in out, out
    reg = registry.read(CacheLayout(filled), cid)
    assert reg.state == "cancelled" and reg.checkpoint_cursor == reg.cursor > 0
    assert f"checkpoints/step-{reg.cursor:08d}" in out  # batch 1: the cursor is the step


def test_a_signalled_consume_with_json_prints_the_summary_line(filled, tmp_path):
    code, out, err = _signalled(filled, tmp_path, "sigjson", signal.SIGTERM, "--json")
    assert code == 143, err[-3000:]
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["state"] == "cancelled" and doc["steps"] >= 3 and doc["steps_planned"] == 100_000


def test_a_finished_consume_prints_a_summary_and_exits_0(filled, tmp_path):
    """Lines for a person by default; the one JSON line with --json (both exit 0)."""
    proc = _consume(filled, tmp_path, "done", 3)
    assert proc.wait(timeout=400) == 0, (tmp_path / "done.err").read_text()[-3000:]
    out = (tmp_path / "done.out").read_text()
    assert out.startswith("done (dflash): completed at step 3/3 after ") and "train loss " in out, out
    assert "checkpoint " in out and "--resume" not in out and "{" not in out, out
    proc = _consume(filled, tmp_path, "donejson", 3, "--json")
    assert proc.wait(timeout=400) == 0, (tmp_path / "donejson.err").read_text()[-3000:]
    doc = json.loads((tmp_path / "donejson.out").read_text())
    assert doc["state"] == "completed" and doc["steps"] == 3 and doc["steps_planned"] == 3


@pytest.mark.parametrize("steps", [1, 3, 7, 12])
def test_regression_a_short_consume_summary_averages_disjoint_steps(filled, tmp_path, steps):
    """A consume of fewer than 10 steps summarised its training loss as the mean of "the first / last 5 steps"
    over overlapping steps: with ``--steps 3`` both means covered steps 1-3, so the summary read the same loss twice
    (``train loss 10.8089 -> 10.8089``) whatever the run did. Now both ends average k = max(1, min(5, n // 2)) of the
    n losses (``artcache.report.loss_ends``, as ``artcache run``'s report and the bench), disjoint from 2 steps on,
    and the summary says k and n."""
    from artcache import journal as J
    from artcache.report import loss_ends

    cid = f"short{steps}"
    proc = _consume(filled, tmp_path, cid, steps, "--json")
    assert proc.wait(timeout=400) == 0, (tmp_path / f"{cid}.err").read_text()[-3000:]
    doc = json.loads((tmp_path / f"{cid}.out").read_text())
    losses = [ev.loss for ev in J.read_events(CacheLayout(filled).journal).events
              if isinstance(ev, J.Step) and ev.consumer == cid]
    k = max(1, min(5, steps // 2))
    assert len(losses) == steps
    assert doc["first_loss"] == pytest.approx(sum(losses[:k]) / k, rel=1e-6)
    assert doc["final_loss"] == pytest.approx(sum(losses[-k:]) / k, rel=1e-6)
    assert (doc["loss_steps"], doc["loss_ends_steps"]) == (steps, k)
    assert (doc["first_loss"], doc["final_loss"], k) == pytest.approx(loss_ends(losses), rel=1e-6)
    from artcache.report import format_consume_summary

    text = format_consume_summary(doc)
    if steps == 1:
        assert f"train loss {losses[0]:.4f} (the one step this process ran)" in text, text
    else:
        assert f"(mean of the first / last {k} of the {steps} steps this process ran)" in text, text


def test_loss_ends_never_shares_a_step_between_the_two_means():
    from artcache.report import loss_ends

    assert loss_ends([]) == (None, None, 0)
    assert loss_ends([4.0]) == (4.0, 4.0, 1)
    assert loss_ends([4.0, 2.0]) == (4.0, 2.0, 1)
    assert loss_ends([3.0, 2.0, 1.0]) == (3.0, 1.0, 1)
    assert loss_ends([float(i) for i in range(7)]) == (1.0, 5.0, 3)  # (0+1+2)/3, (4+5+6)/3
    assert loss_ends([float(i) for i in range(100)]) == (2.0, 97.0, 5)
