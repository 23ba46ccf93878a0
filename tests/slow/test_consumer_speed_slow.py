"""Consumer speed on real runs (minutes; the fast parts: tests/unit/test_consumer_speed.py)."""

from __future__ import annotations

import math

import pytest
import torch

from artcache.bench import consumer_speed as cs


@pytest.mark.parametrize("draft", ["dflash", "eagle3"])
def test_in_memory_step_and_figures(draft):
    d, cfg = cs.build(
        draft,
        "tiny-llama",
        "syncfree",
        torch.device("cpu"),
        layers=5 if draft == "dflash" else 4,
        anchors=8,
        draft_vocab=512,
    )
    batches = cs.device_batches(2, 64, 5 if draft == "dflash" else 4, 64, 49152, torch.device("cpu"), n=2)
    row = cs.time_in_memory(d, batches, steps=2, warmup=1)
    assert row["steps_per_s"] > 0 and math.isfinite(row["last_loss"])
    flops = (
        cs.dflash_step_flops(cfg, 64, 56)
        if draft == "dflash"
        else cs.eagle3_step_flops(cfg, 64, cfg.ttt_steps)
    )
    lim = cs.limits(row, flops * 2, 1e12, 1e6, 1e9)
    assert 0 < lim["mfu"] < 1 and lim["binding"] in (
        "reads",
        "flops",
        "gpu kernels (below the FLOP floor's rate)",
    )
    assert lim["bytes_per_s"] == pytest.approx(1e6 * row["steps_per_s"])


def test_from_cache_run(tmp_path):
    info = cs.make_root(
        tmp_path / "cache",
        8 * 3,
        torch.device("cpu"),
        target="random:tiny-llama",
        seq=96,  # at least DFlash's 64 anchors (regression: 48 tokens refused --anchors 64 since check_anchors)
        union=[1, 2, 3, 4, 5, 7],
    )
    assert info["artifact_bytes"] > 96 * 6 * 64 * 2 and info["read_verify_Bps"] > 0
    r = cs.from_cache(tmp_path / "cache", "dflash", "main", 3, torch.device("cpu"), view=[1, 2, 3, 4, 5])
    assert r["steps"] == 3 and math.isfinite(r["final_loss"])
    r = cs.from_cache(tmp_path / "cache", "eagle3", "syncfree", 3, torch.device("cpu"), view=[1, 3, 4, 7])
    assert r["steps"] == 3 and math.isfinite(r["final_loss"]) and r["read_workers"] == 1
    r = cs.from_cache(tmp_path / "cache", "dflash", "main@3", 3, torch.device("cpu"), view=[1, 2, 3, 4, 5])
    assert r["steps"] == 3 and r["read_workers"] == 3
    assert set(r["host_ms_per_step"]) == {"wait", "launch", "leases", "commit", "record", "total"}
    # a profiled row: the profiler's window is the last 25 steps (epochs past the 24-sample plan), the rate the rest
    prof = tmp_path / "prof.txt"
    r = cs.from_cache(tmp_path / "cache", "dflash", "syncfree", 40, torch.device("cpu"), view=[1, 2, 3, 4, 5],
                      profile_out=prof)
    assert r["steps"] == 40 and math.isfinite(r["steps_per_s"]) and r["launches_per_step"] == 0  # no CUDA here
    assert "Self CPU" in prof.read_text()
    with pytest.raises(ValueError, match="needs >= 40 steps"):
        cs.from_cache(tmp_path / "cache", "dflash", "main", 30, torch.device("cpu"), profile_out=prof)
