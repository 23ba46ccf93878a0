"""The capacity estimate of ``artcache run --dry-run`` (artcache/app/estimate.py): held against the retention
simulator run by hand on configs/dflash-eagle3.toml, with stated and measured rates."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from artcache import journal as J
from artcache.app.cli import main
from artcache.app.estimate import measured_rates, parse_step_rates
from artcache.bench.sim import ConsumerSpec, ProducerSpec, simulate
from artcache.errors import ConfigError
from artcache.scheduler import SchedulerLimits
from tests.support import REPO

CONFIG = REPO / "configs" / "dflash-eagle3.toml"


def _dry_run(tmp_path, *args: str):
    return CliRunner().invoke(main, ["run", "--config", str(CONFIG), "--dry-run", "--out", str(tmp_path / "out"),
                                     "cache.disk_budget=1073741824", *args])


def test_dry_run_estimate_is_the_simulators_on_dflash_eagle3(tmp_path):
    """The printed estimate of configs/dflash-eagle3.toml (two experiments of 10 steps x 1 position, windows 8:32,
    capture batches of 4 samples) at a stated 20 samples/s and 2 / 0.5 steps/s equals bench/sim.py's run of the
    same consumers and producer: per experiment alone and for the root, disk peak, captures, captures per position
    and time to finish."""
    args = ("--capture-rate", "20", "--step-rate", "2", "--step-rate", "eagle3=0.5")
    res = _dry_run(tmp_path, "--json", *args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    est = out["estimate"]
    assert est["rates"] == {"capture": 20.0, "capture_source": "stated", "steps": {"dflash-b8": 2.0, "eagle3": 0.5},
                            "step_sources": {"dflash-b8": "stated", "eagle3": "stated"}}
    assert est["retention"] == "need" and est["budget_bytes"] == 2**30 and est["heldout_samples"] == 0
    per = out["bytes_per_artifact_max"]
    # the simulator by hand, from the config's own numbers
    producer = ProducerSpec(fixed_s=0.0, per_sample_s=1 / 20,
                            limits=SchedulerLimits(max_queue=1024, max_batch_samples=4, max_batch_tokens=8192),
                            sample_tokens=256, max_length=256, artifact_bytes=per, budget_bytes=2**30, policy="need")
    cons = [ConsumerSpec("dflash-b8", step_s=0.5, batch_size=1, lookbehind=8, lookahead=32, end=10),
            ConsumerSpec("eagle3", step_s=2.0, batch_size=1, lookbehind=8, lookahead=32, end=10)]
    plan_len = est["plan_samples"]
    assert plan_len == 200
    for part, consumers in [(est["root"], cons), *((x, [c]) for x, c in zip(est["experiments"], cons, strict=True))]:
        sim = simulate(consumers, producer, 10, plan_len)
        finish = max(r.finish_s for r in sim.consumers.values())
        assert part["disk_peak_artifacts"] == sim.max_retained and part["disk_peak_bytes"] == sim.max_retained * per
        assert part["captures"] == sim.captures and part["positions"] == sim.positions
        assert part["captures_per_position"] == sim.captures_per_position
        assert math.isclose(part["finish_s"], finish)
    assert [x["name"] for x in est["experiments"]] == ["dflash-b8", "eagle3"]
    assert est["root"]["captures"] == 10 and est["root"]["captures_per_position"] == 1.0  # one capture, two readers
    assert est["root"]["finish_s"] == pytest.approx(est["experiments"][1]["finish_s"])  # the slower one's time
    text = _dry_run(tmp_path, *args)
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("estimate (retention simulator"))
    assert "capture 20 samples/s (stated); dflash-b8 2 steps/s (stated), eagle3 0.5 steps/s (stated)" in lines[head]
    rows = {line.split()[0]: line.split() for line in lines[head + 3:head + 6]}
    assert set(rows) == {"root", "dflash-b8", "eagle3"}
    for name, part in [("root", est["root"]), *((x["name"], x) for x in est["experiments"])]:
        row = rows[name]
        assert row[4] == str(part["disk_peak_artifacts"]) and row[5] == str(part["captures"])
        assert row[7] == f"{part['captures_per_position']:.3f}" and row[8] == f"{part['finish_s']:.1f}"
    assert "rates assumed" not in text.stdout


def test_rates_measured_from_the_roots_journal_and_assumed_without(tmp_path):
    root = tmp_path / "cache"
    (root / "journal").mkdir(parents=True)
    w = J.JournalWriter(root / "journal" / "producer-p.jsonl")
    w.emit(J.CaptureBatch(producer="p", fps=["a"] * 4, samples=4, tokens=100, padded_tokens=100, start=10.0, end=10.5))
    w.emit(J.CaptureBatch(producer="p", fps=["b"] * 2, samples=2, tokens=50, padded_tokens=50, start=11.0, end=11.5))
    w.close()
    c = J.JournalWriter(root / "journal" / "consumer-d.jsonl")
    for k, s in enumerate((0.2, 0.3), start=1):
        c.emit(J.Step(consumer="d", step=k, cursor=k, loss=1.0, tau_sum=0.0, blocks=0, acc_correct=[], acc_total=[],
                      wait_s=0.0, step_s=s, lr=1e-3))
    c.close()
    capture, steps = measured_rates(root)
    assert capture == pytest.approx(6.0) and steps == {"d": pytest.approx(4.0)}
    assert measured_rates(tmp_path / "none") == (None, {})
    assert parse_step_rates(["a=2", "0.5"]) == {"a": 2.0, "*": 0.5}
    for bad in ("a=0", "x=fast", "-1"):
        with pytest.raises(ConfigError, match=r"--step-rate .* is invalid: accepted NAME=STEPS_PER_S"):
            parse_step_rates([bad])


@pytest.mark.parametrize("args, needle", [
    (("--json",), "--json needs --dry-run"),
    (("--capture-rate", "5"), "--capture-rate needs --dry-run"),
    (("--step-rate", "2", "--json"), "--json and --step-rate need --dry-run"),
])
def test_regression_run_refuses_dry_run_options_without_dry_run(tmp_path, args, needle):
    """`artcache run --config X --json` (also --capture-rate, --step-rate) without --dry-run started the run as
    if the option were not there, although each only shapes the dry run's output. Refused in one line, exit 2,
    nothing written."""
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--config", str(CONFIG), "--out", str(out), *args])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [res.stderr.strip()], res.output
    assert needle in res.stderr and not out.exists()


def test_regression_step_rate_of_an_unknown_experiment_is_refused(tmp_path):
    """`artcache run --dry-run --step-rate zz=1` where no experiment is named zz printed an estimate that used the
    assumed rate for every experiment: the stated rate was silently ignored. Refused naming the accepted names."""
    res = _dry_run(tmp_path, "--step-rate", "zz=1")
    assert res.exit_code == 2, res.output
    assert "--step-rate 'zz=1': no experiment is named 'zz'; accepted names: dflash-b8, eagle3" in res.stderr
    with pytest.raises(ConfigError, match="no experiment is named 'b'"):
        parse_step_rates(["a=1", "b=2"], ["a"])


def test_regression_capture_rate_is_checked_when_no_estimate_is_made(tmp_path):
    """`--dry-run --capture-rate -1` was accepted when the dry run made no estimate (too many positions, or no
    experiment with steps left): the bad value was only checked inside the estimate. It is checked always."""
    res = _dry_run(tmp_path, "experiments.0.steps=60000", "--capture-rate", "-1")
    assert res.exit_code == 2, res.output
    assert "--capture-rate -1.0 is invalid: accepted a number > 0" in res.stderr


def test_too_many_positions_skip_the_estimate_and_say_so(tmp_path):
    res = _dry_run(tmp_path, "experiments.0.steps=60000")
    assert res.exit_code == 0, res.output
    assert "estimate: none (60,010 positions to simulate exceed the dry run's 50,000;" in res.stdout
