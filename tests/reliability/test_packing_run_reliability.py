"""A packed run under a kill (the fast parts: tests/protocol/test_packing_run.py)."""

from __future__ import annotations

import signal

import pytest

from artcache import registry
from artcache.layout import CacheLayout
from tests.protocol import test_packing_run as fast_part
from tests.protocol.test_packing_run import _steps
from tests.support.procs import Proc as BaseProc

filled = fast_part.filled  # a fixture of tests/protocol/test_packing_run.py


class Proc(BaseProc):
    deadline = 240.0


def _consume(tmp_path, root, cid, *extra, crash_at=None) -> Proc:
    return Proc(cid, ["consume", "--cache", str(root), "--id", cid, "--block-size", "4", "--anchors", "4",
                      "--draft-layers", "3",
                      "--window", "0:16", "--steps", "6", "--batch-size", "2", "--pack-tokens", "80", "--threads", "1",
                      "--commit-interval", "0", "--save-every", "2", "--log-every", "1", "--no-progress",
                      "--out", str(tmp_path / "runs" / cid), *extra], tmp_path, crash_at)


def test_a_packed_run_killed_and_resumed_trains_the_uninterrupted_losses(filled, tmp_path):
    """SIGKILL after the 5th cursor commit (checkpoint at step 4), ``--resume``: the resumed process retrains steps
    5 and 6 on the same packed rows, with the same anchors, to the same losses as a run never interrupted."""
    whole = _consume(tmp_path, filled, "whole")
    assert whole.wait() == 0, whole.text()[-3000:]
    killed = _consume(tmp_path, filled, "killed", crash_at="cursor.after-commit:5")
    assert killed.wait() == -signal.SIGKILL, killed.text()[-3000:]
    resumed = _consume(tmp_path, filled, "killed", "--resume")
    assert resumed.wait() == 0, resumed.text()[-3000:]
    want = _steps(filled, "whole")
    got = {}
    for s in _steps(filled, "killed"):  # the resumed process's record of a step replaces the killed one's
        got[s.step] = s
    assert [s.cursor for s in want] == [4 * i for i in range(1, 7)]
    assert sorted(got) == [s.step for s in want]
    for w in want:
        assert got[w.step].cursor == w.cursor
        assert got[w.step].loss == pytest.approx(w.loss, rel=1e-6, abs=0), w.step
    assert registry.read(CacheLayout(filled), "killed").cursor == 24
