"""``artcache run --launcher slurm``: the run's roles as steps of one Slurm job.

:func:`render` turns a checked :class:`~artcache.app.experiments.RunPlan` into an sbatch script: the
producer step (``artcache producer --spec <out>/producer.spec.json``) on the first node of the allocation with
``slurm.producer_gpus`` GPUs, then (once the producer has created the cache root) one ``srun --exact -N1
-n1 --gres=gpu:G`` step per experiment (``artcache consume --spec <its out>/consumer.spec.json``: the role spec
files :mod:`artcache.rolespec` the launcher writes before submitting), placed by
``slurm.placement``. Each step writes ``<out>/logs/<role>.log``, ``<out>/status/<role>.env`` (node, step,
the ``CUDA_VISIBLE_DEVICES`` Slurm gave it) and ``<out>/status/<role>.exit``; the job ends with ``artcache
inspect`` of the root (``<out>/inspect.json``) and exits nonzero if any role failed or an invariant broke.

The roles stay ordinary processes: the script is plain ``srun`` lines a user can edit, and a user's own
sbatch can call ``artcache producer`` / ``artcache consume`` directly (docs/scale-out.md). The cache root
and the run directory must be on a filesystem every node mounts at the same path.

:func:`launch` writes (``--dry-run``: prints) the script, submits it with ``sbatch`` (``--submit``) and
waits for the job (``--wait``), then prints :func:`collect`'s summary.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from artcache.app.config import RunConfig
from artcache.app.experiments import RunPlan, _write_configs, consumer_spec_path, format_plan, producer_spec_path
from artcache.errors import ConfigError, LaunchError
from artcache.fsio import atomic_write

#: filesystems that several nodes can mount at once (for the dry-run's note about the cache root)
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "ceph", "cephfs", "beegfs", "wekafs", "glusterfs", "fuse.glusterfs",
             "fuse.ceph", "fuse.juicefs", "fuse.weka", "orangefs", "pvfs2", "panfs", "9p", "virtiofs")


class Role(msgspec.Struct, frozen=True, kw_only=True):
    """One job step: ``name`` (producer or an experiment), the node index in the allocation, the GPUs of each of
    its tasks, and its tasks (an experiment of ``consumer.nproc`` N ranks: N tasks, one rank each)."""

    name: str
    node: int
    gpus: int
    argv: list[str]
    tasks: int = 1

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.tasks


def place(plan: RunPlan, cfg: RunConfig) -> tuple[int, list[Role]]:
    """(nodes, roles): the producer first, then one role per experiment, each on a node of the job.

    Raises:
        ConfigError: a role needs more GPUs than a node has, or ``slurm.nodes`` is too small for them; several
            producers (``target.replicas``).
    """
    s = cfg.slurm  # its ranges are declared on SlurmSection's fields (checked when the config is read)
    if cfg.target.replicas > 1:
        raise ConfigError(f"slurm: target.replicas {cfg.target.replicas} is not accepted under --launcher slurm (one "
                          "producer step); accepted: 1, or artcache run on one machine for several producers")
    demand = [s.producer_gpus] + [s.experiment_gpus * x.nproc for x in plan.experiments]
    if max(demand) > s.gpus_per_node:
        big = max(range(len(demand)), key=lambda i: demand[i])
        what = "the producer" if big == 0 else f"experiment {plan.experiments[big - 1].name!r}" + (
            f" ({plan.experiments[big - 1].nproc} ranks x slurm.experiment_gpus {s.experiment_gpus})"
            if plan.experiments[big - 1].nproc > 1 else "")
        raise ConfigError(f"slurm: {what} asks for {demand[big]} GPUs but a node has {s.gpus_per_node} "
                          "(slurm.gpus_per_node); a role never spans nodes")
    nodes = s.nodes or max(1, math.ceil(sum(demand) / s.gpus_per_node))
    if nodes > len(demand):
        raise ConfigError(f"slurm.nodes {nodes} is more than the run's {len(demand)} roles (a producer and "
                          f"{len(plan.experiments)} experiments); every node must hold one")
    # (an experiment of several ranks is one step of that many tasks: its demand is its ranks' GPUs together)
    used = [0] * nodes
    where = []
    for i, g in enumerate(demand):
        if s.placement == "spread":
            order = [0] if i == 0 else [((i - 1) + k) % nodes for k in range(nodes)]
        else:
            order = list(range(nodes))
        node = next((n for n in order if used[n] + g <= s.gpus_per_node), None)
        if node is None:
            raise ConfigError(f"slurm: {sum(demand)} GPUs ({s.producer_gpus} for the producer, {s.experiment_gpus} per "
                              f"experiment rank) do not fit on {nodes} node(s) of {s.gpus_per_node}; raise slurm.nodes")
        used[node] += g
        where.append(node)
    py = s.python or sys.executable
    roles = [Role(name="producer", node=where[0], gpus=s.producer_gpus,
                  argv=[py, "-m", "artcache", "producer", "--spec", str(producer_spec_path(plan))])]
    for x, node in zip(plan.experiments, where[1:], strict=True):
        roles.append(Role(name=x.name, node=node, gpus=s.experiment_gpus, tasks=x.nproc,
                          argv=[py, "-m", "artcache", "consume", "--spec", str(consumer_spec_path(x)), "--json"]))
    return nodes, roles


def _check_devices(plan: RunPlan, cfg: RunConfig) -> None:
    """Each step sees only its own GPUs (as cuda:0..); a device index beyond them is refused, and so is an
    experiment's own ``consumer.devices`` (Slurm gives each rank of a group its GPUs: ``--gpus-per-task``)."""
    s = cfg.slurm
    for x in plan.experiments:
        if x.devices:
            raise ConfigError(f"experiments.{x.name}.consumer.devices {x.devices}: under Slurm each rank is a task "
                              "of the experiment's step and gets its own GPUs from it (slurm.experiment_gpus per "
                              "rank); leave consumer.devices out")
    for what, device, gpus in [("target.device", plan.target["device"], s.producer_gpus),
                               *((f"experiments.{x.name}.device", x.device, s.experiment_gpus)
                                 for x in plan.experiments)]:
        if device.startswith("cuda"):
            index = int(device.partition(":")[2] or 0)
            if gpus == 0 or index >= gpus:
                raise ConfigError(f"{what} {device!r}: under Slurm a step sees only the {gpus} GPU(s) it was given "
                                  f"(slurm.{'producer' if what == 'target.device' else 'experiment'}_gpus), as "
                                  f"cuda:0..; use cuda{'' if gpus else ' with a GPU count >= 1, or cpu'}")


def group_port(index: int) -> str:
    """The ``MASTER_PORT`` of role ``index``'s group step, as shell arithmetic on the job id: distinct for the
    job's roles, in 20000..59999, and the same in every task of the step (they read it from the step's
    environment)."""
    return f"$(( 20000 + (SLURM_JOB_ID * 64 + {index}) % 40000 ))"


def filesystem_of(path: str | Path) -> str:
    """The type of the filesystem ``path`` (or its nearest existing parent) is on, from /proc/mounts ('' if
    unknown)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (str(p) == mnt or str(p).startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def shared_note(plan: RunPlan) -> str | None:
    """A note when the cache root is not on a filesystem type that several nodes mount (else None)."""
    kind = filesystem_of(plan.cache_root)
    if kind in SHARED_FS:
        return None
    return (f"the cache root {plan.cache_root} is on a {kind or 'unknown'} filesystem: every node must mount it "
            "at the same path (a shared filesystem; check it with `artcache verify-fs`), unless all the job's "
            "nodes are this host")


def render(plan: RunPlan, cfg: RunConfig) -> str:
    """The sbatch script of ``plan`` (see the module docstring). Raises ConfigError (placement, devices)."""
    s = cfg.slurm
    nodes, roles = place(plan, cfg)
    _check_devices(plan, cfg)
    per_node = [sum(r.tasks for r in roles if r.node == n) for n in range(nodes)]
    gpus_node = max(sum(r.total_gpus for r in roles if r.node == n) for n in range(nodes))
    q = shlex.quote
    run = Path(plan.out)
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={q('artcache-' + run.name)}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={max(per_node)}",
        f"#SBATCH --cpus-per-task={s.cpus_per_role}",
        f"#SBATCH --output={q(str(run / 'logs' / 'slurm-%j.out'))}",
        f"#SBATCH --time={s.time}",
    ]
    if gpus_node:
        head.append(f"#SBATCH --gres=gpu:{gpus_node}")
    for flag, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos)):
        if value:
            head.append(f"#SBATCH --{flag}={q(value)}")
    head += [f"#SBATCH {a}" for a in s.sbatch_args]
    lines = [
        *head,
        f"# written by `artcache run --launcher slurm` for {plan.out}: edit freely; each role is a plain",
        "# artcache process (artcache producer / artcache consume --spec FILE; the spec files hold every setting)",
        "set -uo pipefail",
        f"RUN={q(str(run))}",
        f"ROOT={q(plan.cache_root)}",
        *(f"export {k}={q(v)}" for k, v in s.env.items()),
        *s.setup,
        'mkdir -p "$RUN/logs" "$RUN/status" && rm -f "$RUN"/status/*',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'if (( ${{#NODES[@]}} < {nodes} )); then',
        f'  echo "artcache: the job has ${{#NODES[@]}} node(s); this placement needs {nodes}" >&2; exit 2',
        "fi",
        "",
        "# role NAME NODE_INDEX GPUS CMD...: one job step; its log, node/GPUs and exit status under $RUN",
        "role() {",
        '  local name=$1 node=${NODES[$2]} gpus=$3; shift 3',
        '  ARTCACHE_ROLE_ENV="$RUN/status/$name.env" srun --exact -N1 -n1 -w "$node" --gres=gpu:"$gpus" \\',
        f'    --cpus-per-task={s.cpus_per_role} --job-name="$name" --output="$RUN/logs/$name.log" '
        + "".join(f"{q(a)} " for a in s.step_args) + "\\",
        "    bash -c 'printf \"node=%s\\nstep=%s\\ncuda_visible_devices=%s\\n\" \"$SLURMD_NODENAME\" "
        "\"$SLURM_STEP_ID\" "
        "\"${CUDA_VISIBLE_DEVICES-}\" > \"$ARTCACHE_ROLE_ENV\"; exec \"$@\"' role \"$@\"",
        '  echo $? > "$RUN/status/$name.exit"',
        "}",
        "",
        "# group NAME NODE_INDEX GPUS_PER_TASK TASKS PORT CMD...: an experiment of TASKS ranks as one job step of",
        "# TASKS tasks; each task is one rank of the torch.distributed group (ARTCACHE_GROUP_LAUNCHER=slurm: the",
        "# rank reads RANK, WORLD_SIZE, LOCAL_RANK from SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID); rank 0 on",
        "# MASTER_ADDR:MASTER_PORT (the step's node); a rank that fails ends the step (--kill-on-bad-exit)",
        "group() {",
        '  local name=$1 node=${NODES[$2]} gpus=$3 tasks=$4 port=$5; shift 5',
        '  local per_task=(); (( gpus > 0 )) && per_task=(--gpus-per-task="$gpus")',
        '  ARTCACHE_ROLE_ENV="$RUN/status/$name.env" ARTCACHE_GROUP_LAUNCHER=slurm MASTER_ADDR="$node" \\',
        '    MASTER_PORT="$port" srun --exact -N1 -n"$tasks" -w "$node" "${per_task[@]}" --kill-on-bad-exit=1 \\',
        f'    --cpus-per-task={s.cpus_per_role} --job-name="$name" --output="$RUN/logs/$name.log" '
        + "".join(f"{q(a)} " for a in s.step_args) + "\\",
        "    bash -c '[ \"$SLURM_PROCID\" != 0 ] || "
        "printf \"node=%s\\nstep=%s\\ncuda_visible_devices=%s\\nranks=%s\\n\" \"$SLURMD_NODENAME\" \"$SLURM_STEP_ID\" "
        "\"${CUDA_VISIBLE_DEVICES-}\" \"$SLURM_STEP_NUM_TASKS\" > "
        "\"$ARTCACHE_ROLE_ENV\"; exec \"$@\"' rank \"$@\"",
        '  echo $? > "$RUN/status/$name.exit"',
        "}",
        "",
        f"role producer {roles[0].node} {roles[0].gpus} {' '.join(q(a) for a in roles[0].argv)} &",
        "PRODUCER=$!",
        "# the consumers open the root the producer creates; it captures nothing until all have registered",
        f"for _ in $(seq 1 {max(1, int(s.root_wait_s * 10))}); do",
        '  [ -f "$ROOT/artcache.json" ] && break',
        '  kill -0 "$PRODUCER" 2>/dev/null || break',
        "  sleep 0.1",
        "done",
        'if [ ! -f "$ROOT/artcache.json" ]; then',
        '  echo "artcache: the producer did not create $ROOT; see $RUN/logs/producer.log" >&2',
        '  scancel "$SLURM_JOB_ID"; exit 1',
        "fi",
        *(f"role {q(r.name)} {r.node} {r.gpus} {' '.join(q(a) for a in r.argv)} &" if r.tasks == 1 else
          f"group {q(r.name)} {r.node} {r.gpus} {r.tasks} {group_port(i)} {' '.join(q(a) for a in r.argv)} &"
          for i, r in enumerate(roles[1:], 1)),
        "wait",
        "",
        "fail=0",
        f"for name in {' '.join(q(r.name) for r in roles)}; do",
        '  code=$(cat "$RUN/status/$name.exit" 2>/dev/null || echo missing)',
        '  echo "artcache: role $name exit $code ($(tr \'\\n\' \' \' < "$RUN/status/$name.env" 2>/dev/null))"',
        '  [ "$code" = 0 ] || fail=1',
        "done",
        f'{q(s.python or sys.executable)} -m artcache inspect --cache "$ROOT" --json > "$RUN/inspect.json" || fail=1',
        'echo "artcache: inspect $( [ $fail = 0 ] && echo ok || echo FAILED ); $RUN/inspect.json"',
        "exit $fail",
    ]
    return "\n".join(lines) + "\n"


def collect(run_dir: str | Path, roles: list[str]) -> dict:
    """What a finished job left in ``run_dir``: per role its exit status and ``.env`` (node, step,
    cuda_visible_devices), and the root's inspect JSON. ``ok``: every role exited 0 and inspect found no
    violation."""
    run = Path(run_dir)
    out: dict = {"roles": {}, "inspect": None}
    for name in roles:
        exit_path, env_path = run / "status" / f"{name}.exit", run / "status" / f"{name}.env"
        code = exit_path.read_text().strip() if exit_path.is_file() else None
        env = dict(line.split("=", 1) for line in env_path.read_text().splitlines() if "=" in line) \
            if env_path.is_file() else {}
        out["roles"][name] = {"exit": int(code) if code and code.lstrip("-").isdigit() else code, **env,
                              "log": str(run / "logs" / f"{name}.log")}
    with contextlib.suppress(OSError, ValueError):
        out["inspect"] = json.loads((run / "inspect.json").read_text())
    acc = out["inspect"]
    out["ok"] = all(r["exit"] == 0 for r in out["roles"].values()) and acc is not None and not acc["violations"]
    return out


def format_collect(res: dict) -> str:
    lines = []
    for name, r in res["roles"].items():
        lines.append(f"{name:16s} exit {r['exit']}  node {r.get('node', '?')}  CUDA_VISIBLE_DEVICES "
                     f"{r.get('cuda_visible_devices', '?') or '-'}  log {r['log']}")
    acc = res["inspect"]
    if acc is None:
        lines.append("inspect: no inspect.json (the job did not get that far)")
    else:
        c = acc["cache"]
        lines.append(f"inspect: {'ok' if not acc['violations'] else 'VIOLATIONS: ' + '; '.join(acc['violations'])}; "
                     f"captures {c['captures']} for {c['distinct_positions_consumed']} consumed positions "
                     f"({c['captures_per_consumed_position']:.3f} per position)")
    return "\n".join(lines)


def _squeue_state(job: str) -> str:
    """The job's state from squeue ('' once it has left the queue)."""
    try:
        res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "UNKNOWN"
    return res.stdout.strip() if res.returncode == 0 else ""


def launch(plan: RunPlan, cfg: RunConfig, *, dry_run: bool = False, submit: bool = False, wait: bool = False,
           poll_s: float = 2.0) -> int:
    """Write (or with ``dry_run`` print) the job script; submit it; wait for it. Returns the exit status:
    0 (written / submitted / every role ok), 1 (the job failed)."""
    script = render(plan, cfg)
    note = shared_note(plan)
    if dry_run:
        print(format_plan(plan))
        if note:
            print(f"note: {note}")
        print(f"\n# {Path(plan.out) / 'slurm' / 'run.sbatch'}\n{script}", end="")
        return 0
    if submit and shutil.which("sbatch") is None:
        raise ConfigError("--submit: sbatch is not on PATH (run on a Slurm login node, or leave --submit out and "
                          "submit the written script yourself)")
    _write_configs(plan, cfg, expect_consumers=len(plan.experiments))  # the producer waits for every experiment
    out = Path(plan.out)
    for d in ("logs", "status", "slurm"):
        (out / d).mkdir(parents=True, exist_ok=True)
    path = out / "slurm" / "run.sbatch"
    atomic_write(path, [script.encode()], path.parent)
    path.chmod(0o755)
    print(format_plan(plan))
    if note:
        print(f"note: {note}")
    print(f"slurm script: {path}")
    if not submit:
        print(f"submit it with: sbatch {shlex.quote(str(path))}")
        return 0
    res = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, cwd=out, timeout=120)
    if res.returncode != 0:
        raise LaunchError(f"sbatch {path} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    job = res.stdout.strip().split(";")[0]
    (out / "slurm" / "job_id").write_text(job + "\n")
    print(f"submitted job {job}; logs in {out / 'logs'}", flush=True)
    if not wait:
        return 0
    last = None
    while True:
        state = _squeue_state(job)
        if not state:
            break
        if state != last:
            print(f"job {job}: {state}", flush=True)
            last = state
        time.sleep(poll_s)
    summary = collect(out, ["producer", *(x.name for x in plan.experiments)])
    (out / "slurm" / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_collect(summary), flush=True)
    return 0 if summary["ok"] else 1


__all__ = ["LaunchError", "Role", "collect", "filesystem_of", "format_collect", "launch", "place", "render"]
