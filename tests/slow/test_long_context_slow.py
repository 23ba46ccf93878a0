"""Long context end to end through the CLI (minutes; the fast parts: tests/protocol/test_long_context.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

LONG = 32768


def _artcache(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "artcache", *args], capture_output=True, text=True, timeout=900,
                          cwd=cwd)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_32k_plan_captures_publishes_verifies_and_trains(tmp_path, dtype):
    """A 32,768-token synthetic plan on the tiny random target: the producer fills it with 8,192-token prefill
    chunks (the default --batch-tokens 8192 could not hold one sample in one pass), fsck finds every artifact
    clean, and a DFlash and a DSpark consumer (the DSpark view: DFlash's three context layers and the last layer)
    each train two steps on whole 32,768-token samples with finite losses."""
    from artcache import store
    from artcache.fingerprint import PlanFingerprints
    from artcache.layout import CacheLayout
    from artcache.plan import Plan
    from artcache.settings import load_settings

    cache, run = tmp_path / "cache", tmp_path / "run"
    fill = _artcache("producer", "--cache", str(cache), "--target", "random:tiny-llama", "--data", "synthetic",
                     "--max-samples", "2", "--max-length", str(LONG), "--prefill-chunk", "8192",
                     "--layer-ids", "1,3,5,7", "--dtype", dtype, "--threads", "1", "--fill", cwd=tmp_path)
    assert fill.returncode == 0, fill.stderr[-3000:]
    assert "2 captures, 2 publications" in fill.stderr
    layout = CacheLayout(cache)
    settings = load_settings(layout)
    plan = Plan.load(layout.plan_dir(settings.plan_id))
    for fp in PlanFingerprints(settings.contract, plan).table()[0]:
        art = store.read(layout, fp, settings.contract, verify_tokens=True)
        assert tuple(art.hidden_states.shape) == (LONG, 4, 64) and art.input_ids.dtype == torch.int32
        assert bool(torch.isfinite(art.hidden()).all())
    fsck = _artcache("fsck", "--cache", str(cache), cwd=tmp_path)
    assert fsck.returncode == 0, fsck.stdout[-2000:] + fsck.stderr[-2000:]
    dspark = ["--draft-layers", "3", "--markov-rank", "8"]
    for draft, flags in (("dflash", ["--draft-layers", "3"]), ("dspark", dspark)):
        cons = _artcache("consume", "--cache", str(cache), "--id", f"long-{draft}", "--draft", draft, *flags,
                         "--block-size", "8", "--anchors", "16", "--steps", "2", "--batch-size", "1", "--window",
                         "0:2", "--threads", "1", "--no-progress", "--no-tensorboard", "--json", "--out",
                         str(run / draft), cwd=tmp_path)
        assert cons.returncode == 0, cons.stderr[-3000:]
        summary = json.loads([ln for ln in cons.stdout.splitlines() if ln.startswith("{")][-1])
        assert summary["steps"] == 2 and math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0, draft


@pytest.mark.timeout(2400)
def test_32k_eagle3_trains_on_whole_samples(tmp_path):
    """EAGLE-3 (7 TTT steps) trains two steps on a whole 32,768-token sample: the forward picks the chunked
    training-time-test attention (the dense [T, 7·T] mask would be 7.5 G booleans), the losses are finite, and
    the wall time and peak RSS of the fill and of the consumer are printed (``-s``)."""
    import resource
    import time

    from artcache.layer_ids import eagle3_capture_ids

    cache, run = tmp_path / "cache", tmp_path / "run"
    t0 = time.monotonic()
    fill = _artcache("producer", "--cache", str(cache), "--target", "random:tiny-llama", "--data", "synthetic",
                     "--max-samples", "1", "--max-length", str(LONG), "--batch-tokens", str(LONG), "--layer-ids",
                     ",".join(map(str, eagle3_capture_ids(8))), "--threads", "1", "--fill", cwd=tmp_path)
    t1 = time.monotonic()
    fill_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert fill.returncode == 0, fill.stderr[-3000:]
    assert "1 captures, 1 publications" in fill.stderr
    cons = _artcache("consume", "--cache", str(cache), "--id", "long-e3", "--draft", "eagle3", "--draft-vocab", "1024",
                     "--steps", "2", "--batch-size", "1", "--window", "0:1", "--threads", "1", "--log-every", "1",
                     "--no-progress", "--no-tensorboard", "--json", "--out", str(run), cwd=tmp_path)
    t2 = time.monotonic()
    both_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert cons.returncode == 0, cons.stderr[-3000:]
    summary = json.loads([ln for ln in cons.stdout.splitlines() if ln.startswith("{")][-1])
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0
    print(f"\nfill: {t1 - t0:.0f} s, peak RSS {fill_rss / 1024:.0f} MB; EAGLE-3 consume: {t2 - t1:.0f} s, "
          f"peak RSS of the larger of the two {both_rss / 1024:.0f} MB")
