"""``artcache bench --suite``: pieces that resume, a time budget that stops starting pieces, one result per piece
written atomically with its provenance, settings checked on resume, GPU pieces refused on a CPU in one line; the
CPU-runnable suites run at ``--scale tiny`` (killed mid-way, resumed, no piece run twice)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.bench import suites as S
from artcache.errors import ConfigError
from tests.support import REPO
from tests.support.procs import child_env


def _suite(calls: list[str], *, fail: str = "", sleep: float = 0.0, cuda: tuple[str, ...] = ()) -> S.Suite:
    def piece(name: str) -> S.Piece:
        def run(ctx: S.PieceContext) -> dict:
            calls.append(name)
            assert ctx.work.is_dir() and not any(ctx.work.iterdir())  # an empty scratch directory
            (ctx.work / "junk").write_text("x")
            time.sleep(sleep)
            if name == fail:
                raise RuntimeError(f"{name} broke")
            return {"name": name, "before": sorted(ctx.done)}

        return S.Piece(name, run, f"piece {name}", cuda=name in cuda)

    return S.Suite("fake", "a suite of test pieces", tuple(piece(n) for n in ("a", "b", "c")))


def test_the_time_budget_stops_starting_pieces_and_resume_skips_the_finished(tmp_path):
    calls: list[str] = []
    d, lines = tmp_path / "fake", []
    code = S.run_suite(_suite(calls, sleep=0.3), d, device="cpu", time_budget_s=0.2, echo=lines.append)
    assert code == S.EXIT_PIECES_LEFT == 75 and calls == ["a"]  # the first piece always starts
    assert "2 piece(s) left: b, c" in lines[-1] and f"--resume {d}" in lines[-1]
    assert sorted(p.name for p in (d / "pieces").iterdir()) == ["a.json"] and not (d / "fake.json").exists()
    doc = json.loads((d / "pieces" / "a.json").read_text())
    assert doc["result"] == {"name": "a", "before": []} and doc["wall_s"] >= 0.3
    assert doc["commit"] and doc["hardware"]["cpu_count"] >= 1 and doc["command"]
    first = (d / "pieces" / "a.json").read_bytes()

    assert S.run_suite(_suite(calls), d, device="cpu", resume=True, echo=lines.append) == 0
    assert calls == ["a", "b", "c"]  # a not run again
    assert (d / "pieces" / "a.json").read_bytes() == first
    final = json.loads((d / "fake.json").read_text())
    assert list(final["pieces"]) == ["a", "b", "c"] and final["pieces"]["c"]["result"]["before"] == ["a", "b"]
    assert final["suite"] == "fake" and final["scale"] == "full" and final["device"] == "cpu" and final["commit"]
    assert not list((d / "work").glob("*/junk"))  # a finished piece's scratch is removed
    assert S.run_suite(_suite(calls), d, device="cpu", resume=True, echo=lines.append) == 0 and len(calls) == 3


def test_a_failing_piece_keeps_the_finished_ones_and_names_itself(tmp_path):
    calls: list[str] = []
    d = tmp_path / "fake"
    with pytest.raises(S.PieceFailed, match="suite fake, piece b: RuntimeError: b broke"):
        S.run_suite(_suite(calls, fail="b"), d, device="cpu", echo=lambda _: None)
    assert (d / "pieces" / "a.json").is_file() and not (d / "pieces" / "b.json").exists()
    assert S.run_suite(_suite(calls), d, device="cpu", resume=True, echo=lambda _: None) == 0
    assert calls == ["a", "b", "b", "c"]


def test_bad_settings_are_refused_before_any_piece(tmp_path):
    calls: list[str] = []
    d = tmp_path / "fake"
    S.run_suite(_suite(calls), d, device="cpu", pieces="a", echo=lambda _: None)
    cases = [
        (dict(resume=False), "holds an earlier run of suite fake: continue it with --resume"),
        (dict(resume=True, scale="tiny", pieces="a"), "scale 'full' (now 'tiny')"),
        (dict(resume=True), "pieces ['a'] (now ['a', 'b', 'c'])"),
        (dict(pieces="a,zz"), "--pieces zz: not a piece of suite fake; accepted: a, b, c"),
        (dict(scale="huge"), "--scale 'huge' is not accepted"),
        (dict(time_budget_s=0), "--time-budget 0: accepted seconds > 0"),
        (dict(time_budget_s=math.nan), "--time-budget nan: accepted seconds > 0"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=None) as exc:
            S.run_suite(_suite(calls), d, device="cpu", echo=lambda _: None, **kw)
        assert msg in str(exc.value), (kw, str(exc.value))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty and holds no suite.json"):
        S.run_suite(_suite(calls), tmp_path / "other", device="cpu", resume=True, echo=lambda _: None)
    assert calls == ["a"]


def test_regression_empty_pieces_and_a_file_as_the_suite_directory_are_refused(tmp_path):
    """``--pieces ", "`` ran no piece, reported the suite done and wrote a suite.json of no pieces (which refused
    every later resume naming real pieces); ``--resume FILE`` raised NotADirectoryError with a traceback. Both are
    one line, before anything is written. (``--scale tiny`` without ``--suite`` ran the whole scenario: refused
    in test_suite_refusals_are_one_line_exit_2.)"""
    calls: list[str] = []
    with pytest.raises(ConfigError, match="--pieces ', ' names no piece; accepted: a comma list of a, b, c"):
        S.run_suite(_suite(calls), tmp_path / "f", device="cpu", pieces=", ", echo=lambda _: None)
    assert not (tmp_path / "f").exists()
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(ConfigError, match="report.json is not a directory"):
        S.run_suite(_suite(calls), tmp_path / "report.json", device="cpu", resume=True, echo=lambda _: None)
    assert calls == []


def test_cuda_pieces_are_refused_on_a_cpu_at_full_scale(tmp_path):
    calls: list[str] = []
    with pytest.raises(ConfigError) as exc:
        S.run_suite(_suite(calls, cuda=("b",)), tmp_path / "f", device="cpu", echo=lambda _: None)
    assert "piece(s) b need a CUDA device" in str(exc.value) and "--pieces a,c run on a CPU" in str(exc.value)
    assert calls == [] and not (tmp_path / "f").exists()
    assert S.run_suite(_suite(calls, cuda=("b",)), tmp_path / "t", device="cpu", scale="tiny",
                       echo=lambda _: None) == 0 and calls == ["a", "b", "c"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("args, needles", [
    (["--suite", "consumer-speed"], ["piece(s) matmul, dflash:main", "need a CUDA device", "--scale tiny"]),
    (["--suite", "gpu-micro"], ["piece(s) producer, consumer, producer-16k, producer-32k need a CUDA device",
                                "--pieces matmul,io run on a CPU"]),
    (["--suite", "gpu-micro", "--device", "cuda"], ["--device cuda: no CUDA device is visible"]),
    (["--suite", "nope"], ["--suite 'nope' is not a suite; accepted: retention-gap, gpu-micro"]),
    (["--resume", "x"], ["--resume, --time-budget, --pieces and --scale belong to --suite NAME"]),
    (["--scale", "tiny"], ["--resume, --time-budget, --pieces and --scale belong to --suite NAME"]),
    (["--suite", "packing", "--scale", "tiny", "--pieces", ", "], ["--pieces ', ' names no piece; accepted"]),
    (["--suite", "packing", "--scale", "tiny", "--resume", ""], ["--resume '' is empty"]),
    (["--suite", "retention-gap", "--steps", "3", "--scenario", "1p1c"],
     ["--scenario, --steps: scenario flag(s), not taken by --suite retention-gap"]),
])
def test_suite_refusals_are_one_line_exit_2(tmp_path, args, needles):
    res = CliRunner().invoke(main, ["bench", "--out", str(tmp_path / "o"), *args])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("artcache: error: "), res.output
    assert all(n in lines[0] for n in needles), lines[0]
    assert not (tmp_path / "o").exists()


def _bench(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "artcache", "bench", *args], cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(600)
def test_retention_gap_suite_killed_limited_and_resumed_runs_each_piece_once(tmp_path):
    """The real suite on a CPU at --scale tiny: a call SIGKILLed in its second piece keeps the first; a call with a
    tiny --time-budget runs one piece and exits 75; the last call finishes the rest. Every piece ran once (its
    file's bytes never change once written) and the suite's JSON holds every family's figures."""
    d = tmp_path / "rg"
    args = ["--suite", "retention-gap", "--scale", "tiny", "--resume", str(d)]
    proc = _bench(*args, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (d / "pieces" / "together.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    first = (d / "pieces" / "together.json").read_bytes()
    done = sorted(p.name for p in (d / "pieces").iterdir())
    assert done[0] == "together.json" and "retention-gap.json" not in {p.name for p in d.iterdir()}

    limited = _bench(*args, "--time-budget", "0.001", cwd=tmp_path)
    out = limited.communicate(timeout=300)[0]
    assert limited.returncode == 75, out
    assert "pieces done earlier" in out and "--time-budget 0.001 s reached" in out and f"--resume {d}" in out, out
    assert len(list((d / "pieces").iterdir())) == len(done) + 1

    last = _bench(*args, cwd=tmp_path)
    out = last.communicate(timeout=300)[0]
    assert last.returncode == 0, out
    assert (d / "pieces" / "together.json").read_bytes() == first
    assert "piece together (" not in out  # skipped, not run again
    doc = json.loads((d / "retention-gap.json").read_text())
    assert list(doc["pieces"]) == ["together", "staggered", "near-floor", "near-floor-load"]
    for name, piece in doc["pieces"].items():
        r = piece["result"]
        assert r["family"] == name and r["summary"]["n"] == 2 and r["summary"]["violations"] == 0
        assert piece["command"][:3] == ["artcache", "bench", "--suite"] and piece["commit"] and piece["hardware"]
    assert doc["scale"] == "tiny" and doc["device"] == "cpu"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_running_piece_unrecorded_and_exits_128_plus_it(tmp_path, monkeypatch, capsys, sig):
    """SIGTERM / Ctrl-C in a piece: the piece stops at once and is not recorded (it runs again on the next call), the
    finished ones stay, the call says so and exits 143 / 130."""
    import os

    calls: list[str] = []
    base = _suite(calls)

    def signalled(ctx: S.PieceContext) -> dict:
        calls.append("b")
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends
        return {}

    fake = S.Suite("fake", base.about, (base.pieces[0], S.Piece("b", signalled, "signalled"), base.pieces[2]))
    monkeypatch.setitem(S.SUITES, "fake", fake)
    d = tmp_path / "fake"
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert S.main_suite("fake", out_dir="", resume=str(d), device="cpu", scale="full", pieces="",
                        time_budget_s=None) == 128 + sig
    assert calls == ["a", "b"] and sorted(p.name for p in (d / "pieces").iterdir()) == ["a.json"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"stopped by {signal.Signals(sig).name} in piece b (not recorded: it runs again)" in last
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers put back
    monkeypatch.setitem(S.SUITES, "fake", base)
    assert S.main_suite("fake", out_dir="", resume=str(d), device="cpu", scale="full", pieces="",
                        time_budget_s=None) == 0
    assert calls == ["a", "b", "b", "c"]


def test_every_suite_is_named_in_the_bench_help_and_in_the_docs_table():
    """``artcache bench --help`` (and so docs/cli.md) and docs/benchmarks.md's suite table name every suite."""
    res = CliRunner().invoke(main, ["bench", "--help"], terminal_width=1000)
    assert res.exit_code == 0, res.output
    table = (REPO / "docs" / "benchmarks.md").read_text()
    for name in S.SUITES:
        assert name in res.output, name
        assert f"| `{name}` |" in table, name


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("suite, module, needle", [
    ("payload", "mooncake", "mooncake_master not found: python3 -m pip install mooncake-transfer-engine-non-cuda"),
    ("vllm-throughput", "vllm", "the vllm backend needs vLLM: install artcache[vllm]"),
])
def test_the_payload_and_vllm_suites_name_what_to_install_when_it_is_missing(tmp_path, suite, module, needle):
    """The two suites that need an optional package fail their piece in one line naming it (exit 1 through the
    CLI), leaving nothing recorded, on a machine without it."""
    if _installed(module):
        pytest.skip(f"{module} is installed here: its lane runs the suite")
    with pytest.raises(S.PieceFailed) as exc:
        S.run_suite(S.get_suite(suite), tmp_path / suite, device="cpu", scale="tiny", echo=lambda _: None)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert not (tmp_path / suite / "pieces").exists()
