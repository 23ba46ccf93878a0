"""Run bench scenarios: fresh cache root, one producer process, N consumer processes, a report.

Each scenario gets ``<out>/<scenario>/`` holding ``cache/`` (a fresh root), ``logs/``, ``runs/``
(consumer checkpoints), ``report.json``, ``report.md`` and ``progress.png``. ``<out>/report.json`` is the run's
own (:func:`write_run_report`): each scenario's status, checks and the path of its report.

Modes (``--modes``), run one after the other in the same invocation, each on fresh roots and with
the same consumers, settings and step counts:

* ``artcache``: one producer, one root, consumers independent (the system under test; its checks
  decide the exit status). Output directly under ``<out>/<scenario>/``.
* ``naive``: nothing shared: one producer and one root per consumer (``naive/cache-<id>/``).
* ``lockstep``: one producer and one root, consumers bound to one shared cursor
  (``ConsumerConfig.lockstep_group``: a position is read only once every consumer committed the
  batches before it), as when one data loader drives every trainer (``lockstep/cache/``).

With baselines the report adds ``modes`` (per mode: producer captures per consumed position, each
consumer's steady steps/s, the aggregate) and ``comparison`` (the verdict: artcache against
``naive`` on captures, against ``lockstep`` on the fast consumer's steps/s), plus ``modes.png``.

Retention modes (the ``hetero`` scenario runs them by default):

* ``windows``: as ``artcache`` but the producer keeps only the live windows (no ``--disk-budget``: the
  windows-only rule, the producer's default): the before of the before/after.
* ``tight``: as ``artcache`` with a disk budget of the live windows' floor (:func:`window_floor`, which the
  retention guarantee holds whatever the budget) plus ``--budget-fraction`` of the room between it and the
  budget that covers the run: too small for the fast consumer's lead, so the budget binds (recaptures rise; the
  report says it binds), yet above what the guarantee pins, so it can be kept.
* ``solo``: the scenario's fast consumer alone on its own root: its rate alone, against its rate in ``artcache``.

``artcache`` and ``solo`` get a budget that covers the run (every position any consumer reads, at the longest
sample's size) unless ``--disk-budget`` says otherwise; the 1p1c/1p3c scenarios keep the producer's default, the
windows-only rule (:func:`artcache.eviction.retention_rule`), unless ``--disk-budget`` is given.

Disk (``--save``, :data:`SAVE_POLICIES`): each consumer ends with the final checkpoint a real run writes,
weights only by default (``weights``: the bench never resumes, and AdamW's state is two thirds of an
fp32 draft's checkpoint), with its optimizer state (``full``) or none at all (``none``). Once a mode's
journals have been read, :func:`clean_mode` removes what it wrote in bulk — its consumers' checkpoints and
the artifacts left in its roots — before the next mode starts, keeping logs, journals, registrations,
plans and metrics, and writes ``removed.json`` (every path removed and its bytes) beside them. Each
mode's ``disk`` (:func:`disk_summary`) gives the bytes it wrote: checkpoints, artifacts published, the
artifacts' peak and what was left at the end. Before any scenario starts, :func:`preflight_disk` sizes
every mode (consumers' checkpoints + retention bounds of artifacts) and refuses the run in one line (exit 2)
unless the largest fits in the free space; report.json's ``disk_plan`` keeps that plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import shutil
import signal
import stat
import subprocess
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from artcache import journal as J
from artcache.accounting import account
from artcache.bench.metrics import scenario_figures
from artcache.bench.plots import gpu_plot, modes_plot, progress_plot
from artcache.bench.progress import ModeProgress
from artcache.bench.scenarios import ConsumerSpec, Scenario, resolve
from artcache.errors import ConfigError, InsufficientSpace
from artcache.eviction import retention_rule
from artcache.fsio import atomic_write, free_space, space_reserve
from artcache.launch import Role, cli_argv, kill_all, role_env, wait_for_file
from artcache.layout import CacheLayout
from artcache.producer import ProducerConfig
from artcache.ranges import DiskBudget, check_value
from artcache.report import format_bytes, table
from artcache.rolespec import write_spec
from artcache.store import artifact_bytes_bound
from artcache.telemetry import make_sampler

LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
MODES = ("artcache", "naive", "lockstep", "windows", "tight", "solo")
#: goals of the hetero scenario
HETERO_GOALS = {"captures_per_consumed_position": 1.05, "speed_ratio": 1.5, "fast_vs_solo": 0.95}
#: ``--save``: what each consumer's final checkpoint holds (``none``: no checkpoint at all)
SAVE_POLICIES = ("none", "weights", "full")


#: the bench's per-device defaults, in one place (``artcache bench`` flags, ``[bench]`` config fields and
#: :class:`BenchConfig` leave these unset; :func:`resolved` fills them in): warm-up and measured steps per
#: consumer, DFlash anchors per sequence. A scenario may set its own steps / max_length per device.
DEVICE_DEFAULTS = {"cpu": {"warmup": 3, "steps": 15, "anchors": 64},
                   "cuda": {"warmup": 30, "steps": 150, "anchors": 256}}
DEFAULT_MAX_LENGTH = 512


@dataclass
class BenchConfig:
    """One ``artcache bench`` invocation. ``None`` (``0`` for ``max_length``) = the default for the
    device and scenario (:data:`DEVICE_DEFAULTS`, the scenario's own, else :data:`DEFAULT_MAX_LENGTH`),
    filled in by :func:`resolved`."""

    scenario: str = "1p3c"
    device: str = "cpu"
    out_dir: str = "bench-out"
    warmup: int | None = None
    steps: int | None = None
    target: str = "smollm2-135m-instruct"
    dataset: str = "sharegpt"
    max_length: int = 0
    max_samples: int = 2000
    anchors: int | None = None
    batch_size: int = 1
    window: str = ""  # "": the scenario's default, else 64:256
    allow_shared_gpu: bool = False
    draft_layers: int = 5
    timeout_s: float = 1800.0
    modes: str = ""  # comma-separated subset of MODES; "" = parse_modes' default for the scenario
    disk_budget: int = 0  # bytes for the artcache/solo producers (0: the run's covering budget for hetero)
    budget_fraction: float = 0.25  # the tight mode's budget: window floor + this share of (covering - floor)
    save: str = "weights"  # one of SAVE_POLICIES
    consumer_ranks: int = 1  # ranks of every consumer: a torch.distributed group (gloo on cpu), one consumer each


def resolved(cfg: BenchConfig, sc: Scenario) -> BenchConfig:
    """``cfg`` with the device's and the scenario's defaults filled in (window, warm-up, steps, anchors,
    max_length). ConfigError for a device with no defaults."""
    dev = "cuda" if cfg.device.startswith("cuda") else cfg.device
    if dev not in DEVICE_DEFAULTS:
        raise ConfigError(f"--device {cfg.device!r} is not accepted: use cpu or cuda")
    base = DEVICE_DEFAULTS[dev]
    window = cfg.window or sc.window or "64:256"
    steps = cfg.steps if cfg.steps is not None else (sc.steps or {}).get(dev, base["steps"])
    max_length = cfg.max_length or (sc.max_length or {}).get(dev, DEFAULT_MAX_LENGTH)
    return replace(cfg, window=window, steps=steps, max_length=max_length,
                   warmup=cfg.warmup if cfg.warmup is not None else base["warmup"],
                   anchors=cfg.anchors if cfg.anchors is not None else base["anchors"])


def _check_environment(cfg: BenchConfig, n_roles: int) -> list[int]:
    """Refuse distributed launchers and shared GPUs; return the GPU index per role (producer first)."""
    found = [v for v in LAUNCHER_VARS if v in os.environ]
    if found:
        raise ConfigError(f"artcache bench must not run under a distributed launcher ({', '.join(found)} set): "
                          "consumers are independent processes, started by the bench itself")
    if cfg.device == "cpu":
        return []
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu")
    if n < n_roles and cfg.consumer_ranks > 1:
        raise ConfigError(f"{n_roles} roles and ranks need {n_roles} GPUs but {n} are visible: each rank of a "
                          f"consumer group needs a GPU of its own (--consumer-ranks {cfg.consumer_ranks})")
    if n < n_roles and not cfg.allow_shared_gpu:
        raise ConfigError(f"{n_roles} roles need {n_roles} GPUs but {n} are visible; pass --allow-shared-gpu "
                          "to put several roles on one GPU (reported on every line)")
    return [i % n for i in range(n_roles)]


def _roles(cfg: BenchConfig, sc: Scenario) -> int:
    """Devices one mode of ``sc`` uses at most: its producers and every consumer's ranks (naive: a producer per
    consumer)."""
    ranks = cfg.consumer_ranks
    return max((ranks + (m == "naive")) * len(sc.consumers) + (m != "naive")
               for m in parse_modes(cfg.modes, sc, ranks))


def _check_fresh(path: Path) -> None:
    """ConfigError unless ``path`` is absent, empty or a previous bench output (which the run replaces)."""
    if path.exists() and any(path.iterdir()) and not (path / "report.json").exists() \
            and not (path / "cache").exists():
        raise ConfigError(f"{path} exists and is not a previous bench output; choose another --out")


def _fresh_dir(path: Path) -> None:
    _check_fresh(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def parse_modes(text: str, sc: Scenario, consumer_ranks: int = 1) -> tuple[str, ...]:
    """``--modes`` text → the modes to run for ``sc``, in :data:`MODES` order.

    Empty text: every mode for a scenario of several consumers, ``artcache`` alone for one (with one
    consumer the baselines are artcache itself); with ``consumer_ranks`` > 1 (``--consumer-ranks``) every mode but
    ``lockstep`` (a lockstep baseline is a set of one-process consumers). Raises ConfigError naming an unknown
    mode, ``lockstep`` with several ranks, or a list without ``artcache`` (the baselines are compared against it).
    """
    if not text.strip():
        if sc.modes:
            modes = tuple(m for m in MODES if m in sc.modes)
        else:
            modes = ("artcache", "naive", "lockstep") if len(sc.consumers) > 1 else ("artcache",)
        return tuple(m for m in modes if m != "lockstep" or consumer_ranks == 1)
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad:
        raise ConfigError(f"--modes {text!r}: unknown mode(s) {', '.join(bad)}; accepted: a comma-separated "
                          f"subset of {','.join(MODES)}")
    if "artcache" not in names:
        raise ConfigError(f"--modes {text!r} must include artcache: the baselines are compared against it")
    if "lockstep" in names and consumer_ranks > 1:
        raise ConfigError(f"--modes {text!r} with --consumer-ranks {consumer_ranks}: lockstep runs one-process "
                          "consumers only; leave lockstep out or use --consumer-ranks 1")
    return tuple(m for m in MODES if m in names)


def _producers(base: Path, mode: str, sc: Scenario) -> list[tuple[str, Path, tuple[ConsumerSpec, ...]]]:
    """(producer id, cache root, consumers it serves) for each producer of ``mode``."""
    if mode == "naive":
        return [(f"producer-{c.consumer_id}", base / "naive" / f"cache-{c.consumer_id}", (c,))
                for c in sc.consumers]
    if mode == "solo":
        return [("producer", base / "solo" / "cache", (fast_consumer(sc),))]
    return [("producer", (base if mode == "artcache" else base / mode) / "cache", sc.consumers)]


#: ``--done-grace`` of a producer whose ``--expect-consumers`` does not count every consumer it serves (several
#: consumers with staggered starts): how long it waits for a sibling that has not registered yet
STAGGERED_DONE_GRACE_S = 5.0


def producer_exit(served: tuple[ConsumerSpec, ...], staggered: bool) -> dict:
    """A bench producer's exit settings (:class:`~artcache.producer.ProducerConfig` fields): ``exit_when_done``,
    ``expect_consumers`` and ``done_grace_s`` (``--exit-when-done``, ``--expect-consumers``, ``--done-grace``).

    ``--exit-when-done`` exits once at least ``--expect-consumers`` consumers registered (any state) and none has
    been live for ``--done-grace`` seconds; the grace only waits for a consumer that has not registered yet. When
    ``--expect-consumers`` counts every consumer the producer serves (consumers started together, or one served
    alone), "done" cannot hold before each of them registered, so the grace is 0 and the producer leaves on its
    first idle pass after the last one ended (5 s in every mode used to idle 20 s of the CPU bench's
    ``--scenario all``). Several staggered consumers get a start line of 1 (capture for the first at once), so a
    later one is waited for by :data:`STAGGERED_DONE_GRACE_S` only, as before."""
    expect = 1 if staggered else len(served)
    grace = 0.0 if expect >= len(served) else STAGGERED_DONE_GRACE_S
    return {"exit_when_done": True, "done_grace_s": grace, "expect_consumers": expect}


def fast_consumer(sc: Scenario) -> ConsumerSpec:
    """The consumer marked ``fast`` (else the first), started at once when it runs alone."""
    fast = next((c for c in sc.consumers if c.fast), sc.consumers[0])
    return replace(fast, start_s=0.0)


def capture_layers(cfg: BenchConfig, sc: Scenario) -> list[int] | None:
    """The producer's ``--layer-ids`` when a consumer is not DFlash (the union of every consumer's layers), else
    None (``--draft-layers``)."""
    if all(c.draft == "dflash" for c in sc.consumers):
        return None
    from artcache.layer_ids import dflash_layer_ids, eagle3_capture_ids
    from artcache.target import resolve_target

    n = resolve_target(cfg.target).num_layers
    ids = set(dflash_layer_ids(n, cfg.draft_layers)) if any(c.draft == "dflash" for c in sc.consumers) else set()
    ids |= set(eagle3_capture_ids(n)) if any(c.draft == "eagle3" for c in sc.consumers) else set()
    return sorted(ids)


def _sample_bytes(cfg: BenchConfig, sc: Scenario) -> int:
    """Bytes of one artifact of ``max_length`` tokens: the captured layers in bfloat16 plus 16 KiB of header."""
    from artcache.layer_ids import dflash_layer_ids
    from artcache.target import resolve_target

    info = resolve_target(cfg.target)
    layers = capture_layers(cfg, sc) or dflash_layer_ids(info.num_layers, cfg.draft_layers)
    return (16 << 10) + cfg.max_length * (len(layers) * info.hidden_size * 2 + 5)


def covering_budget(cfg: BenchConfig, sc: Scenario) -> int:
    """Bytes that hold every position of the run at the longest sample's size: a budget that covers any lead
    (``(warmup + steps) × consumer ranks × batch size`` artifacts of ``max_length`` tokens, the captured layers in
    bfloat16, plus 16 KiB of header each)."""
    return (cfg.warmup + cfg.steps) * cfg.consumer_ranks * cfg.batch_size * _sample_bytes(cfg, sc)


def window_floor(cfg: BenchConfig, sc: Scenario) -> int:
    """Bytes the retention guarantee holds whatever the budget: every consumer's live window (``lookbehind +
    lookahead + 1`` positions, at most the run's) plus one capture batch per consumer (demand in flight), at
    the longest sample's size. A budget below it cannot be kept (docs/scheduler.md: the guarantee wins)."""
    from artcache.trainers.consumer import parse_window

    lookbehind, lookahead = parse_window(cfg.window)
    step = cfg.consumer_ranks * cfg.batch_size  # positions one optimizer step consumes (every rank's slice)
    run = (cfg.warmup + cfg.steps) * step
    per_consumer = min(lookbehind + lookahead + 1, run) + step
    return len(sc.consumers) * per_consumer * _sample_bytes(cfg, sc)


def mode_budget(cfg: BenchConfig, sc: Scenario, mode: str) -> int:
    """The ``--disk-budget`` of ``mode``'s producer (0: none, the producer's default windows-only rule; always for
    the ``windows`` mode). ``tight``: the window floor
    plus ``budget_fraction`` of the room between it and the covering budget, so it is too small for the
    lead yet keepable (regression: 0.25 × the covering budget fell below the live windows of ``--window
    64:512`` on the H200 and was exceeded by design, failing ``tight_budget_binds_and_is_kept``)."""
    covering = cfg.disk_budget or covering_budget(cfg, sc)
    if mode == "tight":
        floor = window_floor(cfg, sc)
        return int(floor + cfg.budget_fraction * max(0, covering - floor))
    if mode in ("artcache", "solo") and (cfg.disk_budget or sc.modes):
        return covering
    return 0


def check_tight_budget(cfg: BenchConfig, sc: Scenario, modes: list[str]) -> None:
    """ConfigError when ``tight`` is run but its budget cannot bind and be kept: the live windows already reach
    the budget it lies under (the covering one, or ``--disk-budget``), or it holds the whole run itself (a
    ``--disk-budget`` above the covering one; regression: it never bound and the run failed at its end)."""
    if "tight" not in modes:
        return
    run = covering_budget(cfg, sc)
    floor, ceiling = window_floor(cfg, sc), cfg.disk_budget or run
    windows = f"the live windows (--window {cfg.window}, {len(sc.consumers)} consumers: {format_bytes(floor)})"
    if floor >= ceiling:
        if cfg.disk_budget:
            raise ConfigError(
                f"--modes tight: {windows} reach --disk-budget {format_bytes(ceiling)}, so no budget under it is "
                "kept; use a larger --disk-budget (or none), a smaller --window, or leave tight out of --modes")
        raise ConfigError(
            f"--modes tight: {windows} hold the whole run ({format_bytes(run)}), so no budget binds and is "
            "kept; use a smaller --window, more --steps, or leave tight out of --modes")
    tight = mode_budget(cfg, sc, "tight")
    if tight >= run:
        raise ConfigError(
            f"--modes tight: its budget ({format_bytes(tight)}: {windows} + --budget-fraction {cfg.budget_fraction} "
            f"of the room up to --disk-budget {format_bytes(ceiling)}) holds the whole run ({format_bytes(run)}), so "
            "it never binds; use a smaller --disk-budget (or none) or --budget-fraction, or leave tight out of --modes")


def mode_retention(cfg: BenchConfig, sc: Scenario, mode: str) -> str:
    """The retention rule of ``mode``'s producer, as the producer derives it from its ``--disk-budget``
    (:func:`mode_budget`; :func:`artcache.eviction.retention_rule`): ``need`` with a budget, else ``windows``."""
    return retention_rule(mode_budget(cfg, sc, mode))


@dataclass
class ModeRun:
    """What one mode left behind: its roots' journal events (concatenated) and accounting."""

    mode: str
    roots: list[Path]
    codes: dict[str, int | None]  # role (producer id or consumer id) -> exit status
    wall_s: float
    events: list
    accounts: list
    cpu_s: float = 0.0  # user + system CPU seconds of the mode's processes (getrusage of waited children)
    #: what :func:`clean_mode` found and removed: {"checkpoints": [(path, bytes)], "artifacts": [(path, bytes)]}
    removed: dict = dataclasses.field(default_factory=dict)
    #: what :func:`plan_disk` expected before the consumers started
    planned: dict = dataclasses.field(default_factory=dict)


def run_mode(cfg: BenchConfig, sc: Scenario, base: Path, mode: str, gpus: list[int], sampler=None,
             sizes: dict | None = None) -> ModeRun:
    """Start the producer(s) of ``mode``, then its consumers; wait for all of them; read the journals.

    Every role is started as ``artcache producer --spec FILE`` / ``artcache consume --spec FILE`` from the
    :class:`~artcache.producer.ProducerConfig` / :class:`ConsumerConfig` built here (spec files in ``<mode
    dir>/specs``, :mod:`artcache.rolespec`), the consumers' the same in every mode but for ``cache`` and
    ``lockstep_group``. Roles get GPUs producers first, then consumers.
    Before the consumers start, :func:`plan_disk` checks that the mode's checkpoints and artifacts fit
    (``sizes`` caches the consumers' checkpoint sizes across modes).

    Raises:
        InsufficientSpace: the mode would not fit on its disk (its producers are stopped first).
    """
    work = base if mode == "artcache" else base / mode
    logs = work / "logs"
    logs.mkdir(parents=True)
    producers = _producers(base, mode, sc)
    specs = work / "specs"
    layers = capture_layers(cfg, sc)
    budget = mode_budget(cfg, sc, mode)
    staggered = any(c.start_s > 0 for c in sc.consumers)
    env = role_env()
    cpu = cfg.device == "cpu"
    dev = (lambda i: "cpu") if cpu else (lambda i: f"cuda:{gpus[i]}")
    # the roles share the bench's process group (a terminal's Ctrl-C reaches them too), as they always did
    procs: dict[str, Role] = {}
    codes: dict[str, int | None] = {}
    if sampler is not None:
        sampler.start()
    t_start = time.monotonic()  # durations: the monotonic clock
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        for i, (pid, root, served) in enumerate(producers):
            spec = ProducerConfig(
                cache=str(root), producer_id=pid, target=cfg.target, dataset=cfg.dataset, max_length=cfg.max_length,
                max_samples=cfg.max_samples, layer_ids=layers, draft_layers=cfg.draft_layers, device=dev(i),
                disk_budget=budget, threads=1 if cpu else 0,  # no budget: the windows-only rule
                **producer_exit(served, staggered))
            procs[pid] = Role(pid, cli_argv("producer", "--spec", str(write_spec(specs / f"{pid}.producer.json",
                                                                                 "producer", spec))),
                              logs / f"{pid}.log", env, new_session=False)
        for pid, root, _ in producers:
            wait_for_file(root / "artcache.json", procs[pid], cfg.timeout_s)  # the producer initialised the root
        n_served = sum(len(served) for _, _, served in producers)
        ranks, first = cfg.consumer_ranks, len(producers)  # each consumer's ranks get GPUs of their own
        order = consumer_configs(cfg, sc, work, mode, [(root, served) for _, root, served in producers],
                                 [dev(first + j * ranks) for j in range(n_served)],
                                 None if cpu or ranks == 1 else
                                 [gpus[first + j * ranks:first + (j + 1) * ranks] for j in range(n_served)])
        ccfgs: dict[Path, list] = {}
        for _, root, ccfg in order:
            ccfgs.setdefault(root, []).append(ccfg)
        planned = plan_disk(cfg, f"{sc.name} mode {mode}", work, ccfgs, sizes if sizes is not None else {},
                            budget=budget, retention=mode_retention(cfg, sc, mode))
        t_first = time.monotonic()
        for start_s, _, ccfg in order:
            time.sleep(max(0.0, t_first + start_s - time.monotonic()))  # staggered starts
            spec = write_spec(specs / f"{ccfg.consumer_id}.consumer.json", "consumer", ccfg)
            procs[ccfg.consumer_id] = Role(ccfg.consumer_id, cli_argv("consume", "--spec", str(spec)),
                                           logs / f"{ccfg.consumer_id}.log", env, new_session=False)
        deadline = time.monotonic() + cfg.timeout_s
        served_ids = [c.consumer_id for _, _, served in producers for c in served]
        waiting = [c.consumer_id for c in sc.consumers if c.consumer_id in served_ids]
        # the terminal says what happens: each consumer's steps and the captures, from the roots' journals
        progress = ModeProgress(mode, [root for _, root, _ in producers], {c.consumer_id: c.steps for _, _, c in order})
        try:
            while any(procs[cid].poll() is None for cid in waiting):
                progress.poll()
                if time.monotonic() > deadline:
                    late = next(cid for cid in waiting if procs[cid].poll() is None)
                    raise subprocess.TimeoutExpired(procs[late].popen.args, cfg.timeout_s)
                time.sleep(0.5)
        finally:
            progress.close()
        for cid in waiting:
            codes[cid] = procs[cid].wait(timeout=60)
        for pid, _, _ in producers:
            try:
                codes[pid] = procs[pid].wait(timeout=60)
            except subprocess.TimeoutExpired:
                procs[pid].signal(signal.SIGTERM)
                codes[pid] = procs[pid].wait(timeout=60)
    finally:
        if sampler is not None:
            sampler.stop()
        kill_all(procs.values())
    wall = time.monotonic() - t_start
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    roots = [root for _, root, _ in producers]
    events = [ev for root in roots for ev in J.read_events(CacheLayout(root).journal).events]
    return ModeRun(mode, roots, codes, wall, events, [account(CacheLayout(root)) for root in roots], cpu,
                   planned=planned)


def consumer_configs(cfg: BenchConfig, sc: Scenario, work: Path, mode: str,
                     served: list[tuple[Path, tuple[ConsumerSpec, ...]]],
                     devices: list[str], rank_devices: list[list[int]] | None = None
                     ) -> list[tuple[float, Path, object]]:
    """(start offset in s, cache root, :class:`ConsumerConfig`) of every consumer of ``mode``, in start order
    (offset, then role). ``served``: (root, its consumers) per producer, in :func:`_producers` order;
    ``devices``: one per consumer in that order; ``rank_devices``: on CUDA with ``cfg.consumer_ranks`` > 1, the
    GPU indices of each consumer's ranks (its ``devices``). Every consumer has ``cfg.consumer_ranks`` ranks. The
    same settings in every mode; only ``cache`` and ``lockstep_group`` differ. ``cfg`` is the scenario's
    :func:`resolved` config."""
    from artcache.trainers.consumer import ConsumerConfig, parse_window
    from artcache.trainers.consumer.config import draft_options

    lookbehind, lookahead = parse_window(cfg.window)
    group = ",".join(c.consumer_id for c in sc.consumers) if mode == "lockstep" else ""
    layers = capture_layers(cfg, sc)
    starts = [(c.start_s, role, root, c) for role, (root, c) in
              enumerate((root, c) for root, consumers in served for c in consumers)]
    out = []
    for start_s, role, root, c in sorted(starts, key=lambda x: (x[0], x[1])):
        extra = {"draft_layers": cfg.draft_layers} if layers and c.draft == "dflash" else {}
        # each draft's own options only: a consumer refuses another draft's
        opts = {"block_size": c.block_size, "num_anchors": c.anchors or cfg.anchors, "ttt_steps": c.ttt_steps,
                "draft_vocab": c.draft_vocab}
        own = draft_options(c.draft)
        out.append((start_s, root, ConsumerConfig(
            cache=str(root), consumer_id=c.consumer_id, draft=c.draft, lookbehind=lookbehind,
            lookahead=lookahead, batch_size=cfg.batch_size, steps=cfg.warmup + cfg.steps,
            device="cuda" if rank_devices else devices[role], nproc=cfg.consumer_ranks,
            devices=list(rank_devices[role]) if rank_devices else [],
            **{k: v for k, v in opts.items() if k in own and v is not None},
            threads=1 if cfg.device == "cpu" else 0, out_dir=str(work / "runs" / c.consumer_id), log_every=10,
            lockstep_group=group, progress=False, checkpoints=cfg.save != "none",
            checkpoint_optimizer=cfg.save == "full", **extra)))
    return out


def run_scenario(cfg: BenchConfig, sc: Scenario, plan: dict | None = None) -> dict:
    """Run every mode of one scenario end to end and return its report dict (also written to disk).
    ``plan``: the run's :func:`preflight_disk` (its checkpoint sizes are reused; the report's ``disk_plan``)."""
    cfg = resolved(cfg, sc)
    modes = parse_modes(cfg.modes, sc, cfg.consumer_ranks)
    gpus = _check_environment(cfg, _roles(cfg, sc))
    base = Path(cfg.out_dir).absolute() / sc.name
    _fresh_dir(base)
    sampler = make_sampler(sorted(set(gpus[:1 + len(sc.consumers)])))
    roles = {}
    if gpus:
        roles[gpus[0]] = "producer"
        for i, c in enumerate(sc.consumers, start=1):
            roles[gpus[i]] = (roles[gpus[i]] + "+" if gpus[i] in roles else "") + c.consumer_id
    runs = {}
    # consumer id -> (checkpoint bytes, hidden size): the same consumers in every mode
    sizes = plan["sizes"].setdefault(sc.name, {}) if plan is not None else {}
    for mode in modes:
        if len(modes) > 1:
            served = _producers(base, mode, sc)
            print(f"-- mode {mode}: {len(served)} producer(s), {sum(len(p[2]) for p in served)} consumer(s)",
                  flush=True)
        runs[mode] = run_mode(cfg, sc, base, mode, gpus, sampler if mode == "artcache" else None, sizes)
        runs[mode].removed = clean_mode(base if mode == "artcache" else base / mode, runs[mode].roots, sc)
    art = runs["artcache"]
    figures = scenario_figures(art.events, cfg.warmup)
    report = _report(cfg, sc, figures, art.accounts[0], art.codes, art.wall_s, sampler, roles)
    mode_figures = {m: (figures if m == "artcache" else scenario_figures(r.events, cfg.warmup))
                    for m, r in runs.items()}
    report["modes"] = {m: mode_summary(cfg, sc, r, mode_figures[m]) for m, r in runs.items()}
    report["comparison"] = compare(report["modes"]) if len(modes) > 1 else None
    report["checks"].update(validity_checks(cfg, report["modes"]))
    if any(m in modes for m in ("windows", "tight", "solo")):
        report["retention"] = retention_summary(sc, report)
        report["checks"].update(report["retention"]["checks"])
        report["not_checked"].update(report["retention"].get("not_checked", {}))
    if plan is not None:
        report["disk_plan"] = {k: v for k, v in plan.items() if k != "sizes"}
    _write(base, report, figures, sampler, roles)
    if len(modes) > 1:
        modes_plot(report["modes"], mode_figures, base / "modes.png", f"{sc.name} on {cfg.device}: modes")
    return report


def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks neither followed nor counted)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _empty(directory: Path) -> None:
    """Remove everything inside ``directory`` (the directory itself, its mode and owner stay)."""
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def clean_mode(work: Path, roots: list[Path], sc: Scenario) -> dict:
    """Remove what one mode wrote in bulk, once its journals and accounting have been read: each
    consumer's ``runs/<id>/checkpoints/`` and the artifacts (published and quarantined) left in its
    cache roots. Logs, journals, registrations, plans, ``metrics.csv`` and the reports stay. Writes
    ``work/removed.json`` (``{"checkpoints": [[path, bytes], ...], "artifacts": [...]}``, paths relative
    to ``work``) and returns the same dict."""
    removed: dict[str, list] = {"checkpoints": [], "artifacts": []}
    for c in sc.consumers:
        ckpts = work / "runs" / c.consumer_id / "checkpoints"
        if ckpts.is_dir():
            removed["checkpoints"].append([str(ckpts.relative_to(work)), _tree_bytes(ckpts)])
            shutil.rmtree(ckpts)
    for root in roots:
        layout = CacheLayout(root)
        for sub in (layout.objects, layout.quarantine, layout.tmp):
            if sub.is_dir() and any(sub.iterdir()):  # fan-out directories that eviction emptied go too
                if n := _tree_bytes(sub):
                    removed["artifacts"].append([str(sub.relative_to(work)), n])
                _empty(sub)
    (work / "removed.json").write_text(json.dumps(removed, indent=1))
    return removed


def checkpoint_size_of(ccfg) -> tuple[int, int]:
    """(bytes of the checkpoint ``ccfg``'s run writes, the target's hidden size), as the consumer itself sizes
    it: :meth:`Session.setup <artcache.trainers.consumer.Session.setup>` reads the root, builds the draft and
    sizes its checkpoints (refusing them alone if they cannot fit). Built on the meta device (no memory,
    no initialisation) where the draft's build allows it, else on the CPU. 0 bytes with checkpoints off."""
    import torch

    from artcache.trainers.consumer import Session

    try:
        session = Session(msgspec.structs.replace(ccfg, device="meta", threads=0))
        with torch.device("meta"):
            session.setup()
    except InsufficientSpace:
        raise
    except Exception:  # a build that reads values (EAGLE-3's vocab map check): build it for real; a real
        session = Session(msgspec.structs.replace(ccfg, device="cpu", threads=0))  # error raises again here
        session.setup()
    size = session.checkpoint_bytes
    return (size.total if size is not None else 0), session.draft.target_info.hidden_size


def mode_bytes(cfg: BenchConfig, ccfgs: dict[Path, list], sizes: dict, contract=None, *, budget: int = 0,
               retention: str = "need") -> tuple[int, int]:
    """(checkpoint bytes, artifact bytes) one mode holds on its disk at most: every consumer's final
    checkpoint (:func:`checkpoint_size_of`, cached in ``sizes`` by consumer id) and, per root, its retention
    bound × the artifact bound (:func:`artcache.store.artifact_bytes_bound`). A root's producer never holds
    more than the positions its consumers read (``steps × global batch`` of the longest, at most
    ``cfg.max_samples``: windows are clipped at each consumer's end). Under ``retention`` ``windows`` it
    holds at most its live windows (the sum of its consumers' ``lookbehind + lookahead + 1``; the producer's
    default, no ``--disk-budget``); under ``need`` it keeps what a consumer will still read while it fits
    ``budget`` (the producer's ``--disk-budget``; 0 here: a budget this function does not know, which does not
    bound it), but never evicts a live window, so at most max(windows, ``budget``) bytes. ``contract``: the roots'
    capture contract (default: read from each root's ``artcache.json``)."""
    from artcache.settings import load_settings

    ckpt = art = 0
    for root, group in ccfgs.items():
        for c in group:
            if c.consumer_id not in sizes:
                sizes[c.consumer_id] = checkpoint_size_of(c)
            ckpt += sizes[c.consumer_id][0]
        con = contract if contract is not None else load_settings(CacheLayout(root)).contract
        per = artifact_bytes_bound(con, sizes[group[0].consumer_id][1])
        positions = min(max(c.steps * c.global_batch for c in group), cfg.max_samples)
        windows = min(sum(c.lookbehind + c.lookahead + 1 for c in group), positions) * per
        if retention == "windows":
            art += windows
        else:
            art += min(positions * per, max(windows, budget)) if budget else positions * per
    return ckpt, art


def _refuse(cfg: BenchConfig, what: str, ckpt: int, art: int, work: Path, free: int, at: Path, reserve: int,
            extra: str = "") -> InsufficientSpace:
    """The one-line refusal of :func:`plan_disk` and :func:`preflight_disk`: the bytes needed (checkpoints
    and artifacts), free, kept in reserve, and the settings that need fewer."""
    ways = ["a smaller --window or fewer --warmup/--steps (fewer artifacts retained)",
            "another --out on a filesystem with more space"]
    if cfg.save != "none":
        ways.insert(0, "--save none (no checkpoints)" if cfg.save == "weights" else
                    "--save weights (a third of the bytes) or --save none")
    return InsufficientSpace(
        f"{what} needs {ckpt + art:,} B ({format_bytes(ckpt + art)}: checkpoints {format_bytes(ckpt)} under "
        f"--save {cfg.save}, artifacts {format_bytes(art)} at the retention bound) under {work}, but {at} has "
        f"{free:,} B ({format_bytes(free)}) free{extra}, {format_bytes(reserve)} of it kept in reserve; pass "
        + ", or ".join(ways))


def plan_disk(cfg: BenchConfig, what: str, work: Path, ccfgs: dict[Path, list], sizes: dict, *, budget: int = 0,
              retention: str = "need") -> dict:
    """What one mode will hold on its disk at most (:func:`mode_bytes`, its producers' ``budget`` and
    ``retention``), checked against the free space
    under ``work`` before its consumers start, plus the filesystem's reserve. The bench checked the whole
    run before any mode started (:func:`preflight_disk`); this check, with the mode's real roots, catches
    a disk that other writers filled since.

    Returns ``{"checkpoint_bytes": .., "artifact_bytes": .., "free_bytes": ..}`` (the first two planned).

    Raises:
        InsufficientSpace: naming the bytes needed and free and the settings that need fewer.
    """
    ckpt, art = mode_bytes(cfg, ccfgs, sizes, budget=budget, retention=retention)
    free, fs_size, at = free_space(work)
    reserve = space_reserve(fs_size)
    # artifacts the producers published already are inside the retention bound and out of the free space
    present = sum(_tree_bytes(CacheLayout(root).objects) for root in ccfgs if CacheLayout(root).objects.is_dir())
    if ckpt + max(0, art - present) + reserve > free:
        extra = f" (+ {format_bytes(present)} of artifacts published already)" if present else ""
        raise _refuse(cfg, what, ckpt, art, work, free, at, reserve, extra)
    return {"checkpoint_bytes": ckpt, "artifact_bytes": art, "free_bytes": free}


def preflight_disk(cfg: BenchConfig, scenarios: list[Scenario]) -> dict:
    """The whole run's disk plan, checked before any scenario or mode starts (nothing is written if it
    refuses; sizing needs one scratch cache root, made in a temporary directory and removed).

    For every scenario × mode, what it holds at most (:func:`mode_bytes`: the consumers' checkpoints
    under ``--save`` plus each root's retention bound of artifacts under the mode's ``--retention`` and
    ``--disk-budget``, from the contract the scenario's producers will write). :func:`clean_mode` removes
    each mode's checkpoints and artifacts before the next mode starts, so the run needs the largest mode's
    bytes at once, not their sum (the sum over consumers × modes,
    ``total_bytes_bound``, is what the run writes over its length at most counting each retained artifact
    once; the artifacts published are in each report). A previous bench output that the run
    replaces (``--out``'s scenario directories) counts as free from the scenario that removes it on.

    Returns ``{"free_bytes", "reserve_bytes", "peak_bytes", "peak_mode", "checkpoint_bytes_total",
    "total_bytes_bound", "modes": {"<scenario>/<mode>": {"checkpoint_bytes", "artifact_bytes"}}, "sizes":
    {"<scenario>": {consumer id: (checkpoint bytes, hidden size)}}}``.

    Raises:
        InsufficientSpace: one line naming the mode that does not fit, its bytes, the free bytes and the
            settings that need fewer (exit 2).
        ConfigError: a scenario directory under ``--out`` is not a previous bench output.
    """
    import tempfile

    from artcache.producer import ProducerConfig, prepare_root

    out = Path(cfg.out_dir).absolute()
    with tempfile.TemporaryDirectory(prefix="artcache-bench-preflight-") as tmp:
        free, fs_size, at = free_space(out)
        reserve = space_reserve(fs_size)
        plan: dict = {"free_bytes": free, "reserve_bytes": reserve, "peak_bytes": 0, "peak_mode": "",
                      "checkpoint_bytes_total": 0, "total_bytes_bound": 0, "modes": {}, "sizes": {}}
        scratch: dict[tuple, tuple] = {}  # (max_length, capture layers) -> (scratch root, contract)
        reclaimed = 0
        for sc in scenarios:
            rc = resolved(cfg, sc)
            layers = capture_layers(rc, sc)
            key = (rc.max_length, tuple(layers) if layers else None)
            if key not in scratch:  # the contract the scenario's producers will write, on a scratch root
                root = Path(tmp) / f"cache-{len(scratch)}"
                pc = ProducerConfig(cache=str(root), target=rc.target, dataset=rc.dataset, max_length=rc.max_length,
                                    max_samples=rc.max_samples, draft_layers=rc.draft_layers, layer_ids=layers,
                                    threads=1)
                pc.validate()  # named by the flags the bench shares with the producer (--max-samples, ...)
                _, settings, _, _, _ = prepare_root(pc)
                scratch[key] = (root, settings.contract)
            root, contract = scratch[key]
            base = out / sc.name
            _check_fresh(base)
            reclaimed += _tree_bytes(base) if base.exists() else 0
            sizes = plan["sizes"].setdefault(sc.name, {})
            for mode in parse_modes(rc.modes, sc, rc.consumer_ranks):
                work = base if mode == "artcache" else base / mode
                merged: dict[Path, list] = {}
                for _, _, consumers in _producers(base, mode, sc):  # one key per root of the mode (naive: one each)
                    group = consumer_configs(rc, sc, work, mode, [(root, consumers)], ["cpu"] * len(consumers))
                    merged[root / consumers[0].consumer_id] = [ccfg for _, _, ccfg in group]
                ckpt, art = mode_bytes(rc, merged, sizes, contract, budget=mode_budget(rc, sc, mode),
                                       retention=mode_retention(rc, sc, mode))
                what = f"{sc.name} mode {mode}"
                plan["modes"][f"{sc.name}/{mode}"] = {"checkpoint_bytes": ckpt, "artifact_bytes": art}
                plan["checkpoint_bytes_total"] += ckpt
                plan["total_bytes_bound"] += ckpt + art
                if ckpt + art > plan["peak_bytes"]:
                    plan["peak_bytes"], plan["peak_mode"] = ckpt + art, what
                if ckpt + art + reserve > free + reclaimed:
                    extra = f" (+ {format_bytes(reclaimed)} of the previous output it replaces)" if reclaimed else ""
                    raise _refuse(rc, f"artcache bench: {what}", ckpt, art, work, free, at, reserve, extra)
    return plan


def disk_summary(cfg: BenchConfig, run: ModeRun) -> dict:
    """The bytes one mode wrote, from its roots' accounting and what :func:`clean_mode` removed.

    ``checkpoint_bytes``: the consumers' checkpoints (``--save``; measured on disk before removal).
    ``artifact_bytes_published``: every artifact its producers published (recaptures included).
    ``artifact_bytes_peak``: the most artifact bytes retained at once, summed over the mode's roots (one
    root: its peak; naive: the per-root peaks added, a bound since they need not coincide).
    ``artifact_bytes_left``: artifacts still in the roots when the mode ended (removed then).
    ``peak_bytes_bound``: ``artifact_bytes_peak + checkpoint_bytes``, at least the most the mode held on
    its disk at once (the final checkpoints are written while the windows' artifacts are still retained).
    ``planned``: what :func:`plan_disk` expected before the consumers started (checkpoints, artifact bound,
    free bytes then).
    """
    ckpt = sum(n for _, n in run.removed.get("checkpoints", []))
    peak = sum(a.cache.max_retained_bytes for a in run.accounts)
    return {"save": cfg.save, "checkpoint_bytes": ckpt,
            "checkpoints": len(run.removed.get("checkpoints", [])),
            "artifact_bytes_published": sum(a.cache.published_bytes for a in run.accounts),
            "artifact_bytes_peak": peak,
            "artifact_bytes_left": sum(n for _, n in run.removed.get("artifacts", [])),
            "peak_bytes_bound": peak + ckpt,
            "planned": run.planned,
            "removed": run.removed}


def _report(cfg, sc, figures, acc, codes, wall, sampler, roles) -> dict:
    c = acc.cache
    consumers = []
    for spec in sc.consumers:
        f = figures["consumers"].get(spec.consumer_id, {})
        k = next((k for k in acc.consumers if k.consumer == spec.consumer_id), None)
        consumers.append({
            "id": spec.consumer_id, "draft": spec.draft, "block_size": spec.block_size,
            "steps": f.get("steps", 0), "steps_per_s": f.get("steps_per_s", 0.0),
            "wait_s": f.get("wait_s", 0.0), "fetch_fraction": f.get("fetch_fraction", 0.0),
            "first_loss": f.get("first_loss"), "final_loss": f.get("final_loss"),
            "tau": f.get("tau"), "tau_includes_bonus": True,
            "exit_code": codes.get(spec.consumer_id), "state": k.state if k else "missing",
            "requests": k.logical_requests if k else 0, "hits": k.hits if k else 0, "misses": k.misses if k else 0,
        })
    t0, t1 = figures["interval"]
    checks = {
        "all_consumers_finished": all(x["exit_code"] == 0 and x["steps"] == cfg.warmup + cfg.steps for x in consumers),
        "captures_per_consumed_position_le_1.1": c.captures <= 1.1 * max(1, c.distinct_positions_consumed),
        # retained bytes under the disk budget (retention by need), or under the windows (--retention windows)
        "max_retained_within_bound": (c.budget_exceeded_bytes == 0 and (
            c.max_retained_bytes <= c.budget_bytes or c.windows_exceeded_budget) if c.retention == "need"
            else c.max_retained_artifacts <= c.window_bound_artifacts),
        "every_loss_went_down": all(x["final_loss"] is not None and x["final_loss"] < x["first_loss"]
                                    for x in consumers),
        "accounting_invariants": not acc.violations,
        "producer_exit_ok": codes.get("producer") == 0,
    }
    not_checked = {}
    if cfg.dataset == SYNTHETIC:  # nothing to learn: the figure is reported, never a verdict
        not_checked["every_loss_went_down"] = {"value": checks.pop("every_loss_went_down"), "why": SYNTHETIC_LOSS}
    import torch

    from artcache.bench.provenance import record

    return {
        **record(None, device=cfg.device),  # the command, commit and hardware (GPU included) of these figures
        "scenario": sc.name, "device": cfg.device, "consumer_ranks": cfg.consumer_ranks,
        "shared_gpu": bool(cfg.allow_shared_gpu and cfg.device == "cuda"),
        "warmup_steps": cfg.warmup, "measured_steps": cfg.steps,
        "interval_s": figures["interval_s"], "interval": [t0, t1], "wall_s": wall,
        "aggregate_steps_per_s": figures["aggregate_steps_per_s"],
        "median_consumer_steps_per_s": figures["median_consumer_steps_per_s"],
        "consumers": consumers,
        "producer": {"captures": c.captures, "busy_s": figures["producer_busy_s"],
                     "busy_in_interval_s": figures["producer_busy_in_interval_s"],
                     "utilization": figures["producer_utilization"], "exit_code": codes.get("producer")},
        "cache": {"logical_requests": c.logical_requests, "hits": c.hits, "misses": c.misses,
                  "coalesced": c.coalesced, "captures": c.captures, "publications": c.publications,
                  "failures": c.failures, "evictions": c.evictions, "recaptures": c.recaptures,
                  "distinct_positions_consumed": c.distinct_positions_consumed,
                  "captures_per_consumed_position": c.captures_per_consumed_position,
                  "max_retained_artifacts": c.max_retained_artifacts,
                  "max_retained_bytes": c.max_retained_bytes,
                  "window_bound_artifacts": c.window_bound_artifacts,
                  "retention": c.retention, "budget_bytes": c.budget_bytes, "budget_binding": c.budget_binding,
                  "windows_exceeded_budget": c.windows_exceeded_budget,
                  "evictions_by_reason": c.evictions_by_reason,
                  "leases_acquired": c.leases_acquired, "leases_released": c.leases_released,
                  "leases_expired": c.leases_expired},
        "accounting_violations": acc.violations,
        "checks": checks,
        "not_checked": not_checked,
        "telemetry": sampler.summary(roles, t0, t1),
        "environment": {"python": platform.python_version(), "torch": str(torch.__version__),
                        "platform": platform.platform(), "cpus": os.cpu_count(), **sampler.environment(),
                        "settings": {"target": cfg.target, "dataset": cfg.dataset, "max_length": cfg.max_length,
                                     "anchors": cfg.anchors, "batch_size": cfg.batch_size, "window": cfg.window,
                                     "save": cfg.save}},
    }


def max_lead(events: list, ids: list[str]) -> int:
    """Largest number of optimizer steps any consumer had committed beyond the slowest other one, at
    the moments it committed (from the journals' ``step`` events; 0 with a single consumer).

    Under ``lockstep`` it is at most 1: a consumer reads batch k only once every other one committed
    k - 1 steps (their ``step`` events precede its own by at least one training step)."""
    times = {cid: sorted(ev.t for ev in events if isinstance(ev, J.Step) and ev.consumer == cid) for cid in ids}
    lead = 0
    for cid in ids:
        others = [times[j] for j in ids if j != cid]
        for k, t in enumerate(times[cid], start=1):
            if others:
                lead = max(lead, k - min(bisect_right(ts, t) for ts in others))
    return lead


def mode_summary(cfg: BenchConfig, sc: Scenario, run: ModeRun, figures: dict) -> dict:
    """One mode in numbers.

    ``captures_per_consumed_position`` = captures summed over the mode's producers / distinct
    positions consumed; every consumer walks the same plan positions from 0 in every root, so the
    distinct positions are the largest cursor over the roots. Per consumer, ``steps_per_s`` is its
    steady rate after its own warm-up (:func:`artcache.bench.metrics.scenario_figures`);
    ``aggregate_steps_per_s`` is taken over the mode's common post-warm-up interval.
    """
    ids = [c.consumer_id for c in sc.consumers if c.consumer_id in run.codes]
    captures = sum(a.cache.captures for a in run.accounts)
    positions = max((a.cache.distinct_positions_consumed for a in run.accounts), default=0)
    consumers = []
    for spec in (c for c in sc.consumers if c.consumer_id in ids):
        f = figures["consumers"].get(spec.consumer_id, {})
        consumers.append({"id": spec.consumer_id, "block_size": spec.block_size, "steps": f.get("steps", 0),
                          "steps_per_s": f.get("steps_per_s", 0.0), "rate_spread": f.get("rate_spread"),
                          "wait_s": f.get("wait_s", 0.0),
                          "fetch_fraction": f.get("fetch_fraction", 0.0),
                          "exit_code": run.codes.get(spec.consumer_id)})
    return {
        "mode": run.mode, "producers": len(run.roots), "captures": captures,
        "recaptures": sum(a.cache.recaptures for a in run.accounts),
        "distinct_positions_consumed": positions,
        "captures_per_consumed_position": captures / positions if positions else 0.0,
        "consumers": consumers,
        "aggregate_steps_per_s": figures["aggregate_steps_per_s"], "interval_s": figures["interval_s"],
        "producer_busy_s": figures["producer_busy_s"], "wall_s": run.wall_s, "cpu_s": run.cpu_s,
        "max_lead_steps": max_lead(run.events, ids), "disk": disk_summary(cfg, run),
        "producer_exit_codes": {k: v for k, v in run.codes.items() if k not in ids},
        "consumers_per_root": [len(a.consumers) for a in run.accounts],
        "accounting_violations": [v for a in run.accounts for v in a.violations],
        "budget_bytes": max((a.cache.budget_bytes for a in run.accounts), default=0),
        "max_retained_bytes": max((a.cache.max_retained_bytes for a in run.accounts), default=0),
        "budget_binding": any(a.cache.budget_binding for a in run.accounts),
        "evictions_by_reason": {k: sum(a.cache.evictions_by_reason.get(k, 0) for a in run.accounts)
                                for k in sorted({k for a in run.accounts for k in a.cache.evictions_by_reason})},
    }


#: ``--data synthetic``: uniformly random token ids
SYNTHETIC = "synthetic"
#: why a loss on synthetic data is no check (tests/gpu/test_gpu.py measured it: B4 10.815 -> 10.819 in 8 steps)
SYNTHETIC_LOSS = ("synthetic data (uniform random token ids) has nothing to learn: no draft's loss falls below "
                  "ln(vocab - 64), and the tiny drafts start within ~0.015 nats of it")


def cpu_shared(report: dict, art: dict) -> str | None:
    """Why the fast consumer's rate against its rate alone measures the CPU, not the cache, or None when it is
    measurable: on ``--device cpu`` with fewer CPU cores than the ``artcache`` mode's single-thread processes (its
    producers and consumers), the consumers share cores in that mode and not alone (``solo``: one producer, one
    consumer), so the ratio is the share of a core each got (the 2-core CI box: 4 processes, 0.33 of solo). The cores
    are this process's affinity (a cgroup's CPU quota is not seen)."""
    cpus = len(os.sched_getaffinity(0))  # the cores this bench and its roles may run on (taskset, cpusets)
    processes = art.get("producers", 1) + len(art.get("consumers", []))
    if report.get("device") != "cpu" or cpus >= processes:
        return None
    return (f"--device cpu: the artcache mode ran {processes} single-thread processes on {cpus} CPU cores, so its "
            "consumers shared cores that the fast one had to itself alone: the ratio measures the CPU sharing, not "
            "the cache; measure it with a core (or a GPU) per role")


def retention_summary(sc: Scenario, report: dict) -> dict:
    """The retention figures of a scenario run with the retention modes: the speed ratio of its
    consumers, captures per consumed position under retention by need (``artcache``) and under the windows
    rule (``windows``), the fast consumer's rate against its rate alone (``solo``), and a budget too small for
    the lead (``tight``); ``checks`` holds the goals of :data:`HETERO_GOALS`."""
    modes = report["modes"]
    art = modes["artcache"]
    rates = {c["id"]: c["steps_per_s"] for c in art["consumers"]}
    positive = [r for r in rates.values() if r > 0]
    ratio = max(positive) / min(positive) if positive else 0.0
    out: dict = {
        "goals": HETERO_GOALS, "steps_per_s": rates, "speed_ratio": ratio,
        "captures_per_consumed_position": art["captures_per_consumed_position"],
        "recaptures": art["recaptures"], "budget_bytes": art["budget_bytes"],
        "max_retained_bytes": art["max_retained_bytes"], "budget_binding": art["budget_binding"],
    }
    checks = {
        "speed_ratio_ge_1.5": ratio >= HETERO_GOALS["speed_ratio"],
        "captures_per_consumed_position_le_1.05":
            art["captures_per_consumed_position"] <= HETERO_GOALS["captures_per_consumed_position"],
        "max_retained_le_budget": 0 < art["max_retained_bytes"] <= art["budget_bytes"],
    }
    if "windows" in modes:
        w = modes["windows"]
        out["windows_rule"] = {"captures_per_consumed_position": w["captures_per_consumed_position"],
                               "recaptures": w["recaptures"], "max_retained_bytes": w["max_retained_bytes"]}
    if "solo" in modes:
        fast = fast_consumer(sc).consumer_id
        solo = next((c["steps_per_s"] for c in modes["solo"]["consumers"] if c["id"] == fast), 0.0)
        out["fast_consumer"] = {"id": fast, "steps_per_s": rates.get(fast, 0.0), "solo_steps_per_s": solo,
                                "ratio": rates.get(fast, 0.0) / solo if solo else 0.0}
        met = out["fast_consumer"]["ratio"] >= HETERO_GOALS["fast_vs_solo"]
        shared = cpu_shared(report, art)
        if shared is None:
            checks["fast_consumer_ge_0.95_of_solo"] = met
        else:
            out["not_checked"] = {"fast_consumer_ge_0.95_of_solo": {"value": met, "why": shared}}
    if "tight" in modes:
        t = modes["tight"]
        out["tight"] = {"budget_bytes": t["budget_bytes"], "captures_per_consumed_position":
                        t["captures_per_consumed_position"], "recaptures": t["recaptures"],
                        "budget_binding": t["budget_binding"], "max_retained_bytes": t["max_retained_bytes"],
                        "evictions_by_reason": t["evictions_by_reason"]}
        # too small for the lead: the report says the budget binds, and the figure rises
        checks["tight_budget_binds_and_is_kept"] = (t["budget_binding"]
                                                    and 0 < t["max_retained_bytes"] <= t["budget_bytes"])
    out["checks"] = checks
    return out


#: the run-to-run noise of a consumer's steps/s on these machines (docs/benchmarks.md): two runs of the same
#: settings differ by up to this ratio, so a smaller one is never called a win or a loss
NOISE = 1.10


def noise_of(*spreads: float | None) -> float:
    """The relative noise a ratio is judged against: the largest of the run-to-run noise (:data:`NOISE` - 1) and the
    within-run rate spreads given (:func:`artcache.bench.metrics.rate_spread`; None: not measured)."""
    return max([NOISE - 1.0, *(s for s in spreads if s is not None)])


def judge(better: bool, ratio: float, noise: float) -> tuple[str, bool]:
    """``(words, within)`` for a ratio >= 1 of the better mode's figure over the other's (``better``: artcache's
    is the better one): inside ``1 + noise`` it is "within noise", never a win or a loss."""
    within = ratio <= 1.0 + noise
    if within:
        return f"within noise (±{noise:.0%}): neither wins", True
    return ("artcache wins" if better else "artcache DOES NOT win"), False


def compare(modes: dict) -> dict:
    """The verdict of artcache against the baselines that ran. Reported, never an exit criterion.

    * captures: artcache wins when its producer captures per consumed position are below naive's by more than the
      run-to-run noise (:func:`noise_of`).
    * throughput: the *fast consumer* is the one with the highest steady steps/s under artcache;
      artcache wins when that consumer's steps/s under artcache exceed its steps/s under lockstep by more than the
      noise: the larger of the run-to-run noise and that consumer's measured rate spread in either mode.
    A ratio inside the noise is reported as "within noise" (``within_noise`` true, ``artcache_wins`` false).
    """
    art = modes["artcache"]
    out: dict = {}
    lines = []
    if "naive" in modes:
        a, b = art["captures_per_consumed_position"], modes["naive"]["captures_per_consumed_position"]
        win, ratio = a < b, (b / a if a else float("inf"))
        noise = noise_of()
        words, within = judge(win, max(ratio, 1 / ratio) if ratio else float("inf"), noise)
        out["captures_vs_naive"] = {"artcache": a, "naive": b, "ratio": ratio, "noise": noise,
                                    "within_noise": within, "artcache_wins": win and not within}
        lines.append(f"captures per consumed position: artcache {a:.2f} vs naive {b:.2f} ({ratio:.2f}x): {words}")
    if "lockstep" in modes:
        rates = {c["id"]: c["steps_per_s"] for c in art["consumers"]}
        fast = max(rates, key=lambda k: rates[k])
        lock_c = next(c for c in modes["lockstep"]["consumers"] if c["id"] == fast)
        lock = lock_c["steps_per_s"]
        art_c = next(c for c in art["consumers"] if c["id"] == fast)
        win, ratio = rates[fast] > lock, (rates[fast] / lock if lock else float("inf"))
        noise = noise_of(art_c.get("rate_spread"), lock_c.get("rate_spread"))
        words, within = judge(win, max(ratio, 1 / ratio) if ratio else float("inf"), noise)
        out["fast_consumer_vs_lockstep"] = {"consumer": fast, "artcache": rates[fast], "lockstep": lock,
                                            "ratio": ratio, "noise": noise, "within_noise": within,
                                            "artcache_wins": win and not within}
        lines.append(f"fast consumer {fast}: artcache {rates[fast]:.3f} vs lockstep {lock:.3f} steps/s "
                     f"({ratio:.2f}x): {words}")
    out["artcache_wins"] = all(v["artcache_wins"] for v in out.values())
    out["verdict"] = "; ".join(lines)
    return out


def validity_checks(cfg: BenchConfig, modes: dict) -> dict[str, bool]:
    """Checks that the baselines measured what they claim; a failure makes the comparison invalid
    (and the bench exit nonzero). The win/lose verdict itself is not among them.

    Per baseline: every consumer finished all its steps with status 0, every producer exited 0, each
    consumer has a steady rate, the roots' accounting invariants hold. ``naive``: exactly one
    consumer per root (nothing shared). ``lockstep``: no consumer ever led another by more than one
    step (one shared cursor)."""
    checks = {}
    for m, s in modes.items():
        if m == "artcache":
            continue
        checks[f"{m}_completed"] = (
            all(c["exit_code"] == 0 and c["steps"] == cfg.warmup + cfg.steps for c in s["consumers"])
            and all(code == 0 for code in s["producer_exit_codes"].values()))
        checks[f"{m}_rates_measured"] = all(c["steps_per_s"] > 0 for c in s["consumers"])
        checks[f"{m}_accounting_invariants"] = not s["accounting_violations"]
        if m == "naive":
            checks["naive_one_consumer_per_root"] = all(n == 1 for n in s["consumers_per_root"])
        if m == "lockstep":
            checks["lockstep_one_shared_cursor"] = s["max_lead_steps"] <= 1
    return checks


def _write(base: Path, report: dict, figures: dict, sampler, roles) -> None:
    (base / "report.json").write_text(json.dumps(report, indent=2))
    progress_plot(figures, base / "progress.png", f"{report['scenario']} on {report['device']}")
    if sampler.samples:
        gpu_plot(sampler.samples, roles, base / "gpu_util.png", figures["interval"][0])
    (base / "report.md").write_text(format_report(report))


def format_report(r: dict) -> str:
    shared = " (SHARED GPU: several roles on one device)" if r["shared_gpu"] else ""
    target = r["environment"]["settings"]["target"]
    weights = (f"target {target}: random weights (throughput does not depend on weight values)"
               if target.startswith("random:") else f"target {target}")
    rows = [[c["id"], c["block_size"], c["steps"], round(c["steps_per_s"], 3), round(c["wait_s"], 2),
             round(c["fetch_fraction"], 3), round(c["first_loss"] or 0, 3), round(c["final_loss"] or 0, 3),
             round(c["tau"] or 0, 3), c["hits"], c["misses"], c["state"]] for c in r["consumers"]]
    cache = r["cache"]
    lines = [
        f"## {r['scenario']} on {r['device']}{shared}" + (f", every consumer a group of {r['consumer_ranks']} ranks"
                                                           if r.get('consumer_ranks', 1) > 1 else ""), "",
        f"common post-warm-up interval {r['interval_s']:.1f} s; aggregate steady throughput "
        f"{r['aggregate_steps_per_s']:.3f} steps/s; median per-consumer {r['median_consumer_steps_per_s']:.3f} "
        f"steps/s; producer utilisation {100 * r['producer']['utilization']:.1f} %{shared}", "",
        f"{weights}; {r['environment'].get('gpu', 'CPU')}; torch {r['environment']['torch']}", "",
        "```", table(["consumer", "B", "steps", "steps/s", "wait_s", "fetch_frac", "loss first5", "loss last5",
                      "tau(+1)", "hits", "misses", "state"], rows), "```", "",
        f"captures {cache['captures']} for {cache['distinct_positions_consumed']} distinct positions consumed "
        f"({cache['captures_per_consumed_position']:.3f} per position; {cache['recaptures']} recaptures); "
        f"max retained {cache['max_retained_artifacts']} artifacts, {cache['max_retained_bytes']} bytes (window "
        f"bound {cache['window_bound_artifacts']} artifacts; disk budget {cache.get('budget_bytes') or '-'} bytes, "
        f"{'binding' if cache.get('budget_binding') else 'not binding'}; retention {cache.get('retention') or '-'}); "
        f"evictions {cache['evictions']} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(cache.get('evictions_by_reason', {}).items())) or '-'}); "
        f"logical requests {cache['logical_requests']} = hits {cache['hits']} + misses {cache['misses']}.", "",
        "tau(+1) = mean acceptance length per block over the last 10 steps, including the +1 bonus token.", "",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()), "",
        *[f"not checked: {k} ({'met' if v['value'] else 'not met'}): {v['why']}"
          for k, v in r.get("not_checked", {}).items()],
    ]
    if len(r.get("modes", {})) > 1:
        lines += [format_modes(r), ""]
    if any("disk" in m for m in r.get("modes", {}).values()):
        lines += [format_disk(r), ""]
    if r.get("retention"):
        lines += [format_retention(r["retention"]), ""]
    return "\n".join(lines)


def format_retention(t: dict) -> str:
    """The retention figures (:func:`retention_summary`) as lines of text."""
    gib = 2 ** 30
    lines = [f"### retention: speed ratio {t['speed_ratio']:.2f} (fastest / slowest steady steps/s); budget "
             f"{t['budget_bytes'] / gib:.3f} GiB, max retained {t['max_retained_bytes'] / gib:.3f} GiB, "
             f"{t['captures_per_consumed_position']:.3f} captures per consumed position ({t['recaptures']} "
             f"recaptures), budget {'binding' if t['budget_binding'] else 'not binding'}"]
    if "windows_rule" in t:
        w = t["windows_rule"]
        lines.append(f"- windows-only rule (before): {w['captures_per_consumed_position']:.3f} captures per consumed "
                     f"position ({w['recaptures']} recaptures)")
    if "tight" in t:
        x = t["tight"]
        lines.append(f"- budget too small for the lead ({x['budget_bytes'] / gib:.3f} GiB): "
                     f"{x['captures_per_consumed_position']:.3f} captures per consumed position ({x['recaptures']} "
                     f"recaptures), the budget {'BINDS' if x['budget_binding'] else 'does not bind'}; evictions "
                     + (", ".join(f"{k} {v}" for k, v in sorted(x["evictions_by_reason"].items())) or "none"))
    if "fast_consumer" in t:
        f = t["fast_consumer"]
        lines.append(f"- fast consumer {f['id']}: {f['steps_per_s']:.3f} steps/s, alone {f['solo_steps_per_s']:.3f} "
                     f"({f['ratio']:.3f} of solo)")
    lines.append("goals: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in t["checks"].items()))
    lines += [f"not checked: {k} ({'met' if v['value'] else 'not met'}): {v['why']}"
              for k, v in t.get("not_checked", {}).items()]
    return "\n".join(lines)


def format_disk(r: dict) -> str:
    """The bytes each mode wrote (checkpoints under ``--save``, artifacts) and what was removed after it."""
    rows, save = [], ""
    for m, s in r["modes"].items():
        d = s["disk"]
        save = d["save"]
        plan = d.get("planned") or {}
        rows.append([m, d["checkpoints"], format_bytes(d["checkpoint_bytes"]),
                     format_bytes(plan.get("checkpoint_bytes", 0)), format_bytes(d["artifact_bytes_published"]),
                     format_bytes(d["artifact_bytes_peak"]), format_bytes(plan.get("artifact_bytes", 0)),
                     format_bytes(d["artifact_bytes_left"]), format_bytes(d["peak_bytes_bound"])])
    return "\n".join([
        f"### disk: bytes each mode wrote (--save {save}); removed once the mode's journals were read", "",
        "```", table(["mode", "checkpoints", "checkpoint bytes", "planned", "artifacts published", "artifact peak",
                      "planned bound", "left at end", "peak bound"], rows), "```", "",
        "planned = what the bench checked against the free space before the mode's consumers started (each "
        "consumer's checkpoint as it sizes it; the retention bound x the artifact bound); artifact peak = most "
        "artifact bytes retained at once (several roots: their peaks added); left at end = artifacts still in the "
        "roots when the mode ended; peak bound = artifact peak + checkpoint bytes. Every removed path and its "
        "bytes: removed.json in the mode's directory.",
    ])


def format_modes(r: dict) -> str:
    """The modes table (steady steps/s per consumer after its warm-up) and the verdict line."""
    modes = r["modes"]
    ids = [c["id"] for c in r["consumers"]]
    rows = []
    for m, s in modes.items():
        rate = {c["id"]: c["steps_per_s"] for c in s["consumers"]}
        rows.append([m, s["producers"], s["captures"], s["distinct_positions_consumed"],
                     round(s["captures_per_consumed_position"], 3),
                     *(round(rate[i], 3) if i in rate else "-" for i in ids),
                     round(s["aggregate_steps_per_s"], 3) if s["interval_s"] > 0 else "n/a", s["max_lead_steps"],
                     round(s["wall_s"], 1), round(s["cpu_s"], 1)])
    headers = ["mode", "producers", "captures", "positions", "captures/pos", *(f"{i} steps/s" for i in ids),
               "aggregate", "max lead", "wall_s", "cpu_s"]
    return "\n".join([
        f"### modes: artcache against the baselines ({r['warmup_steps']} warm-up + {r['measured_steps']} "
        "measured steps per consumer, each mode on fresh roots)", "",
        "```", table(headers, rows), "```", "",
        "captures/pos = producer captures (all producers of the mode) per distinct position consumed; steps/s "
        "= each consumer's steady rate after its warm-up; aggregate over the mode's common post-warm-up "
        "interval (n/a: the first consumer finished before the last one's warm-up ended); max lead = most "
        "steps any consumer committed beyond the slowest other; cpu_s = CPU seconds of all the mode's "
        "processes (start-up included; unlike steps/s it does not depend on other load on the machine).", "",
        "verdict: " + (r["comparison"] or {}).get("verdict", "") if (r["comparison"] or {}).get("verdict") else "",
    ])


def write_run_report(out: Path, name: str, scenarios: list[Scenario], reports: list[dict]) -> dict:
    """Write ``out/report.json``, the run's own report beside its scenarios' directories, atomically
    (:func:`artcache.fsio.atomic_write`): once the disk preflight passed and after every scenario, so it always
    lists what finished (and never a previous run's verdict). ``{"scenario":
    the --scenario given (``all``, ``1p3c`` ...), "passed": every scenario ran and passed every check,
    "scenarios": [{"scenario", "status": "passed" | "failed" | "not run", "checks": {name: bool},
    "failed_checks": [name, ...], "not_checked": [name, ...] (figures reported but not measurable as a verdict on
    this run: the scenario report's ``not_checked`` says why), "report": its own report.json, relative to
    ``out``}, ...]}`` in run order.
    Returns the document."""
    done = {r["scenario"]: r for r in reports}
    rows = []
    for sc in scenarios:
        r = done.get(sc.name)
        checks = dict(r["checks"]) if r is not None else {}
        rows.append({"scenario": sc.name,
                     "status": "not run" if r is None else "passed" if checks and all(checks.values()) else "failed",
                     "checks": checks, "failed_checks": [k for k, v in checks.items() if not v],
                     "not_checked": sorted((r or {}).get("not_checked", {})),
                     "report": f"{sc.name}/report.json"})
    # a scenario that checked nothing, or a run of none, passed nothing
    doc = {"scenario": name, "passed": bool(rows) and all(row["status"] == "passed" for row in rows),
           "scenarios": rows}
    atomic_write(out / "report.json", [json.dumps(doc, indent=2).encode()], out)
    return doc


def run_bench(cfg: BenchConfig, on_start: Callable[[Path], object] | None = None) -> bool:
    """Run the scenarios serially; print each report; write the run's ``report.json`` (:func:`write_run_report`)
    under ``--out``; True when every check passed. ``on_start(out)``: called once every setting is checked and
    ``--out`` exists, before any scenario runs (``artcache bench --config`` saves the resolved config there), so bad
    input leaves nothing written.

    Raises:
        ConfigError: a bad setting, before anything is written (exit 2)."""
    from artcache.trainers.consumer import parse_window

    ok = True
    reports = []
    if not 0 < cfg.budget_fraction < 1:
        raise ConfigError(f"--budget-fraction {cfg.budget_fraction} is not accepted: a number in (0, 1)")
    # the CLI (parse_bytes) and a config file (bench.disk_budget: DiskBudget) refuse a bad budget already; this is
    # the check of a BenchConfig built in Python (run_bench is public), with the declared range and its message
    check_value(cfg.disk_budget, DiskBudget, "--disk-budget")
    if cfg.save not in SAVE_POLICIES:
        raise ConfigError(f"--save {cfg.save!r} is not accepted: use one of {', '.join(SAVE_POLICIES)}")
    if cfg.steps is not None and cfg.steps < 1:  # 0 measured steps "passed" every check with 0 steps/s
        raise ConfigError(f"--steps {cfg.steps} is not accepted: measured steps per consumer, an integer >= 1")
    if cfg.warmup is not None and cfg.warmup < 0:
        raise ConfigError(f"--warmup {cfg.warmup} is not accepted: an integer >= 0")
    if not str(cfg.out_dir).strip():  # Path("") is the working directory: its report.json would be replaced
        raise ConfigError("--out '' is empty; accepted: a directory path (created if missing)")
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {cfg.out_dir!r} exists and is not a directory; give a directory path (created "
                          "if missing)")
    for sc in resolve(cfg.scenario):  # bad input fails here, before anything is written
        parse_window(resolved(cfg, sc).window)
        check_tight_budget(resolved(cfg, sc), sc, list(parse_modes(cfg.modes, sc, cfg.consumer_ranks)))
        # the device, before any data is loaded or checkpoint sized (--device cuda without a GPU failed after
        # them and left a report saying "not run")
        _check_environment(resolved(cfg, sc), _roles(cfg, sc))
    plan = preflight_disk(cfg, resolve(cfg.scenario))  # refuses (exit 2) before any mode starts
    print(f"disk plan: at most {format_bytes(plan['peak_bytes'])} at once ({plan['peak_mode']}; each mode's "
          f"checkpoints and artifacts are removed before the next) of {format_bytes(plan['free_bytes'])} free "
          f"under {Path(cfg.out_dir).absolute()}; checkpoints over the run "
          f"{format_bytes(plan['checkpoint_bytes_total'])}"
          f" (--save {cfg.save})", flush=True)
    scenarios = resolve(cfg.scenario)
    out.mkdir(parents=True, exist_ok=True)  # --out is created if missing (its report is the first thing in it)
    write_run_report(out, cfg.scenario, scenarios, reports)  # none run yet: no previous run's verdict stays
    if on_start is not None:
        on_start(out)
    for sc in scenarios:
        rc = resolved(cfg, sc)
        print(f"== scenario {sc.name}: {len(sc.consumers)} consumer(s), {cfg.device}, {rc.warmup}+{rc.steps} "
              f"steps each, window {rc.window}, modes {','.join(parse_modes(cfg.modes, sc, cfg.consumer_ranks))}"
              + (f", {cfg.consumer_ranks} ranks per consumer" if cfg.consumer_ranks > 1 else "") + " ...", flush=True)
        r = run_scenario(cfg, sc, plan)
        reports.append(r)
        print(format_report(r), flush=True)
        print(f"report: {Path(cfg.out_dir).absolute() / sc.name / 'report.json'}", flush=True)
        ok &= all(r["checks"].values())
        write_run_report(out, cfg.scenario, scenarios, reports)
    # every scenario's whole report in one file (the run's report.json lists their verdicts and paths)
    atomic_write(out / "summary.json", [msgspec.json.format(msgspec.json.encode(reports))], out)
    return ok
