"""``artcache run --launcher slurm``: placement, the sbatch script, refusals (default lane), and a tiny run
through a fake 3-node Slurm cluster on this machine (marker ``slurm``: ``.ci/slurm-cluster.sh`` starts
munged, slurmctld and three slurmd as n1-n3 with two fake GPUs each; needs root and Debian's slurm
packages, which the script installs; skips otherwise).

The end-to-end test: the producer on n1, three consumers on n1, n2, n3, each step seeing its own
``CUDA_VISIBLE_DEVICES`` (fake GPUs: the roles compute on the CPU, the test checks what Slurm gave them);
``artcache inspect`` invariants hold and the producer captured each consumed position once (<= 1.05).
Deadlines only bound a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from artcache.app.cli import main
from artcache.app.config import load_run_config
from artcache.app.experiments import plan_run
from artcache.app.slurm import place, render
from artcache.errors import ConfigError
from tests.support.procs import child_env
from tests.unit.test_cli import snapshot

EXPERIMENT = """
[[experiments]]
name = "{name}"
block_size = {bs}
anchors = 4
batch_size = 2
steps = {steps}
window = "2:8"
threads = 1
log_every = 1
[experiments.consumer]
progress = false
tensorboard = false
"""


def config(tmp_path: Path, *, names=("c1", "c2", "c3"), steps: int = 6, slurm: str = "", device: str = "cpu",
           cache: str = "") -> Path:
    body = f"""
out = "{tmp_path / 'run'}"
[target]
name = "random:tiny-llama"
threads = 1
device = "{device}"
[data]
dataset = "synthetic"
max_length = 32
max_samples = 64
[capture]
draft_layers = 3
batch_samples = 2
[cache]
done_grace_s = 1.0
{cache}
[slurm]
nodes = 3
gpus_per_node = 2
time = "00:20:00"
{slurm}
""" + "".join(EXPERIMENT.format(name=n, bs=4 * (1 + i % 2), steps=steps) for i, n in enumerate(names))
    path = tmp_path / "run.toml"
    path.write_text(body)
    return path


def planned(path: Path, *overrides: str):
    return plan_run(load_run_config(path, overrides), local_devices=False)


# ---- placement and script (no cluster) -------------------------------------------------------------------

def test_spread_puts_the_producer_on_the_first_node_and_one_experiment_per_node(tmp_path):
    plan, cfg = planned(config(tmp_path))
    nodes, roles = place(plan, cfg)
    assert nodes == 3
    assert [(r.name, r.node, r.gpus) for r in roles] == [("producer", 0, 1), ("c1", 0, 1), ("c2", 1, 1), ("c3", 2, 1)]
    # every step reads its role's spec file, which launch() writes (the producer's expecting all 3 consumers)
    assert roles[0].argv[2:] == ["artcache", "producer", "--spec", str(Path(plan.out) / "producer.spec.json")]
    assert roles[2].argv[2:] == ["artcache", "consume", "--spec",
                                 str(Path(plan.experiments[1].out_dir) / "consumer.spec.json"), "--json"]


def test_pack_fills_a_node_before_the_next(tmp_path):
    plan, cfg = planned(config(tmp_path, slurm='placement = "pack"'), "slurm.nodes=2")
    _, roles = place(plan, cfg)
    assert [r.node for r in roles] == [0, 0, 1, 1]


def test_node_count_follows_the_gpus_when_not_given(tmp_path):
    plan, cfg = planned(config(tmp_path), "slurm.nodes=0", "slurm.gpus_per_node=8", "slurm.producer_gpus=4")
    nodes, roles = place(plan, cfg)
    assert nodes == 1 and {r.node for r in roles} == {0} and roles[0].gpus == 4


@pytest.mark.parametrize("overrides,needle", [
    (("slurm.producer_gpus=3",), "a node has 2"),
    (("slurm.nodes=1",), "do not fit on 1 node"),
    (("slurm.nodes=5",), "more than the run's 4 roles"),
    (("slurm.gpus_per_node=0",), "slurm.gpus_per_node 0"),
])
def test_placements_that_cannot_work_are_refused(tmp_path, overrides, needle):
    """A value outside a declared range (slurm.gpus_per_node 0) is refused when the config is read, the
    placements that cannot fit by place()."""
    with pytest.raises(ConfigError, match=needle):
        place(*planned(config(tmp_path), *overrides))


def test_a_device_index_beyond_the_steps_gpus_is_refused(tmp_path):
    plan, cfg = planned(config(tmp_path), "experiments.c2.device=cuda:1")
    with pytest.raises(ConfigError, match=r"experiments.c2.device 'cuda:1'.*cuda:0"):
        render(plan, cfg)


def test_script_has_one_exact_single_gpu_step_per_role(tmp_path):
    plan, cfg = planned(config(tmp_path, slurm='partition = "gpu"\nsbatch_args = ["--mem=0"]\n'
                                                'setup = ["source /opt/venv/bin/activate"]\n'
                                                'env = { HF_HOME = "/shared/hf" }'))
    script = render(plan, cfg)
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=2", "#SBATCH --gres=gpu:2", "#SBATCH --partition=gpu",
                 "#SBATCH --mem=0", "#SBATCH --time=00:20:00", "source /opt/venv/bin/activate",
                 "export HF_HOME=/shared/hf"):
        assert line in script.splitlines(), line
    assert 'srun --exact -N1 -n1 -w "$node" --gres=gpu:"$gpus"' in script
    steps = [ln for ln in script.splitlines() if ln.startswith("role ")]
    assert len(steps) == 4 and steps[0].startswith("role producer 0 1 ")
    assert [ln.split()[1:4] for ln in steps[1:]] == [["c1", "0", "1"], ["c2", "1", "1"], ["c3", "2", "1"]]
    assert all(ln.endswith(" &") for ln in steps)
    # the consumers start only once the producer made the root
    assert script.index('[ -f "$ROOT/artcache.json" ] && break') < script.index("role c1 ")
    res = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert res.returncode == 0, res.stderr


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path)
    before = snapshot(tmp_path)
    res = CliRunner().invoke(main, ["run", "--config", str(cfg), "--launcher", "slurm", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "#!/bin/bash" in res.output and "srun --exact -N1 -n1" in res.output and "role c3 2 1 " in res.output
    assert snapshot(tmp_path) == before


def test_without_submit_the_script_and_configs_are_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run", "--config", str(config(tmp_path)), "--launcher", "slurm"])
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    script = run / "slurm" / "run.sbatch"
    assert script.is_file() and os.access(script, os.X_OK) and f"sbatch {script}" in res.output
    assert (run / "config.toml").is_file() and (run / "plan.json").is_file()
    assert not (run / "cache").exists()  # the producer step creates the root, in the job
    # each step's spec file, built by the launcher: the producer waits for every experiment
    from artcache.producer import ProducerConfig
    from artcache.rolespec import read_spec
    from artcache.trainers.consumer import ConsumerConfig

    producer = read_spec(run / "producer.spec.json", "producer", ProducerConfig)
    assert producer.exit_when_done and producer.expect_consumers == 3 and producer.producer_id == "producer"
    specs = {n: read_spec(run / "experiments" / n / "consumer.spec.json", "consumer", ConsumerConfig)
             for n in ("c1", "c2", "c3")}
    assert {n: c.consumer_id for n, c in specs.items()} == {n: n for n in specs}
    assert {c.cache for c in specs.values()} == {producer.cache}


@pytest.mark.parametrize("args,needle", [
    (["--submit"], "need --launcher slurm"),
    (["--launcher", "slurm", "--wait"], "--wait needs --submit"),
    (["--launcher", "slurm", "--dry-run", "--json"], "--json"),
])
def test_launcher_flag_combinations_refused(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run", "--config", str(config(tmp_path)), *args])
    assert res.exit_code == 2 and needle in res.stderr, res.output


def test_submit_without_sbatch_is_bad_input_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    cfg = config(tmp_path)
    before = snapshot(tmp_path)
    res = CliRunner().invoke(main, ["run", "--config", str(cfg), "--launcher", "slurm", "--submit"])
    assert res.exit_code == 2 and "sbatch is not on PATH" in res.stderr, res.output
    assert snapshot(tmp_path) == before


# ---- an experiment of several ranks: one job step of that many tasks ------------------------------------------

FAKE_SRUN = """#!/bin/bash
# records its argv and the group's variables, then runs the command once per task as Slurm would (-n N)
printf '%s\\n' "$@" > "$FAKE_LOG/argv"
env | grep -E '^(ARTCACHE_GROUP_LAUNCHER|MASTER_ADDR|MASTER_PORT)=' | sort > "$FAKE_LOG/env"
n=1; args=("$@")
while [ $# -gt 0 ]; do case $1 in -n*) n=${1#-n};; esac; shift; done
while [ "${args[0]}" != bash ]; do args=("${args[@]:1}"); done
pids=()
for ((t = 0; t < n; t++)); do
  SLURM_PROCID=$t SLURM_STEP_NUM_TASKS=$n SLURM_LOCALID=$t SLURMD_NODENAME=nodeA SLURM_STEP_ID=7 \\
    "${args[@]}" > "$FAKE_LOG/task$t" 2>&1 & pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc
"""


def test_an_experiment_of_two_ranks_is_one_step_of_two_tasks(tmp_path):
    plan, cfg = planned(config(tmp_path), "experiments.c2.consumer.nproc=2")
    nodes, roles = place(plan, cfg)
    assert [(r.name, r.node, r.gpus, r.tasks) for r in roles] == [
        ("producer", 0, 1, 1), ("c1", 0, 1, 1), ("c2", 1, 1, 2), ("c3", 2, 1, 1)]
    script = render(plan, cfg)
    assert "#SBATCH --ntasks-per-node=2" in script.splitlines() and "#SBATCH --gres=gpu:2" in script.splitlines()
    steps = [ln for ln in script.splitlines() if ln.startswith(("role ", "group "))]
    assert [ln.split()[:4] for ln in steps] == [["role", "producer", "0", "1"], ["role", "c1", "0", "1"],
                                                 ["group", "c2", "1", "1"], ["role", "c3", "2", "1"]]
    assert steps[2].split()[4] == "2"  # two tasks
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0
    with pytest.raises(ConfigError, match="asks for 4 GPUs but a node has 2"):
        place(*planned(config(tmp_path), "experiments.c2.consumer.nproc=4"))
    with pytest.raises(ConfigError, match=r"experiments.c2.consumer.devices \[0, 1\]: under Slurm"):
        render(*planned(config(tmp_path, device="cuda"), "experiments.c2.consumer.nproc=2",
                        "experiments.c2.consumer.devices=[0,1]"))


def test_the_group_step_gives_each_task_its_rank_from_slurm(tmp_path):
    """The group step's srun argv (N tasks, GPUs per task, one node, the step ends when a rank fails) and what
    each task's rank entry reads: RANK / WORLD_SIZE / LOCAL_RANK from Slurm's task variables, MASTER_ADDR the
    step's node, one MASTER_PORT for all, each rank on its task's own GPU (cuda:0)."""
    plan, cfg = planned(config(tmp_path), "experiments.c2.consumer.nproc=2")
    script = render(plan, cfg)
    lines = script.splitlines()
    start = lines.index("group() {")
    func = "\n".join(lines[start:lines.index("}", start) + 1])
    step = next(ln for ln in lines if ln.startswith("group c2 "))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(0o755)
    log = tmp_path / "log"
    log.mkdir()
    probe = ("import os; from artcache.trainers.consumer.group import env_world, rank_gpu; w = env_world(); "
             "print(os.environ['RANK'], w, os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'], "
             "os.environ['MASTER_PORT'], rank_gpu(int(os.environ['LOCAL_RANK'])))")
    # the step's own line, its command replaced by the probe (the spec's consume needs a producer)
    head = step[:step.index(sys.executable if sys.executable in step else cfg.slurm.python)]
    body = "\n".join([
        "set -uo pipefail", f"RUN={tmp_path}", "NODES=(nodeZ nodeA)", "SLURM_JOB_ID=12345", "mkdir -p $RUN/status",
        func, head + f"{sys.executable} -c {json.dumps(probe)}", "wait"])
    res = subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=120,
                         env=child_env(PATH=f"{fake}:{os.environ['PATH']}", FAKE_LOG=str(log)))
    assert res.returncode == 0, res.stderr
    argv = (log / "argv").read_text().splitlines()
    assert argv[:argv.index("bash")] == ["--exact", "-N1", "-n2", "-w", "nodeA", "--gpus-per-task=1",
                                         "--kill-on-bad-exit=1", "--cpus-per-task=1", "--job-name=c2",
                                         f"--output={tmp_path}/logs/c2.log"]
    port = str(20000 + (12345 * 64 + 2) % 40000)
    assert (log / "env").read_text().splitlines() == ["ARTCACHE_GROUP_LAUNCHER=slurm", "MASTER_ADDR=nodeA",
                                                       f"MASTER_PORT={port}"]
    seen = sorted((log / f"task{t}").read_text().split() for t in range(2))
    assert seen == [["0", "2", "0", "nodeA", port, "0"], ["1", "2", "1", "nodeA", port, "0"]]
    env = dict(ln.split("=", 1) for ln in (tmp_path / "status" / "c2.env").read_text().splitlines())
    assert env == {"node": "nodeA", "step": "7", "cuda_visible_devices": "", "ranks": "2"}
    assert (tmp_path / "status" / "c2.exit").read_text().strip() == "0"
