"""``artcache bench --scenario all --device cpu`` in CI size: every scenario writes its three report files,
passes its checks, and its counts equal ``artcache inspect`` on the same root; 1p3c also runs the naive and
lockstep baselines in the same invocation and reports the comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import TINY_SHAREGPT
from tests.support.procs import inspect_json

DATA = TINY_SHAREGPT


@pytest.fixture(scope="module")
def bench_all(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("bench-cpu") / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "artcache", "bench", "--scenario", "all", "--target", tiny_target.path,
         "--data", str(DATA), "--max-length", "128", "--max-samples", "32", "--anchors", "8",
         "--draft-layers", "3", "--warmup", "2", "--steps", "6", "--window", "8:8", "--out", str(out)],
        capture_output=True, text=True, timeout=1200, env=env)
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
        # regression (a report named no command or commit): the figures' provenance
        assert report["command"][:3] == ["artcache", "bench", "--scenario"] and len(report["commit"]) == 40
        assert report["hardware"]["cpu_count"] >= 1
        assert f"## {scenario} on cpu" in (base / "report.md").read_text()
    assert "captures" in proc.stdout and "checks:" in proc.stdout  # the table is printed
    run = json.loads((out / "report.json").read_text())  # the run's own report: every scenario's verdict
    assert run["passed"] is True and [s["scenario"] for s in run["scenarios"]] == ["1p1c", "1p3c"]
    assert all(s["status"] == "passed" and (out / s["report"]).is_file() for s in run["scenarios"])
    summary = json.loads((out / "summary.json").read_text())
    assert [r["scenario"] for r in summary] == ["1p1c", "1p3c"] and not list(out.glob("*.part"))


def test_each_mode_says_what_it_does_while_it_runs(bench_all):
    """Off a terminal every mode ends with a line of each consumer's journaled steps and the captures (and writes
    one every 30 s meanwhile): the bench is never silent for a whole mode."""
    proc, _ = bench_all
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("   mode ")]
    for mode in ("artcache", "naive", "lockstep"):
        ends = [ln for ln in lines if ln.startswith(f"   mode {mode}, ")]
        assert ends and "dflash-b16 8/8 steps" in ends[-1] and " captures" in ends[-1], lines


def test_1p1c_runs_artcache_alone_by_default(bench_all):
    _, out = bench_all
    report = json.loads((out / "1p1c" / "report.json").read_text())
    assert list(report["modes"]) == ["artcache"] and report["comparison"] is None
    assert not (out / "1p1c" / "naive").exists() and not (out / "1p1c" / "modes.png").exists()


def test_1p3c_runs_both_baselines_in_the_same_invocation(bench_all):
    proc, out = bench_all
    base = out / "1p3c"
    report = json.loads((base / "report.json").read_text())
    modes = report["modes"]
    assert list(modes) == ["artcache", "naive", "lockstep"]
    assert (base / "modes.png").stat().st_size > 0
    ids = ["dflash-b4", "dflash-b8", "dflash-b16"]
    for m, s in modes.items():
        assert [c["id"] for c in s["consumers"]] == ids, m
        assert all(c["steps"] == 8 and c["exit_code"] == 0 and c["steps_per_s"] > 0 for c in s["consumers"]), m
        assert s["distinct_positions_consumed"] == 8 and s["cpu_s"] > 0, m
    # three producers (each loading the target) cost more CPU than one
    assert modes["naive"]["cpu_s"] > modes["artcache"]["cpu_s"]
    # naive: one producer and one root per consumer, each capturing every position its consumer read
    assert modes["naive"]["producers"] == 3 and modes["naive"]["consumers_per_root"] == [1, 1, 1]
    assert modes["naive"]["captures"] >= 3 * 8
    for cid in ids:
        assert [k["consumer"] for k in inspect_json(base / "naive" / f"cache-{cid}")["consumers"]] == [cid]
    # artcache and lockstep: one producer shared by the three consumers
    for m in ("artcache", "lockstep"):
        assert modes[m]["producers"] == 1 and modes[m]["captures_per_consumed_position"] <= 1.1, m
    comp = report["comparison"]
    assert comp["captures_vs_naive"]["artcache_wins"] is True
    assert comp["captures_vs_naive"]["naive"] >= 2.5 * comp["captures_vs_naive"]["artcache"]
    fast = comp["fast_consumer_vs_lockstep"]
    assert fast["consumer"] in ids and fast["lockstep"] > 0
    # lockstep held one shared cursor (checked, so a broken baseline fails the run)
    assert modes["lockstep"]["max_lead_steps"] <= 1 and report["checks"]["lockstep_one_shared_cursor"]
    for key in ("naive_completed", "lockstep_completed", "naive_one_consumer_per_root"):
        assert report["checks"][key], key
    text = (base / "report.md").read_text()
    assert "### modes" in text and "verdict: captures per consumed position" in text
    assert "verdict:" in proc.stdout


def test_every_mode_reports_its_bytes_and_leaves_no_checkpoint_or_artifact(bench_all):
    """Three modes x three consumers of full checkpoints filled a 64 GB disk. Now each consumer
    saves its weights only (--save weights, the default), and every mode's checkpoints and leftover
    artifacts are removed once its figures are read; report.json / report.md give the bytes per mode."""
    _, out = bench_all
    for scenario, modes in (("1p1c", ["artcache"]), ("1p3c", ["artcache", "naive", "lockstep"])):
        base = out / scenario
        report = json.loads((base / "report.json").read_text())
        n = len(report["consumers"])
        assert report["environment"]["settings"]["save"] == "weights"
        for m in modes:
            work = base if m == "artcache" else base / m
            disk = report["modes"][m]["disk"]
            removed = json.loads((work / "removed.json").read_text())
            assert disk["removed"] == removed and disk["save"] == "weights"
            assert disk["checkpoints"] == n == len(removed["checkpoints"]) and disk["checkpoint_bytes"] > 0, m
            assert disk["checkpoint_bytes"] == sum(b for _, b in removed["checkpoints"])
            assert 0 < disk["artifact_bytes_peak"] <= disk["artifact_bytes_published"], m
            assert disk["peak_bytes_bound"] == disk["artifact_bytes_peak"] + disk["checkpoint_bytes"]
            plan = disk["planned"]  # checked before the consumers started, an upper bound of what they wrote
            assert disk["checkpoint_bytes"] <= plan["checkpoint_bytes"] <= disk["checkpoint_bytes"] + n * (2 << 20)
            assert disk["artifact_bytes_peak"] <= plan["artifact_bytes"] < plan["free_bytes"]
            for c in report["consumers"]:  # the run's record stays, its checkpoints do not
                run = work / "runs" / c["id"]
                assert (run / "metrics.csv").is_file() and not (run / "checkpoints").exists(), (m, c["id"])
            roots = [work / "cache"] if m != "naive" else [work / f"cache-{c['id']}" for c in report["consumers"]]
            for root in roots:
                assert list((root / "objects").iterdir()) == [], root
                assert list((root / "journal").iterdir()), root  # the journals the report was made from stay
        sizes = [report["modes"][m]["disk"]["checkpoint_bytes"] for m in modes]
        # the same consumers write the same tensors in every mode; state.json's figures (losses, cursor,
        # times) differ by a few digits (seen: 1,496,308 and 1,496,310 B)
        assert max(sizes) - min(sizes) < 4096, sizes
        assert "### disk: bytes each mode wrote (--save weights)" in (base / "report.md").read_text()


def test_clean_mode_removes_checkpoints_and_artifacts_and_keeps_the_record(tmp_path):
    """Also the regression of the CPU bench leaving ``objects/<fan-out>/`` directories that eviction had
    emptied (nothing to count, so they were skipped): every root's ``objects/`` ends empty."""
    from artcache.bench.run import clean_mode
    from artcache.bench.scenarios import SCENARIOS
    from artcache.layout import CacheLayout

    work = tmp_path / "naive"
    sc = SCENARIOS["1p3c"]
    roots = []
    for c in sc.consumers:
        (work / "runs" / c.consumer_id / "checkpoints" / "step-00000002").mkdir(parents=True)
        (work / "runs" / c.consumer_id / "checkpoints" / "step-00000002" / "model.safetensors").write_bytes(b"w" * 100)
        (work / "runs" / c.consumer_id / "checkpoints" / "latest").symlink_to("step-00000002")
        (work / "runs" / c.consumer_id / "metrics.csv").write_text("step,tag,value,wall_time\n")
        layout = CacheLayout(work / f"cache-{c.consumer_id}")
        layout.create()
        (layout.objects / "cd").mkdir()  # a fan-out directory whose artifacts were all evicted
        if c is not sc.consumers[-1]:  # the last root: nothing left but that empty directory
            (layout.objects / "ab").mkdir()
            (layout.objects / "ab" / ("ab" + "0" * 38 + ".safetensors")).write_bytes(b"a" * 1000)
        (layout.journal / "producer-p-1.jsonl").write_text("{}\n")
        roots.append(layout.root)
    removed = clean_mode(work, roots, sc)
    assert removed["checkpoints"] == [[f"runs/{c.consumer_id}/checkpoints", 100] for c in sc.consumers]
    assert removed["artifacts"] == [[f"cache-{c.consumer_id}/objects", 1000] for c in sc.consumers[:-1]]
    assert json.loads((work / "removed.json").read_text()) == removed
    for c, root in zip(sc.consumers, roots, strict=True):
        assert not (work / "runs" / c.consumer_id / "checkpoints").exists()
        assert (work / "runs" / c.consumer_id / "metrics.csv").is_file()
        assert (root / "objects").is_dir() and list((root / "objects").iterdir()) == []
        assert (root / "journal" / "producer-p-1.jsonl").is_file()


def test_plan_disk_refuses_a_mode_that_cannot_fit_naming_the_bytes(tmp_path, monkeypatch):
    """The bench's own preflight: every consumer's checkpoint as the consumer sizes it, plus each root's
    retention bound of artifacts (windows; by need: the positions read, or the budget), against the free
    space, before any consumer starts (three consumers that each fit alone can fill a disk together)."""
    import msgspec

    from artcache import fsio
    from artcache.bench import run as R
    from artcache.errors import InsufficientSpace
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.store import artifact_bytes_bound
    from artcache.trainers.consumer import ConsumerConfig

    root = tmp_path / "cache"
    _, settings, _, info, _ = prepare_root(ProducerConfig(cache=str(root), target="random:tiny-llama",
                                                          dataset="synthetic", max_length=64, max_samples=16,
                                                          draft_layers=3, threads=1))
    cfg = R.BenchConfig(max_samples=16, save="weights")
    ccfgs = {root: [ConsumerConfig(cache=str(root), consumer_id=f"d{b}", block_size=b, lookbehind=2, lookahead=4,
                                   batch_size=1, steps=4, num_anchors=4, checkpoint_optimizer=False, threads=1,
                                   out_dir=str(tmp_path / "runs" / f"d{b}")) for b in (4, 8, 16)]}
    sizes: dict = {}
    per_artifact = artifact_bytes_bound(settings.contract, 64)
    # the windows-only rule: three windows of 2 + 4 + 1 positions, at most the 4 positions the consumers read
    plan = R.plan_disk(cfg, "1p3c mode windows", tmp_path, ccfgs, sizes, retention="windows")
    per = sizes["d4"][0]
    assert set(sizes) == {"d4", "d8", "d16"} and sizes["d4"][1] == info.hidden_size == 64
    assert plan["checkpoint_bytes"] == sum(v[0] for v in sizes.values()) and per > 0
    assert plan["artifact_bytes"] == min(3 * 7, 4) * per_artifact
    # retention by need with a budget it is not told (0): every position a consumer reads (steps 4 x batch 1)
    assert R.plan_disk(cfg, "1p3c mode artcache", tmp_path, ccfgs, sizes)["artifact_bytes"] == 4 * per_artifact
    # a budget: at most it (and the 12 positions read), but never less than the live window (7 positions)
    long = {root: [msgspec.structs.replace(ccfgs[root][0], steps=12)]}
    for budget, n in ((10, 10), (1, 7), (50, 12)):
        got = R.plan_disk(cfg, "1p1c mode artcache", tmp_path, long, sizes, budget=budget * per_artifact)
        assert got["artifact_bytes"] == n * per_artifact, budget
    fs = 10**12
    need = plan["checkpoint_bytes"] + plan["artifact_bytes"]
    monkeypatch.setattr(R, "free_space", lambda p: (need + fsio.space_reserve(fs) - 1, fs, tmp_path))
    with pytest.raises(InsufficientSpace) as info_:
        R.plan_disk(cfg, "1p3c mode naive", tmp_path, ccfgs, sizes, retention="windows")
    text = str(info_.value)
    assert f"1p3c mode naive needs {need:,} B" in text and "--save weights" in text and "--save none" in text
    assert "a smaller --window" in text and "another --out" in text
    assert not (tmp_path / "runs").exists()  # sizing writes nothing


def _preflight_cfg(out: Path, **kw):
    from artcache.bench import run as R

    kw = {"scenario": "all", **kw}
    return R.BenchConfig(out_dir=str(out), target="random:tiny-llama", dataset="synthetic", max_length=64,
                         max_samples=16, anchors=4, draft_layers=3, warmup=1, steps=2, window="2:4", **kw)


def test_preflight_refuses_the_whole_run_before_any_mode_starts(tmp_path, monkeypatch):
    """The bench's own preflight sizes every scenario x mode before the first one starts: a run
    whose 1p1c fits but whose 1p3c modes (three checkpoints each) do not is refused in one line, exit 2,
    with nothing written under --out and no process started (1p1c does not run first)."""
    from click.testing import CliRunner

    from artcache import fsio
    from artcache.app.cli import main
    from artcache.bench import run as R
    from artcache.bench.scenarios import resolve

    plan = R.preflight_disk(_preflight_cfg(tmp_path / "probe"), resolve("all"))
    m = plan["modes"]
    assert set(m) == {"1p1c/artcache", "1p3c/artcache", "1p3c/naive", "1p3c/lockstep"}
    one = m["1p1c/artcache"]["checkpoint_bytes"]
    assert one > 0 and m["1p3c/naive"]["checkpoint_bytes"] == 3 * one  # weights-only, the same draft shape
    # cleaning between modes: the run needs its largest mode at once, and writes every mode's checkpoints
    peak = max(v["checkpoint_bytes"] + v["artifact_bytes"] for v in m.values())
    assert plan["peak_bytes"] == peak and plan["peak_mode"] == "1p3c mode naive"
    assert plan["checkpoint_bytes_total"] == one + 3 * 3 * one
    # the windows-only rule (1p3c's producers get no --disk-budget): windows of 2 + 4 + 1 positions, at most
    # the positions read, warmup 1 + steps 2; naive: 3 roots of 3 artifacts; artcache and lockstep: one root of 3
    assert m["1p3c/naive"]["artifact_bytes"] == 3 * m["1p3c/artcache"]["artifact_bytes"] > 0
    assert m["1p3c/lockstep"]["artifact_bytes"] == m["1p3c/artcache"]["artifact_bytes"]
    assert not (tmp_path / "probe").exists()
    fs = 10**12
    free = m["1p1c/artcache"]["checkpoint_bytes"] + m["1p1c/artcache"]["artifact_bytes"] + fsio.space_reserve(fs)
    monkeypatch.setattr(R, "free_space", lambda p: (free, fs, tmp_path))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--scenario", "all", "--target", "random:tiny-llama", "--data",
                                    "synthetic", "--max-length", "64", "--max-samples", "16", "--anchors", "4",
                                    "--draft-layers", "3", "--warmup", "1", "--steps", "2", "--window", "2:4",
                                    "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("artcache: error:")]
    assert len(lines) == 1 and "1p3c mode artcache needs" in lines[0], res.output
    assert f"{free:,} B" in lines[0] and "--save none" in lines[0] and "== scenario" not in res.output
    assert not out.exists()
    # the same free space is enough for 1p1c alone: the refusal came from 1p3c, before 1p1c ran
    assert R.preflight_disk(_preflight_cfg(out, scenario="1p1c"), resolve("1p1c"))["peak_mode"] == "1p1c mode artcache"
    assert not out.exists()


def test_preflight_counts_the_previous_output_it_replaces(tmp_path, monkeypatch):
    """A previous bench output under --out is removed when its scenario starts: from then on its bytes are
    free. A directory that is not a bench output is refused before anything runs (ConfigError)."""
    from artcache import fsio
    from artcache.bench import run as R
    from artcache.bench.scenarios import resolve
    from artcache.errors import ConfigError, InsufficientSpace

    out = tmp_path / "out"
    cfg = _preflight_cfg(out, save="none")
    plan = R.preflight_disk(cfg, resolve("1p3c"))
    fs = 10**12
    short = 1 << 20
    monkeypatch.setattr(R, "free_space", lambda p: (plan["peak_bytes"] + fsio.space_reserve(fs) - short, fs, out))
    with pytest.raises(InsufficientSpace, match="1p3c mode artcache needs"):
        R.preflight_disk(cfg, resolve("1p3c"))
    (out / "1p3c").mkdir(parents=True)
    (out / "1p3c" / "report.json").write_text("{}")
    (out / "1p3c" / "old.bin").write_bytes(b"x" * short)
    assert R.preflight_disk(cfg, resolve("1p3c"))["peak_bytes"] == plan["peak_bytes"]
    (out / "1p3c" / "report.json").unlink()
    with pytest.raises(ConfigError, match="is not a previous bench output"):
        R.preflight_disk(cfg, resolve("1p3c"))
    assert (out / "1p3c" / "old.bin").is_file()  # nothing removed by a refused run


def test_bad_modes_exit_2_and_write_nothing(tmp_path):
    from click.testing import CliRunner

    from artcache.app.cli import main

    out = tmp_path / "bench-out"
    for modes, msg in (("artcache,bogus", "unknown mode(s) bogus"), ("naive,lockstep", "must include artcache")):
        res = CliRunner().invoke(main, ["bench", "--modes", modes, "--out", str(out)])
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("artcache: error:")]
        assert res.exit_code == 2 and len(errors) == 1 and msg in errors[0], res.output
        assert not out.exists()


def test_inspect_shows_the_reports_counts(bench_all):
    _, out = bench_all
    for scenario in ("1p1c", "1p3c"):
        report = json.loads((out / scenario / "report.json").read_text())
        acc = inspect_json(out / scenario / "cache")
        assert acc["violations"] == [], acc["violations"]
        cache = acc["cache"]
        for key, value in report["cache"].items():
            assert cache[key] == pytest.approx(value), key


# ---- the lockstep baseline's gate in the consumer's reader ---------------------------------------------

def test_lockstep_reader_reads_only_the_batch_every_member_may_read():
    from artcache.trainers.consumer.reader import Reader

    group = {"cursor": 0}
    r = Reader(None, 0, batch=2, lookahead=8, depth=1, end=100, group_cursor=lambda: group["cursor"])
    assert r._authorized(0) and r._authorized(1) and not r._authorized(2)  # batch [0, 2) only
    r.authorize(2)  # its own commit does not move the group's cursor
    assert not r._authorized(2)
    group["cursor"] = 2  # every member committed batch [0, 2)
    assert r._authorized(2) and r._authorized(3) and not r._authorized(4)
    # without a group the window alone decides: [cursor, cursor + lookahead]
    free = Reader(None, 0, batch=2, lookahead=8, depth=1, end=100)
    assert free._authorized(8) and not free._authorized(9)


def test_group_cursor_is_the_min_over_running_members(tmp_path):
    from artcache import registry
    from artcache.layout import CacheLayout
    from artcache.trainers.consumer.reader import group_cursor

    layout = CacheLayout(tmp_path / "root")
    layout.create()
    members = ["a", "b", "c"]
    handles = {}
    for cid in ("a", "b"):
        reg = registry.register(layout, registry.Registration(consumer_id=cid, draft="dflash", lookahead=8))
        handles[cid] = registry.ConsumerHandle(layout, reg)
    handles["a"].commit_cursor(4)
    handles["b"].commit_cursor(6)
    assert group_cursor(layout, members) == 0  # c has not registered yet: nobody may run ahead of it
    reg = registry.register(layout, registry.Registration(consumer_id="c", draft="dflash", lookahead=8))
    handles["c"] = registry.ConsumerHandle(layout, reg)
    handles["c"].commit_cursor(2)
    assert group_cursor(layout, members) == 2
    handles["c"].finish("failed", "boom")  # a member that stopped no longer holds the others back
    assert group_cursor(layout, members) == 4


def test_regression_bench_all_writes_the_runs_own_report(tmp_path, monkeypatch):
    """Regression: ``artcache bench --scenario all`` wrote each scenario's report.json and none of its own. The
    run's ``<out>/report.json`` lists every scenario's status, checks and report path, written atomically
    (artcache.fsio.atomic_write) before the first scenario and after each: a run that stops part-way lists what
    finished and what did not run, never a previous run's verdict. (Scenarios and preflight stubbed: this is
    the report, not the bench.)"""
    from artcache.bench import run as R

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"passed": true}')  # a previous run's
    checks = {"1p1c": {"a": True, "b": True}, "1p3c": {"a": True, "b": False}}
    seen = []

    def run_scenario(cfg, sc, plan):
        seen.append(json.loads((out / "report.json").read_text()))
        if sc.name not in checks:
            raise RuntimeError("stopped")
        (out / sc.name).mkdir(exist_ok=True)
        return {"scenario": sc.name, "checks": checks[sc.name]}

    writes = []
    real_write = R.atomic_write
    monkeypatch.setattr(R, "atomic_write", lambda dest, *a, **k: (writes.append(dest), real_write(dest, *a, **k)))
    monkeypatch.setattr(R, "run_scenario", run_scenario)
    monkeypatch.setattr(R, "format_report", lambda r: "")
    monkeypatch.setattr(R, "preflight_disk", lambda cfg, scs: {"peak_bytes": 0, "peak_mode": "", "free_bytes": 0,
                                                                "checkpoint_bytes_total": 0})
    assert R.run_bench(_preflight_cfg(out)) is False
    doc = json.loads((out / "report.json").read_text())
    assert doc == {"scenario": "all", "passed": False, "scenarios": [
        {"scenario": "1p1c", "status": "passed", "checks": {"a": True, "b": True}, "failed_checks": [],
         "not_checked": [], "report": "1p1c/report.json"},
        {"scenario": "1p3c", "status": "failed", "checks": {"a": True, "b": False}, "failed_checks": ["b"],
         "not_checked": [], "report": "1p3c/report.json"}]}
    assert [s["status"] for s in seen[0]["scenarios"]] == ["not run", "not run"] and seen[0]["passed"] is False
    assert [s["status"] for s in seen[1]["scenarios"]] == ["passed", "not run"]
    assert writes == [out / "report.json"] * 3 + [out / "summary.json"] and not list(out.glob("*.part"))
    del checks["1p3c"]  # a run that stops in its second scenario
    with pytest.raises(RuntimeError):
        R.run_bench(_preflight_cfg(out))
    assert [s["status"] for s in json.loads((out / "report.json").read_text())["scenarios"]] == ["passed", "not run"]


def test_regression_the_run_report_creates_a_missing_out(tmp_path, monkeypatch):
    """The run's report.json was written before the first scenario into an
    ``--out`` that did not exist yet (the scenarios created it), so every bench run into a new directory failed
    at once; ``--out`` is created if missing, as documented."""
    from artcache.bench import run as R

    out = tmp_path / "new" / "out"
    monkeypatch.setattr(R, "run_scenario", lambda cfg, sc, plan: {"scenario": sc.name, "checks": {"a": True}})
    monkeypatch.setattr(R, "format_report", lambda r: "")
    monkeypatch.setattr(R, "preflight_disk", lambda cfg, scs: {"peak_bytes": 0, "peak_mode": "", "free_bytes": 0,
                                                                "checkpoint_bytes_total": 0})
    assert R.run_bench(_preflight_cfg(out)) is True
    assert json.loads((out / "report.json").read_text())["passed"] is True


def test_regression_a_scenario_with_no_checks_is_not_passed(tmp_path):
    """write_run_report called a scenario whose checks were empty passed (all({}) is
    True), and a run of no scenario passed."""
    from artcache.bench import run as R
    from artcache.bench.scenarios import resolve

    sc = resolve("1p1c")
    doc = R.write_run_report(tmp_path, "1p1c", sc, [{"scenario": "1p1c", "checks": {}}])
    assert doc["scenarios"][0]["status"] == "failed" and doc["passed"] is False
    assert R.write_run_report(tmp_path, "none", [], [])["passed"] is False


def test_regression_bench_producers_wait_no_grace_when_every_consumer_is_expected():
    """Tidy item 3: every bench producer got ``--done-grace 5`` (5 s idle per mode, 20 s of ``--scenario all`` on
    CPU). A producer whose ``--expect-consumers`` counts every consumer it serves waits no grace (its "done" needs
    all of them registered: test_regression_exit_when_done_counts_every_expected_consumer_before_the_grace);
    several staggered consumers keep a start line of 1 and the 5 s grace."""
    from artcache.bench import run as R
    from artcache.bench.scenarios import SCENARIOS

    def flags(name: str, mode: str) -> list[list[str]]:
        sc = SCENARIOS[name]
        staggered = any(c.start_s > 0 for c in sc.consumers)
        return [R.producer_exit(served, staggered) for _, _, served in R._producers(Path("b"), mode, sc)]

    def expect(n: int, grace: float) -> dict:
        return {"exit_when_done": True, "done_grace_s": grace, "expect_consumers": n}

    assert flags("1p3c", "artcache") == flags("1p3c", "lockstep") == [expect(3, 0.0)]
    assert flags("1p1c", "artcache") == [expect(1, 0.0)]
    assert flags("1p3c", "naive") == flags("hetero", "naive") == [expect(1, 0.0)] * 3
    assert flags("hetero", "solo") == [expect(1, 0.0)]
    assert flags("hetero", "artcache") == [expect(1, 5.0)]  # staggered: a later consumer may register after


def test_regression_bench_on_cuda_without_a_gpu_fails_before_anything(tmp_path, monkeypatch):
    """``artcache bench --device cuda`` on a machine without a GPU failed only after loading data and sizing
    checkpoints (16 s) and left a report.json saying "not run" in --out. Now it fails first: one line, exit 2,
    nothing written (the disk plan, which loads the data, is never reached)."""
    import torch
    from click.testing import CliRunner

    from artcache.app.cli import main
    from artcache.bench import run as R

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_plan(*a, **k):
        raise AssertionError("the disk plan loads data: the device must be refused before it")

    monkeypatch.setattr(R, "preflight_disk", no_plan)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--scenario", "1p1c", "--device", "cuda", "--target",
                                    "random:tiny-llama", "--data", "synthetic", "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("artcache: error:") and "no CUDA device" in lines[0], lines
    assert not out.exists()
