"""A consumer that is a ``torch.distributed`` group of ranks: one consumer to the cache.

One experiment may span devices: ``artcache consume ... --nproc N`` starts N ranks itself (:func:`launch`), and
the same command under ``torchrun --nproc-per-node N -m artcache consume ...`` runs as one of the N ranks torchrun
started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment). Either
way the cache sees ONE consumer:

- rank 0 registers (one registration, one cursor, one window, one lineage of checkpoints) and is the only rank
  that commits the cursor, writes checkpoints, evaluates the held-out split and writes metrics, TensorBoard and
  the progress bar; the other ranks read the registration it made;
- an optimizer step consumes one global batch of ``N × --batch-size × --grad-accum`` consecutive positions; rank
  r reads and leases its own contiguous slice of it (``--grad-accum`` micro-batches of ``--batch-size``) and
  journals those reads as its own reader (``journal/reader-<id>-<rank's token>.jsonl``); with ``--cp C``
  (context parallelism, :func:`cp_layout`) the global batch is ``N / C × --batch-size × --grad-accum`` and the C
  ranks of a CP group read the same slice, each training on its part of every sequence;
- the cursor moves only after every rank finished the optimizer step that consumed the positions: the step's
  metric sums are all-reduced after the optimizer step, then rank 0 commits, then it tells the others whether
  the commit held (a fence of the registration stops every rank);
- gradients are averaged by ``torch.nn.parallel.DistributedDataParallel`` (with ``--cp``: by one all-reduce after
  the backward; with ``--shard full``: reduce-scattered by FSDP2, :mod:`.shard`) and normalised over the global
  batch (:meth:`Session.train_step`), so the update is the one a single process would make on the whole global
  batch.

Collectives run on the default group with ``--group-timeout`` seconds (not the backend's 30-minute default); the
waits that may legitimately be long (a rank waiting for its batch on a demand miss, rank 0's evaluation or
checkpoint) run on a second gloo group whose timeout covers them (:attr:`Group.slow_timeout_s`).
Before registering, the ranks all-gather a digest of what they must agree on (plan, contract, window, batch, the
resume point, the draft's configuration; :func:`agree`) and refuse to start when one differs.

The launcher (:func:`launch`) watches its ranks: when one exits nonzero, is killed or stops beating (a stopped or
frozen process: :data:`BEAT_S`, :data:`SILENT_S`), the others are stopped (SIGTERM, then SIGKILL after
``--group-timeout``), a registration left running by a dead rank 0 is fenced as failed (its leases are then
reclaimed), and :class:`~artcache.errors.GroupFailed` names the rank, its pid and its exit status or signal (and
its error, or how long it made no progress). Bad input is one error, as one process raises it: the launcher checks
what needs no draft before starting ranks (:func:`~.session.preflight`) and raises the bad input a rank found once.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from artcache import registry
from artcache.errors import ConfigError, ConsumerFenced, GroupFailed
from artcache.shutdown import Cancelled, Forwarding
from artcache.trainers.draft import DraftBatch, MetricSums, PendingSums

__all__ = ["BEAT_S", "GROUP_DIR_ENV", "GROUP_LAUNCHER_ENV", "LAUNCHER_PID_ENV", "SUMMARY_ENV", "Group",
           "GroupHandle", "agree", "cp_layout", "env_world", "from_slurm", "join", "launch", "leave", "micro_batches",
           "rank_file", "rank_gpu", "sums_from_vector", "sums_names", "sums_vector"]

log = logging.getLogger("artcache.consumer")

#: what :func:`launch` tells each rank: the file rank 0 writes its summary to, and the launcher's pid (a rank stops
#: when that process dies: :func:`artcache.trainers.consumer.rank.child_main`)
SUMMARY_ENV = "ARTCACHE_GROUP_SUMMARY"
LAUNCHER_PID_ENV = "ARTCACHE_GROUP_LAUNCHER_PID"
#: the launcher's private directory (:func:`rank_file`): each rank's beat file and the error that ended it
GROUP_DIR_ENV = "ARTCACHE_GROUP_DIR"
#: seconds between a rank's beats (:func:`artcache.trainers.consumer.rank.child_main` touches its beat file)
BEAT_S = 1.0
#: a rank whose beat file did not change for this long when another rank fails is taken for the cause (s)
SILENT_S = 5.0

#: the environment variables a rank reads (set by :func:`launch` and by torchrun)
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: the least timeout of the slow group (s): rank 0's held-out evaluation or checkpoint may take this long
SLOW_MIN_S = 1800.0


@dataclass
class Group:
    """This process's place in its consumer group.

    Attributes:
        rank, world, local_rank: from the environment. backend: ``gloo`` (CPU) or ``nccl`` (CUDA).
        timeout_s: the default group's collective timeout (``--group-timeout``).
        slow: a gloo group over the same ranks for waits that may be long; ``slow_timeout_s`` its timeout.
        gpu: the CUDA index this rank runs on (:func:`rank_gpu`); None on a CPU.
    """

    rank: int
    world: int
    local_rank: int
    backend: str
    timeout_s: float
    slow: Any
    slow_timeout_s: float
    gpu: int | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def any_slow(self, flag: bool) -> bool:
        """Whether any rank passed ``flag`` True (a max all-reduce over the slow group: a rank may have waited for
        data or rank 0's work); every rank reached this point."""
        box = torch.tensor([float(flag)])
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.slow)
        return bool(box.item() > 0)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (a small picklable object, over the slow group)."""
        box = [value if self.main else None]
        dist.broadcast_object_list(box, src=0, group=self.slow)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (small picklable objects, over the slow group)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.slow)
        return out


#: set to ``slurm`` by ``artcache run --launcher slurm`` on the job step of a group (one task per rank): the rank
#: reads its place from Slurm's task variables (:func:`from_slurm`)
GROUP_LAUNCHER_ENV = "ARTCACHE_GROUP_LAUNCHER"
#: Slurm's task variables → the ``torch.distributed`` ones (:func:`from_slurm`)
SLURM_ENV = {"SLURM_PROCID": "RANK", "SLURM_STEP_NUM_TASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def from_slurm() -> bool:
    """On a Slurm job step of a group (``ARTCACHE_GROUP_LAUNCHER=slurm``, set by ``artcache run --launcher
    slurm``): set ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` and
    ``SLURM_LOCALID`` (``MASTER_ADDR`` / ``MASTER_PORT`` come from the job script). Variables already set are kept
    (a value differing from Slurm's is refused). Returns whether this process is such a rank.

    Raises:
        ConfigError: ``ARTCACHE_GROUP_LAUNCHER`` names another launcher, or a Slurm variable is missing or
            differs from the torch.distributed one already set.
    """
    launcher = os.environ.get(GROUP_LAUNCHER_ENV)
    if launcher is None:
        return False
    if launcher != "slurm":
        raise ConfigError(f"{GROUP_LAUNCHER_ENV} {launcher!r} is not accepted: slurm (or leave it unset)")
    for src, dst in SLURM_ENV.items():
        value = os.environ.get(src)
        if value is None:
            raise ConfigError(f"{GROUP_LAUNCHER_ENV}=slurm but {src} is not set: run the rank as a task of a Slurm "
                              "job step (srun), or leave ARTCACHE_GROUP_LAUNCHER unset")
        if os.environ.get(dst, value) != value:
            raise ConfigError(f"{dst} {os.environ[dst]!r} differs from Slurm's {src} {value!r}: leave {dst} unset "
                              "on a Slurm job step")
        os.environ[dst] = value
    return True


def env_world() -> int | None:
    """``WORLD_SIZE`` from the environment (torchrun, :func:`launch`, or a Slurm job step: :func:`from_slurm`), or
    None outside a group.

    Raises:
        ConfigError: ``WORLD_SIZE`` / ``RANK`` are not integers in range; a bad Slurm step (:func:`from_slurm`).
    """
    from_slurm()
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return None
    try:
        world, rank = int(raw), int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE {raw!r} / RANK {os.environ.get('RANK')!r} are not integers (set by torchrun or "
                          "artcache consume --nproc)") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK {rank} is not inside WORLD_SIZE {world}: accepted 0 <= RANK < WORLD_SIZE >= 1")
    return world


def rank_gpu(local_rank: int, devices: list[int] | tuple[int, ...] = ()) -> int:
    """The CUDA index a rank runs on: ``devices[local_rank]`` when the consumer was given its ranks' devices
    (``artcache run``), 0 on a Slurm job step (``--gpus-per-task``: each task sees only its own GPUs, from
    ``cuda:0``), else ``LOCAL_RANK`` (torchrun, ``artcache consume --nproc``).

    Raises:
        ConfigError: ``local_rank`` has no entry in ``devices``.
    """
    if devices:
        if not 0 <= local_rank < len(devices):
            raise ConfigError(f"LOCAL_RANK {local_rank} has no device in devices {list(devices)}: accepted one "
                              "CUDA index per rank")
        return int(devices[local_rank])
    return 0 if os.environ.get(GROUP_LAUNCHER_ENV) == "slurm" else local_rank


def join(device: str, timeout_s: float, demand_timeout_s: float,
         devices: list[int] | tuple[int, ...] = ()) -> Group | None:
    """Join the consumer group the environment describes (None for a world of one): ``init_process_group`` with
    ``timeout=timeout_s`` on gloo (CPU) or nccl (CUDA; the device becomes ``cuda:`` :func:`rank_gpu`, from
    ``devices`` when given), and the slow gloo group with ``max(demand_timeout_s, SLOW_MIN_S) + timeout_s``.

    Raises:
        ConfigError: a partial environment (``MASTER_ADDR`` / ``MASTER_PORT`` missing).
    """
    world = env_world()
    if world is None or world == 1:
        return None
    missing = [k for k in ENV if k not in os.environ and k != "LOCAL_RANK"]
    if missing:
        raise ConfigError(f"WORLD_SIZE {world} is set but {', '.join(missing)} is not: run the group with "
                          "artcache consume --nproc N or torchrun --nproc-per-node N")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    cuda = torch.device(device).type == "cuda"
    backend = "nccl" if cuda else "gloo"
    gpu = rank_gpu(local, devices) if cuda else None
    if gpu is not None:
        torch.cuda.set_device(gpu)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    slow_s = max(demand_timeout_s, SLOW_MIN_S) + timeout_s
    slow = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=slow_s))
    return Group(rank, world, local, backend, timeout_s, slow, slow_s, gpu)


def leave(group: Group | None) -> None:
    """Destroy the process group (every rank, at its end; errors of a group a peer left are ignored)."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a peer died: nothing left to tear down cleanly
        log.debug("destroy_process_group: %s", exc)


def agree(group: Group, what: dict[str, Any]) -> None:
    """Refuse to start unless every rank has the same ``what`` (plan, contract, window, resume point, ...): each
    rank's digest (sha256 of its canonical JSON) is all-gathered with the values.

    Raises:
        ConfigError: ``consumer group: rank r disagrees with rank 0 about <field>: <value> (rank 0: <value>)``.
    """
    blob = json.dumps(what, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()
    got = group.all_gather((digest, blob))
    for r, (d, other) in enumerate(got):
        if d == got[0][0]:
            continue
        mine, theirs = json.loads(got[0][1]), json.loads(other)
        field = next((k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)), "?")
        raise ConfigError(f"consumer group: rank {r} disagrees with rank 0 about {field}: {theirs.get(field)!r} "
                          f"(rank 0: {mine.get(field)!r}); every rank must run the same command on the same root")


def cp_layout(group: Group | None, cp: int) -> tuple[int, int, Any]:
    """This rank's place under context parallelism (``--cp N``): ``(data-parallel rank, rank inside its CP group,
    the CP group's process group)``. Rank ``r`` of a world of ``nproc`` is CP rank ``r % N`` of data-parallel
    group ``r // N``; the N ranks of a CP group read the same positions and split each sequence. Every rank
    creates every CP group (``new_group`` is collective), each a gloo or nccl group like the default one.
    ``(rank, 0, None)`` with N = 1 (no CP), ``(0, 0, None)`` outside a group.

    Raises:
        ConfigError: N does not divide the world size.
    """
    if group is None or cp == 1:
        return (0 if group is None else group.rank), 0, None
    if group.world % cp:
        raise ConfigError(f"--cp {cp} does not divide the group's world size {group.world}: accepted a world size "
                          f"that is a multiple of {cp}")
    mine = None
    for d in range(group.world // cp):
        pg = dist.new_group(ranks=list(range(d * cp, (d + 1) * cp)), backend=group.backend,
                            timeout=datetime.timedelta(seconds=group.timeout_s))
        if group.rank // cp == d:
            mine = pg
    return group.rank // cp, group.rank % cp, mine


class GroupHandle(registry.ConsumerHandle):
    """A rank's handle on its group's one registration: every rank writes only its own training demand (the
    positions of its slice it waits for), leaving the other ranks' entries as they are on disk; everything else
    is :class:`~artcache.registry.ConsumerHandle`'s (only rank 0 heartbeats, commits and finishes)."""

    def __init__(self, layout, reg: registry.Registration, space_wait_s: float = 30.0) -> None:
        super().__init__(layout, reg, space_wait_s)
        self._mine: set[int] = set()

    def set_demand(self, positions: list[int] | None, pinned: list[int] | None = None) -> registry.Registration:
        if positions is None:
            return super().set_demand(None, pinned)
        mine, before = set(positions), self._mine

        def fn(old: registry.Registration | None) -> registry.Registration:
            if old is None or old.generation != self.generation or old.state != "running":
                raise ConsumerFenced(f"consumer {self.consumer_id!r} was fenced (state "
                                     f"{old.state if old else 'missing'}, generation "
                                     f"{old.generation if old else '-'} != {self.generation})")
            changes = {"demand": sorted((set(old.demand) - before) | mine)}
            if pinned is not None:
                changes["pinned_demand"] = sorted(set(pinned))
            return msgspec.structs.replace(old, heartbeat=time.time(), beat=old.beat + 1, **changes)

        self.current = self._update(fn)
        self._mine = mine
        return self.current


def micro_batches(batch: DraftBatch, k: int) -> list[DraftBatch]:
    """``batch`` ([k·b, T] rows) as ``k`` micro-batches of ``b`` consecutive rows, each cut to its own longest
    sample (the length it would have had collated alone; columns past it are padding in every row)."""
    if k == 1:
        return [batch]
    b = batch.input_ids.shape[0] // k
    out = []
    for i in range(k):
        rows = slice(i * b, (i + 1) * b)
        valid = batch.valid[rows]
        cols = valid.any(0).nonzero()
        t = int(cols.max()) + 1 if cols.numel() else 1
        out.append(DraftBatch(batch.hidden[rows, :t], batch.input_ids[rows, :t], batch.loss_mask[rows, :t],
                              valid[:, :t],
                              positions=batch.positions[rows],
                              last_layer=None if batch.last_layer is None else batch.last_layer[rows, :t],
                              supervised_host=None if batch.supervised_host is None else
                              batch.supervised_host[rows, :t]))
    return out


def sums_names(sums: MetricSums | PendingSums) -> list[str]:
    """The figure names of a step's sums (a name with a denominator as ``name/``): what :func:`sums_vector` lays
    out. Ranks all-gather these first, since a draft reports some figures only when measured (DSpark's
    calibration bins)."""
    if isinstance(sums, PendingSums):
        return [n + "/" if has else n for n, has in sums.names]
    return [n + "/" if n in sums.den else n for n in sums.num]


def sums_vector(sums: MetricSums | PendingSums, device: torch.device,
                names: list[str] | None = None) -> tuple[Tensor, list[tuple[str, bool]]]:
    """A step's metric sums as one float64 vector on ``device``, laid out by ``names`` (:func:`sums_names` of every
    rank, united; None: this one's), a figure this rank lacks as zeros; and the layout :func:`sums_from_vector`
    reads it back with."""
    if isinstance(sums, PendingSums):
        sums = sums.resolve()
    layout = [(n.rstrip("/"), n.endswith("/")) for n in (sorted(sums_names(sums)) if names is None else names)]
    flat = [x for n, has in layout
            for x in ((sums.num.get(n, 0.0), sums.den.get(n, 0.0)) if has else (sums.num.get(n, 0.0),))]
    return torch.tensor(flat, dtype=torch.float64, device=device), layout


def sums_from_vector(vec: Tensor, names: list[tuple[str, bool]]) -> MetricSums:
    """Inverse of :func:`sums_vector` (one host read-back)."""
    return PendingSums(tuple(names), vec).resolve()


# ---- the launcher: artcache consume --nproc N ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe(rc: int) -> str:
    """A rank's exit status in words: ``exit status 2`` or ``signal SIGKILL``."""
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def rank_file(directory: Path, kind: str, rank: int) -> Path:
    """A rank's file in the launcher's directory: ``beat-<rank>`` (touched every :data:`BEAT_S` s), ``error-<rank>``
    (the error that ended it: :func:`~.reader_process.failure_of`'s JSON) and ``trace-<rank>`` (its traceback, when
    it was no artcache error)."""
    return directory / f"{kind}-{rank}"


def launch(cfg) -> dict:
    """Run consumer ``cfg`` as ``cfg.nproc`` ranks on this machine (MASTER_ADDR 127.0.0.1, a free port); return
    rank 0's summary (:func:`~.session.run_consumer`'s). Each rank is ``python -c`` :func:`~.rank.child_main` with the
    config on its stdin and ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` set. SIGINT and
    SIGTERM to the launcher go to every rank (each stops at its next step boundary).

    The group fails like one process: a rank leaves the error that ended it in the launcher's directory instead of
    printing it, and when the first rank to fail ended with bad input (exit status 2: every rank finds the same bad
    value) that error is raised here once, rank 0's when it has one. Each rank touches its beat file every
    :data:`BEAT_S` s from a thread of its own (a rank waiting in a collective keeps beating): a rank whose beat is
    silent for ``cfg.group_timeout_s`` (stopped with ``SIGSTOP``, frozen) stops the group, and when a rank fails
    while another's beat has been silent for :data:`SILENT_S` s, the silent one is named as the cause.

    Raises:
        Cancelled: SIGINT / SIGTERM to the launcher stopped every rank cleanly (each after its checkpoint); it
            carries the signal and rank 0's summary, as one process's consume raises it.
        ArtcacheError: the bad input (exit status 2) the first failing rank found, as one process raises it.
        GroupFailed: a rank exited nonzero, was killed or made no progress; the others were stopped first
            (SIGTERM, then SIGKILL after ``cfg.group_timeout_s``; a silent rank SIGKILL at once). The message names
            the rank, its pid, its exit status or signal (and its error, or how long it was silent); a
            registration a dead rank 0 left running is fenced as failed.
    """
    n = cfg.nproc
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="artcache-group-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        payload = msgspec.json.encode(cfg)
        procs: list[subprocess.Popen] = []
        for r in range(n):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                   "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   SUMMARY_ENV: str(summary_path), LAUNCHER_PID_ENV: str(os.getpid()), GROUP_DIR_ENV: tmp}
            p = subprocess.Popen([sys.executable, "-c", "from artcache.trainers.consumer.rank import child_main; "
                                  "child_main()"], env=env, stdin=subprocess.PIPE)
            p.stdin.write(payload)
            p.stdin.close()
            procs.append(p)
        log.info("[%s] started a group of %d ranks (pids %s)", cfg.consumer_id, n, ", ".join(str(p.pid) for p in procs))
        forwarded: list[int] = []
        beats = [rank_file(Path(tmp), "beat", r) for r in range(n)]
        failed = _watch(procs, cfg.group_timeout_s, forwarded, beats)
        if failed is not None:
            r, rc, silent = failed
            why = f" after {silent}" if silent else _error_note(Path(tmp), r)
            diagnosis = f"rank {r} (pid {procs[r].pid}) ended with {_describe(rc)}{why}"
            fenced = _fence_dead(cfg, procs, "failed", diagnosis, peer_failed=r != 0)
            bad_input = _bad_input(Path(tmp), procs, r)
            if bad_input is not None and silent is None:
                raise bad_input
            trace = rank_file(Path(tmp), "trace", r)
            if silent is None and trace.is_file():  # its traceback once (the others' failed collectives: none)
                sys.stderr.write(f"rank {r}: {trace.read_text()}")
            others = ", ".join(f"rank {i} {_describe(p.returncode)}" for i, p in enumerate(procs) if i != r)
            raise GroupFailed(f"consumer {cfg.consumer_id!r}: {diagnosis}; the group stopped ({others}){fenced}",
                              rank=r, returncode=rc)
        stopped = [s for s in (_stopped_by(p.returncode, forwarded) for p in procs) if s is not None]
        if stopped:  # rank 0 killed by the signal (a second one) before it finished the registration: cancelled
            _fence_dead(cfg, procs, "cancelled", "interrupted")
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, ValueError) as exc:
            if not stopped:
                raise GroupFailed(f"consumer {cfg.consumer_id!r}: every rank exited 0 but rank 0 left no summary "
                                  f"({exc})", rank=0, returncode=0) from None
            summary = None
        if stopped:  # the ranks stopped cleanly on the signal passed on: the launcher ends as one process would
            raise Cancelled(stopped[0], summary)
        return summary


def _rank_error(directory: Path, rank: int):
    """The error rank ``rank`` left (:func:`~.rank.child_main`) as its :class:`~.reader_process.Failed`, or None."""
    from .reader_process import Failed

    try:
        return msgspec.json.decode(rank_file(directory, "error", rank).read_bytes(), type=Failed)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _bad_input(directory: Path, procs: list[subprocess.Popen], rank: int) -> BaseException | None:
    """The bad-input error (exit status 2) that ended rank ``rank``, the first to fail, rebuilt as one process
    raises it (rank 0's when it ended with bad input too: the ranks check the same input); None otherwise."""
    from .reader_process import rebuild

    if procs[rank].returncode != 2:
        return None
    for r in (0, rank):
        msg = _rank_error(directory, r) if procs[r].returncode == 2 else None
        exc = rebuild(msg) if msg is not None else None
        if getattr(exc, "exit_code", None) == 2:
            return exc
    return None


def _error_note(directory: Path, rank: int) -> str:
    """`` (<class>: <message>)``: the error rank ``rank`` left, or nothing."""
    msg = _rank_error(directory, rank)
    return f" ({msg.cls}: {msg.message})" if msg is not None else ""


def _stopped_by(rc: int | None, forwarded: list[int]) -> int | None:
    """The stop signal the launcher passed on that ended a rank with return code ``rc``: its clean stop (exit status
    128 + the signal, as one process exits 130 / 143) or the signal itself (a second one, or one that came while
    the rank's handlers were not installed: one process dies of it the same way); None for any other end."""
    return next((s for s in forwarded if rc in (128 + s, -s)), None)


def _watch(procs: list[subprocess.Popen], grace_s: float, forwarded: list[int],
           beats: list[Path] | None = None) -> tuple[int, int, str | None] | None:
    """Wait for every rank; on the first that ends nonzero stop the rest (SIGTERM, SIGKILL after ``grace_s``).
    A running rank whose beat file (``beats``; :func:`~.rank.child_main`) has not changed for ``grace_s`` fails the
    group itself, and one silent for :data:`SILENT_S` s when another rank fails is taken for the cause; a silent
    rank is SIGKILLed at once (a stopped process never acts on SIGTERM). Returns (rank, return code, how long it
    was silent or None) of that first failure, or None when all exited 0 or, after a stop signal the launcher
    passed on, with 128 + that signal or of that signal (:func:`_stopped_by`). The stop signals passed on are
    appended to ``forwarded``."""
    from artcache.liveness import HeartbeatWatch

    watch = HeartbeatWatch(grace_s)

    def bad(rc: int | None) -> bool:
        return rc not in (None, 0) and not _stopped_by(rc, forwarded)

    def forward(signum):  # the launcher's SIGINT / SIGTERM: every rank stops at its next step boundary
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def silence() -> list[tuple[float, int]]:
        """(seconds silent, rank) of each running rank whose beat file exists, the longest first."""
        out = []
        for r, p in enumerate(procs):
            try:
                beat = beats[r].stat().st_mtime_ns if beats and p.poll() is None else None
            except OSError:  # not started beating yet (importing), or gone
                beat = None
            if beat is not None:
                out.append((watch.observe(r, beat).silent_s, r))
        return sorted(out, reverse=True)

    failed: tuple[int, str | None] | None = None
    deadline = None
    with Forwarding(forward):
        while None in [p.poll() for p in procs]:  # every rank polled (any() would stop at the first running one)
            quiet = silence()
            if failed is None:
                # the first failure; a rank killed by a signal before one that exited (its peers' collectives
                # fail once it is gone, so both may be seen in one poll)
                ended = sorted(((p.returncode >= 0, r) for r, p in enumerate(procs) if bad(p.returncode)))
                limit = SILENT_S if ended else grace_s
                if quiet and quiet[0][0] >= limit:  # a rank stopped beating: it, not the ones waiting for it
                    secs, r = quiet[0]
                    failed = (r, f"making no progress for {secs:.0f}s (no beat: stopped or frozen)")
                    log.error("rank %d (pid %d) made no progress for %.0fs: stopping the group", r, procs[r].pid, secs)
                    procs[r].kill()
                elif ended:
                    r = ended[0][1]
                    failed = (r, None)
                    # bad input (2) is the launcher's one error line; anything else is logged as it happens
                    log.log(logging.INFO if procs[r].returncode == 2 else logging.ERROR,
                            "rank %d (pid %d) ended with %s: stopping the other ranks", r, procs[r].pid,
                            _describe(procs[r].returncode))
                if failed is not None:
                    for q in procs:
                        if q.poll() is None:
                            q.send_signal(signal.SIGTERM)
                    deadline = time.monotonic() + grace_s
            elif deadline is not None and time.monotonic() > deadline:
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                deadline = None
            time.sleep(0.05)
    if failed is None:  # every rank ended in the same poll
        ended = sorted((p.returncode >= 0, r) for r, p in enumerate(procs) if bad(p.returncode))
        failed = (ended[0][1], None) if ended else None
    return None if failed is None else (failed[0], procs[failed[0]].returncode, failed[1])


def _fence_dead(cfg, procs: list[subprocess.Popen], state: str, reason: str, peer_failed: bool = False) -> str:
    """After a failed or stopped group (every rank has exited): fence the consumer's registration as ``state`` with
    ``reason`` (the launcher's diagnosis) when it is still running under one of these ranks' pids (rank 0 was
    killed and could not finish it); with ``peer_failed`` (another rank than 0 failed first) a registration rank 0
    finished as failed gets ``reason`` too, in place of its own error (a collective a dead peer broke). Then reclaim
    the leases the dead ranks still held (journaled as ``lease_expire``, reason ``holder-dead``, in the launcher's
    own journal), so nothing they held waits for the producer's next pass. Returns a note for the error message."""
    from artcache import journal as J
    from artcache import leases
    from artcache.layout import CacheLayout
    from artcache.liveness import dead_reason

    layout = CacheLayout(Path(cfg.cache).expanduser().absolute())
    note = ""
    try:
        reg = registry.read(layout, cfg.consumer_id)
        ours = reg is not None and reg.pid in {p.pid for p in procs}
        if ours and reg.state == "running":
            registry.fence(layout, cfg.consumer_id, state, reason, expect_generation=reg.generation)
            note = f"; its registration was fenced as {state} (--resume continues from its recorded checkpoint)"
        elif ours and peer_failed and reg.state == "failed":
            def blame(old: registry.Registration | None) -> registry.Registration | None:
                return msgspec.structs.replace(old, reason=reason) if old is not None and \
                    old.generation == reg.generation and old.state == "failed" else None

            registry.update(layout, cfg.consumer_id, blame)
        dead = [info for infos in leases.scan(layout).values() for info in infos
                if info.consumer == cfg.consumer_id and info.holder is not None and info.holder.comparable()
                and info.holder.pid in {p.pid for p in procs} and dead_reason(info.holder) is not None]
        if dead:
            journal = J.JournalWriter(layout.journal_path("launcher", cfg.consumer_id))
            try:
                for info in dead:
                    if leases.release(layout, info.name):
                        journal.emit(J.LeaseExpire(producer="launcher", fp=info.fp, lease=info.name,
                                                   reason="holder-dead"))
            finally:
                journal.close()
            note += f"; {len(dead)} lease(s) its dead ranks held were reclaimed"
    except Exception as exc:  # an unreadable root: the producer fences and reclaims on its own passes
        log.warning("[%s] could not fence or reclaim after the group failed: %s", cfg.consumer_id, exc)
    return note
