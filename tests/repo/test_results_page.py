"""docs/results.md is generated from bench/results/ (``python -m artcache.bench.results_page``): the committed page
must be what the generator writes from the files now, every row names a file that exists, and a figure changed in a
file changes the page."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from artcache.bench import results_page as rp
from tests.support import REPO

ROOT = REPO


def test_committed_results_page_is_what_the_generator_writes():
    assert (ROOT / "docs" / "results.md").read_text(encoding="utf-8") == rp.render(), \
        "regenerate it: python -m artcache.bench.results_page"


def test_every_cited_result_file_exists_and_is_linked():
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    for name in rp.cited_files():
        assert (ROOT / "bench" / "results" / name).is_file(), name
        assert f"(../bench/results/{name})" in page, name


def test_a_figure_changed_in_a_file_changes_its_row(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    path = results / "2026-12-02-h200-fp8-tau.json"
    data = json.loads(path.read_text())
    data["rows"][0]["fp8_s0"] = 9.876
    path.write_text(json.dumps(data))
    page = rp.render(results)
    assert "| 9.876 |" in page and page != rp.render()


def test_a_field_the_file_lacks_is_not_recorded(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    path = results / "2026-12-02-h200-fp8-tau.json"
    data = json.loads(path.read_text())
    del data["hardware"], data["commit"], data["command"]
    path.write_text(json.dumps(data))
    row = next(line for line in rp.render(results).splitlines() if "greedy-replay τ (+1 bonus) | 1.071" in line)
    assert row.endswith("| not recorded | not recorded | not recorded |"), row


def test_a_missing_result_file_is_one_line_and_exit_2(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    (results / "2026-12-02-h200-fp8-tau.json").unlink()
    with pytest.raises(rp.ResultsError, match="2026-12-02-h200-fp8-tau.json is missing"):
        rp.render(results)
    proc = subprocess.run([sys.executable, "-m", "artcache.bench.results_page", "--results", str(results), "--check",
                           "--out", str(ROOT / "docs" / "results.md")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is missing" in proc.stderr


def test_check_flags_a_stale_page(tmp_path):
    page = tmp_path / "results.md"
    page.write_text(rp.render().replace("| 1.071 |", "| 1.072 |", 1))
    proc = subprocess.run([sys.executable, "-m", "artcache.bench.results_page", "--check", "--out", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "out of date" in proc.stderr
    page.write_text(rp.render())
    ok = subprocess.run([sys.executable, "-m", "artcache.bench.results_page", "--check", "--out", str(page)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_a_lane_log_cut_at_its_time_bound_names_what_passed_where_and_what_did_not_run():
    log = "\n".join([
        "collecting ... collected 12 items / 2 deselected / 1 skipped / 5 selected", "",
        "tests/test_a.py::test_one PASSED [ 20%]",
        "tests/gpu/test_gpu.py::test_two[cpu-dflash] PASSED [ 40%]",
        "tests/gpu/test_gpu.py::test_two[cpu-eagle3] FAILED [ 60%]",
        "tests/gpu/test_gpu.py::test_three[cuda] gpu lane exit 124 after 215 s"])
    card, on_gpu, on_cpu, skipped, failed, stopped, not_reached, end = rp._lane_row("H100")(log)
    assert (card, on_gpu, on_cpu, skipped) == ("H100", "1: test_a.py: test_one", "1: test_gpu.py: test_two", "1")
    assert failed == "1: test_gpu.py: test_two (CPU)" and stopped == "test_gpu.py: test_three"
    assert not_reached == "1" and end == "exit 124 after 215 s (its time bound)"


def test_a_lane_log_counts_each_test_once_past_its_warnings():
    log = "\n".join([
        "collecting ... collected 3 items / 1 selected", "",
        "tests/test_a.py::test_one PASSED [100%]", "",
        "=============== warnings summary ===============",
        "tests/test_a.py::test_one", "  UserWarning: something",
        "=== 1 passed, 1 warning in 2.50s ==="])
    assert rp._lane_row("H200")(log) == ["H200", "1: test_a.py: test_one", "0", "0", "0", "–", "0",
                                         "pytest finished in 2 s"]


def test_the_long_sample_row_is_end_to_end_over_the_limit_not_the_steady_figure(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    name = "2026-12-05-h100-gpu-micro-long-samples-76f6992.json"
    data = json.loads((results / name).read_text())
    root = next(iter(data["pieces"]["producer-16k"]["result"]["dtypes"]["bfloat16"]["roots"].values()))
    root["capture_publish_1pub_end_to_end_samples_per_s"] = root["limit_samples_per_s"] * 0.5
    root["capture_publish_1pub_samples_per_s"] = 9.999
    (results / name).write_text(json.dumps(data))
    row = next(line for line in rp.render(results).splitlines() if line.startswith("| 16,384 | bfloat16 |"))
    assert "| 0.50 |" in row and "9.99" not in row and "10.00" not in row, row
