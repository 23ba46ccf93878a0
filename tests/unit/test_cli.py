"""The command line on bad input: exit status 2, one line naming the bad value and what is accepted,
and nothing written (no cache root created, no file added to an existing root or directory).

Most cases run in-process through ``click.testing.CliRunner``; a few run the real ``artcache`` console
script where the process exit status and stderr of the installed entry point are the point.

"Nothing written" means: a cache root path that did not exist still does not exist (nor do missing
parent directories the command would have had to create); an existing directory, initialised or not,
keeps exactly the same entries with the same sizes and modification times; the working directory gets
no ``runs/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from tests.support import TINY_SHAREGPT

DATA = TINY_SHAREGPT
VERBS = ("producer", "consume", "inspect", "bench")


# ---- helpers ---------------------------------------------------------------------------------------

def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (relative path -> kind, size, mtime) — to prove nothing was written."""
    out = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = ("d" if p.is_dir() else "f", st.st_size, st.st_mtime_ns)
    return out


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=True)


def assert_bad_input(result, *needles: str, status: int = 2) -> str:
    """Exit ``status``, no traceback, exactly one stderr line 'artcache: error: ...' containing ``needles``."""
    assert not (result.exception and not isinstance(result.exception, SystemExit)), (
        f"uncaught {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code == status, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    line = lines[0]
    assert line.startswith("artcache: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def console_script() -> list[str]:
    exe = shutil.which("artcache")
    return [exe] if exe else [sys.executable, "-m", "artcache"]


def run_script(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*console_script(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty working directory (so a stray ``./runs`` would be noticed)."""
    wd = tmp_path / "wd"
    wd.mkdir()
    monkeypatch.chdir(wd)
    return wd


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_target) -> Path:
    """A cache root initialised exactly as ``artcache producer`` would (plan + artcache.json), no model load."""
    from artcache.producer import ProducerConfig, prepare_root

    path = tmp_path_factory.mktemp("cli-root") / "cache"
    prepare_root(ProducerConfig(cache=str(path), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    assert (path / "artcache.json").is_file()
    return path


def producer_args(cache: Path, tiny_target, *extra: str, data: Path | str = DATA) -> list[str]:
    return ["producer", "--cache", str(cache), "--target", tiny_target.path, "--data", str(data),
            "--max-samples", "40", "--max-length", "128", "--draft-layers", "3", *extra]


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


# ---- consume ---------------------------------------------------------------------------------------

def test_consume_missing_root(tmp_path, workdir):
    missing = tmp_path / "nope" / "cache"
    before = snapshot(tmp_path)
    line = assert_bad_input(invoke("consume", "--cache", str(missing)), str(missing), "artcache producer")
    assert "does not exist" in line
    assert not missing.exists() and not missing.parent.exists()
    assert snapshot(tmp_path) == before


def test_consume_empty_dir_is_not_a_root(tmp_path, workdir):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = assert_bad_input(invoke("consume", "--cache", str(empty)), str(empty), "artcache.json")
    assert "not initialised" in line or "not initialized" in line
    assert list(empty.iterdir()) == []
    assert list(workdir.iterdir()) == []


def test_consume_unknown_draft(root, workdir):
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--draft", "eagle9"), "'eagle9'", "dflash")
    assert snapshot(root) == before and list(workdir.iterdir()) == []


def test_regression_consume_tracker_project_without_a_tracker_is_refused(root, workdir):
    """`artcache consume --tracker-project foo` without --tracker trained as if the option were not there (no
    tracker run is made without --tracker): the option was silently ignored. It is refused in one line."""
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--tracker-project", "foo"),
                     "--tracker-project 'foo' needs --tracker")
    assert snapshot(root) == before and list(workdir.iterdir()) == []


@pytest.mark.parametrize("window", ["64-256", "64:", "a:b", ":", "1:2:3", "-1:5", "", "64:256x"])
def test_consume_bad_window(root, workdir, window):
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--window", window),
                     f"--window {window!r}", "LOOKBEHIND:LOOKAHEAD", "64:256")
    assert snapshot(root) == before and list(workdir.iterdir()) == []


def test_consume_lookahead_smaller_than_batch(root, workdir):
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--window", "0:1", "--batch-size", "2"),
                     "lookahead 1", "2 positions", "--window 0:2")
    assert snapshot(root) == before and list(workdir.iterdir()) == []


@pytest.mark.parametrize("args, needles", [
    (["--steps", "0"], ["--steps", "0"]),
    (["--batch-size", "0", "--window", "0:4"], ["--batch-size", "0"]),
    (["--block-size", "1"], ["--block-size 1 is invalid", ">= 2"]),
    (["--block-size", "0"], ["--block-size 0 is invalid", ">= 2"]),  # regression: said ">= 1" for 0, ">= 2" for 1
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--id", "../escape"], ["'../escape'", "A-Z a-z 0-9"]),
    (["--id", "a~b"], ["'a~b'"]),
    (["--draft-layers", "0"], ["--draft-layers 0", ">= 1"]),  # regression: 0 meant "the default"
    (["--eval-anchors", "-1"], ["--eval-anchors -1"]),
])
def test_consume_other_bad_values(root, workdir, args, needles):
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), *args), *needles)
    assert snapshot(root) == before and list(workdir.iterdir()) == []


def test_consume_zero_anchors_names_the_flag(root, workdir):
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--anchors", "0"), "--anchors 0")
    assert snapshot(root) == before


@pytest.fixture(scope="module")
def root_1_3(tmp_path_factory, tiny_target) -> Path:
    """A root capturing output-of-layer ids [1, 3] only (``--layer-ids 1,3``)."""
    from artcache.producer import ProducerConfig, prepare_root

    path = tmp_path_factory.mktemp("cli-root-1-3") / "cache"
    prepare_root(ProducerConfig(cache=str(path), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, layer_ids=[1, 3]))
    return path


def test_consume_draft_layers_not_captured(root_1_3, workdir):
    """A draft whose layers the root did not capture is refused before it registers or writes anything;
    the message names the missing layer and the producer flag that captures it."""
    before = snapshot(root_1_3)
    assert_bad_input(invoke("consume", "--cache", str(root_1_3), "--draft-layers", "3", "--steps", "1",
                            "--demand-timeout", "5"),
                     "--draft-layers 3", "[1, 2, 3]", "captures [1, 3]", "missing [2]", "--layer-ids 1,2,3")
    assert snapshot(root_1_3) == before and list(workdir.iterdir()) == []


def test_consume_draft_reads_a_subset_view(workdir, tmp_path, tiny_target):
    """A root may capture a superset: a 2-layer DFlash draft reads its view [1, 3] of the root's [1, 2, 3]
    (it gets as far as waiting for data, which no producer publishes here)."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    result = invoke("consume", "--cache", str(cache), "--draft-layers", "2", "--steps", "1", "--id", "view",
                    "--demand-timeout", "1", "--out", str(tmp_path / "run-view"), "--no-progress")
    assert result.exit_code == 1 and "CaptureTimeout" in result.stderr, result.output


def test_consume_eagle3_needs_the_last_layer(root, workdir):
    """EAGLE-3 reads three auxiliary layers plus output-of-layer L-1; this root lacks 5 (L = 6)."""
    pytest.importorskip("artcache.trainers.eagle3")
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--draft", "eagle3", "--steps", "1"),
                     "missing [5]", "--layer-ids 1,2,3,5")
    assert snapshot(root) == before and list(workdir.iterdir()) == []


# ---- producer --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["empty-list", "no-assistant", "only-bad-records"])
def test_producer_dataset_without_usable_sample(tmp_path, workdir, tiny_target, kind):
    data = {
        "empty-list": [],
        "no-assistant": [{"id": f"u{i}", "conversations": [{"from": "human", "value": f"hello {i}"},
                                                            {"from": "human", "value": "anyone?"}]}
                         for i in range(4)],
        "only-bad-records": [{"id": "x"}, 3, {"conversations": "not a list"}],
    }[kind]
    path = write_json(tmp_path / f"{kind}.json", data)
    cache = tmp_path / "cache"
    before = snapshot(tmp_path)
    assert_bad_input(invoke(*producer_args(cache, tiny_target, data=path)), str(path))
    assert not cache.exists(), sorted(p.name for p in cache.iterdir())
    assert snapshot(tmp_path) == before


def test_producer_no_assistant_names_the_reason(tmp_path, workdir, tiny_target):
    path = write_json(tmp_path / "d.json", [{"id": "u", "conversations": [{"from": "human", "value": "hi"}]}])
    line = assert_bad_input(invoke(*producer_args(tmp_path / "cache", tiny_target, data=path)), str(path))
    assert "no_assistant" in line and "0 of 1" in line


def test_producer_bad_dataset_leaves_existing_empty_dir_empty(tmp_path, workdir, tiny_target):
    path = write_json(tmp_path / "empty.json", [])
    cache = tmp_path / "cache"
    cache.mkdir()
    assert_bad_input(invoke(*producer_args(cache, tiny_target, data=path)), str(path))
    assert sorted(p.name for p in cache.iterdir()) == []


def test_producer_bad_dataset_leaves_no_parent_dirs(tmp_path, workdir, tiny_target):
    path = write_json(tmp_path / "empty.json", [])
    cache = tmp_path / "a" / "b" / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, data=path)), str(path))
    assert not (tmp_path / "a").exists()


def test_producer_layer_ids_beyond_target(tmp_path, workdir, tiny_target):
    cache = tmp_path / "cache"
    args = producer_args(cache, tiny_target)
    args[args.index("--draft-layers"):args.index("--draft-layers") + 2] = ["--layer-ids", "1,40"]
    assert_bad_input(invoke(*args), "--layer-ids 1,40: [40]", "6-layer target", "0..5")
    assert not cache.exists()


def test_regression_producer_layer_ids_duplicates_refused(tmp_path, workdir, tiny_target):
    """--layer-ids 1,1,2 used to be accepted and recorded layer 1 twice in the contract."""
    cache = tmp_path / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, "--layer-ids", "1,1,2")), "1,1,2", "[1]",
                     "more than once")
    assert not cache.exists()


@pytest.mark.parametrize("ids", ["1,x", "1;2", "1,,2", "", " "])
def test_producer_layer_ids_not_integers(tmp_path, workdir, tiny_target, ids):
    cache = tmp_path / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, "--layer-ids", ids)), repr(ids), "1,8,14")
    assert not cache.exists()


def test_regression_empty_layer_ids_refused_not_the_default(tmp_path, workdir, tiny_target):
    """`--layer-ids ""` (an unset shell variable) silently meant the draft's default layers."""
    cache = tmp_path / "cache"
    res = invoke(*producer_args(cache, tiny_target, "--layer-ids", ""))
    assert_bad_input(res, "--layer-ids ''", "leave the option out")
    assert not cache.exists()


@pytest.mark.parametrize("n", ["0", "4"])
def test_producer_draft_layers_out_of_range(tmp_path, workdir, tiny_target, n):
    cache = tmp_path / "cache"
    args = producer_args(cache, tiny_target)
    args[args.index("--draft-layers") + 1] = n
    assert_bad_input(invoke(*args), f"--draft-layers {n} is invalid for a target of 6 layers", "[1, 3]")
    assert not cache.exists()


def test_producer_missing_target(tmp_path, workdir):
    cache = tmp_path / "cache"
    assert_bad_input(invoke("producer", "--cache", str(cache), "--target", "/nonexistent", "--data", str(DATA)),
                     "'/nonexistent'", "smollm2-135m-instruct")
    assert not cache.exists()


def test_producer_max_length_too_small(tmp_path, workdir, tiny_target):
    cache = tmp_path / "cache"
    args = producer_args(cache, tiny_target)
    args[args.index("--max-length") + 1] = "3"
    assert_bad_input(invoke(*args), "--max-length 3 is invalid: accepted an integer >= 16")
    assert not cache.exists()


@pytest.mark.parametrize("args, needles", [
    (["--max-samples", "0"], ["--max-samples 0 is invalid: accepted an integer >= 1"]),
    (["--seed", "-1"], ["--seed -1 is invalid: accepted an integer >= 0"]),
    (["--batch-tokens", "64"], ["--batch-tokens 64 is invalid: accepted an integer >= 128, the plan's max length"]),
    (["--batch-samples", "0"], ["--batch-samples 0 is invalid: accepted an integer >= 1"]),
    (["--id", "../p"], ["'../p'"]),
])
def test_producer_other_bad_values(tmp_path, workdir, tiny_target, args, needles):
    cache = tmp_path / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, *args)), *needles)
    assert not cache.exists()


def test_producer_missing_dataset_file(tmp_path, workdir, tiny_target):
    cache = tmp_path / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, data=tmp_path / "nope.json")), "nope.json",
                     "sharegpt")
    assert not cache.exists()


def test_producer_other_contract_on_existing_root_writes_nothing(root, workdir, tiny_target):
    before = snapshot(root)
    args = producer_args(root, tiny_target)
    args[args.index("--draft-layers"):args.index("--draft-layers") + 2] = ["--layer-ids", "0,1"]
    assert_bad_input(invoke(*args), str(root), "--layer-ids/--draft-layers [1, 2, 3] there, [0, 1] here")
    assert snapshot(root) == before


def test_regression_producer_other_plan_names_the_flag_and_writes_nothing(root, workdir, tiny_target):
    """The plan mismatch named the internal field ``plan_id``; it names the flag that
    differs and both values."""
    before = snapshot(root)
    args = producer_args(root, tiny_target)
    args[args.index("--max-samples") + 1] = "7"
    line = assert_bad_input(invoke(*args), str(root), "differs in: --max-samples 40 there, 7 here")
    assert "plan_id" not in line
    assert snapshot(root) == before


# ---- inspect ---------------------------------------------------------------------------------------

def test_inspect_missing_root(tmp_path, workdir):
    missing = tmp_path / "missing"
    result = invoke("inspect", "--cache", str(missing))
    assert result.exit_code != 0
    assert_bad_input(result, str(missing))
    assert not missing.exists()


def test_inspect_uninitialised_dir(tmp_path, workdir):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_bad_input(invoke("inspect", "--cache", str(empty), "--json"), "artcache.json")
    assert list(empty.iterdir()) == []


def test_inspect_fresh_root_is_clean_and_read_only(root, workdir):
    before = snapshot(root)
    result = invoke("inspect", "--cache", str(root), "--json")
    assert result.exit_code == 0, result.output
    acc = json.loads(result.stdout)
    assert acc["violations"] == [] and acc["consumers"] == []
    assert acc["cache"]["captures"] == 0 and acc["cache"]["retained_artifacts"] == 0
    text = invoke("inspect", "--cache", str(root))
    assert text.exit_code == 0 and "invariants: ok" in text.stdout
    assert snapshot(root) == before


# ---- bench -----------------------------------------------------------------------------------------

def test_bench_bad_choices_write_nothing(tmp_path, workdir):
    out = tmp_path / "bench-out"
    for args in (["--scenario", "9p9c"], ["--device", "tpu"]):
        result = invoke("bench", "--out", str(out), *args)
        assert result.exit_code == 2 and args[1] in result.output
        assert not out.exists()


# ---- help --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [None, *VERBS])
def test_help(verb):
    args = [verb, "--help"] if verb else ["--help"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout and "--help" in result.stdout
    if verb:
        assert "--cache" in result.stdout or verb == "bench"
        short = invoke(verb, "-h")
        assert short.exit_code == 0 and short.stdout == result.stdout
    else:
        for v in VERBS:
            assert v in result.stdout


def test_help_from_console_script(tmp_path):
    for verb in VERBS:
        proc = run_script(verb, "--help", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "Usage:" in proc.stdout
    assert list(tmp_path.iterdir()) == []


# ---- the real console script: exit status and stderr of the entry point --------------------------------

def test_script_consume_missing_root(tmp_path):
    missing = tmp_path / "missing"
    proc = run_script("consume", "--cache", str(missing), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("artcache: error: ") and str(missing) in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_script_producer_empty_dataset(tmp_path, tiny_target):
    data = write_json(tmp_path / "empty.json", [])
    cache = tmp_path / "cache"
    proc = run_script(*producer_args(cache, tiny_target, data=data), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("artcache: error: ")]
    assert len(errors) == 1 and str(data) in errors[0]
    assert not cache.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.json"]


def test_script_inspect_missing_root_nonzero(tmp_path):
    proc = run_script("inspect", "--cache", str(tmp_path / "missing"), "--json", cwd=tmp_path)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and "missing" in proc.stderr


# ---- regressions fixed in artcache/cli.py ----------------------------------------------------------------

def test_regression_missing_root_exits_2(tmp_path, workdir):
    """README: a cache root that does not exist is bad input (exit 2), like the other bad values;
    CacheRootError used to take the generic ArtcacheError path (exit 1)."""
    for verb in ("consume", "inspect"):
        assert_bad_input(invoke(verb, "--cache", str(tmp_path / "missing")), "does not exist", status=2)
    empty = tmp_path / "empty"
    empty.mkdir()
    for verb in ("consume", "inspect"):
        assert_bad_input(invoke(verb, "--cache", str(empty)), "artcache.json", status=2)


@pytest.mark.parametrize("verb", ["producer", "consume"])
def test_regression_negative_threads(root, tmp_path, workdir, tiny_target, verb):
    """--threads -1 used to reach torch.set_num_threads and die with a RuntimeError traceback."""
    if verb == "producer":
        cache = tmp_path / "cache"
        args = producer_args(cache, tiny_target, "--threads", "-1")
    else:
        cache = root
        args = ["consume", "--cache", str(root), "--threads", "-1"]
    before = snapshot(cache)
    assert_bad_input(invoke(*args), "--threads -1", "positive integer")
    assert snapshot(cache) == before


@pytest.mark.parametrize("device", ["tpu", "cuda:64", "not a device"])
@pytest.mark.parametrize("verb", ["producer", "consume"])
def test_regression_unusable_device(root, tmp_path, workdir, tiny_target, verb, device):
    """--device cuda on a machine without CUDA used to fail with an AssertionError traceback — for the
    producer after artcache.json had been written. cuda:64 is unusable on any machine with < 65 GPUs."""
    if verb == "producer":
        cache = tmp_path / "cache"
        args = producer_args(cache, tiny_target, "--device", device)
    else:
        cache = root
        args = ["consume", "--cache", str(root), "--device", device]
    before = snapshot(cache)
    assert_bad_input(invoke(*args), f"--device {device!r}")
    assert snapshot(cache) == before


def test_regression_cuda_without_gpu(tmp_path, workdir, tiny_target):
    """``producer --device cuda`` on a machine without a GPU must be one line naming the value, that no CUDA device is
    visible and ``--device cpu`` (exit 2), before anything is created under ``--cache``."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    cache = tmp_path / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, "--device", "cuda")), "--device 'cuda'",
                     "no CUDA device", "--device cpu")
    assert not cache.exists()


@pytest.mark.parametrize("flag, value", [("--heartbeat-timeout", "0"), ("--heartbeat-timeout", "-1"),
                                         ("--heartbeat-timeout", "nan"), ("--idle-exit", "-5"),
                                         ("--expect-timeout", "0"), ("--expect-timeout", "-2"),
                                         ("--heartbeat-timeout", "inf")])  # regression: inf was stored as null
def test_regression_producer_nonpositive_timeouts(tmp_path, workdir, tiny_target, flag, value):
    """A negative --heartbeat-timeout used to be accepted: every consumer was fenced as expired at once."""
    cache = tmp_path / "cache"
    extra = [flag, value] if flag == "--idle-exit" else [flag, value, "--idle-exit", "1"]  # never hang
    assert_bad_input(invoke(*producer_args(cache, tiny_target, *extra)), f"{flag} {value}", "seconds")
    assert not cache.exists()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_regression_consume_nonpositive_demand_timeout(root, workdir, value):
    """--demand-timeout <= 0 used to be accepted: the first miss raised CaptureTimeout after registering."""
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--demand-timeout", value),
                     f"--demand-timeout {value}", "seconds > 0")
    assert snapshot(root) == before


@pytest.mark.parametrize("window", ["\u00b2:5", "\u0663:5", "1_0:5"])
def test_window_with_non_ascii_or_underscored_digits(root, workdir, window):
    """'²' passes str.isdigit() but not int(); '٣' and '1_0' pass int(): all must be refused the same way."""
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--window", window), f"--window {window!r}", "64:256")
    assert snapshot(root) == before


def test_verify_fs_passes_on_a_local_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "artcache", "verify-fs", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["ok"] and set(res["checks"]) == {"flock", "o_excl", "atomic_replace", "dir_fsync"}


def test_verify_fs_rejects_a_missing_path(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "artcache", "verify-fs", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_regression_producer_cache_is_a_file(tmp_path, tiny_target):
    """``producer --cache FILE`` (a file, not a directory) gave a traceback; it is one line saying the path is not a
    directory (exit 2) and the file is left as it was."""
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(f), "--target",
                           tiny_target.path, "--data", str(DATA), "--draft-layers", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert f.read_text() == "x"


def test_regression_producer_refuses_a_root_inside_a_root(tmp_path, tiny_target):
    """A ``--cache`` inside another cache root (here its objects/) was accepted and nested a root in a root; it is
    refused in one line (exit 2) and nothing is created."""
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "artcache.json").write_text("{}")
    inner = outer / "objects"
    proc = subprocess.run([sys.executable, "-m", "artcache", "producer", "--cache", str(inner), "--target",
                           tiny_target.path, "--data", str(DATA), "--draft-layers", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "inside the cache root" in proc.stderr
    assert not inner.exists()


def test_regression_unusable_out_and_cache_paths_are_clear_errors(root, workdir, tmp_path, tiny_target):
    """Tracebacks (exit 1) for --out / --cache under a regular file; consume had already registered."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--out", str(afile / "sub"), "--steps", "1"),
                     "--out", "sub", "writable directory")
    assert snapshot(root) == before  # nothing registered, no journal
    assert_bad_input(invoke(*producer_args(afile / "cache", tiny_target)), "--cache", "cannot be created")
    assert_bad_input(invoke("consume", "--cache", str(afile)), "is a file, not a directory")


def test_regression_producer_on_a_full_disk_is_one_line(tmp_path, workdir, tiny_target, monkeypatch):
    """Breakfix report: `artcache producer` creating a root on a full filesystem (a 10 MiB tmpfs filled up)
    died with a traceback from safetensors (``SafetensorError: ... No space left on device (os error 28)``)
    while saving the plan. Now: one line naming the plan's bytes and the free space (checked before writing),
    or the errno of the failed write, exit 1, and no root left behind."""
    import os as _os

    import artcache.fsio
    import artcache.plan

    cache = tmp_path / "cache"
    real = _os.statvfs

    def full(path):  # the plans directory's filesystem has no free block
        st = real(path)
        if "plans" not in str(path):
            return st
        return _os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, st.f_files, st.f_ffree,
                                   st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(artcache.fsio.os, "statvfs", full)
    line = assert_bad_input(invoke(*producer_args(cache, tiny_target, "--idle-exit", "1")), "plan ",
                            "B of tokens", "cannot be saved", "0 B free", status=1)
    assert "start the producer again" in line
    assert not cache.exists()
    monkeypatch.setattr(artcache.fsio.os, "statvfs", real)

    def enospc(*args, **kwargs):  # what safetensors raises when the write itself hits ENOSPC
        from safetensors import SafetensorError
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(artcache.plan, "save_file", enospc)
    assert_bad_input(invoke(*producer_args(cache, tiny_target, "--idle-exit", "1")), "could not be written",
                     "ENOSPC: No space left on device", "nothing was published", status=1)
    assert not cache.exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--expect-consumers", "-1",
     "--expect-consumers -1 is invalid: accepted an integer >= 0 (0 or a positive integer)"),
    ("--done-grace", "-5", "--done-grace -5.0 is invalid: accepted finite seconds >= 0"),
    ("--done-grace", "inf", "--done-grace inf is invalid: accepted finite seconds >= 0"),
    ("--batch-samples", "0", "--batch-samples 0 is invalid: accepted an integer >= 1"),
    ("--max-queue", "0", "--max-queue 0 is invalid: accepted an integer >= 1")])
def test_regression_producer_negative_counts(tmp_path, workdir, tiny_target, flag, value, message):
    """`--expect-consumers -1` and `--done-grace -5` were accepted silently (the producer ran),
    and `--batch-samples 0` was refused as "max_batch_samples must be >= 1", not naming the flag. The
    ranges are declared on ProducerConfig's fields (no CLI hand check) and reported in the one style."""
    cache = tmp_path / "cache"
    line = assert_bad_input(invoke(*producer_args(cache, tiny_target, flag, value, "--idle-exit", "1")))
    assert line == f"artcache: error: {message}"
    assert not cache.exists()


@pytest.mark.parametrize("value, shown", [("-1", "-1.0"), ("inf", "inf"), ("nan", "nan")])
def test_regression_fsck_observe_out_of_range(tmp_path, workdir, value, shown):
    """`fsck --observe` had its own hand check (`--observe -1 is not accepted: seconds >= 0`); it is
    now the declared range NonNegativeFloat reported in the one style, exit 2, before the root is read."""
    cache = tmp_path / "cache"
    line = assert_bad_input(invoke("fsck", "--cache", str(cache), "--observe", value))
    assert line == f"artcache: error: --observe {shown} is invalid: accepted finite seconds >= 0"
    assert not cache.exists()


@pytest.mark.parametrize("resume", [False, True])
def test_regression_garbage_registration_is_one_line(tmp_path, tiny_target, workdir, resume):
    """Breakfix report: a consumer registration file that is not JSON (`echo '{garbage' > consumers/kk.json`)
    made `artcache consume --id kk` die with a msgspec.DecodeError traceback. Now one line naming the file and
    `artcache fsck --fix`, exit 2, and the file is left for fsck."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    bad = cache / "consumers" / "kk.json"
    bad.write_text("{garbage")
    args = ["consume", "--cache", str(cache), "--id", "kk", "--steps", "1", "--window", "0:4", "--anchors", "4",
            "--block-size", "4", "--out", str(tmp_path / "kk"), "--demand-timeout", "5", "--no-progress",
            *(["--resume"] if resume else [])]
    assert_bad_input(invoke(*args), str(bad), "is unreadable", "fsck", "--fix")
    assert bad.read_text() == "{garbage"


def test_regression_inspect_names_the_saved_config_of_a_missing_root(tmp_path, workdir):
    """``artcache inspect --cache RUN_DIR`` whose saved config.toml names a cache root that no longer
    exists said only "cache root ... does not exist", not which file named that path. One line naming both the
    missing root and the saved config, exit 2, nothing created; a missing --cache root itself is named as before."""
    run_dir, gone = tmp_path / "run", tmp_path / "gone-root"
    run_dir.mkdir()
    saved = run_dir / "config.toml"
    saved.write_text(f'out = "{run_dir}"\n[cache]\nroot = "{gone}"\n')
    line = assert_bad_input(invoke("inspect", "--cache", str(run_dir)), f"the saved run config {str(saved)!r}",
                            f"names cache.root {str(gone)!r}", "does not exist")
    assert not gone.exists() and sorted(p.name for p in run_dir.iterdir()) == ["config.toml"], line
    line = assert_bad_input(invoke("inspect", "--cache", str(gone)), f"cache root {str(gone)!r} does not exist")
    assert "saved run config" not in line


def test_regression_inspect_names_an_unreadable_artcache_json(tmp_path, tiny_target, workdir):
    """Breakfix report: with `artcache.json` overwritten by garbage, `artcache inspect` printed its tables and
    "invariants: ok" (exit 0) while fsck, producer and consume all refused the root. Now inspect names the file
    (exit 2) like they do."""
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    assert invoke("inspect", "--cache", str(cache)).exit_code == 0
    (cache / "artcache.json").write_text("{garbage")
    assert_bad_input(invoke("inspect", "--cache", str(cache)), "artcache.json is invalid")


@pytest.mark.parametrize("args, needle", [(["--steps", "0"], "--steps 0"), (["--warmup", "-1"], "--warmup -1"),
                                          (["--out", "FILE"], "is not a directory")])
def test_regression_bench_zero_steps_and_file_out(tmp_path, workdir, args, needle):
    """Breakfix report: `artcache bench --steps 0` ran, reported 0.000 steps/s and "checks: all ok" (exit 0);
    `--warmup -1` ran too; `--out` naming a file died with a NotADirectoryError traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = [str(blocker) if a == "FILE" else a for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "bench-out")]
    assert_bad_input(invoke("bench", "--scenario", "1p1c", "--target", "random:tiny-llama", "--data", "synthetic",
                            "--max-samples", "20", "--max-length", "32", *out, *args), needle)
    assert not (tmp_path / "bench-out").exists() and blocker.read_text() == "x"


def test_regression_negative_epochs_is_named_as_such(root, workdir):
    """Breakfix report: `consume --steps 2 --epochs -1` was refused as "--epochs -1 and --steps 2 both say how
    long to train" instead of naming -1 as out of range."""
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--steps", "2", "--epochs", "-1"), "--epochs -1",
                     ">= 0")
    assert snapshot(root) == before


@pytest.mark.parametrize("args,needle", [
    (["consume", "--steps", "abc"], "Invalid value for '--steps': 'abc' is not a valid integer"),
    (["consume", "--bogus"], "No such option '--bogus'"),
    (["producer", "--retention", "lru"], "Invalid value for '--retention'"),
    (["nope"], "No such command 'nope'"),
    (["--bogus"], "No such option '--bogus'"),
])
def test_regression_click_usage_errors_are_one_line(workdir, args, needle):
    """Click's own usage errors printed usage, a hint, a blank line
    and 'Error: ...' (4 lines) where every other bad input is one 'artcache: error:' line; they are one line
    now (exit 2, naming the value and where the accepted ones are listed), also from the console script."""
    text = assert_bad_input(invoke(*args), needle)
    assert "--help` lists what is accepted" in text
    proc = run_script(*args, cwd=workdir)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("artcache: error: ")
    assert needle in proc.stderr and proc.stdout == "" and list(workdir.iterdir()) == []


def test_regression_refused_duplicate_consumer_leaves_no_out_dir(tmp_path, workdir, tiny_target):
    """A second `consume` with the id of a live consumer was refused but left its (empty) --out
    directory, parents included. The run directory is now created only once the registration holds."""
    import subprocess as sp

    from artcache import registry
    from artcache.layout import CacheLayout
    from artcache.producer import ProducerConfig, prepare_root

    cache = tmp_path / "cache"
    prepare_root(ProducerConfig(cache=str(cache), target=tiny_target.path, dataset=str(DATA), max_samples=40,
                                max_length=128, draft_layers=3))
    holder = sp.Popen(["sleep", "60"])  # a live process holding the id (the first consumer)
    try:
        registry.register(CacheLayout(cache), registry.Registration(consumer_id="dup", draft="dflash", pid=holder.pid))
        out = tmp_path / "runs" / "dup"
        assert_bad_input(invoke("consume", "--cache", str(cache), "--id", "dup", "--steps", "1", "--out", str(out),
                                "--no-progress"), "consumer id 'dup' is already running", "choose another --id")
        assert not out.exists() and not out.parent.exists()
        assert list(workdir.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()


def test_regression_run_without_experiments_names_the_config(tmp_path, workdir):
    """`artcache run --config FILE` with no [[experiments]] lacked the `--config PATH:` prefix every
    other config error has."""
    path = write_json(tmp_path / "run.json", {"out": str(tmp_path / "o")})
    assert_bad_input(invoke("run", "--config", str(path), "--dry-run"),
                     f"--config {str(path)!r}: no experiments", "[[experiments]]")
    assert not (tmp_path / "o").exists()


# ---- out-of-range flag values --------------------------------------------------------------------

@pytest.mark.parametrize("draft", ["dflash", "eagle3", "dspark"])
def test_regression_unknown_best_metric_refused_before_step_1(root, workdir, tmp_path, draft):
    """`consume --best-metric replay_taux --eval-samples 2` trained, then only warned at the first
    evaluation. It is refused before the root is read, naming the value and the draft's figures."""
    from artcache.trainers.draft import draft_class

    before = snapshot(root)
    out = tmp_path / "run-best"
    line = assert_bad_input(invoke("consume", "--cache", str(root), "--draft", draft, "--eval-samples", "2",
                                   "--best-metric", "replay_taux", "--steps", "1", "--out", str(out)),
                            "--best-metric 'replay_taux'", f"of the {draft} draft",
                            "accepted: " + ", ".join(draft_class(draft).eval_figures))
    assert "replay_tau," in line
    assert snapshot(root) == before and not out.exists() and list(workdir.iterdir()) == []


def test_regression_replay_figure_needs_the_last_layer(root, workdir, tmp_path):
    """The replay_tau-needs-L-1 check covers every greedy-replay figure (this root lacks layer 5)."""
    before = snapshot(root)
    out = tmp_path / "run-replay"
    assert_bad_input(invoke("consume", "--cache", str(root), "--eval-samples", "2", "--best-metric",
                            "replay_truncated_frac", "--steps", "1", "--out", str(out), "--no-progress"),
                     "--best-metric replay_truncated_frac needs the target's last layer 5", "--best-metric tau")
    assert snapshot(root) == before and not out.exists()


@pytest.mark.parametrize("args, needles", [
    (["--block-size", "100000000"], ["--block-size 100000000 is invalid", ">= 2 and <= 64"]),
    (["--block-size", "65"], ["--block-size 65 is invalid", "<= 64"]),
    (["--anchors", "100000000"], ["--anchors 100000000 is invalid", ">= 1 and <= 128", "--max-length"]),
    (["--anchors", "129"], ["--anchors 129 is invalid", "<= 128"]),
    (["--draft", "dspark", "--anchors", "100000000"], ["--anchors 100000000 is invalid", "<= 128"]),
])
def test_regression_huge_block_size_and_anchors_refused(root, workdir, tmp_path, args, needles):
    """`consume --block-size 100000000` (or --anchors) died allocating 40 TB. B is at most 64 (the
    recipes use 4 to 16), a given anchor count at most the root's tokens per sample (max_length 128 here)."""
    before = snapshot(root)
    out = tmp_path / "run-big"
    assert_bad_input(invoke("consume", "--cache", str(root), "--steps", "1", "--out", str(out), "--demand-timeout", "5",
                            "--no-progress", *args), *needles)
    assert snapshot(root) == before and not out.exists() and list(workdir.iterdir()) == []


def test_regression_largest_block_size_and_anchors_accepted():
    """The bounds themselves are accepted: B 64 and anchors = max_length."""
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.consumer.config import check_anchors

    ConsumerConfig(cache="-", block_size=64).validate()
    check_anchors(128, 128)
    check_anchors(None, 16)  # not given: the draft's default is never refused


@pytest.mark.parametrize("window, needles", [
    ("1:10000000000000", ["--window 1:10000000000000 is invalid", "<= 16777216 positions"]),
    ("16777217:8", ["--window 16777217:8 is invalid", ">= 0 and <= 16777216"]),
    ("0:0", ["lookahead 0 is smaller than one batch", "--window 0:2"]),
    ("-4:8", ["--window '-4:8' is not LOOKBEHIND:LOOKAHEAD"]),
])
def test_regression_absurd_window_refused(root, workdir, window, needles):
    """`--window 1:10000000000000` was accepted (every position of a live window stays on disk)."""
    before = snapshot(root)
    assert_bad_input(invoke("consume", "--cache", str(root), "--window", window), *needles)
    assert snapshot(root) == before and list(workdir.iterdir()) == []


def test_regression_window_bound_is_the_one_parser():
    """One parser (artcache.ranges.parse_window) for the consumer, the run config and the bench; its bound is
    accepted."""
    from artcache.ranges import MAX_WINDOW, parse_window
    from artcache.trainers.consumer import parse_window as consumer_parse_window

    assert consumer_parse_window is parse_window
    assert parse_window(f"{MAX_WINDOW}:{MAX_WINDOW}") == (MAX_WINDOW, MAX_WINDOW)


@pytest.mark.parametrize("budget, needles", [
    ("-5", ["--disk-budget '-5' is not accepted", "0 for none", "or auto"]),
    ("1e5", ["--disk-budget '1e5' is not accepted"]),
    ("0.5", ["--disk-budget 0.5 is invalid", "at least one byte"]),  # used to become 0: the default
    ("99999999999T", ["--disk-budget 99999999999T is invalid", "<= 1152921504606846976 bytes (2**60"]),
    (str(2**60 + 1), [f"--disk-budget {2**60 + 1} is invalid"]),
])
def test_regression_absurd_disk_budget_refused(tmp_path, workdir, tiny_target, budget, needles):
    """`producer --disk-budget 99999999999T` was accepted, `0.5` silently meant the default; refused
    before the root is created."""
    cache = tmp_path / "new" / "cache"
    assert_bad_input(invoke(*producer_args(cache, tiny_target, "--disk-budget", budget)), *needles)
    assert not cache.parent.exists() and list(workdir.iterdir()) == []


def test_regression_disk_budget_bounds_accepted():
    """The bound added against ``--disk-budget 99999999999T`` must not refuse real budgets: 1024 TiB, 2**60 bytes, a
    fractional 1.1T and 0 (the default) still parse."""
    from artcache.app.values import parse_bytes

    assert parse_bytes("1024T", "disk-budget") == 1 << 50 and parse_bytes(str(2**60), "disk-budget") == 2**60
    assert parse_bytes("1.1T", "disk-budget") == int(1.1 * 2**40) and parse_bytes("0", "disk-budget") == 0


def test_regression_lr_total_steps_below_steps_refused_before_training(root, workdir, tmp_path):
    """A fresh `consume --steps 4 --lr-total-steps 1` trained its steps 3-4 at LR 0 and
    exited 0 (the check existed only on --resume). Refused before anything is written; equal is accepted."""
    from artcache.trainers.consumer import ConsumerConfig

    before = snapshot(root)
    out = tmp_path / "run-lr"
    assert_bad_input(invoke("consume", "--cache", str(root), "--steps", "4", "--lr-total-steps", "1", "--out", str(out),
                            "--demand-timeout", "5", "--no-progress"),
                     "--lr-total-steps 1 is below --steps 4", "accepted: --lr-total-steps >= --steps")
    assert snapshot(root) == before and not out.exists()
    ConsumerConfig(cache="-", steps=4, lr_total_steps=4).validate()
    ConsumerConfig(cache="-", steps=4, lr_total_steps=1, min_lr_frac=0.1).validate()  # a floor: LR never 0


@pytest.mark.parametrize("flags, needle", [
    (["--keep-vocab-map"], "--keep-vocab-map needs --init-from"),
    (["--min-vocab-coverage", "0.3"], "--min-vocab-coverage 0.3 needs --init-from"),
])
def test_regression_vocab_map_flags_without_init_from_are_refused(root, workdir, flags, needle):
    """``--keep-vocab-map`` and ``--min-vocab-coverage`` judge a seed's own vocab map; without ``--init-from`` they
    were accepted and did nothing. One line, exit 2, nothing written."""
    before = snapshot(root)
    result = invoke("consume", "--cache", str(root), "--draft", "eagle3", "--ttt-steps", "2", "--draft-vocab", "512",
                    *flags)
    assert_bad_input(result, needle)
    assert snapshot(root) == before and not (workdir / "runs").exists()


def test_consume_out_that_is_a_file_is_refused(root, workdir, tmp_path):
    """``consume --out`` naming an existing file (or a path under one) is refused before anything is written,
    naming the path and what is accepted; the file is untouched."""
    victim = tmp_path / "passwd"
    victim.write_text("root:x:0:0\n")
    before = snapshot(root)
    for out, why in ((victim, "it is a regular file"), (victim / "run", f"cannot be created: {victim} is a regular")):
        assert_bad_input(invoke("consume", "--cache", str(root), "--steps", "1", "--out", str(out)),
                         f"--out {str(out)!r}", why, "accepted: a writable directory, existing or creatable")
    assert victim.read_text() == "root:x:0:0\n" and snapshot(root) == before and list(workdir.iterdir()) == []


@pytest.mark.parametrize("args, needle", [
    (["--max-samples", "0"], "--max-samples 0 is invalid: accepted an integer >= 1"),
    (["--draft-layers", "40"], "--draft-layers 40 is invalid for a target of 30 layers: accepted an integer in "
     "[1, 27]"),
])
def test_regression_bench_names_its_own_flags(tmp_path, workdir, args, needle):
    """Bug: ``artcache bench --max-samples 0`` said ``plan max_samples 0 is invalid`` and ``--draft-layers 40`` said
    ``num_draft_layers=40 must be in [1, 27] for num_target_layers=30``: internal names, not the flags typed.
    Symptom: the message did not name the option to change. Both now name the flag; nothing is written."""
    line = assert_bad_input(invoke("bench", *args, "--out", str(tmp_path / "bench-out")), needle)
    assert "plan " not in line and "num_" not in line
    assert not (tmp_path / "bench-out").exists() and list(workdir.iterdir()) == []


@pytest.mark.parametrize("args, needle", [
    (["consume", "--cache", "CACHE", "--id", ""], "invalid --id '': use 1-64 characters"),
    (["consume", "--cache", "CACHE", "--eval-anchors", "3"],
     "--eval-anchors 3 needs a held-out split: pass --eval-samples"),
    (["bench", "--scenario", "1p1c", "--out", ""], "--out '' is empty; accepted: a directory path"),
])
def test_regression_empty_values_and_eval_anchors_without_a_split_are_refused(tmp_path, monkeypatch, args, needle):
    """``consume --id ''`` trained under the default id; ``bench --out ''`` wrote its reports into the working
    directory (replacing a report.json there); ``--eval-anchors`` without ``--eval-samples`` was accepted and
    ignored. Each is one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    args = [str(tmp_path / "cache") if a == "CACHE" else a for a in args]
    res = CliRunner().invoke(main, args)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
    assert list(tmp_path.iterdir()) == []


def test_regression_report_names_a_missing_or_empty_run_directory(tmp_path, monkeypatch):
    """``artcache report /no/such/dir`` said it "is not a run directory ... (no config.toml)" and ``report ''``
    named the working directory; both now say what is wrong with the value given."""
    monkeypatch.chdir(tmp_path)
    for arg, needle in ((str(tmp_path / "gone"), "gone' does not exist"), ("", "run directory '' is empty"),
                        (str(tmp_path), "is not a run directory of artcache run (no config.toml)")):
        res = CliRunner().invoke(main, ["report", arg])
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], (arg, res.output)
