"""How ``artcache producer`` ends on a stop signal, on a real process: the first SIGINT (Ctrl-C) or SIGTERM finishes
the batch in hand, drains the publisher and journals the stop, then the process exits ``128 + signal`` (130 / 143,
as a cancelled ``artcache consume``) with a closing line of its counts; nothing is left half-written."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import child_env, inspect_json, verify_all_published

from artcache import journal as J
from artcache.layout import CacheLayout

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_regression_a_signalled_producer_exits_128_plus_the_signal_after_a_clean_stop(tmp_path, sig, status):
    """A producer stopped by Ctrl-C (or SIGTERM) shut down cleanly but exited 0, the status of a producer that
    finished its work by itself, while a consume stopped the same way exits 130 / 143: a script or launcher could
    not tell a stopped producer (a ``--fill`` cut short) from a finished one. Now: 130 for SIGINT, 143 for SIGTERM,
    a closing line naming the signal, and the root as after any clean stop (every capture journaled as published or
    failed, ``producer_stop`` with reason ``signal``, no temp file, every artifact verifies)."""
    cache = tmp_path / "cache"
    err = tmp_path / "producer.err"
    with open(err, "w") as fh:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                                 "random:tiny-llama", "--data", "synthetic", "--max-samples", "4000", "--max-length",
                                 "64", "--draft-layers", "3", "--threads", "1", "--batch-samples", "2", "--fill"],
                                stdout=subprocess.DEVNULL, stderr=fh, env=child_env(), cwd=tmp_path)
    layout = CacheLayout(cache)
    try:
        deadline = time.monotonic() + 400
        # mid-work: the handler is installed ('producer ready') and some batches are published, not the whole plan
        while "producer ready" not in err.read_text() or not any(layout.objects.glob("*/*")):
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    text = err.read_text()
    name = signal.Signals(sig).name
    assert code == status, (code, text[-3000:])
    assert f"producer stopped by {name} (exit {status}): " in text and " publications" in text, text[-3000:]
    assert "Traceback" not in text and "Aborted!" not in text, text[-3000:]
    stops = [ev for ev in J.read_events(layout.journal).events if isinstance(ev, J.ProducerStop)]
    assert [ev.reason for ev in stops] == ["signal"]
    acc = inspect_json(cache)
    assert acc["violations"] == [] and acc["cache"]["captures_in_flight"] == 0, acc["violations"]
    published = verify_all_published(cache)
    assert 0 < published < 4000 and acc["cache"]["publications"] == published
    assert list(layout.tmp.iterdir()) == []


def test_a_producer_that_ends_by_itself_exits_0(tmp_path):
    """``--fill`` of a small plan: the producer ends on its own (no signal) and exits 0 with ``producer done``."""
    res = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(Path(tmp_path) / "cache"),
                          "--target", "random:tiny-llama", "--data", "synthetic", "--max-samples", "4", "--max-length",
                          "32", "--draft-layers", "3", "--threads", "1", "--fill"], capture_output=True, text=True,
                         timeout=400, env=child_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "producer done: 4 captures, 4 publications, " in res.stderr, res.stderr[-3000:]
