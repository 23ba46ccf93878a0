"""``artcache bench --scenario all --device cpu`` in CI size: every scenario writes its three report files,
passes its checks, and its counts equal ``artcache inspect`` on the same root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "tiny_sharegpt.json"


@pytest.fixture(scope="module")
def bench_all(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("bench-cpu") / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "artcache.cli", "bench", "--scenario", "all", "--target", tiny_target.path,
         "--data", str(DATA), "--max-length", "128", "--max-samples", "32", "--anchors", "8",
         "--draft-layers", "3", "--warmup", "2", "--steps", "6", "--window", "8:8", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    return proc, out


def test_bench_all_passes_and_writes_every_report(bench_all):
    proc, out = bench_all
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for scenario, n in (("1p1c", 1), ("1p3c", 3)):
        base = out / scenario
        for name in ("report.json", "report.md", "progress.png"):
            assert (base / name).is_file() and (base / name).stat().st_size > 0, f"{scenario}/{name}"
        report = json.loads((base / "report.json").read_text())
        assert report["scenario"] == scenario and len(report["consumers"]) == n
        assert all(report["checks"].values()), report["checks"]
        assert report["telemetry"] == {} and report["environment"]["nvml"] is False  # null sampler on CPU
        assert f"## {scenario} on cpu" in (base / "report.md").read_text()
    assert "captures" in proc.stdout and "checks:" in proc.stdout  # the table is printed


def test_inspect_shows_the_reports_counts(bench_all):
    _, out = bench_all
    for scenario in ("1p1c", "1p3c"):
        report = json.loads((out / scenario / "report.json").read_text())
        got = subprocess.run([sys.executable, "-m", "artcache.cli", "inspect", "--cache", str(out / scenario / "cache"),
                              "--json"], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr
        cache = json.loads(got.stdout)["cache"]
        for key, value in report["cache"].items():
            assert cache[key] == pytest.approx(value), key
