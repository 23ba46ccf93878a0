"""bench/consumer_speed.py's parts run end to end at a toy size on the CPU (the GPU figures come from the
lead's H200 run): a built draft steps, a root with published artifacts reads back, run_consumer trains on
it for each draft, and the figures (MFU, bytes read, binding limit, samples/s, ratio to main) are
complete; the plan is validated and the JSON's provenance names the commit and the hardware."""

from __future__ import annotations

import math

import pytest
import torch

from artcache.bench import consumer_speed as cs
from artcache.telemetry import summarize


def test_plan_parsing_names_bad_entries():
    assert cs.parse_plan("dflash:main, cache-eagle3:syncfree+compile") == [
        ("dflash", "main"),
        ("cache-eagle3", "syncfree+compile"),
    ]
    assert [p for p, _ in cs.parse_plan(cs.DEFAULT_PLAN)].count("cache-eagle3") >= 2
    with pytest.raises(ValueError, match="'cache'.*cache-dflash"):
        cs.parse_plan("cache:main")
    with pytest.raises(ValueError, match="'fast'.*syncfree"):
        cs.parse_plan("eagle3:fast")
    assert cs.parse_plan("cache-dflash:syncfree+compile@1") == [("cache-dflash", "syncfree+compile@1")]
    for bad in ("dflash:syncfree@4", "cache-dflash:syncfree@0", "cache-dflash:syncfree@x"):
        with pytest.raises(ValueError, match="cache-\\* parts only"):
            cs.parse_plan(bad)


def test_rates_and_ratio_to_main():
    rows = [
        {"name": "d", "data": "in-memory", "variant": "main", "steps_per_s": 8.0},
        {"name": "d", "data": "in-memory", "variant": "syncfree", "steps_per_s": 20.0},
        {"name": "d", "data": "from-cache", "variant": "syncfree", "steps_per_s": 10.0},
        {"name": "d", "data": "in-memory", "variant": "liger", "error": "ImportError: x"},
    ]
    cs.compare(rows)
    assert rows[0]["x_main"] == 1.0 and rows[1]["x_main"] == 2.5
    assert "x_main" not in rows[2] and "x_main" not in rows[3]  # no main row of that data source
    assert cs.rates(rows[1], 8, 1024) == {
        "batch_size": 8,
        "seq_len": 1024,
        "samples_per_s": 160.0,
        "tokens_per_s": 163840.0,
    }


def test_provenance_names_commit_and_hardware():
    from artcache.bench.provenance import record

    p = record("artcache.bench.consumer_speed", device=torch.device("cpu"))
    assert p["command"][1:3] == ["-m", "artcache.bench.consumer_speed"]
    assert len(p["commit"]) == 40 and int(p["commit"], 16) >= 0  # the tests run in a git checkout
    assert p["hardware"]["cpu_count"] >= 1 and p["hardware"]["torch"] == torch.__version__


def test_provenance_outside_a_checkout_takes_the_named_commit(monkeypatch):
    from artcache.bench import provenance

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    monkeypatch.delenv("ARTCACHE_COMMIT", raising=False)
    assert provenance.record("artcache.bench.consumer_speed")["commit"] == "unknown"
    monkeypatch.setenv("ARTCACHE_COMMIT", "abc123")
    p = provenance.record("artcache.bench.consumer_speed", device=torch.device("cpu"))
    assert p["commit"] == "abc123" and p["dirty"] is False


def test_regression_named_commit_wins_over_a_stale_git(monkeypatch):
    """The H200 call of 2026-12-01 (session 4) ran 3a8a1ce's files in a copy whose .git said 44db884, and
    consumer_speed.json recorded 44db884 (dirty): a commit named by the sender wins, its dirtiness unknown."""
    from artcache.bench import provenance

    monkeypatch.setattr(provenance, "_git", lambda *a: "44db884" if a[0] == "rev-parse" else " M x.py")
    monkeypatch.setenv("ARTCACHE_COMMIT", "3a8a1ce")
    assert provenance.source_commit() == ("3a8a1ce", None)
    monkeypatch.setenv("ARTCACHE_COMMIT", "44db884")
    assert provenance.source_commit() == ("44db884", True)
    monkeypatch.delenv("ARTCACHE_COMMIT")
    assert provenance.source_commit() == ("44db884", True)


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_regression_provenance_is_the_one_hardware_record(tmp_path):
    """Regression: consumer_speed built its own hardware dict (no memory, kernel, load or root mount beside
    gpu_micro's and fp8_tau's). It is now artcache.bench.provenance.hardware's, the --root's mount included."""
    from artcache.bench.provenance import hardware, record

    p = record("artcache.bench.consumer_speed", device=torch.device("cpu"), roots=[tmp_path])
    want = hardware(torch.device("cpu"), [tmp_path])
    assert set(p["hardware"]) == set(want) and p["hardware"]["roots"] == want["roots"]
    assert {"memory_bytes", "kernel", "cpu", "cpu_count", "torch"} <= set(p["hardware"])
    assert p["hardware"]["roots"][str(tmp_path)]["mount"]


def test_regression_a_second_run_on_the_same_root_starts_clean(tmp_path):
    """The H200 call of 2026-12-02 (session 9) ran consumer_speed twice on the default --root: the second found
    the first's run directories, and its from-cache rows failed with "already holds checkpoints"."""
    root = tmp_path / "scratch"
    (root / "runs" / "dflash-main").mkdir(parents=True)
    (root / "cache" / "objects").mkdir(parents=True)
    cs.clear_scratch(root)
    assert list(root.iterdir()) == []
    cs.clear_scratch(tmp_path / "missing")  # nothing to clear
    (root / "mine.txt").write_text("x")
    (root / "runs").mkdir()
    with pytest.raises(ValueError, match="mine.txt"):
        cs.clear_scratch(root)
    assert (root / "runs").is_dir() and (root / "mine.txt").is_file()  # nothing removed


def test_regression_gpu_util_is_taken_over_the_measured_steps_not_the_compile():
    """Session 10's H200 row said 0 % utilisation: the median covered the 28 s compile (GPU idle) too."""
    from artcache.telemetry import GpuSample, NullSampler

    sampler = NullSampler(reason="")
    sampler.summary = lambda roles, t0=None, t1=None: summarize(sampler.samples, [0], roles, t0, t1)
    # compiling (idle) from t=0 to 28 s, then 40 steps of 0.1 s with the GPU busy
    sampler.samples = [GpuSample(t / 10, 0, 0.0 if t < 280 else 90.0, 0, 0.0, 0.0) for t in range(0, 320)]
    ends = [28.0 + 0.1 * k for k in range(1, 41)]
    rate, util = cs.measured_rate_and_util(ends, sampler)
    assert rate == pytest.approx(10.0) and util == 90.0
    assert cs.measured_rate_and_util(ends[:1], sampler) == (pytest.approx(float("nan"), nan_ok=True), None)
    assert cs.measured_rate_and_util(ends, NullSampler())[1] is None  # no NVML: no figure


def test_dspark_in_memory_row_on_cpu():
    """The ``dspark`` part builds DSpark's adapter (5 context layers + L - 1) and times its step; its FLOPs count
    every one of the B slots at the head and the target's head once more (more than DFlash's at equal sizes)."""
    d, cfg = cs.build("dspark", "tiny-llama", "syncfree", torch.device("cpu"), layers=3, anchors=4, block=4)
    assert d.name == "dspark" and len(d.needed_layer_ids) == 4
    batches = cs.device_batches(2, 32, 4, cfg.hidden_size, cfg.vocab_size, torch.device("cpu"), n=1)
    row = cs.time_in_memory(d, batches, steps=1, warmup=1)
    assert row["steps_per_s"] > 0 and math.isfinite(row["last_loss"])
    assert cs.dspark_step_flops(cfg, 32, 28) > cs.dflash_step_flops(cfg, 32, 28)


def test_flex_variants_are_in_memory_rows_of_block_drafts(tmp_path):
    from artcache.errors import ConfigError

    with pytest.raises(ConfigError, match="EAGLE-3 runs sdpa only"):
        cs.build("eagle3", "tiny-llama", "syncfree+compile+flex", torch.device("cpu"), layers=4, draft_vocab=512)
    d, _ = cs.build("dflash", "tiny-llama", "syncfree+compile+flex", torch.device("cpu"), layers=5, anchors=8)
    assert d.model.attn_impl == "flex"
    assert cs.parse_plan("dspark:syncfree+graphs+flex") == [("dspark", "syncfree+graphs+flex")]
    for entry in ("cache-dflash:syncfree+graphs+flex@2", "eagle3:syncfree+compile+flex"):
        with pytest.raises(ValueError, match="in-memory rows of the block drafts"):
            cs.parse_plan(entry)
    with pytest.raises(ValueError, match="in memory only"):
        cs.from_cache(tmp_path, "dflash", "syncfree+compile+flex", 40, torch.device("cpu"))


def test_regression_profile_busy_time_leaves_out_the_profiler_step_range():
    """A scheduled profile (a from-cache row) has a "ProfilerStep*" row on the device whose time spans its kernels';
    summing it with them made the H200's 11.3 ms of kernels a step read 45.7 ms."""
    from types import SimpleNamespace as NS

    cuda = torch.autograd.DeviceType.CUDA

    class Averages(list):
        def table(self, **_):
            return ""

    rows = Averages([NS(key="ProfilerStep*", device_type=cuda, self_device_time_total=30_000.0, count=2),
                     NS(key="sm90_gemm", device_type=cuda, self_device_time_total=8_000.0, count=4),
                     NS(key="Memcpy HtoD (Pinned -> Device)", device_type=cuda, self_device_time_total=2_000.0,
                        count=2),
                     NS(key="cudaLaunchKernel", device_type=torch.autograd.DeviceType.CPU,
                        self_device_time_total=0.0, count=6)])
    fig = cs.profile_figures(NS(key_averages=lambda: rows), steps=2)
    assert fig["gpu_busy_ms_per_step"] == pytest.approx(5.0) and fig["htod_ms_per_step"] == pytest.approx(1.0)
    assert fig["launches_per_step"] == 3


def test_switch_intervals_parse_as_positive_milliseconds():
    ap = cs._arg_parser()
    assert ap.parse_args(["--out", "x", "--switch-intervals-ms", "5,0.5"]).switch_intervals_ms == [5.0, 0.5]
    assert ap.parse_args(["--out", "x"]).switch_intervals_ms is None
    for bad in ("0", "-1", "junk", "5,", "2000"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--out", "x", "--switch-intervals-ms", bad])


def test_regression_a_repeated_row_runs_as_its_own_consumer(tmp_path):
    """H200, session 12: the second pass of --switch-intervals-ms (the same plan again) reused the first row's
    consumer id and run directory, and every repeated from-cache row failed with "already holds checkpoints of
    an earlier run"."""
    cs.make_root(tmp_path / "cache", 8 * 2, torch.device("cpu"), target="random:tiny-llama", seq=96,
                 union=[1, 2, 3, 4, 5, 7])
    for run, commit_s in ((0, 0.0), (1, None)):  # each row records its consumer's --commit-interval
        r = cs.from_cache(tmp_path / "cache", "dflash", "main", 2, torch.device("cpu"), view=[1, 2, 3, 4, 5], run=run,
                          commit_interval_s=commit_s)
        assert r["steps"] == 2 and r["commit_interval_s"] == (0.25 if commit_s is None else commit_s)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["dflash-main", "dflash-main-1"]



def test_commit_intervals_parse_as_seconds_in_the_consumers_range():
    ap = cs._arg_parser()
    assert ap.parse_args(["--out", "x", "--commit-intervals", "0,0.25"]).commit_intervals == [0.0, 0.25]
    assert ap.parse_args(["--out", "x"]).commit_intervals is None
    for bad in ("-1", "junk", "11", "0,"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--out", "x", "--commit-intervals", bad])


def test_regression_a_rerun_does_not_reuse_the_removed_roots_figures(tmp_path):
    """A second run on the same --root kept the first's root.json (rmtree cannot remove a file) while its cache/
    was removed: the second run's from-cache rows then found the figures, skipped building the root and each
    failed with "cache root ... does not exist"."""
    root = tmp_path / "scratch"
    (root / "cache" / "objects").mkdir(parents=True)
    (root / cs.ROOT_INFO).write_text("{}")
    cs.clear_scratch(root)
    assert list(root.iterdir()) == []


def test_compare_records_each_from_cache_rows_ratio_over_its_in_memory_row():
    """A from-cache row gets ``from_cache_over_in_memory`` against the in-memory row of its name and variant (the
    ``@N`` read-worker suffix ignored); rows without a partner or with an error get none."""
    rows = [{"name": "d", "variant": "syncfree", "data": "in-memory", "steps_per_s": 80.0},
            {"name": "d", "variant": "syncfree@2", "data": "from-cache", "steps_per_s": 60.0},
            {"name": "d", "variant": "main", "data": "from-cache", "steps_per_s": 30.0},
            {"name": "e", "variant": "syncfree", "data": "from-cache", "error": "x"}]
    cs.compare(rows)
    assert rows[1]["from_cache_over_in_memory"] == 0.75
    assert "from_cache_over_in_memory" not in rows[2] and "from_cache_over_in_memory" not in rows[3]
    assert "from_cache_over_in_memory" not in rows[0]
