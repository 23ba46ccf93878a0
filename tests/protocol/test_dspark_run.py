"""DSpark end to end on the tiny target (real processes): ``artcache run`` puts DFlash, EAGLE-3 and DSpark on one
capture (the union of their views), the DSpark loss falls and its summary has τ and the calibration figures;
``artcache calibrate`` fits its held-out confidences; the export (both formats) loads back; a new run starts
from that export with ``init_from`` (strict keys; the reliability lane: the seed loader's DSpark mapping is
tests/unit/test_dspark.py's, a seeded run's processes tests/protocol/test_warm_start_cli.py's). Deadlines only bound
a hung run.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from artcache import journal as J
from artcache.app.cli import main
from artcache.app.experiments import draft_view
from tests.protocol.test_run import artcache_run, base_toml, exp, report_of, write


def dspark_exp(name: str, steps: int, **consumer) -> str:
    """A DSpark experiment: B 4, 8 anchors, Markov rank 16, evaluated on the plan's last 4 samples."""
    body = exp(name, "dspark", steps, eval_samples=4, markov_rank=16, **consumer)
    return body.replace("anchors = 4", "anchors = 8").replace("batch_size = 2", "batch_size = 2\nlr = 3e-3")


@pytest.fixture(scope="module")
def dspark_run(tiny_target, tmp_path_factory):
    """One ``artcache run`` of DFlash, EAGLE-3 and a 12-step DSpark on one root; the process and its run dir."""
    tmp_path = tmp_path_factory.mktemp("dspark-run")
    out = tmp_path / "out"
    cfg = write(tmp_path / "run.toml", base_toml(
        tiny_target, out, exp("d", eval_samples=4), exp("e", "eagle3", eval_samples=4), dspark_exp("s", 12)))
    return artcache_run(cfg), out


@pytest.fixture(scope="module")
def dspark_exports(dspark_run, tmp_path_factory):
    """The DSpark experiment calibrated (``artcache calibrate``) and exported in both formats: (calibrate's
    report, {format: export dir})."""
    proc, out = dspark_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = out / "experiments" / "s"
    res = CliRunner().invoke(main, ["calibrate", "--checkpoint", str(run_dir)])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    base = tmp_path_factory.mktemp("dspark-exports")
    dirs = {fmt: base / f"x-{fmt}" for fmt in ("speculators", "hf")}
    for fmt, path in dirs.items():
        res = CliRunner().invoke(main, ["export", "--checkpoint", str(run_dir), "--format", fmt, "--out", str(path)])
        assert res.exit_code == 0, res.output
    return rep, dirs


def test_three_drafts_on_one_capture_and_dspark_calibrates_and_exports(dspark_run, dspark_exports):
    from artcache.app.config import Experiment

    assert draft_view(Experiment(name="s", draft="dspark", draft_layers=3), 6) == [1, 2, 3, 5]
    proc, out = dspark_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = report_of(out)
    assert r["checks"]["every_experiment_completed"] and r["checks"]["accounting_invariants"]
    # one capture: DFlash [1, 2, 3], EAGLE-3 [1, 2, 2, 5], DSpark [1, 2, 3, 5] -> the union [1, 2, 3, 5]
    from artcache.layout import CacheLayout
    from artcache.settings import load_settings

    assert list(load_settings(CacheLayout(out / "cache")).contract.layer_ids) == [1, 2, 3, 5]
    evs = J.read_events(out / "cache" / "journal").events
    steps = [e for e in evs if isinstance(e, J.Step) and e.consumer == "s"]
    assert len(steps) == 12 and all(len(s.acc_total) == 4 and s.blocks > 0 for s in steps)
    first = sum(s.loss for s in steps[:4]) / 4
    last = sum(s.loss for s in steps[-4:]) / 4
    assert last < first, [s.loss for s in steps]
    run_dir = out / "experiments" / "s"
    ckpt = run_dir / "checkpoints" / "latest"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["draft"] == "dspark" and state["layer_ids"] == [1, 2, 3, 5]
    assert "before the final norm" in state["draft_config"]["target_state"]
    from artcache.trainers.tracking import read_metrics

    tags = {t for _, t, _ in read_metrics(run_dir / "metrics.csv")}
    assert {"eval/tau", "eval/replay_tau", "eval/conf_mae", "eval/cum_bias", "eval/ece_cum", "eval/accept_rate@0",
            "train/tau", "train/l1_loss"} <= tags, sorted(tags)

    rep, dirs = dspark_exports
    assert len(rep["temperatures"]) == 4 and rep["blocks"] > 0
    assert rep["ece_cum_pooled_after"] <= rep["ece_cum_pooled_before"]
    assert json.loads((ckpt / "calibration.json").read_text())["temperatures"] == rep["temperatures"]
    for fmt in ("speculators", "hf"):
        c = json.loads((dirs[fmt] / "config.json").read_text())
        assert c["confidence_temperatures"] == rep["temperatures"] and c["block_size"] == 4
    assert json.loads((dirs["speculators"] / "config.json").read_text())["aux_hidden_state_layer_ids"] == [2, 3, 4]
