"""bench.fp8_tau: the two run configs it writes are accepted by ``artcache run``'s own loader and planner and
differ only in the stored dtype (same target, plan, captured layers, drafts, seeds and schedule); the report's
rows compare the right numbers. The end-to-end runs belong to the GPU lane (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from artcache.app.config import load_run_config
from artcache.app.experiments import plan_run
from artcache.bench import fp8_tau
from tests.support import TINY_SHAREGPT

DATA = TINY_SHAREGPT


def _args(tiny_target):
    args, _ = fp8_tau.parse_args(
        ["--out", "unused", "--target", tiny_target.path, "--data", str(DATA), "--max-length", "128",
         "--max-samples", "40", "--steps", "6", "--dflash-block", "4", "--dflash-anchors", "4",
         "--dflash-eval-anchors", "4", "--eagle3-vocab", "512", "--eval-samples", "4", "--window", "2:8"])
    return args


def test_bf16_and_fp8_configs_plan_the_same_run_in_two_dtypes(tiny_target, tmp_path):
    args = _args(tiny_target)
    plans = {}
    for dtype, seeds in (("bfloat16", [0, 1]), ("fp8", [0])):
        path = tmp_path / f"{dtype}.toml"
        path.write_text(fp8_tau.run_config(args, dtype, seeds, tmp_path / dtype))
        plans[dtype], _ = plan_run(load_run_config(path))
    bf, f8 = plans["bfloat16"], plans["fp8"]
    assert (bf.dtype, f8.dtype) == ("bfloat16", "float8_e4m3fn")
    assert [e.name for e in bf.experiments] == ["dflash-s0", "eagle3-s0", "dflash-s1", "eagle3-s1"]
    assert [e.name for e in f8.experiments] == ["dflash-s0", "eagle3-s0"]
    assert bf.plan_id == f8.plan_id and bf.captured_layer_ids == f8.captured_layer_ids
    assert bf.contract_id != f8.contract_id  # the dtype is part of the contract
    def settings(e):  # the consumer's flags less the root's own paths
        return {k: v for k, v in e.consumer.items() if not (isinstance(v, str) and str(tmp_path) in v)}

    for a, b in zip(bf.experiments[:2], f8.experiments, strict=True):
        assert (a.layer_ids, a.view, a.steps, a.seed, a.lr, a.window, settings(a)) == (
            b.layer_ids, b.view, b.steps, b.seed, b.lr, b.window, settings(b))
        assert {"cache", "out_dir"} <= set(a.consumer) - set(settings(a))
    assert bf.experiments[2].seed == 1
    # fp8: one byte per value plus a 4-byte scale per token row per layer, against two bytes per value
    assert 0.5 < f8.bytes_per_artifact_max / bf.bytes_per_artifact_max < 0.6


def test_compare_rows_give_seed_spread_and_fp8_difference():
    runs = {"bfloat16": {"dflash-s0": {"replay_tau": 1.5, "tau": 2.0}, "dflash-s1": {"replay_tau": 1.7, "tau": 1.9},
                         "eagle3-s0": {"sim_acc_len": 0.8}, "eagle3-s1": {}},
            "fp8": {"dflash-s0": {"replay_tau": 1.45, "tau": 2.1}, "eagle3-s0": {"sim_acc_len": 0.75}}}
    rows = {(r["draft"], r["metric"]): r for r in fp8_tau.compare(runs, [0, 1])}
    assert set(rows) == {("dflash", "replay_tau"), ("dflash", "tau"), ("eagle3", "sim_acc_len")}
    r = rows[("dflash", "replay_tau")]
    assert r["bf16_seed_spread"] == pytest.approx(0.2) and r["fp8_minus_bf16"] == pytest.approx(-0.05)
    assert rows[("dflash", "tau")]["fp8_minus_bf16"] == pytest.approx(0.1)
    e = rows[("eagle3", "sim_acc_len")]
    assert e["bf16_seed_spread"] is None and e["fp8_minus_bf16"] == pytest.approx(-0.05)  # one bf16 seed only


def test_bad_flags_are_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        fp8_tau.main(["--out", str(tmp_path / "o"), "--seeds", ""])
    assert exc.value.code == 2 and "--seeds" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_regression_the_report_records_commit_and_hardware(tmp_path, monkeypatch, capsys):
    """fp8_tau.json had the command but no commit or hardware (which every committed result
    carries); the two ``artcache run`` processes are stood in for by ones that write a report."""
    import json as _json
    import types

    import tomllib

    class FakeRun:
        def __init__(self, cmd, env=None):
            cfg = tomllib.loads(Path(cmd[cmd.index("--config") + 1]).read_text())
            run = Path(cfg["out"])
            run.mkdir(parents=True)
            exps = [{"name": e["name"], "registration": "completed",
                     "consumer_summary": {"steps": 4, "eval": {"step": 4, "samples": 4, "replay_tau": 1.5}}}
                    for e in cfg["experiments"]]
            (run / "report.json").write_text(_json.dumps({"experiments": exps,
                                                          "shared_production": {"published_bytes": 10}}))

        def wait(self):
            return 0

    monkeypatch.setattr(fp8_tau, "subprocess", types.SimpleNamespace(Popen=FakeRun))
    monkeypatch.setenv("ARTCACHE_COMMIT", "c0ffee")
    assert fp8_tau.main(["--out", str(tmp_path / "o"), "--steps", "4"]) == 0
    doc = _json.loads((tmp_path / "o" / "fp8_tau.json").read_text())
    assert doc["commit"] == "c0ffee" and doc["hardware"]["cpu_count"] >= 1 and doc["command"][-2:] == ["--steps", "4"]
