"""A pre-filled root used offline: capture everything once, train many times.

``python -m artcache.bench.offline --out DIR [--target NAME] [--data D] [--max-samples N] [--steps S] ...``

1. ``artcache producer --fill`` captures the whole plan into ``DIR/cache`` and exits (timed); a second
   ``--fill`` on the same root captures nothing and exits (same contract and plan).
2. Rounds, alternated so that the machine's other load hits both alike: three DFlash consumers
   (block sizes ``--blocks``) train ``--warmup`` + ``S`` steps each, at the same time, **from the root with no
   producer running**; then the same three train the same steps from batches **held in memory** (read and
   collated before the loop; the loop is ``Session.train_step`` alone, the consumer's own compute).
   Both arms are the same process (:func:`worker_command`: one module, one flag set, ``--warmup`` included,
   the same environment, ``cfg.threads`` torch threads), built the same way, and the three of a round begin
   their steps together once all three are built (:func:`release_round`), so start-up never overlaps
   another's measured steps in one arm and not in the other. Both arms are timed by the same clock at
   the same point, the end of ``Session.train_step`` (:func:`_timed_session`), over the same steps
   (:func:`measured`): the root arm's window also holds everything its loop does between two steps
   (the wait for the reader's batch, lease release, cursor commit, journal). ``--pairing process`` instead
   runs both arms in each consumer's one process, one after the other (the three change arm together; the
   order alternated per round), for machines where a process's own speed varies from one process to the next
   (measured on the idle H200 machine: the same consumer's CPU time per step 23-38 ms across rounds).
   ``--pairing steps`` alternates the two arms inside each consumer's one process every ``--chunk`` steps
   (:func:`_interleave`; the steps right after a switch not counted, :func:`interleaved`), for machines whose
   speed changes within seconds (on an H200 VM: the same pinned process's CPU time per step
   21-37 ms from one arm to the next).
3. ``report.json``: the fill, each consumer's steady steps/s and process CPU ms per step in each mode and
   round, the root/memory ratio per consumer (median over rounds; also of steps per CPU second, less
   sensitive to the machine's other load), the torch threads and measured steps of each arm (checked
   equal), the captures made while the consumers ran (0: the root served everything), and the check
   that every ratio is >= 0.95.

``--out`` must be new, or hold nothing of an earlier run (:func:`check_out`: a second run is refused before the
fill; the earlier report and logs are results, never removed here). Bad flags exit 2 in one line before anything
is written. A worker that fails, is killed or runs past ``--timeout-s`` stops the round: its other workers are
stopped (SIGTERM, then SIGKILL) and the bench exits 1 in one line naming the worker, its exit status and its log.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from artcache.accounting import account
from artcache.bench.provenance import record
from artcache.errors import ArtcacheError, ConfigError, WorkerFailed
from artcache.fsio import atomic_write
from artcache.launch import Role, cli_argv, stop_all
from artcache.layout import CacheLayout
from artcache.rolespec import read_spec, write_spec
from artcache.shutdown import GracefulShutdown

GOAL = 0.95
#: the two arms, in round 0's order (alternated every round)
MODES = ("root", "memory")
#: ``--pairing process``: one process runs both arms, one after the other (in round 0's order, alternated)
PAIRED = ("root+memory", "memory+root")
#: ``--pairing steps``: one process alternates the arms every ``--chunk`` steps (round 0's order first, alternated)
INTERLEAVED = ("root~memory", "memory~root")
#: the shortest ``--chunk``: the consumer's default handover (``prefetch_batches + 1`` = 3 steps) and 2 counted
MIN_CHUNK = 5
#: ``--chunk`` when ``--pairing steps`` is given without it
DEFAULT_CHUNK = 12
#: logical CPUs a pinned consumer process gets (``--pin auto``): its trainer thread and its reader thread
CPUS_PER_WORKER = 2
#: what a run writes under ``--out``; a second run on an ``--out`` holding any of them is refused (:func:`check_out`)
WRITTEN = ("cache", "runs", "logs", "barriers", "specs", "report.json")
#: the fewest steps an arm must measure (:func:`measured`: its ratios divide by the rate of the window)
MIN_MEASURED = 1
#: seconds a stopped worker gets between SIGTERM and SIGKILL (:func:`artcache.launch.Role.terminate`)
GRACE_S = 10.0


def fill(args, root: Path, logs: Path, name: str) -> dict:
    """Run ``artcache producer --fill`` on ``root`` (its spec file ``<out>/specs/<name>.producer.json``); its wall
    time, exit status and captures."""
    from artcache.producer import ProducerConfig

    before = account(CacheLayout(root)).cache.captures if (root / "artcache.json").is_file() else 0
    spec = write_spec(logs.parent / "specs" / f"{name}.producer.json", "producer", ProducerConfig(
        cache=str(root), target=args.target, dataset=args.data, max_samples=args.max_samples,
        max_length=args.max_length, draft_layers=5, threads=args.threads, fill=True))
    t0 = time.time()
    with open(logs / f"{name}.log", "wb") as log:
        code = subprocess.run(cli_argv("producer", "--spec", str(spec)), stdout=log,
                              stderr=subprocess.STDOUT).returncode
    acc = account(CacheLayout(root))
    return {"exit_code": code, "wall_s": time.time() - t0, "captures": acc.cache.captures - before,
            "retained_artifacts": acc.cache.retained_artifacts, "retained_bytes": acc.cache.retained_bytes}


def consumer_config(args, root: Path, block: int, run_dir: Path, cid: str):
    from artcache.trainers.consumer import ConsumerConfig

    commit = getattr(args, "commit_interval", None)  # None: the consumer's default
    return ConsumerConfig(cache=str(root), consumer_id=cid, draft="dflash", block_size=block,
                          num_anchors=args.anchors, batch_size=1, steps=args.warmup + args.steps,
                          lookbehind=0, lookahead=8, threads=1, out_dir=str(run_dir), progress=False,
                          tensorboard=False, log_every=10, reader=getattr(args, "reader", "thread"),
                          **({} if commit is None else {"commit_interval_s": commit}))


def worker_command(mode: str, spec: Path, warmup: int, barrier: Path, timeout_s: float,
                   cpus: list[int] | None = None, chunk: int = 0) -> list[str]:
    """The argv of one timed consumer process, whose settings are the consumer spec file ``spec``
    (:func:`artcache.rolespec.write_spec`). Both arms start the same module with the same flags (the
    warm-up included) and differ only in ``mode`` (``root`` or ``memory``), so they share the process
    model, the thread setting (the spec's ``threads``, set by ``Session.setup``), the clock and the steps skipped;
    ``cpus``: the logical CPUs the process is pinned to (:func:`cpu_sets`; None: not pinned); ``chunk``: the steps of
    one arm between two switches of an interleaved worker (:data:`INTERLEAVED`)."""
    if mode not in MODES + PAIRED + INTERLEAVED:
        raise ValueError(f"mode {mode!r} is not accepted: one of {', '.join(MODES + PAIRED + INTERLEAVED)}")
    pin = ["--cpus", ",".join(map(str, cpus))] if cpus else []
    chunked = ["--chunk", str(chunk)] if mode in INTERLEAVED else []
    return [sys.executable, "-m", "artcache.bench.offline", "--worker", mode, "--warmup", str(warmup),
            "--barrier", str(barrier), "--timeout-s", str(timeout_s), *pin, *chunked, "--spec", str(spec)]


def physical_cores(allowed: set[int] | None = None,
                   sysfs: Path = Path("/sys/devices/system/cpu")) -> list[list[int]]:
    """The physical cores this process may run on, each as the sorted logical CPUs it holds (SMT siblings share a
    ``(physical_package_id, core_id)`` in sysfs), in order of their first CPU; a CPU whose topology cannot be read
    counts as a core of its own. ``allowed``: the CPUs to consider (default ``os.sched_getaffinity(0)``)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    cores: dict[tuple, list[int]] = {}
    for cpu in sorted(allowed):
        try:
            top = sysfs / f"cpu{cpu}" / "topology"
            key = (int((top / "physical_package_id").read_text()), int((top / "core_id").read_text()))
        except (OSError, ValueError):
            key = ("cpu", cpu)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def cpu_sets(workers: int, per_worker: int, cores: list[list[int]]) -> list[list[int]] | None:
    """One set of ``per_worker`` logical CPUs per worker, each CPU the first of a physical core no other worker (nor
    the SMT sibling of another CPU of the bench) uses, so two trainers never share a core; the first core is left to
    the bench and the system when there are enough. None when the machine has fewer than ``workers × per_worker``
    physical cores (the workers are then left to the scheduler, as the report says)."""
    need = workers * per_worker
    if len(cores) < need:
        return None
    pool = [c[0] for c in (cores[1:] if len(cores) > need else cores)]
    return [pool[i * per_worker:(i + 1) * per_worker] for i in range(workers)]


def worker_env(threads: int) -> dict[str, str]:
    """The environment of every timed process (both arms): unbuffered output, OpenMP / MKL pools of
    ``threads`` (the consumer's ``--threads``) in every thread, not only the one ``Session.setup`` sets."""
    n = str(threads) if threads else os.environ.get("OMP_NUM_THREADS", "")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if n:
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
    return env


def window_start(warmup: int) -> int:
    """The step (1-based) whose end starts :func:`measured`'s window: ``max(warmup, 1)`` (a window needs a start,
    so with no warm-up the first step is still left out)."""
    return max(warmup, 1)


def measured_steps(warmup: int, steps: int) -> int:
    """How many steps :func:`measured` times in a run of ``warmup`` + ``steps`` steps (``steps`` with a warm-up,
    ``steps - 1`` without)."""
    return warmup + steps - window_start(warmup)


def measured(steps: list[tuple[float, float, float]], warmup: int) -> dict:
    """The steady figures of one arm from ``steps[i]`` = (``time.perf_counter()`` at the start and at the end
    of ``Session.train_step`` of step i+1, ``time.process_time()`` at its end), as :func:`_timed_session`
    records them in both arms.

    The window runs from the end of step ``max(warmup, 1)`` to the end of the last step, so the steps
    measured are ``max(warmup, 1) + 1 .. len(steps)`` (1-based; returned as ``measured_steps`` [first, last]).
    Returns {steps, measured_steps, steps_per_s, cpu_s_per_step (the process's CPU seconds over the window per
    step: all its threads, the root arm's reader included; a reader process's too, :func:`_reader_cpu_s`),
    train_step_share (of the window's wall time, the part inside ``train_step``: 1 in memory; in the root arm the
    rest is the loop's own work between two steps, measured on the same steps under the same load), threads
    (``torch.get_num_threads()``)}; the figures are 0.0 when the window holds no step."""
    first = window_start(warmup) - 1  # index of the window's start: the end of step first + 1
    return {"steps": len(steps), "measured_steps": [first + 2, len(steps)], **_figures([_window(steps, warmup)])}


def _window(steps: list[tuple[float, float, float]], warmup: int) -> tuple[int, float, float, float]:
    """(steps counted, wall s, CPU s, wall s inside ``train_step``) of :func:`measured`'s window over ``steps``."""
    first = window_start(warmup) - 1
    counted = len(steps) - 1 - first
    if counted <= 0:
        return 0, 0.0, 0.0, 0.0
    return (counted, steps[-1][1] - steps[first][1], steps[-1][2] - steps[first][2],
            sum(end - start for start, end, _ in steps[first + 1:]))


def _figures(windows: list[tuple[int, float, float, float]]) -> dict:
    """:func:`measured`'s rates over one or more :func:`_window` sums (pooled: total steps over total time)."""
    import torch

    counted, wall, cpu, inside = (sum(w[i] for w in windows) for i in range(4))
    return {"steps_per_s": counted / wall if wall > 0 else 0.0, "cpu_s_per_step": cpu / counted if counted > 0 else 0.0,
            "train_step_share": inside / wall if wall > 0 else 0.0, "threads": torch.get_num_threads()}


def interleaved_steps(warmup: int, steps: int, chunk: int, handover: int) -> int:
    """How many steps :func:`interleaved` counts per arm of a run of ``warmup + steps`` steps alternated every
    ``chunk`` (the first chunk's first ``max(warmup, handover)`` steps and every later chunk's first ``handover`` left
    out)."""
    n = warmup + steps
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    skips = [max(warmup, handover, 1)] + [max(handover, 1)] * (len(sizes) - 1)
    return sum(max(0, size - skip) for size, skip in zip(sizes, skips, strict=True))


def interleaved(chunks: list[list[tuple[float, float, float]]], warmup: int, handover: int) -> dict:
    """The figures of one arm of an interleaved worker from its chunks (each as :func:`measured` takes it): every
    chunk's window starts at the end of its step ``handover`` (the first chunk's at step ``max(warmup, handover)``),
    so the steps right after a switch, whose batches the reader read during the other arm's chunk, are not counted,
    and the rates pool the windows (total steps over total time). ``measured_steps``: [steps counted, chunks]."""
    windows = [_window(c, max(warmup, handover) if i == 0 else handover) for i, c in enumerate(chunks)]
    return {"steps": sum(map(len, chunks)), "measured_steps": [sum(w[0] for w in windows), len(chunks)],
            **_figures(windows)}


def _timed_session(cfg):
    """A :class:`~artcache.trainers.consumer.session.Session` whose ``train_step`` records its start and end
    (``perf_counter``) and its end's ``process_time`` in ``.timed``: the one clock and the one point of both
    arms."""
    from artcache.trainers.consumer.session import Session

    class TimedSession(Session):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.timed: list[tuple[float, float, float]] = []

        def train_step(self, batch, step_index):
            t0 = time.perf_counter()
            out = super().train_step(batch, step_index)
            t1 = time.perf_counter()
            self.timed.append((t0, t1, time.process_time() + _reader_cpu_s(self)))
            return out

    return TimedSession(cfg)


def _reader_cpu_s(s) -> float:
    """CPU seconds of ``s``'s reader process so far (``--reader process``; 0.0 without one): the CPU figures count the
    reading in both readers (a thread's is the process's own)."""
    cpu_s = getattr(getattr(s, "reader", None), "cpu_s", None)
    return cpu_s() if cpu_s is not None else 0.0


def held_batches(s) -> list:
    """Every batch of ``s``'s run, read from its root and collated now (positions 0 .. steps × batch - 1,
    in the consumer's order): what the in-memory arm trains on, outside the timed loop."""
    from artcache import store
    from artcache.client import Leased
    from artcache.fingerprint import PlanFingerprints
    from artcache.trainers.consumer.reader import collate

    fps = PlanFingerprints(s.settings.contract, s.plan)
    n, b = s.cfg.steps * s.cfg.batch_size, s.cfg.batch_size
    items = [Leased(p, store.read(s.layout, fps.of_sample(s.order.sample(p)), s.settings.contract), "")
             for p in range(n)]
    return [collate(items[i:i + b], s.device, s.layers) for i in range(0, n, b)]


def wait_for_go(barrier: Path, cid: str, timeout_s: float, phase: int = 0) -> None:
    """Mark ``cid`` ready under ``barrier`` and wait for the round's ``go`` (:func:`release_round`; ``phase`` 1:
    the second arm of a paired round, ``go1``).

    Raises:
        TimeoutError: no ``go`` within ``timeout_s``."""
    suffix = str(phase) if phase else ""
    (barrier / f"{cid}.ready{suffix}").touch()
    deadline = time.monotonic() + timeout_s
    while not (barrier / f"go{suffix}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{cid}: no go{suffix} under {barrier} within {timeout_s:g} s")
        time.sleep(0.01)


def fresh_barrier(out: Path, mode: str, k: int) -> Path:
    """The empty barrier directory of round ``k`` of ``mode`` under ``out`` (a previous run's ``go`` and
    ready marks removed: they would start this round before its consumers are built)."""
    barrier = out / "barriers" / f"{mode}-{k}"
    shutil.rmtree(barrier, ignore_errors=True)
    barrier.mkdir(parents=True)
    return barrier


def _stop_for(roles: dict, failed: Role | None, why: str) -> WorkerFailed:
    """Stop every worker of ``roles`` still running (SIGTERM, then SIGKILL after :data:`GRACE_S`) and the one-line
    :class:`WorkerFailed` to raise: ``failed`` (its exit status and log) or ``why`` (a timeout), then the workers
    stopped."""
    running = [r for r in roles.values() if r.poll() is None]
    stop_all(running, GRACE_S)
    stopped = f"; stopped {', '.join(r.name for r in running)}" if running else ""
    if failed is None:
        return WorkerFailed(f"{why}{stopped}")
    return WorkerFailed(f"worker {failed.name} exited {failed.code}{why} (log {failed.log}){stopped}")


def release_round(barrier: Path, roles: dict, timeout_s: float, phase: int = 0) -> None:
    """Once every worker of ``roles`` ({block: :class:`~artcache.launch.Role`}) is ready, write ``go``: the three
    consumers of a round begin their steps together in both arms, whatever their start-up took (``phase`` 1:
    ``go1``, the second arm of a paired round, once all three finished the first).

    Raises:
        WorkerFailed: a worker exited before it was ready, or ``timeout_s`` passed; the others are stopped first
            and no ``go`` is written."""
    suffix = str(phase) if phase else ""
    deadline = time.monotonic() + timeout_s
    while not all((barrier / f"{r.name}.ready{suffix}").exists() for r in roles.values()):
        dead = next((r for r in roles.values() if r.poll() is not None), None)
        if dead is not None:
            raise _stop_for(roles, dead, f" before it was ready under {barrier}")
        if time.monotonic() > deadline:
            raise _stop_for(roles, None, f"not every worker was ready under {barrier} within --timeout-s {timeout_s:g}")
        time.sleep(0.05)
    (barrier / f"go{suffix}").touch()


def wait_round(roles: dict, timeout_s: float, poll_s: float = 0.05) -> None:
    """Wait until every worker of ``roles`` ({block: :class:`~artcache.launch.Role`}) has exited 0.

    Raises:
        WorkerFailed: one exited nonzero (a failure, or killed: a negative status is the signal), or ``timeout_s``
            passed; every other worker still running is stopped (SIGTERM, then SIGKILL) before it is raised, so
            none trains on alone or outlives the bench."""
    deadline = time.monotonic() + timeout_s
    while any(r.poll() is None for r in roles.values()):
        failed = next((r for r in roles.values() if r.poll() not in (None, 0)), None)
        if failed is not None:
            raise _stop_for(roles, failed, "")
        if time.monotonic() > deadline:
            raise _stop_for(roles, None, f"the workers did not finish within --timeout-s {timeout_s:g}")
        time.sleep(poll_s)
    failed = next((r for r in roles.values() if r.code != 0), None)
    if failed is not None:
        raise _stop_for(roles, failed, "")


def figures_of(role: Role) -> dict:
    """The figures a worker that exited 0 printed: the last JSON line of its log (:func:`main`'s worker path).

    Raises:
        WorkerFailed: its log holds no such line."""
    lines = [ln for ln in role.log.read_text(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        raise WorkerFailed(f"worker {role.name} exited 0 but printed no figures (log {role.log})")
    return json.loads(lines[-1])


def machine_busy_s() -> float | None:
    """The whole machine's busy CPU seconds since boot (``/proc/stat``: user, nice, system, irq, softirq of
    every CPU; None where it cannot be read)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def other_cores(busy0: float | None, busy1: float | None, own_cpu_s: float, seconds: float) -> float | None:
    """The cores the machine's other processes kept busy over ``seconds``: the machine's busy CPU seconds
    between two :func:`machine_busy_s` readings less ``own_cpu_s`` (the bench's own processes), per second."""
    if busy0 is None or busy1 is None or seconds <= 0:
        return None
    return max(0.0, busy1 - busy0 - own_cpu_s) / seconds


def _cpu_s() -> float:
    """CPU seconds of this process and of its children reaped so far (user + system)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _interleave(s, arms: list[str], batches: list, warmup: int, chunk: int) -> dict[str, dict]:
    """Both arms in one process, alternated every ``chunk`` steps (``arms[0]`` first): the root arm is the consumer's
    own loop (:meth:`Session.step` after :meth:`Session.register`: reader thread, leases, cursor commits, journal),
    the memory arm ``Session.train_step`` on the held batches, on the one model. Slow spells of the machine (seconds
    long on shared VMs) then fall on both arms alike. Each arm's figures: :func:`interleaved` (its first
    ``prefetch_batches + 1`` steps after a switch not counted)."""
    from artcache import registry

    n, done = s.cfg.steps, {"root": 0, "memory": 0}
    chunks: dict[str, list] = {"root": [], "memory": []}
    s.register()
    try:
        while min(done.values()) < n:
            for arm in arms:
                s.timed = []
                for _ in range(min(chunk, n - done[arm])):
                    i = done[arm]
                    s.step(i) if arm == "root" else s.train_step(batches[i], i)
                    done[arm] += 1
                if s.timed:
                    chunks[arm].append(s.timed)
        s.state = registry.COMPLETED
    finally:
        s.close()
    handover = s.cfg.prefetch_batches + 1
    return {arm: interleaved(chunks[arm], warmup, handover) for arm in arms}


def worker(mode: str, spec: Path, warmup: int, barrier: Path, timeout_s: float,
           cpus: list[int] | None = None, chunk: int = 0) -> dict:
    """One consumer of one arm, or of both (``root+memory``, ``memory+root``: :data:`PAIRED`): build it (and, for
    ``memory``, read and collate its batches), wait for the round's go, then train — ``root``: the consumer's own
    loop on the root (register, reader thread, leases, cursor commits, journal); ``memory``: ``Session.train_step``
    alone on the held batches. A paired worker waits for ``go1`` between its two arms (the round's three consumers
    change arm together) and trains the second on the state the first left (the cost of a step does not depend
    on the weights). Returns {consumer_id, mode, warmup, cpu_s_at_go (this process's CPU seconds before the go:
    its start-up), **measured(...)}: the same figures, from the same clock, both arms; a paired worker the same
    with each arm's figures under ``arms``."""
    from artcache.trainers.consumer import ConsumerConfig

    if cpus:  # before torch starts its thread pools, which inherit the affinity
        os.sched_setaffinity(0, cpus)
    cfg = read_spec(spec, "consumer", ConsumerConfig)
    s = _timed_session(cfg)
    s.setup()  # reads the root, builds the draft, sets cfg.threads; registers nothing
    s.resume()
    arms = mode.replace("~", "+").split("+")
    batches = held_batches(s) if "memory" in arms else None
    wait_for_go(barrier, cfg.consumer_id, timeout_s)
    cpu_at_go = time.process_time()
    figures = {}
    if mode in INTERLEAVED:
        figures = _interleave(s, arms, batches, warmup, chunk)
    for phase, arm in enumerate(arms if mode not in INTERLEAVED else []):
        if phase:
            wait_for_go(barrier, cfg.consumer_id, timeout_s, phase)
        s.timed = []
        if arm == "root":
            s.register()
            s.run()
        else:
            for i, batch in enumerate(batches):
                s.train_step(batch, i)
        figures[arm] = measured(s.timed, warmup)
    head = {"consumer_id": cfg.consumer_id, "mode": mode, "warmup": warmup, "cpu_s_at_go": cpu_at_go,
            "cpus": sorted(os.sched_getaffinity(0)) if cpus else None}
    return {**head, **figures[mode]} if mode in MODES else {**head, "arms": figures}


def run_round(args, root: Path, out: Path, mode: str, k: int) -> dict[str, dict[int, dict]]:
    """One round of ``mode`` (``root``, ``memory``, or both arms in each process: :data:`PAIRED`): three processes
    at once, started together (:func:`release_round`; a paired round's second arm released once all three
    finished the first); arm → block → its :func:`worker`'s figures, each with the round's ``other_cores``
    (:func:`other_cores` from the go until the three exited, less their CPU after the go and the bench's:
    the machine's other load on this round; a paired round's value covers both its arms).

    Raises:
        WorkerFailed: a worker exited before its go, exited nonzero, or the round ran past ``--timeout-s``; no
            worker of the round is left running (also on any other error or Ctrl-C)."""
    roles: dict[int, Role] = {}
    logs = out / "logs"
    barrier = fresh_barrier(out, mode, k)
    sets = getattr(args, "cpu_sets", None) or [None] * len(args.blocks)
    try:
        for block, cpus in zip(args.blocks, sets, strict=True):  # a consumer's CPUs are the same in every round
            cid = f"dflash-b{block}-{mode.replace('+', '-').replace('~', '-')}-{k}"  # ids allow no "+" or "~"
            cfg = consumer_config(args, root, block, out / "runs" / cid, cid)
            spec = write_spec(out / "specs" / f"{cid}.consumer.json", "consumer", cfg)
            # the bench's process group (a terminal's Ctrl-C reaches them too), as before
            roles[block] = Role(cid, worker_command(mode, spec, args.warmup, barrier, args.timeout_s, cpus,
                                                    getattr(args, "chunk", 0)),
                                logs / f"{cid}.log", worker_env(cfg.threads), new_session=False)
        release_round(barrier, roles, args.timeout_s)
        busy0, t0, cpu0 = machine_busy_s(), time.monotonic(), _cpu_s()
        if mode in PAIRED:
            release_round(barrier, roles, args.timeout_s, phase=1)
        wait_round(roles, args.timeout_s)
        busy1, t1 = machine_busy_s(), time.monotonic()
    finally:  # whatever happened (an error, Ctrl-C): no worker of this round outlives it
        stop_all(roles.values(), GRACE_S)
    got = {block: figures_of(r) for block, r in roles.items()}
    # the three workers' CPU after the go (their whole lives, reaped above, less their start-ups) and the bench's
    own = _cpu_s() - cpu0 - sum(g["cpu_s_at_go"] for g in got.values())
    other = other_cores(busy0, busy1, own, t1 - t0)
    arms = {}
    for block, g in got.items():
        for arm, figures in (g.pop("arms") if mode in PAIRED + INTERLEAVED else {mode: {}}).items():
            arms.setdefault(arm, {})[block] = {**g, **figures, "mode": arm, "other_cores": other}
    return arms


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m artcache.bench.offline", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/offline")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--max-samples", type=int, default=200)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per consumer (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--blocks", default="4,8,16", help="DFlash block sizes, one consumer each")
    ap.add_argument("--rounds", type=int, default=2, help="root / memory rounds, alternated")
    ap.add_argument("--pairing", choices=("round", "process", "steps"), default="round",
                    help="round: each arm in processes of its own, rounds alternated; process: one process per "
                         "consumer runs both arms one after the other (order alternated per round), so the "
                         "process's own speed, which varies from one process to the next, cancels in the ratio; "
                         "steps: one process per consumer alternates the arms every --chunk steps, so the "
                         "machine's slow spells fall on both")
    ap.add_argument("--chunk", type=int, default=None,
                    help=f"--pairing steps only: steps of one arm between two switches (default {DEFAULT_CHUNK}; its "
                         "first 3 after a switch are not counted)")
    ap.add_argument("--pin", choices=("auto", "off"), default="auto",
                    help="auto: pin each consumer process to CPUS_PER_WORKER logical CPUs of physical cores of its "
                         "own (the same in every round and both arms) when the machine has enough; off: leave them "
                         "to the scheduler")
    ap.add_argument("--commit-interval", type=float, default=None,
                    help="the consumers' --commit-interval in seconds (0: a cursor commit after every step; default: "
                         "the consumer's own)")
    ap.add_argument("--reader", choices=("thread", "process"), default="thread",
                    help="the root arm's reader: a thread beside the trainer, or a process of its own "
                         "(consume --reader)")
    ap.add_argument("--threads", type=int, default=1, help="the producer's torch threads")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    # one timed consumer process (worker_command): its arm, the round's barrier directory, its consumer spec file
    ap.add_argument("--worker", choices=MODES + PAIRED + INTERLEAVED, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", help=argparse.SUPPRESS)
    ap.add_argument("--cpus", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap


def summarize(args, rounds: dict[str, list[dict[int, dict]]]) -> dict:
    """The report's figures from every round's worker figures: steps/s and CPU ms per step per round, the
    root/memory ratios (median over rounds; ``cpu_root_over_memory``: of steps per CPU second), the root
    arm's ``train_step`` share of its window (median over rounds: its rate over a loop that would do
    nothing else, from the same steps), the machine's other load in each round (``other_cores``), the
    threads and measured steps of both arms (they must match)."""
    pairs = list(zip(rounds["root"], rounds["memory"], strict=True))
    med = statistics.median

    def seen(key: str) -> dict[str, list]:
        return {mode: sorted({json.dumps(r[b][key]) for r in rs for b in r}) for mode, rs in rounds.items()}

    return {
        "rounds": {mode: [{f"B{b}": v["steps_per_s"] for b, v in r.items()} for r in rs]
                   for mode, rs in rounds.items()},
        "cpu_ms_per_step": {mode: [{f"B{b}": 1000 * v["cpu_s_per_step"] for b, v in r.items()} for r in rs]
                            for mode, rs in rounds.items()},
        "root_over_memory": {f"B{b}": med(r[b]["steps_per_s"] / m[b]["steps_per_s"] for r, m in pairs)
                             for b in args.blocks},
        "cpu_root_over_memory": {f"B{b}": med(m[b]["cpu_s_per_step"] / r[b]["cpu_s_per_step"] for r, m in pairs)
                                 for b in args.blocks},
        "train_step_share": {mode: [{f"B{b}": v["train_step_share"] for b, v in r.items()} for r in rs]
                             for mode, rs in rounds.items()},
        "root_train_step_share": {f"B{b}": med(r[b]["train_step_share"] for r in rounds["root"]) for b in args.blocks},
        "other_cores": {mode: [next(iter(r.values()))["other_cores"] for r in rs] for mode, rs in rounds.items()},
        "threads": seen("threads"), "measured_steps": seen("measured_steps"),
    }


def check_out(out: Path) -> None:
    """``--out`` must be a directory to be made, or one holding nothing of an earlier run (:data:`WRITTEN`): its
    ``runs/`` hold the earlier consumers' checkpoints, which a new consumer refuses to train over, and its report
    and logs are results to keep, so they are never removed here.

    Raises:
        ConfigError: ``out`` is a file, or holds an earlier run's files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not accepted: a file, not a directory")
    earlier = [name for name in WRITTEN if (out / name).exists()]
    if earlier:
        raise ConfigError(f"--out {out} is not accepted: it holds an earlier run ({', '.join(earlier)}); give another "
                          f"--out, or remove {out} first")


def check_args(args) -> None:
    """Refuse bad flags before anything is written (``args.blocks`` parsed into a list of ints here).

    Raises:
        ConfigError: one line naming the bad values and what is accepted."""
    try:
        args.blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        raise ConfigError(f"--blocks {args.blocks!r} is not accepted: comma-separated block sizes (4,8,16)") from None
    bad = [f"--{k} {getattr(args, k)}" for k in ("rounds", "steps") if getattr(args, k) < 1]
    bad += [f"--blocks {b}" for b in args.blocks if b < 1] + ([f"--warmup {args.warmup}"] if args.warmup < 0 else [])
    if bad:
        raise ConfigError(f"{', '.join(bad)} is not accepted: --rounds, --steps and block sizes at least 1, --warmup "
                          "at least 0")
    if args.chunk is not None and args.pairing != "steps":
        raise ConfigError(f"--chunk {args.chunk} is not accepted with --pairing {args.pairing}: it goes with --pairing "
                          "steps")
    if args.pairing == "steps":
        from artcache.trainers.consumer import ConsumerConfig

        args.chunk = DEFAULT_CHUNK if args.chunk is None else args.chunk
        if args.chunk < MIN_CHUNK:
            raise ConfigError(f"--chunk {args.chunk} is not accepted: with --pairing steps at least {MIN_CHUNK} (the "
                              "first 3 steps after a switch are not counted)")
        handover = ConsumerConfig(cache="-").prefetch_batches + 1  # the bench's consumers keep the default
        counted = interleaved_steps(args.warmup, args.steps, args.chunk, handover)
        if counted < MIN_MEASURED:
            raise ConfigError(f"--warmup {args.warmup} --steps {args.steps} --chunk {args.chunk} is not accepted with "
                              f"--pairing steps: it measures {counted} steps per arm (the first max(--warmup, "
                              f"{handover}) steps of the first chunk and {handover} of every later one are not "
                              f"counted); at least {MIN_MEASURED}: raise --steps")
    from artcache.trainers.consumer.config import MAX_COMMIT_INTERVAL_S

    if args.commit_interval is not None and not 0 <= args.commit_interval <= MAX_COMMIT_INTERVAL_S:
        raise ConfigError(f"--commit-interval {args.commit_interval:g} is not accepted: seconds in 0 .. "
                          f"{MAX_COMMIT_INTERVAL_S:g}")
    if measured_steps(args.warmup, args.steps) < MIN_MEASURED:
        raise ConfigError(f"--warmup {args.warmup} --steps {args.steps} is not accepted: it measures "
                          f"{measured_steps(args.warmup, args.steps)} steps (the end of step max(--warmup, 1) starts "
                          f"the window); at least {MIN_MEASURED}: with --warmup 0, --steps at least {MIN_MEASURED + 1}")
    if args.warmup + args.steps > args.max_samples:
        raise ConfigError(f"--warmup + --steps ({args.warmup + args.steps}) is not accepted: at most --max-samples "
                          f"{args.max_samples} (each consumer reads one pass)")
    check_out(Path(args.out).absolute())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        from artcache.logs import setup_logging

        setup_logging(False)
        cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
        print(json.dumps(worker(args.worker, Path(args.spec), args.warmup, Path(args.barrier), args.timeout_s, cpus,
                                args.chunk)))
        return 0
    try:
        check_args(args)
        # the first SIGTERM / Ctrl-C interrupts the bench: the round's finally stops its workers (SIGTERM, then
        # SIGKILL) before it exits
        with GracefulShutdown("bench.offline", asked="stopping the round's workers now",
                              on_request=_interrupt):
            return run(args, argv)
    except ArtcacheError as exc:  # bad input (exit 2) or a failed worker (exit 1): one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: stopped by a signal; the round's workers were stopped, no report written", file=sys.stderr)
        return 130


def _interrupt(signum: int) -> None:
    """:class:`GracefulShutdown`'s ``on_request`` of the bench: unwind at once (the workers are stopped by the
    round's ``finally``; a measurement cannot finish early)."""
    raise KeyboardInterrupt(f"signal {signum}")


def run(args, argv: list[str] | None) -> int:
    """The whole bench on checked ``args`` (:func:`check_args`): the fill, the refill, the rounds, ``report.json``;
    0 when every check passed, 1 otherwise.

    Raises:
        WorkerFailed: a worker of a round failed, was killed or timed out (the others stopped)."""
    out = Path(args.out).absolute()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    root = out / "cache"
    cores = physical_cores()
    args.cpu_sets = cpu_sets(len(args.blocks), CPUS_PER_WORKER, cores) if args.pin == "auto" else None
    report: dict = {**record("artcache.bench.offline", argv, roots=[out]),
                    "settings": {k: v for k, v in vars(args).items()
                                 if k not in ("worker", "barrier", "spec", "cpus", "cpu_sets")}}
    report["pinning"] = {"logical_cpus": sum(map(len, cores)), "physical_cores": len(cores),
                         "cpu_sets": {f"B{b}": c for b, c in zip(args.blocks, args.cpu_sets, strict=True)}
                         if args.cpu_sets else None,
                         "why_not": None if args.cpu_sets else "--pin off" if args.pin == "off" else
                         f"{len(cores)} physical cores, fewer than {len(args.blocks)} consumers x {CPUS_PER_WORKER}"}
    for name in ("fill", "refill"):
        report[name] = fill(args, root, out / "logs", name)
        if report[name]["exit_code"] != 0:  # no round can run on a root the fill did not complete
            raise WorkerFailed(f"artcache producer --fill ({name}) exited {report[name]['exit_code']}; its log: "
                               f"{out / 'logs' / f'{name}.log'}")
    captures_before = account(CacheLayout(root)).cache.captures
    rounds: dict[str, list[dict[int, dict]]] = {"root": [], "memory": []}
    for k in range(args.rounds):
        order = MODES if k % 2 == 0 else MODES[::-1]
        for mode in order if args.pairing == "round" else ["~".join(order) if args.pairing == "steps" else
                                                            "+".join(order)]:
            for arm, last in run_round(args, root, out, mode, k).items():
                rounds[arm].append(last)
                got = ", ".join(f"B{b} {r['steps_per_s']:.3f} steps/s ({1000 * r['cpu_s_per_step']:.0f} CPU ms/step)"
                                for b, r in last.items())
                other = next(iter(last.values()))["other_cores"]
                print(f"round {k} {arm}: {got}; other processes {'-' if other is None else f'{other:.2f}'} cores",
                      flush=True)
    acc = account(CacheLayout(root))
    report.update(summarize(args, rounds))
    ratios = report["root_over_memory"]
    report.update({
        "captures_while_consumers_ran": acc.cache.captures - captures_before,
        "producer_running": False,
        "accounting_violations": acc.violations,
        "checks": {"fill_exit_0": report["fill"]["exit_code"] == 0 and report["refill"]["exit_code"] == 0,
                   "refill_captures_nothing": report["refill"]["captures"] == 0,
                   "no_capture_while_consumers_ran": acc.cache.captures == captures_before,
                   "same_threads_and_steps_in_both_arms": report["threads"]["root"] == report["threads"]["memory"]
                   and report["measured_steps"]["root"] == report["measured_steps"]["memory"],
                   f"every_consumer_ge_{GOAL}_of_in_memory": all(v >= GOAL for v in ratios.values()),
                   "accounting_invariants": not acc.violations},
    })
    atomic_write(out / "report.json", [json.dumps(report, indent=2).encode()], out, durable=False)
    shown = ("fill", "refill", "pinning", "root_over_memory", "cpu_root_over_memory", "root_train_step_share",
             "other_cores", "threads", "measured_steps", "captures_while_consumers_ran", "checks")
    print(json.dumps({k: report[k] for k in shown}, indent=2))
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
