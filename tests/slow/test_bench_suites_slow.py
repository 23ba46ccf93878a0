"""Bench suites run end to end (minutes each; the fast parts: tests/protocol/test_bench_suites.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.procs import child_env


# about a minute on an idle 2-core machine
def test_gpu_micro_suite_at_tiny_scale_on_a_cpu(tmp_path):
    d = tmp_path / "gm"
    res = subprocess.run([sys.executable, "-m", "artcache", "bench", "--suite", "gpu-micro", "--scale", "tiny",
                          "--resume", str(d)], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((d / "gpu-micro.json").read_text())
    p = doc["pieces"]
    assert p["matmul"]["result"]["matmul_peak_flops"] > 0
    assert 0.5 < next(iter(p["io"]["result"]["fp8_bytes_over_bf16"].values())) < 0.6
    assert set(p["producer"]["result"]["dtypes"]) == {"bfloat16", "float8_e4m3fn"}
    assert p["consumer"]["result"]["blocks"]["B4"]["in_memory_steps_per_s"] > 0


# a few minutes on a 2-core machine
def test_consumer_speed_and_offline_suites_at_tiny_scale_on_a_cpu(tmp_path):
    res = subprocess.run([sys.executable, "-m", "artcache", "bench", "--suite", "consumer-speed", "--scale", "tiny",
                          "--pieces", "matmul,dflash:main,cache-dflash:main,cache-eagle3:syncfree,dflash:liger",
                          "--resume", str(tmp_path / "cs")], cwd=tmp_path, env=child_env(), capture_output=True,
                         text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "not run on a CPU at --scale tiny (CUDA-only or compiled code): dflash:liger" in res.stdout
    doc = json.loads((tmp_path / "cs" / "consumer-speed.json").read_text())
    assert list(doc["pieces"]) == ["matmul", "dflash:main", "cache-dflash:main", "cache-eagle3:syncfree"]
    assert all(p["result"]["steps_per_s"] > 0 for k, p in doc["pieces"].items() if k != "matmul")
    res = subprocess.run([sys.executable, "-m", "artcache", "bench", "--suite", "offline", "--scale", "tiny",
                          "--pieces", "steps-thread", "--resume", str(tmp_path / "off")], cwd=tmp_path,
                         env=child_env(), capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((tmp_path / "off" / "offline.json").read_text())["pieces"]["steps-thread"]["result"]
    assert r["checks"]["refill_captures_nothing"] and set(r["root_over_memory"]) == {"B4", "B8"}


# four minutes on a loaded 2-core machine: two `artcache run` pieces and the curves
def test_training_curve_suite_at_tiny_scale_resumes_the_run_piece_after_piece(tmp_path):
    res = subprocess.run([sys.executable, "-m", "artcache", "bench", "--suite", "training-curve", "--scale", "tiny",
                          "--resume", str(tmp_path / "tc")], cwd=tmp_path, env=child_env(), capture_output=True,
                         text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "tc" / "training-curve.json").read_text())
    assert list(doc["pieces"]) == ["train-01", "train-02", "curves"]
    first, second = (doc["pieces"][k]["result"] for k in ("train-01", "train-02"))
    for x in first["experiments"]:
        assert (x["state"], x["first_step"], x["last_step"]) == ("completed", 1, 3), x
    for x in second["experiments"]:  # resumed from the first piece's checkpoint, not started over
        assert (x["state"], x["first_step"], x["last_step"]) == ("completed", 4, 6), x
    curves = doc["pieces"]["curves"]["result"]
    assert set(curves["experiments"]) == {"dflash", "eagle3"} and Path(curves["png"]).stat().st_size > 0
    assert [e["step"] for e in curves["experiments"]["dflash"]["evals"]] == [0, 3, 6]


# three minutes on a loaded 2-core machine: a capture, then two `artcache run`s
def test_fp8_suite_at_tiny_scale_on_a_cpu(tmp_path):
    """Both pieces give figures: the error per layer, and held-out rows of both drafts (the runs' reports carry each
    consumer's summary, which the rows come from)."""
    res = subprocess.run([sys.executable, "-m", "artcache", "bench", "--suite", "fp8", "--scale", "tiny",
                          "--resume", str(tmp_path / "fp8")], cwd=tmp_path, env=child_env(), capture_output=True,
                         text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    p = json.loads((tmp_path / "fp8" / "fp8.json").read_text())["pieces"]
    layers = p["error"]["result"]["layers"]
    assert layers and all(0 < r["fp8_rel_error"] < 0.1 and r["bf16_rel_error"] < r["fp8_rel_error"] for r in layers)
    rows = p["tau"]["result"]["rows"]
    assert {(r["draft"], r["metric"]) for r in rows} >= {("dflash", "replay_tau"), ("eagle3", "loss")}
    assert all(r["fp8_s0"] is not None and r["bf16_s0"] is not None for r in rows)


# under three minutes on a loaded 2-core machine: three pieces, each building a ShareGPT plan
def test_packing_suite_at_tiny_scale_on_a_cpu(tmp_path):
    """One piece per draft, each with the walk's and the timed steps' packed / unpacked figures: the packed arm
    pads less, holds more positions a step, and (DFlash, DSpark) draws anchors per document, so its coverage of
    supervised tokens is recorded; EAGLE-3 draws none."""
    d = tmp_path / "pk"
    res = subprocess.run([sys.executable, "-m", "artcache", "bench", "--suite", "packing", "--scale", "tiny",
                          "--resume", str(d)], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((d / "packing.json").read_text())
    assert list(doc["pieces"]) == ["dflash", "eagle3", "dspark"] and doc["scale"] == "tiny"
    for draft, piece in doc["pieces"].items():
        r = piece["result"]
        assert r["draft"] == draft and r["arch"] == "tiny-llama" and r["max_length"] == 1024
        walked = r["walk"]
        assert walked["packed"]["padding_fraction"] < walked["unpacked"]["padding_fraction"]
        assert r["walk_packed_over_unpacked"]["positions_per_step"] > 1
        assert r["packed_over_unpacked"]["supervised_tokens_per_s"] > 0 and r["arms"]["packed"]["steps"] == 1
        assert ("anchor_coverage" in r["walk_packed_over_unpacked"]) == (draft != "eagle3")
        if draft != "eagle3":
            assert 0 < walked["packed"]["anchor_coverage"] <= 1
