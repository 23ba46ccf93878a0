"""Experiments that span devices in a run config: ``experiments.X.consumer.nproc`` starts the experiment as a group
of ranks, each rank on its own GPU (``consumer.devices``, or GPUs after the producer's, assigned deterministically;
too few refused in one line), handed to the child in its role spec; on a CPU the ranks run on gloo. Also the rank's
device and Slurm's task variables (trainers/consumer/group.py).

The full run (two experiments, one of two ranks) is in the ``distributed`` lane: it starts real rank processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from click.testing import CliRunner

from artcache import journal as J
from artcache.app.cli import main
from artcache.app.config import RunConfig, load_run_config
from artcache.app.experiments import consumer_spec_path, place_groups, plan_run
from artcache.errors import ConfigError
from artcache.layout import CacheLayout
from artcache.rolespec import read_spec, spec_digest
from artcache.trainers.consumer import ConsumerConfig
from artcache.trainers.consumer.group import from_slurm, rank_gpu
from tests.test_run import base_toml, exp, write

REPO = Path(__file__).parent.parent


def cfg_of(target: dict, *experiments: dict) -> RunConfig:
    return msgspec.convert({"target": target, "experiments": list(experiments)}, RunConfig)


def devices_of(cfg: RunConfig) -> dict[str, tuple[str, list[int] | None]]:
    return {e.name: (e.device, e.consumer.get("devices")) for e in cfg.experiments}


# ---- the assignment of GPUs --------------------------------------------------------------------------------

def test_groups_get_the_gpus_after_the_producers_in_config_order():
    cfg = cfg_of({"device": "cuda:0"},
                 {"name": "a", "consumer": {"nproc": 2}},
                 {"name": "one"},  # one rank, no device: shares the producer's cuda:0 as before
                 {"name": "b", "consumer": {"nproc": 3}},
                 {"name": "pinned", "device": "cuda:3"})  # one rank on its own GPU: never given to a group
    out = place_groups(cfg, visible=8)
    assert devices_of(out) == {"a": ("cuda", [1, 2]), "one": ("", None), "b": ("cuda", [4, 5, 6]),
                               "pinned": ("cuda:3", None)}
    assert place_groups(cfg, visible=8) == out  # deterministic


def test_explicit_devices_are_kept_and_taken_from_the_auto_assignment():
    cfg = cfg_of({"device": "cuda", "tensor_parallel_size": 2},  # the producer: cuda:0 and cuda:1
                 {"name": "auto", "consumer": {"nproc": 2}},
                 {"name": "mine", "consumer": {"nproc": 2, "devices": [2, 3]}})
    assert devices_of(place_groups(cfg, visible=6)) == {"auto": ("cuda", [4, 5]), "mine": ("cuda", [2, 3])}
    multi = cfg_of({"devices": ["cuda:0", "cuda:2"]}, {"name": "g", "device": "cuda", "consumer": {"nproc": 2}})
    assert devices_of(place_groups(multi, visible=4))["g"] == ("cuda", [1, 3])


@pytest.mark.parametrize("cfg, visible, needle", [
    (cfg_of({"device": "cuda:0"}, {"name": "a", "consumer": {"nproc": 2}}, {"name": "b", "consumer": {"nproc": 2}}),
     4, "experiments.b.consumer.nproc 2 needs 2 GPUs of its own but 1 of the 4 visible are free (taken: cuda:0 the "
        "producer, cuda:1 experiment 'a', cuda:2 experiment 'a')"),
    (cfg_of({"device": "cuda"}, {"name": "a", "device": "cuda:1", "consumer": {"nproc": 2}}), 4,
     "experiments.a.device 'cuda:1' names one GPU but consumer.nproc is 2"),
    (cfg_of({"device": "cuda"}, {"name": "a", "consumer": {"nproc": 2, "devices": [1, 4]}}), 4,
     "experiments.a.consumer.devices [1, 4]: cuda:4 is not visible (4 CUDA device(s): 0..3)"),
])
def test_too_few_gpus_or_a_bad_device_is_one_line(cfg, visible, needle):
    with pytest.raises(ConfigError) as got:
        place_groups(cfg, visible)
    assert needle in str(got.value) and "\n" not in str(got.value)


def test_cpu_groups_and_other_launchers_get_no_gpus():
    cpu = cfg_of({"device": "cpu"}, {"name": "a", "consumer": {"nproc": 2}})
    assert place_groups(cpu, visible=0) == cpu
    slurm = cfg_of({"device": "cuda"}, {"name": "a", "consumer": {"nproc": 2}})
    assert devices_of(place_groups(slurm, visible=None)) == {"a": ("cuda", None)}  # Slurm places the ranks


@pytest.mark.parametrize("fields, needle", [
    ({"nproc": 2, "devices": [1]}, "devices [1] gives 1 GPU(s) for 2 rank(s) (nproc)"),
    ({"nproc": 2, "devices": [1, 1], "device": "cuda"}, "devices [1, 1] names a GPU twice"),
    ({"nproc": 2, "devices": [0, 1], "device": "cpu"}, "devices [0, 1] needs a cuda device (device is 'cpu')"),
    ({"nproc": 0}, "nproc"),
])
def test_consumer_refuses_bad_rank_devices(fields, needle):
    cfg = ConsumerConfig(cache="/tmp/x", **{"device": "cuda", **fields}) if "nproc" in fields and fields["nproc"] \
        else None
    with pytest.raises((ConfigError, msgspec.ValidationError)) as got:
        if cfg is None:
            msgspec.convert({"cache": "/tmp/x", **fields}, ConsumerConfig)
        cfg.validate()
    assert needle in str(got.value)


# ---- the rank's device and Slurm's variables ---------------------------------------------------------------

def test_rank_gpu_follows_devices_then_slurm_then_local_rank(monkeypatch):
    monkeypatch.delenv("ARTCACHE_GROUP_LAUNCHER", raising=False)
    assert rank_gpu(1, [5, 7]) == 7 and rank_gpu(1) == 1
    monkeypatch.setenv("ARTCACHE_GROUP_LAUNCHER", "slurm")
    assert rank_gpu(3) == 0  # --gpus-per-task: each task sees its own GPU as cuda:0
    with pytest.raises(ConfigError, match="LOCAL_RANK 2 has no device in devices"):
        rank_gpu(2, [5, 7])


def test_a_slurm_task_reads_its_rank_from_slurm(monkeypatch):
    import os

    # from_slurm writes the variables it derives: on a copy of the environment, so no later test inherits them
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ARTCACHE_GROUP_LAUNCHER")})
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert from_slurm() is False and "RANK" not in os.environ  # not a group's step: untouched
    monkeypatch.setenv("ARTCACHE_GROUP_LAUNCHER", "slurm")
    assert from_slurm() is True
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="RANK '2' differs from Slurm's SLURM_PROCID '3'"):
        from_slurm()
    monkeypatch.delenv("SLURM_LOCALID")
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="SLURM_LOCALID is not set"):
        from_slurm()


# ---- the plan and the role spec ----------------------------------------------------------------------------

def test_dry_run_shows_each_experiments_ranks_and_devices(tiny_target, tmp_path):
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("solo"),
                                                   exp("pair", nproc=2, grad_accum=2)))
    res = CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    header = next(line for line in lines if line.startswith("experiment "))
    cols = {name: header.index(name) for name in ("ranks", "device", "window")}
    rows = {line.split()[0]: line for line in lines if line.split()[:2] in (["solo", "dflash"], ["pair", "dflash"])}
    cell = {n: (r[cols["ranks"]:cols["device"]].split(), r[cols["device"]:cols["window"]].split())
            for n, r in rows.items()}
    assert cell == {"solo": (["1"], ["cpu"]), "pair": (["2"], ["cpu"])}, res.output
    assert "8 (2/micro-batch)" in res.output  # 2 ranks x 2 micro-batches x batch 2 per optimizer step
    plan = json.loads(CliRunner().invoke(main, ["run", "--config", str(path), "--dry-run", "--json"]).output)
    got = {x["name"]: (x["nproc"], x["devices"], x["global_batch"], x["positions"]) for x in plan["experiments"]}
    assert got == {"solo": (1, [], 2, 12), "pair": (2, [], 8, 48)}


def test_the_spec_a_group_is_started_with_holds_its_ranks_and_gpus(tiny_target, tmp_path, monkeypatch):
    """What ``artcache run`` hands each experiment's child (its role spec file) is its own nproc and GPUs."""
    from artcache.app.experiments import _write_configs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 5)
    cfg = load_run_config(write(tmp_path / "run.toml", base_toml(
        tiny_target, tmp_path / "out", exp("a", nproc=2), exp("b"), exp("c", nproc=2, devices=[3, 2]))),
        overrides=["target.device=cuda:0", "target.dtype=bfloat16"])
    plan, resolved = plan_run(cfg)
    _write_configs(plan, resolved)
    got = {x.name: read_spec(consumer_spec_path(x), "consumer", ConsumerConfig) for x in plan.experiments}
    assert {n: (c.nproc, c.devices, c.device) for n, c in got.items()} == {
        "a": (2, [1, 4], "cuda"), "b": (1, [], "cuda:0"), "c": (2, [3, 2], "cuda")}
    assert "several roles share" in " ".join(plan.notes)  # b shares the producer's cuda:0, as a one-rank default


# ---- a whole run on the CPU --------------------------------------------------------------------------------

@pytest.mark.distributed
def test_regression_run_waits_for_and_reports_a_group_by_its_rank_0(tiny_target, tmp_path):
    """Two experiments on one root, one a group of 2 ranks on gloo: both complete, the group is one consumer to
    the cache (one registration, its cursor at steps x global batch), each child journaled the spec it was
    handed, and the root's invariants hold.

    Regression: ``artcache run`` looked for an experiment's registration and journal under the pid of the process
    it started, but a group registers and journals from its rank 0, a child of that process: the run waited for a
    registration that never came before starting the producer, and its report showed a group that had completed
    as ``not started`` with 0 steps."""
    path = write(tmp_path / "run.toml", base_toml(tiny_target, tmp_path / "out", exp("solo", steps=4),
                                                   exp("pair", steps=4, nproc=2)))
    res = subprocess.run([sys.executable, "-m", "artcache", "run", "--config", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "experiment pair started" in res.stdout and "cpu, 2 ranks" in res.stdout
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    got = {x["name"]: x for x in report["experiments"]}
    assert {n: (x["state"], x["exit_code"], x["nproc"]) for n, x in got.items()} == {
        "solo": ("completed", 0, 1), "pair": ("completed", 0, 2)}
    layout = CacheLayout(tmp_path / "out" / "cache")
    from artcache import registry

    regs = {r.consumer_id: r for r in registry.read_all(layout)}
    assert regs["pair"].cursor == 4 * 2 * 2 and regs["solo"].cursor == 4 * 2
    starts = {ev.consumer: ev for ev in J.read_events(layout.journal).events if isinstance(ev, J.ConsumerStart)}
    for name in ("solo", "pair"):
        spec = read_spec(tmp_path / "out" / "experiments" / name / "consumer.spec.json", "consumer", ConsumerConfig)
        assert starts[name].spec == spec_digest(spec)
    assert starts["pair"].ranks == 2 and starts["solo"].ranks == 1
    inspect = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(layout.root), "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0 and not json.loads(inspect.stdout)["violations"], inspect.stdout[-2000:]


# ---- the bench: every consumer a group of ranks ------------------------------------------------------------

def test_bench_with_consumer_groups_leaves_the_lockstep_baseline_out():
    from artcache.bench.run import BenchConfig, _roles, parse_modes
    from artcache.bench.scenarios import SCENARIOS

    sc = SCENARIOS["1p3c"]
    assert parse_modes("", sc) == ("artcache", "naive", "lockstep")
    assert parse_modes("", sc, consumer_ranks=2) == ("artcache", "naive")
    with pytest.raises(ConfigError, match="lockstep runs one-process consumers only") as got:
        parse_modes("artcache,lockstep", sc, consumer_ranks=2)
    assert "\n" not in str(got.value)
    # devices one mode needs: naive has a producer per consumer, each consumer 2 ranks
    assert _roles(BenchConfig(consumer_ranks=2), sc) == 3 * (2 + 1)
    assert _roles(BenchConfig(), sc) == 6


@pytest.mark.distributed
def test_bench_1p3c_with_two_rank_consumers_captures_each_position_once(tiny_target, tmp_path):
    """``artcache bench --scenario 1p3c --consumer-ranks 2`` on the CPU (gloo), short: every consumer a 2-rank
    group finishes its steps, each position consumed is captured once, and every check passes."""
    import os

    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "artcache", "bench", "--scenario", "1p3c", "--device", "cpu", "--consumer-ranks", "2",
         "--modes", "artcache", "--target", tiny_target.path, "--data", str(REPO / "tests" / "data" /
                                                                            "tiny_sharegpt.json"),
         "--max-length", "128", "--max-samples", "32", "--anchors", "8", "--draft-layers", "3", "--warmup", "1",
         "--steps", "3", "--window", "8:8", "--out", str(out)],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "1p3c" / "report.json").read_text())
    assert report["consumer_ranks"] == 2 and all(report["checks"].values()), report["checks"]
    assert [(c["steps"], c["exit_code"]) for c in report["consumers"]] == [(4, 0)] * 3
    cache = report["cache"]
    assert cache["distinct_positions_consumed"] == 4 * 2 and cache["captures_per_consumed_position"] == 1.0, cache
