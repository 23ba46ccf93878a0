"""``artcache run``: one target, one producer, many independent draft experiments on one cache root.

:func:`plan_run` resolves a :class:`~artcache.app.config.RunConfig` into a :class:`RunPlan` and checks it
before anything starts: each experiment's *view* (the ordered output-of-layer ids its draft reads),
the union the producer captures, target identity (weights digest), normalisation and dtype, the
checkpoints it resumes or starts from, its consumer settings, devices, and a disk bound from the
windows. :func:`run_experiments` then starts the producer and one consumer process per experiment
(no step barrier: each walks the plan at its own pace), fences nothing itself (a failed consumer
fences itself; one killed outright is fenced by the producer, which sees its process gone) and
writes the run report: shared production counted once, each experiment's committed work apart.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec

from artcache import journal as J
from artcache.app.config import (
    CAPTURE_PATHS,
    PRODUCER_FLAGS,
    Experiment,
    RunConfig,
    cache_root,
    capture_layers,
    consumer_config,
    draft_view,
    evaluates,
    experiment_dir,
    layer_union,
    load_run_config,
    producer_config,
    save_config,
    saved_config_source,
)
from artcache.app.values import check_device
from artcache.contract import stored_bytes_per_token, stored_dtype
from artcache.errors import CacheRootError, ConfigError, ContractMismatch, DataError, IntegrityError, UnsafePath
from artcache.fsio import unwritable_dir
from artcache.launch import Role, cli_argv, role_env, stop_all
from artcache.liveness import parent_pid
from artcache.registry import COMPLETED
from artcache.report import format_bytes, loss_ends
from artcache.scheduler import bound_of
from artcache.shutdown import GracefulShutdown
from artcache.store import artifact_bytes_bound

log = logging.getLogger("artcache.run")


# ---- views and the union ---------------------------------------------------------------------------

def view_index(captured: list[int] | tuple[int, ...], view: list[int]) -> list[int]:
    """Positions of ``view``'s ids inside the captured layer axis, in the view's order, so that
    ``hidden_states[:, view_index(captured, view)]`` ([T, len(view), H]) equals a capture of ``view``.

    Raises:
        ContractMismatch: an id of the view is not captured (names the missing ids).
    """
    where = {layer: i for i, layer in enumerate(captured)}
    missing = [i for i in view if i not in where]
    if missing:
        raise ContractMismatch(f"layers {missing} of the view {list(view)} are not captured (captured: "
                               f"{list(captured)})")
    return [where[i] for i in view]


# ---- the plan ----------------------------------------------------------------------------------------

class ExperimentPlan(msgspec.Struct, kw_only=True):
    """One experiment, resolved. ``positions``: plan positions it reads this run (steps × batch size
    from its start cursor); ``window_artifacts``: lookbehind + lookahead + 1 + its held-out split's samples
    (``eval_samples``: pinned, so counted in the producer's window bound, :func:`artcache.scheduler.window_bound`).
    ``skip``: why it is not started (a complete experiment: its checkpoint is at its final step), else empty."""

    name: str
    draft: str
    layer_ids: list[int]
    view: list[int]
    device: str
    window: str
    steps: int
    batch_size: int
    lr: float
    seed: int
    start_step: int = 0
    start_cursor: int = 0
    positions: int
    window_artifacts: int
    out_dir: str
    resume_from: str = ""
    init_from: str = ""
    skip: str = ""
    consumer: dict[str, Any]
    env: dict[str, str] = {}
    #: ranks of its consumer group (``consumer.nproc``), the CUDA index of each (``consumer.devices``; ``[]`` on a
    #: CPU, or where the launcher's scheduler gives each rank its GPUs), and the positions one optimizer step
    #: consumes (``nproc × grad_accum × batch_size``)
    nproc: int = 1
    devices: list[int] = []
    global_batch: int = 0
    #: the :class:`~artcache.trainers.consumer.ConsumerConfig` its consumer is started with, as built here once
    #: (:func:`~artcache.app.config.consumer_config`); written to :func:`consumer_spec_path` (``consume --spec``)
    spec: Any = None


class RunPlan(msgspec.Struct, kw_only=True):
    """Everything :func:`run_experiments` starts, resolved and checked (also written as plan.json)."""

    out: str
    cache_root: str
    config_path: str
    target: dict[str, Any]
    dtype: str
    compute_dtype: str
    captured_layer_ids: list[int]
    plan_id: str
    contract_id: str
    #: the resolved ``[data]`` section (:func:`data_doc`: ``dataset`` is None where ``sources`` replace it)
    data: dict[str, Any]
    bytes_per_artifact_max: int
    window_bound_artifacts: int
    disk_bound_bytes: int
    experiments: list[ExperimentPlan]
    notes: list[str] = []
    #: the target's last layer L-1 when the plan added it to the union for a held-out greedy replay
    #: (``capture.replay_layer``; :func:`~artcache.app.config.capture_layers`), the evaluating experiments it
    #: serves, and the bytes it adds to one artifact at most (``replay_layer_bytes`` x ``window_bound_artifacts``
    #: of the disk bound)
    replay_layer: int | None = None
    replay_layer_for: list[str] = []
    replay_layer_bytes: int = 0
    #: ``captured_layer_ids`` is the config's own ``capture.layer_ids`` (not the union the plan derived)
    explicit_layer_ids: bool = False
    #: the :class:`~artcache.producer.ProducerConfig` of the run's producer (``--exit-when-done``, id
    #: ``producer``), as built here once; written to :func:`producer_spec_path` (``producer --spec``)
    producer: Any = None
    #: the ProducerConfig of every producer of the run (``target.replicas``; the first is ``producer``), each with
    #: its own id and device (:func:`replica_placement`); written to :func:`producer_spec_path` of its replica
    producers: list[Any] = []


def _check_dtypes(cfg: RunConfig, compute: str) -> None:
    """The stored dtype must be one the target's compute dtype can give without inventing precision."""
    stored = stored_dtype(cfg.target.dtype)
    if stored != compute and compute != "float32" and stored != "float8_e4m3fn":  # fp8 holds less than any
        raise ConfigError(
            f"target.dtype {stored} cannot be given by a target computing in {compute} (target.compute_dtype"
            f"{' auto on ' + cfg.target.device if cfg.target.compute_dtype == 'auto' else ''}): the stored bits "
            f"would only be {compute} values converted; set target.dtype = {compute!r} or "
            "target.compute_dtype = 'float32'")
    for e in cfg.experiments:
        if e.dtype is not None and stored_dtype(e.dtype) != stored:
            raise ConfigError(f"experiment {e.name!r} wants {e.dtype} hidden states but this run captures "
                              f"{stored} (target.dtype): one capture serves every experiment in one dtype; "
                              f"set experiments.{e.name}.dtype = {stored!r} or run it separately")


def check_checkpoint(e: Experiment, ckpt: Path, *, info, contract, plan_id: str, resume: bool,
                     strict: bool = True):
    """Check a checkpoint an experiment resumes (``resume``) or starts from (``init_from``) against this
    run's target identity (weights digest), normalisation (layer convention, final norm), dtype, draft
    and (for a resume) plan. Returns its :class:`~artcache.trainers.checkpoint.CheckpointState`; None
    when it records no target identity and not ``strict`` (a resume on the same contract needs none:
    the contract holds the weights digest).

    Raises:
        ContractMismatch: naming the recorded and the expected value (or, ``strict``, that the
            checkpoint records no target identity).
        ConfigError: its state.json is unreadable or not a checkpoint state, or a resume names a
            weights-only checkpoint (it cannot be resumed).
    """
    from artcache.trainers.checkpoint import read_state

    state = read_state(ckpt)
    what = f"experiment {e.name!r}: {'resume' if resume else 'init_from'} checkpoint {ckpt}"
    digest = state.target_weights_digest
    if digest is not None and digest != info.weights_digest:
        raise ContractMismatch(f"{what} was trained against target weights digest {digest}; this run's target "
                               f"{info.name} has {info.weights_digest}")
    unverified = digest is None and not (resume and state.contract_id == contract.contract_id)
    if unverified and strict:
        raise ContractMismatch(f"{what} records no target weights digest, so its target cannot be checked against "
                               f"{info.name} ({info.weights_digest})")
    for got, expected, name in ((state.dtype, contract.dtype, "hidden-state dtype"),
                                (state.layer_convention, contract.layer_convention, "layer convention"),
                                (state.final_norm, info.final_norm, "target final norm")):
        if got is not None and got != expected:
            raise ContractMismatch(f"{what} records {name} {got!r}; this run gives {expected!r}")
    if state.draft not in (None, e.draft):
        raise ContractMismatch(f"{what} holds a {state.draft!r} draft; the experiment trains {e.draft!r}")
    if resume and not state.resumable:
        raise ConfigError(f"{what} is weights-only (checkpoint_optimizer = false: no optimizer or RNG state), so it "
                          f"cannot be resumed, only seeded from: set resume = false and init_from = {str(ckpt)!r}")
    if resume and state.plan_id not in (None, plan_id):
        raise ContractMismatch(f"{what} walked plan {state.plan_id}; this run's data section gives plan "
                               f"{plan_id} (positions would not mean the same samples)")
    return None if unverified else state


def resolve(cfg: RunConfig, captured: list[int] | None = None) -> RunConfig:
    """Absolute paths, each experiment's device, out dir and DFlash layer count, and (when given) the
    captured layers filled in: the config every process of the run reads."""
    out = Path(cfg.out).expanduser().absolute()
    base = msgspec.structs.replace(cfg, out=str(out))
    root = Path(cache_root(base)).expanduser().absolute()
    exps = [msgspec.structs.replace(
        e, device=e.device or cfg.target.device, out=str(Path(experiment_dir(base, e)).expanduser().absolute()),
        draft_layers=(e.draft_layers or cfg.capture.draft_layers) if e.draft == "dflash" and e.layer_ids is None
        else e.draft_layers,
        init_from=str(Path(e.init_from).expanduser().absolute()) if e.init_from else "") for e in cfg.experiments]
    capture = cfg.capture if captured is None else msgspec.structs.replace(cfg.capture, layer_ids=list(captured))
    return msgspec.structs.replace(base, cache=msgspec.structs.replace(cfg.cache, root=str(root)),
                                   experiments=exps, capture=capture)


def _gpu_index(device: str) -> int | None:
    """``cuda[:i]`` → i (0 for ``cuda``); None for a CPU."""
    return int(device.partition(":")[2] or 0) if device.startswith("cuda") else None


def producer_gpus(cfg: RunConfig) -> list[int]:
    """The CUDA indices the producers use, ascending: every replica's (:func:`replica_placement`); one replica's
    are ``target.devices``, else ``target.tensor_parallel_size`` ranks from ``cuda:0`` (one per rank,
    :func:`artcache.backends.tensor_parallel.rank_device`), else ``target.device``'s; ``[]`` on a CPU."""
    t = cfg.target
    if t.tensor_parallel_size > 1 and _gpu_index(t.device) is not None:
        return list(range(t.tensor_parallel_size))
    return sorted({i for device, devices in replica_placement(cfg) for d in (devices or [device])
                   if (i := _gpu_index(d)) is not None})


def producer_ids(replicas: int) -> list[str]:
    """The producer id (journal id, role name) of each of ``replicas`` producers: ``producer``, then
    ``producer-1``, ``producer-2``, ..."""
    return ["producer", *(f"producer-{r}" for r in range(1, replicas))]


def replica_placement(cfg: RunConfig) -> list[tuple[str, list[str]]]:
    """``(device, devices)`` of each of the ``target.replicas`` producers. On a CPU every replica gets the
    target's own. On CUDA replica r takes the r-th block of GPUs: ``cuda:(i + r)`` for ``target.device`` ``cuda:i``,
    and ``target.devices`` (k of them) shifted by ``r * k`` indices.

    Raises:
        ConfigError: several replicas of a tensor-parallel target on CUDA (its ranks take ``cuda:0`` onward,
            :func:`artcache.backends.tensor_parallel.rank_device`, so two groups would share GPUs).
    """
    t = cfg.target
    n = t.replicas
    first = _gpu_index(t.device)
    if n == 1 or (first is None and not any(_gpu_index(d) is not None for d in t.devices)):
        return [(t.device, list(t.devices))] * n
    if t.tensor_parallel_size > 1:
        raise ConfigError(f"target.replicas {n} with target.tensor_parallel_size {t.tensor_parallel_size} on "
                          f"{t.device!r} is not accepted: the tensor-parallel ranks take cuda:0 onward in every "
                          "replica; accepted: replicas = 1 with tensor parallelism, or replicas with a single-device "
                          "or target.devices target")
    if t.devices:
        idx = [_gpu_index(d) for d in t.devices]
        return [(t.device, [f"cuda:{i + r * len(idx)}" for i in idx]) for r in range(n)]
    return [(f"cuda:{first + r}", []) for r in range(n)]


def _ranks_of(e: Experiment) -> int:
    """``consumer.nproc`` as given (1 when absent or not a count: the consumer's config refuses it later)."""
    n = e.consumer.get("nproc", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def place_groups(cfg: RunConfig, visible: int | None) -> RunConfig:
    """Give every experiment of several ranks (``consumer.nproc`` > 1) on CUDA its own GPUs, deterministically:
    ``consumer.devices`` when given, else the lowest visible indices that neither the producer
    (:func:`producer_gpus`), an experiment with its own ``device = "cuda:i"`` or ``consumer.devices``, nor an
    earlier group (in config order) uses. The group's ``device`` becomes ``cuda`` (each rank runs on
    ``cuda:devices[r]``). ``cfg`` is the config as read (before :func:`resolve`); ``visible``: the CUDA
    devices of this machine, or None where another launcher places the ranks (Slurm: nothing is assigned and an
    explicit ``consumer.devices`` is refused by that launcher).

    Raises:
        ConfigError: a group's own ``device`` names one GPU (``cuda:i``); an explicit index that is not visible;
            too few free GPUs for a group (naming the experiment, its ranks and what the others use).
    """
    groups = [e for e in cfg.experiments if _ranks_of(e) > 1 and (e.device or cfg.target.device).startswith("cuda")]
    if not groups:
        return cfg
    taken = {i: "the producer" for i in producer_gpus(cfg)}
    for e in cfg.experiments:
        explicit = e.consumer.get("devices")
        if isinstance(explicit, list) and explicit and all(isinstance(i, int) for i in explicit):
            if visible is not None:
                bad = [i for i in explicit if not 0 <= i < visible]
                if bad:
                    raise ConfigError(f"experiments.{e.name}.consumer.devices {explicit}: cuda:{bad[0]} is not visible "
                                      f"({visible} CUDA device(s): 0..{visible - 1})")
            taken.update({i: f"experiment {e.name!r}" for i in explicit if i not in taken})
        elif _ranks_of(e) == 1 and e.device.startswith("cuda:"):
            taken.setdefault(_gpu_index(e.device), f"experiment {e.name!r}")
    placed = {}
    for e in groups:
        if e.device not in ("", "cuda"):
            raise ConfigError(f"experiments.{e.name}.device {e.device!r} names one GPU but consumer.nproc is "
                              f"{_ranks_of(e)}: give device = \"cuda\" and consumer.devices (one index per rank), or "
                              "leave both out for GPUs after the producer's")
        if e.consumer.get("devices") or visible is None:
            continue
        n = _ranks_of(e)
        free = [i for i in range(visible) if i not in taken]
        if len(free) < n:
            used = ", ".join(f"cuda:{i} {who}" for i, who in sorted(taken.items())) or "none"
            raise ConfigError(f"experiments.{e.name}.consumer.nproc {n} needs {n} GPUs of its own but {len(free)} of "
                              f"the {visible} visible are free (taken: {used}); give consumer.devices, lower nproc or "
                              "make more GPUs visible")
        placed[e.name] = free[:n]
        taken.update({i: f"experiment {e.name!r}" for i in free[:n]})
    exps = [msgspec.structs.replace(e, device="cuda", consumer={**e.consumer, "devices": placed[e.name]})
            if e.name in placed else msgspec.structs.replace(e, device="cuda") if e in groups else e
            for e in cfg.experiments]
    return msgspec.structs.replace(cfg, experiments=exps)


def replica_specs(resolved: RunConfig) -> list[Any]:
    """The :class:`~artcache.producer.ProducerConfig` of each producer of a run (``--exit-when-done``), one per
    ``target.replicas``, each with its id (:func:`producer_ids`) and device (:func:`replica_placement`).

    Raises:
        ConfigError: capture batching against ``data.max_length`` (named by the config's ``capture.*`` paths).
    """
    producer = producer_config(resolved, exit_when_done=True, producer_id="producer")
    producer.limits.validate(resolved.data.max_length, lambda field: CAPTURE_PATHS[field])
    return [msgspec.structs.replace(producer, producer_id=pid, device=device, devices=devices)
            for pid, (device, devices) in zip(producer_ids(resolved.target.replicas), replica_placement(resolved),
                                              strict=True)]


def device_cell(x: ExperimentPlan) -> str:
    """An experiment's devices in words: ``cuda:2,cuda:3`` for a group with GPUs, else its device (``cpu``)."""
    return ",".join(f"cuda:{i}" for i in x.devices) if x.devices else x.device


def shared_gpus(devices: list[str]) -> list[str]:
    """The CUDA devices that more than one of ``devices`` (the producer's and each consumer's) names, sorted."""
    gpus = [d for d in devices if d.startswith("cuda")]
    return sorted({d for d in gpus if gpus.count(d) > 1})


def _explicit_capture(cfg: RunConfig, views: dict[str, list[int]], num_layers: int, notes: list[str]) -> list[int]:
    """The config's own ``capture.layer_ids`` (:func:`plan_run`): ConfigError unless it holds every layer the
    experiments' ``views`` read; a note in ``notes`` when an evaluating experiment then has no target last layer
    (no ``replay_tau``), unless ``capture.replay_layer = false`` turned that replay off."""
    captured = list(cfg.capture.layer_ids or [])
    missing = {n: [i for i in v if i not in captured] for n, v in views.items()}
    missing = {n: m for n, m in missing.items() if m}
    if missing:
        union, _ = capture_layers(cfg, num_layers)
        raise ConfigError(f"capture.layer_ids {captured} lacks layers the experiments read: "
                          + "; ".join(f"{n} needs {m}" for n, m in missing.items())
                          + f" (leave capture.layer_ids out to capture {union})")
    last = num_layers - 1
    blind = [e.name for e in cfg.experiments if evaluates(e)] \
        if last not in captured and cfg.capture.replay_layer else []
    if blind:
        notes.append(f"capture.layer_ids {captured} lacks the target's last layer {last}: the held-out "
                     f"evaluation of {', '.join(blind)} reports data-token figures only, no replay_tau")
    return captured


def _check_out_dirs(cfg: RunConfig, source: str) -> None:
    """The directories a run writes — ``out`` (``--out``), ``cache.root`` and each experiment's ``out`` where set
    (left out, they lie under ``out``) — must each be a directory, existing or creatable, this process can write
    (:func:`artcache.fsio.unwritable_dir`). Checked first, in the dry run as in the run; nothing is touched.

    Raises:
        ConfigError: naming the key, the path, what it is and what is accepted.
    """
    keys = [("out (--out)", cfg.out), ("cache.root", cfg.cache.root)] + [(f"experiments.{e.name}.out", e.out)
                                                                  for e in cfg.experiments]
    for key, path in keys:
        why = unwritable_dir(Path(path).expanduser()) if path else None
        if why is not None:
            raise ConfigError(f"{source}: {key} {path!r} {why}; accepted: a writable directory, existing or "
                              "creatable (the run writes its cache root, logs and checkpoints there)")


def _check_devices(cfg: RunConfig, local_devices: bool, source: str) -> None:
    """At least one experiment; every device the config names is cpu or cuda[:i] (here, when ``local_devices``)."""
    if not cfg.experiments:
        raise ConfigError(f"{source}: no experiments: add at least one [[experiments]] table with a name")
    check_device(cfg.target.device, "target.device", local_devices)
    for i, dev in enumerate(cfg.target.devices):
        check_device(dev, f"target.devices[{i}]", local_devices)
    for r, (device, devices) in enumerate(replica_placement(cfg)[1:], 1):  # each further replica's own GPUs
        for dev in devices or [device]:
            check_device(dev, f"target.replicas {cfg.target.replicas}: replica {r}'s device", local_devices)
    for e in cfg.experiments:
        check_device(e.device or cfg.target.device, f"experiments.{e.name}.device", local_devices)


def plan_run(cfg: RunConfig, *, local_devices: bool = True, source: str = "config") -> tuple[RunPlan, RunConfig]:
    """Resolve and check a run; nothing is written. Returns the plan and the resolved config.

    ``local_devices=False`` (a launcher that runs the roles elsewhere, e.g. Slurm) checks only that each
    device names cpu or cuda[:i], not that this machine has it. ``source`` names the config in a message
    about the file as a whole (``--config 'run.toml'``, as :func:`~artcache.app.config.load_run_config`).

    Raises:
        ConfigError: no experiment, a bad device, dtype, layer set, consumer setting or cache root.
        ContractMismatch: a checkpoint of another target, dtype, normalisation, draft or plan; a cache
            root initialised with another contract or plan.
    """
    from artcache.layer_ids import check_layer_ids
    from artcache.layout import CacheLayout
    from artcache.plan import PlanSpec, plan_id_for
    from artcache.producer import capture_contract, resolve_compute_dtype
    from artcache.settings import check_compatible, load_settings
    from artcache.target import load_tokenizer, resolve_target

    _check_out_dirs(cfg, source)
    _check_devices(cfg, local_devices, source)
    compute = resolve_compute_dtype(cfg.target.compute_dtype, (cfg.target.devices or [cfg.target.device])[0])
    _check_dtypes(cfg, compute)
    info = resolve_target(cfg.target.name)
    views = {e.name: draft_view(e, info.num_layers, cfg.capture.draft_layers) for e in cfg.experiments}
    last = info.num_layers - 1
    replay_for: list[str] = []  # the evaluating experiments the added last layer serves
    notes: list[str] = []
    if cfg.capture.layer_ids:
        # the range first: an id the target lacks (-1) is named as such, not as a layer the experiments lack
        check_layer_ids(list(cfg.capture.layer_ids), info.num_layers, f"capture.layer_ids {cfg.capture.layer_ids}",
                        target=info.name)
        captured = _explicit_capture(cfg, views, info.num_layers, notes)
    else:
        captured, replay_for = capture_layers(cfg, info.num_layers)
    # an explicit capture.layer_ids is the root's capture set: each id once (the union is a set already)
    check_layer_ids(captured, info.num_layers, f"capture.layer_ids {captured}" if cfg.capture.layer_ids
                    else f"the experiments' layer union {captured}", target=info.name, unique=True)
    import torch

    # an experiment of several ranks gets its own GPUs here; under another launcher (Slurm) that one's scheduler does
    cfg = place_groups(cfg, (torch.cuda.device_count() if torch.cuda.is_available() else 0) if local_devices else None)
    resolved = resolve(cfg, captured)
    producers = replica_specs(resolved)
    producer = producers[0]
    # the plan spec and the contract the producer will build (artcache.producer.capture_contract)
    spec = PlanSpec(dataset=resolved.data.dataset, sources=tuple(resolved.data.sources), eval=resolved.data.eval,
                    seed=resolved.data.seed, max_length=resolved.data.max_length,
                    max_samples=resolved.data.max_samples, template_options=dict(resolved.data.template_options))
    tok = load_tokenizer(info)
    plan_id = plan_id_for(spec, tok)
    contract = capture_contract(info, tok, layer_ids=captured, dtype=resolved.target.dtype, compute_dtype=compute,
                                device=resolved.target.device, max_length=spec.max_length,
                                template_options=spec.template_options, backend=resolved.capture.backend)
    layout = CacheLayout(Path(resolved.cache.root))
    if layout.settings.is_file():
        try:
            check_compatible(load_settings(layout), contract, plan_id, layout, spec=spec,
                             name_of=lambda setting: PRODUCER_FLAGS.get(setting, f"data.{setting}"))
        except ConfigError as exc:
            hint = "" if not replay_for or "layer_ids" not in str(exc) else \
                (f"; the last layer {last} is added for the held-out replay of {', '.join(replay_for)}: "
                 "capture.replay_layer = false captures without it")
            raise ContractMismatch(f"{exc} (the experiments' layers {captured} on target {info.name}{hint})") \
                from None
    elif layout.root.exists() and any(layout.root.iterdir()):
        raise ConfigError(f"cache.root {str(layout.root)!r} exists, is not empty and is not a cache root; choose "
                          "another cache.root or out")
    per_artifact = artifact_bytes_bound(contract, info.hidden_size)
    replay_bytes = spec.max_length * (stored_bytes_per_token(contract.dtype, len(captured), info.hidden_size)
                                      - stored_bytes_per_token(contract.dtype, len(captured) - 1, info.hidden_size)) \
        if replay_for else 0
    exps = []
    plan_cache: list = []  # the plan, built (in memory) or loaded once, when a check needs its tokens

    def plan_obj():
        if not plan_cache:
            plan_cache.append(_load_or_build_plan(layout, plan_id, spec, tok, info))
        return plan_cache[0]

    final: list[Experiment] = []
    for e in resolved.experiments:
        e = msgspec.structs.replace(e, resume=_resume_or_fresh(e))
        e = _steps_of_epochs(e, resolved, plan_obj, notes)
        final.append(e)
        resolved_e = msgspec.structs.replace(resolved, experiments=[*final, *resolved.experiments[len(final):]])
        x, seeded = _plan_experiment(e, resolved_e, layout=layout, plan_id=plan_id, contract=contract, info=info,
                                     captured=captured, view=views[e.name], plan_obj=plan_obj)
        exps.append(x)
        notes.extend(seeded)
    resolved = msgspec.structs.replace(resolved, experiments=final)
    # the plan's samples once it is built or published; before, data.max_samples (the most it holds)
    published = (layout.plan_dir(plan_id) / "plan.json").is_file()
    samples = len(plan_obj()) if plan_cache or published else spec.max_samples
    bound = bound_of((x.window_artifacts for x in exps), samples)
    free_at = next((p for p in [layout.root, *layout.root.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(free_at).free
    if bound * per_artifact > free:
        notes.append(f"disk bound {format_bytes(bound * per_artifact)} exceeds the {format_bytes(free)} free at "
                     f"{free_at}")
    over = _budget_over_filesystem(resolved, layout)
    if over:
        notes.append(over)
    shared = shared_gpus([*(d for p in producers for d in (p.devices or [p.device])),
                          *(d for x in exps for d in device_cell(x).split(","))])
    if shared and local_devices:  # elsewhere (Slurm) each role gets its own devices
        notes.append(f"several roles share {', '.join(shared)}")
    plan = RunPlan(
        out=resolved.out, cache_root=str(layout.root), config_path=str(Path(resolved.out) / "config.toml"),
        target={"name": info.name, "path": info.path, "architecture": info.architecture,
                "num_layers": info.num_layers, "hidden_size": info.hidden_size,
                "weights_digest": info.weights_digest, "final_norm": info.final_norm,
                "device": resolved.target.device},
        dtype=stored_dtype(resolved.target.dtype), compute_dtype=compute, captured_layer_ids=captured, plan_id=plan_id,
        contract_id=contract.contract_id,
        data=data_doc(resolved.data), bytes_per_artifact_max=per_artifact, window_bound_artifacts=bound,
        disk_bound_bytes=bound * per_artifact, experiments=exps, notes=notes,
        replay_layer=last if replay_for else None, replay_layer_for=replay_for, replay_layer_bytes=replay_bytes,
        explicit_layer_ids=bool(cfg.capture.layer_ids), producer=producer, producers=producers)
    return plan, resolved


def _budget_over_filesystem(cfg: RunConfig, layout) -> str:
    """The producer's start warning (:func:`artcache.producer.budget_over_filesystem`) for a byte
    ``cache.disk_budget`` the root's filesystem cannot hold, named by its config key, so that the dry run and the
    run say it on the terminal; ``""`` when it fits, for ``auto``, no budget or a remote payload (as the producer).
    What the root holds is the bytes under its objects directory."""
    from artcache.producer import budget_over_filesystem

    budget = cfg.cache.disk_budget
    if not isinstance(budget, int) or not budget or cfg.cache.payload.startswith("mooncake"):
        return ""
    retained = sum(f.stat().st_size for f in layout.objects.rglob("*") if f.is_file()) \
        if layout.objects.is_dir() else 0
    return budget_over_filesystem(layout, budget, retained, key="cache.disk_budget")


def _steps_of_epochs(e: Experiment, resolved: RunConfig, plan_obj, notes: list[str]) -> Experiment:
    """Experiment ``e`` with ``consumer.epochs`` (> 0) turned into ``steps``: ``epochs x epoch_len // batch_size``
    over the plan's training part (all but its held-out split; :func:`~artcache.trainers.evaluation.epoch_steps`,
    as the consumer computes it), ``epochs`` removed from its consumer table, and a note saying so in ``notes``.
    The dry run, the run (every process reads the saved config, which holds the steps) and a rerun of the same
    file then walk one horizon. ``e`` as it is without epochs (``steps`` and ``epochs`` together are refused by
    :func:`~artcache.app.config.check_horizon`).

    Raises:
        ConfigError: a consumer setting is invalid, or the epochs are not one batch.
    """
    from artcache.trainers.evaluation import epoch_steps, eval_split

    ccfg = consumer_config(msgspec.structs.replace(resolved, experiments=[e]), e.name)  # its settings checked
    if not ccfg.epochs:
        return e
    n = len(plan_obj())
    lo, _ = eval_split(n, ccfg.eval_samples, f"experiments.{e.name}.consumer.eval_samples",
                       f"the plan has {n} samples (data.max_samples {resolved.data.max_samples} is the most it holds)")
    epoch_len = lo or n
    try:
        steps = epoch_steps(ccfg.epochs, epoch_len, ccfg.global_batch)
    except ConfigError as exc:
        raise ConfigError(f"experiment {e.name!r}: {exc}") from None
    notes.append(f"{e.name}: consumer.epochs {ccfg.epochs} = {steps} steps ({ccfg.epochs} x {epoch_len} training "
                 f"samples // batch {ccfg.batch_size})")
    return msgspec.structs.replace(e, steps=steps, consumer={k: v for k, v in e.consumer.items() if k != "epochs"})


def _resume_or_fresh(e: Experiment) -> bool:
    """Whether experiment ``e`` resumes: ``e.resume``, or (left out) whether its out holds checkpoints.
    ConfigError when ``resume = true`` finds no checkpoint or ``resume = false`` finds some."""
    from artcache.trainers.checkpoint import list_checkpoints

    has = bool(list_checkpoints(Path(e.out)))
    resume = e.resume if e.resume is not None else has  # left out: resume when its out holds checkpoints
    if resume and not has:
        raise ConfigError(f"experiment {e.name!r}: resume = true but {e.out} holds no checkpoint "
                          "(checkpoints/latest); leave resume out (or false) to start it fresh")
    if not resume and has:
        raise ConfigError(f"experiment {e.name!r}: {e.out} already holds checkpoints of an earlier run and resume "
                          f"= false; leave experiments.{e.name}.resume out (or true) to continue it, or choose "
                          "another out")
    return bool(resume)


def _plan_experiment(e: Experiment, resolved: RunConfig, *, layout, plan_id: str, contract, info,
                     captured: list[int], view: list[int], plan_obj) -> tuple[ExperimentPlan, list[str]]:
    """One experiment of :func:`plan_run` (``e.resume`` decided, ``resolved`` holding it): its consumer
    settings, the checkpoint it resumes or the seed it starts from (checked as the consumer will check
    them), its heartbeat against the root's timeout and its out directory. Returns its plan and the seed's
    notes. ``plan_obj()``: the run's plan, built or loaded once when a check needs its tokens."""
    from artcache.trainers.consumer.config import check_anchors
    from artcache.trainers.consumer.restore import check_same_draft, plan_init, resume_state
    from artcache.trainers.draft import draft_class
    from artcache.trainers.evaluation import eval_split, heldout_samples
    from artcache.trainers.packing import check_pack_tokens
    from artcache.trainers.seed import read_seed

    start_step = start_cursor = 0
    resume_from = skip = ""
    notes: list[str] = []
    given = consumer_config(resolved, e.name)
    check_anchors(given.num_anchors, resolved.data.max_length, f"experiments.{e.name}.anchors",
                  "data.max_length, the tokens per sample")  # as the consumer will (artcache.trainers.consumer)
    ccfg = given.resolved()
    check_pack_tokens(ccfg.pack_tokens, resolved.data.max_length, f"experiments.{e.name}.consumer.pack_tokens",
                      "data.max_length")  # as the consumer will (artcache.trainers.packing.packer_of)
    if resolved.data.eval is not None:  # the eval source's samples are every experiment's held-out split
        ccfg = msgspec.structs.replace(ccfg, eval_samples=heldout_samples(
            plan_obj(), ccfg.eval_samples, f"experiments.{e.name}.consumer.eval_samples"))
    if ccfg.eval_samples > 0:  # the consumer's own check: the split against the plan's length, which
        # data.max_samples only bounds (a dataset with fewer usable samples gives a shorter plan)
        n, max_samples = len(plan_obj()), resolved.data.max_samples
        eval_split(n, ccfg.eval_samples, f"experiments.{e.name}.consumer.eval_samples",
                   f"the plan has {n} samples (data.max_samples {max_samples} is the most it holds)")
    found = resume_state(ccfg, layout, plan_id, contract.contract_id, Path(e.out), allow_complete=True) \
        if e.resume else None  # None on resume: only unrecorded checkpoints of a kill, it continues from step 0
    if found is not None:  # the consumer's own checks (registry record, run settings, draft), before it starts
        path, state = found
        check_checkpoint(e, path, info=info, contract=contract, plan_id=plan_id, resume=True)
        planned = draft_class(e.draft).configure(ccfg, info, captured, plan_obj())
        check_same_draft(state.draft_config, planned, path)
        start_step, start_cursor, resume_from = state.step, state.cursor, str(path)
        if state.step == ccfg.steps:
            skip = f"complete: its checkpoint is at its final step {state.step}"
    elif not e.resume and layout.consumers.is_dir():  # an earlier run of this id elsewhere: as the consumer will
        from artcache import registry
        from artcache.trainers.consumer.restore import refuse_reused_id

        try:
            refuse_reused_id(e.name, registry.read(layout, e.name), Path(e.out))
        except ConfigError as exc:
            raise ConfigError(f"experiment {e.name!r}: {exc}") from None
    if found is None and e.init_from:  # the seed checked exactly as the consumer will (artcache.trainers.seed)
        src = read_seed(e.init_from, info.num_layers)
        if src.state is not None:
            check_checkpoint(e, src.path, info=info, contract=contract, plan_id=plan_id, resume=False, strict=False)
        if src.draft != e.draft:
            raise ConfigError(f"experiment {e.name!r}: init_from {src.path} ({src.layout}) holds a {src.draft} "
                              f"draft, not {e.draft}")
        planned = draft_class(e.draft).configure(ccfg, info, captured, plan_obj())
        try:
            seeded = plan_init(ccfg, src, planned, draft_class(e.draft).weight_shapes(planned), info, contract,
                               plan_obj())
        except (ConfigError, ContractMismatch) as exc:
            raise type(exc)(f"experiment {e.name!r}: {exc}") from None
        notes.extend(f"{e.name}: {n}" for n in seeded.notes)
    beat = getattr(ccfg, "heartbeat_s", 0.0)
    if beat >= resolved.cache.heartbeat_timeout_s:
        raise ConfigError(f"experiment {e.name!r}: heartbeat every {beat}s is not below cache.heartbeat_timeout_s "
                          f"{resolved.cache.heartbeat_timeout_s}s: the producer would fence it as expired")
    why = unwritable_dir(Path(e.out))
    if why is not None:
        raise ConfigError(f"experiment {e.name!r}: out {e.out!r} {why}; accepted: a writable directory, "
                          "existing or creatable")
    lb, la = ccfg.lookbehind, ccfg.lookahead
    return ExperimentPlan(
        name=e.name, draft=e.draft, layer_ids=view, view=view_index(captured, view),
        device=ccfg.device, window=f"{lb}:{la}", steps=ccfg.steps, batch_size=ccfg.batch_size, lr=ccfg.lr,
        seed=ccfg.seed, start_step=start_step, start_cursor=start_cursor,
        positions=0 if skip else (ccfg.steps - start_step) * ccfg.global_batch,
        nproc=ccfg.nproc, devices=list(ccfg.devices), global_batch=ccfg.global_batch,
        window_artifacts=0 if skip else lb + la + 1 + ccfg.eval_samples,  # the held-out split is pinned too
        out_dir=e.out, resume_from=resume_from, init_from=e.init_from, skip=skip,
        consumer=msgspec.to_builtins(ccfg), env=dict(e.env), spec=given), notes


def _load_or_build_plan(layout, plan_id: str, spec, tok, info):
    """The root's plan when it is published, else built in memory (nothing is written: a dry run)."""
    from artcache.plan import Plan, build_plan, build_synthetic_plan

    if (layout.plan_dir(plan_id) / "plan.json").is_file():
        return Plan.load(layout.plan_dir(plan_id))
    if spec.dataset == "synthetic":
        return build_synthetic_plan(spec, target_vocab_size=info.vocab_size)
    return build_plan(spec, tok, target_vocab_size=info.vocab_size)


def data_doc(data) -> dict[str, Any]:
    """The resolved ``[data]`` section (:class:`~artcache.app.config.DataSection`) as the dry run shows it: its
    fields, with ``dataset`` None where ``sources`` replace it (the section's default ``sharegpt`` is then no data of
    the plan)."""
    doc = msgspec.to_builtins(data)
    if doc.get("sources"):
        doc["dataset"] = None
    return doc


def data_words(data: dict[str, Any]) -> str:
    """The dry-run text's words for the plan's data (:func:`data_doc`): the dataset, or each source as
    ``PATH:WEIGHT``, then ``eval PATH`` where a separate evaluation source is given."""
    sources = data.get("sources") or []
    words = ", ".join(f"{s['path']}:{s['weight']:g}" for s in sources) if sources else str(data["dataset"])
    return words + (f" (eval {data['eval']['path']})" if data.get("eval") else "")


def format_plan(plan: RunPlan) -> str:
    """The dry-run text: the shared capture, then every experiment's resolved plan and requirements."""
    from artcache.report import table

    t = plan.target
    lines = [
        f"run {plan.out}",
        f"target {t['name']} ({t['architecture']}, {t['num_layers']} layers, H {t['hidden_size']}, weights "
        f"{t['weights_digest'][:16]}, final norm {t['final_norm']}) on {t['device']}, computing in "
        f"{plan.compute_dtype}, storing {plan.dtype}",
        f"data {data_words(plan.data)} seed {plan.data['seed']} max_length {plan.data['max_length']} "
        f"max_samples {plan.data['max_samples']} (plan {plan.plan_id[:16]})",
        f"capture layers {plan.captured_layer_ids} ("
        + ("capture.layer_ids, explicit in the config" if plan.explicit_layer_ids else "union of the experiments' views"
           + (f" + layer {plan.replay_layer}" if plan.replay_layer is not None else "")) + f") into {plan.cache_root}",
        *([f"  layer {plan.replay_layer}, the target's last, is added for the held-out greedy replay (replay_tau) of "
           f"{', '.join(plan.replay_layer_for)}: {format_bytes(plan.replay_layer_bytes)} per artifact at most, "
           f"{format_bytes(plan.replay_layer_bytes * plan.window_bound_artifacts)} of the disk bound "
           "(capture.replay_layer = false leaves it out)"] if plan.replay_layer is not None else []),
        *([f"producers {len(plan.producers)} (target.replicas), one root, each fingerprint captured once: "
           + ", ".join(f"{p.producer_id} on {','.join(p.devices) or p.device}" for p in plan.producers)]
          if len(plan.producers) > 1 else []),
        f"disk bound {format_bytes(plan.disk_bound_bytes)} = {plan.window_bound_artifacts} artifacts (sum of windows "
        f"and held-out splits, at most the plan) x {format_bytes(plan.bytes_per_artifact_max)} per artifact at most",
        "",
        table(["experiment", "draft", "layers (view)", "index in capture", "ranks", "device", "window", "steps",
               "batch", "positions", "lr", "seed", "start", "out"],
              [[x.name, x.draft, ",".join(map(str, x.layer_ids)), ",".join(map(str, x.view)), x.nproc, device_cell(x),
                x.window, x.steps, x.batch_size if x.global_batch in (0, x.batch_size) else
                f"{x.global_batch} ({x.batch_size}/rank)" if x.global_batch == x.nproc * x.batch_size else
                f"{x.global_batch} ({x.batch_size}/micro-batch)", x.positions, f"{x.lr:g}", x.seed,
                "complete (not started)" if x.skip else
                f"step {x.start_step} cursor {x.start_cursor}" if x.resume_from else
                ("init " + Path(x.init_from).name if x.init_from else "fresh"), x.out_dir] for x in plan.experiments]),
    ]
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


# ---- running -----------------------------------------------------------------------------------------

def producer_spec_path(plan: RunPlan, replica: int = 0) -> Path:
    """The spec file (:mod:`artcache.rolespec`) of the run's producer ``replica``: ``<out>/producer.spec.json``
    for the first, ``<out>/producer-<r>.spec.json`` for replica r (``target.replicas``)."""
    return Path(plan.out) / f"{producer_ids(replica + 1)[replica]}.spec.json"


def run_producers(plan: RunPlan) -> list[Any]:
    """The ProducerConfig of each producer the run starts (:attr:`RunPlan.producers`; a plan written before
    replicas existed holds only ``producer``)."""
    return list(plan.producers) or [plan.producer]


def consumer_spec_path(x: ExperimentPlan) -> Path:
    """Experiment ``x``'s consumer spec file (:mod:`artcache.rolespec`): ``<its out>/consumer.spec.json``."""
    return Path(x.out_dir) / "consumer.spec.json"


def _write_configs(plan: RunPlan, cfg: RunConfig, **producer: Any) -> None:
    """The run's files before anything starts: the resolved config (the run's and each experiment's own), the
    plan, and every role's spec file (the producer's with the launcher's ``producer`` process settings, e.g.
    ``expect_consumers``)."""
    from artcache.rolespec import write_spec

    out = Path(plan.out)
    save_config(cfg, out / "config.toml")
    (out / "plan.json").write_bytes(msgspec.json.format(msgspec.json.encode(plan)))
    for e in cfg.experiments:
        save_config(msgspec.structs.replace(cfg, experiments=[e]), Path(e.out) / "config.toml")
    for r, p in enumerate(run_producers(plan)):
        write_spec(producer_spec_path(plan, r), "producer", msgspec.structs.replace(p, **producer))
    for x in plan.experiments:
        write_spec(consumer_spec_path(x), "consumer", x.spec)


def run_experiments(plan: RunPlan, cfg: RunConfig, *, poll_s: float = 0.2) -> int:
    """Initialise the cache root, start one consumer per experiment, start the producer once each has
    registered (or exited), wait for all of them and write the report (no step barrier anywhere).

    Returns the exit status: 0 when every experiment completed and the producer exited cleanly; ``128 +
    signal`` when a stop signal cancelled the run (130 SIGINT, 143 SIGTERM: :func:`run_report`); 1 otherwise.
    A failed experiment does not stop its siblings. The roles are :class:`artcache.launch.Role`
    processes; signals follow :mod:`artcache.shutdown`: the first SIGINT/SIGTERM is forwarded once to every
    experiment (they end as ``cancelled``), then to the producer; a second terminates every role still
    running (SIGTERM, SIGKILL after 30 s).
    """
    out = Path(plan.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _write_configs(plan, cfg)
    env = role_env()
    # the first SIGINT/SIGTERM asks: one SIGTERM to every experiment, the producer once they ended; a second
    # forces: the roles are terminated now (artcache.shutdown; the previous handlers come back at the end)
    shutdown = GracefulShutdown("artcache run", asked="stopping every experiment (one SIGTERM each)")
    shutdown.install()
    stop = shutdown.requested
    t0 = time.monotonic()  # the run's wall time is a duration: never from the wall clock
    producers: list[Role] = []  # one per target.replicas, the first is ``producer``
    consumers: dict[str, Role] = {}
    journal_pids: dict[str, int] = {}  # the process that registered (and journals) each experiment's consumer
    problems: list[str] = []
    cancel_signalled: dict[str, bool] = {}  # producer → it got the cancel's one SIGTERM (not the hung-exit one)
    try:
        from artcache import registry
        from artcache.layout import CacheLayout
        from artcache.producer import prepare_root

        # the root, plan and artcache.json first (as the producer would make them), so every consumer
        # can register before the producer starts: its first pass sees every window (a start line that
        # an experiment dying at start-up cannot hold up)
        prepare_root(producer_config(cfg))
        layout = CacheLayout(Path(plan.cache_root))
        for x in plan.experiments:
            if x.skip:
                print(f"experiment {x.name} {x.skip}; not started", flush=True)
                continue
            consumers[x.name] = Role(x.name, cli_argv("consume", "--spec", str(consumer_spec_path(x)), "--json"),
                                     logs / f"{x.name}.log", {**env, **x.env})
            print(f"experiment {x.name} started (pid {consumers[x.name].popen.pid}, {x.draft}, layers "
                  f"{x.layer_ids}, {device_cell(x)}{f', {x.nproc} ranks' if x.nproc > 1 else ''}); log "
                  f"{consumers[x.name].log}", flush=True)
        while True:
            regs = {r.consumer_id: r for r in registry.read_all(layout)}
            for n, c in consumers.items():  # a group registers from its rank 0, a child of the role's process
                if n in regs and c.popen.pid in (regs[n].pid, parent_pid(regs[n].pid)):
                    journal_pids[n] = regs[n].pid
            unsettled = [n for n, c in consumers.items() if c.poll() is None and n not in journal_pids]
            if not unsettled:
                break
            if stop.is_set():
                raise KeyboardInterrupt
            time.sleep(poll_s)
        if not consumers:
            print("every experiment is complete: nothing to run", flush=True)
        elif any(c.poll() is None for c in consumers.values()):
            for r, p in enumerate(run_producers(plan)):
                producers.append(Role(p.producer_id, cli_argv("producer", "--spec", str(producer_spec_path(plan, r))),
                                      logs / f"{p.producer_id}.log", env))
                print(f"{p.producer_id} started (pid {producers[-1].popen.pid}, {','.join(p.devices) or p.device}); "
                      f"capturing layers {plan.captured_layer_ids}; log {producers[-1].log}", flush=True)
        else:
            problems.append("every experiment ended before the producer started")
        forwarded = False
        while any(c.poll() is None for c in consumers.values()):
            for c in consumers.values():
                if c.code is not None and not c.announced:
                    c.announced = True
                    state = role_outcome(c.code)
                    print(f"experiment {c.name} {state}{'; its siblings go on' if c.code else ''}", flush=True)
            failed = next((p for p in producers if p.poll() not in (None, 0)), None)
            if failed is not None and not forwarded:
                # (exit 0 is --exit-when-done: every registration is terminal, the rest are exiting)
                problems.append(f"the producer {failed.name} exited with {failed.code} while experiments were running")
                print(f"{failed.name} exited with {failed.code}; stopping the experiments", flush=True)
                stop.set()
            if stop.is_set() and not forwarded:
                forwarded = True
                for c in consumers.values():
                    c.signal(signal.SIGTERM)
            time.sleep(poll_s)
        for c in consumers.values():
            if not c.announced:
                print(f"experiment {c.name} {role_outcome(c.code)}", flush=True)
        if stop.is_set():
            cancel_signalled = {p.name: cancel_producer(layout, p) for p in producers}
        deadline = time.monotonic() + cfg.cache.done_grace_s + 120
        for p in producers:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.signal(signal.SIGTERM)
                p.wait(timeout=60)
    except KeyboardInterrupt:
        problems.append("interrupted")
    finally:
        stop_all([*consumers.values(), *producers], grace_s=30)
        shutdown.restore()
    wall = time.monotonic() - t0
    report = merge_earlier(run_report(plan, producers, consumers, wall, problems, cancel_signalled=cancel_signalled,
                                      cancelled_by=shutdown.signum, journal_pids=journal_pids), out / "report.json")
    write_report(plan, report)
    print(format_report(report), flush=True)
    print(f"report: {out / 'report.json'}", flush=True)
    return report["exit_code"]


# ---- reports -----------------------------------------------------------------------------------------

def _events(path: Path | None) -> list:
    return list(J.iter_file(path)) if path is not None and path.is_file() else []


def consumer_events(path: Path | None) -> list:
    """One consumer process's journal events (``path``) and those of the journals its ``consumer_start`` names
    beside it (``reader-<consumer>-<token>.jsonl``, each holding requests and leases): its reader process's, when
    it ran one, and for a group (rank 0's journal) every other rank's. Regressions: ``artcache run`` and
    ``report`` showed 0 requests for a ``--reader process`` experiment, and only rank 0's for a group."""
    events = _events(path)
    start = next((ev for ev in events if isinstance(ev, J.ConsumerStart)), None)
    if start is not None:
        for token in [start.reader, *start.rank_readers]:
            if token:
                events += _events(path.parent / f"reader-{start.consumer}-{token}.jsonl")
    return events


def production(events: list) -> dict:
    """What one producer process did, counted once (captures, publications, bytes, evictions): its journal's
    :func:`artcache.accounting.fold`."""
    from artcache.accounting import fold

    f = fold(events)
    c = f.cache
    return {"captures": c.captures, "recaptures": c.recaptures, "publications": c.publications,
            "published_bytes": c.published_bytes, "failures": c.failures, "evictions": c.evictions,
            "evicted_bytes": c.evicted_bytes, "batches": c.capture_batches, "busy_s": c.producer_busy_s,
            "max_retained_artifacts": c.max_retained_artifacts, "max_retained_bytes": c.max_retained_bytes,
            "distinct_fingerprints": len(f.captured), "stop_reason": f.stop_reason}


def committed_work(events: list) -> dict:
    """One experiment's own work in one consumer process: steps, cursor range, committed positions,
    requests (its journal's :func:`artcache.accounting.fold`), losses. Never added across experiments into
    production."""
    from artcache.accounting import ConsumerCounts, fold

    steps = [ev for ev in events if isinstance(ev, J.Step)]
    start = next((ev for ev in events if isinstance(ev, J.ConsumerStart)), None)
    end = next((ev for ev in events if isinstance(ev, J.ConsumerEnd)), None)
    counts = fold(events).consumers
    k = counts[start.consumer] if start is not None and start.consumer in counts else ConsumerCounts(consumer="")
    cursor0 = start.cursor if start else 0
    cursor1 = max(cursor0, k.cursor)
    first_loss, final_loss, _ = loss_ends([s.loss for s in steps if s.loss is not None])
    last = steps[-10:]
    blocks = sum(s.blocks for s in last)
    return {
        "state": end.state if end else ("running" if start else "not started"), "error": end.error if end else "",
        "pid": start.pid if start else None, "started": start.t if start else None,
        "steps_run": len(steps), "first_step": steps[0].step if steps else None,
        "last_step": steps[-1].step if steps else None, "cursor_start": cursor0, "cursor_end": cursor1,
        "positions_committed": cursor1 - cursor0, "requests": k.logical_requests, "hits": k.hits,
        "misses": k.misses, "wait_s": k.wait_s,
        "first_loss": first_loss, "final_loss": final_loss,
        "tau": sum(s.tau_sum for s in last) / blocks if blocks else None, "tau_includes_bonus": True,
    }


def _union_length(ranges: list[tuple[int, int]]) -> int:
    total, hi = 0, None
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if hi is None or a > hi:
            total += b - a
            hi = b
        elif b > hi:
            total += b - hi
            hi = b
    return total


def _summary_line(log_path: Path) -> dict:
    """The JSON summary ``artcache consume --json`` prints when it ends ({} if none)."""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def journaled_stop(layout, producer: Role) -> str | None:
    """The reason producer process ``producer`` (journal id: its role name) journaled with its ``producer_stop``, or
    None while it has not.
    The producer writes it as the last thing of its loop (after its last publication and final eviction pass),
    just before it puts the default signal handlers back and exits on its own."""
    stops = [ev for ev in _events(layout.journal_of("producer", producer.name, producer.popen.pid))
             if isinstance(ev, J.ProducerStop)]
    return stops[-1].reason if stops else None


def cancel_producer(layout, producer: Role) -> bool:
    """The cancel's one SIGTERM to the producer once the experiments ended, unless it has journaled its stop
    (:func:`journaled_stop`): an ``--exit-when-done`` producer whose grace passed is leaving on its own, and its
    teardown runs with the default handlers back, where a SIGTERM kills it (-15) and cuts its backend's close
    short; it is only waited for. Returns whether the SIGTERM was sent."""
    reason = journaled_stop(layout, producer)
    if reason is not None:
        print(f"producer is already exiting ({reason}); not signalled", flush=True)
        return False
    producer.signal(signal.SIGTERM)
    return True


def producer_exit_ok(code: int | None, stop_reason: str, cancel_signalled: bool) -> bool:
    """Whether this run's producer ended cleanly: exit 0; or, after the cancel's one SIGTERM, a stop it journaled
    that is not a failure with exit 143 (it stopped on that SIGTERM after its clean shutdown: ``128 + signal``, as
    ``artcache producer`` exits) or ``-15`` (killed by it: the stop was not journaled yet when the run looked,
    :func:`journaled_stop`, and the SIGTERM landed in the teardown, after every capture was published and
    journaled). A producer killed before its stop line (cut off mid-work), by any other signal, signalled by
    anything but this run's cancel, or after ``failed: ...`` is not ok."""
    if code == 0:
        return True
    return (cancel_signalled and code in (-signal.SIGTERM, 128 + signal.SIGTERM) and bool(stop_reason)
            and not stop_reason.startswith("failed"))


def role_outcome(code: int | None) -> str:
    """How ``artcache run`` names an experiment's end from its consumer's exit status, as its report's state does:
    ``completed`` (0); ``cancelled (SIGTERM, exit 143)`` (``128 + signal`` of a stop signal: the consumer ended at a
    step boundary with a checkpoint, its state ``cancelled``); ``FAILED (killed by SIGKILL)`` (a negative status:
    no end record; the producer fences it); ``FAILED (exit N)`` otherwise."""
    if code == 0:
        return COMPLETED
    if code is None:
        return "FAILED (still running)"
    if code < 0:
        return f"FAILED (killed by {_signal_name(-code)})"
    if code - 128 in (signal.SIGINT, signal.SIGTERM):
        return f"cancelled ({_signal_name(code - 128)}, exit {code})"
    return f"FAILED (exit {code})"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def settle_state(name: str, work: dict, *, fences: list, reg, later_start: float | None = None,
                 code: int | None = None) -> None:
    """Settle the state of a consumer process with no end record (:func:`committed_work` says ``running``): a
    process SIGKILLed, or dead on its own, writes none. In ``work`` (its ``pid`` and ``started``), from what
    others recorded of it: a producer's fence of ``name`` in its lifetime (``fences``: the producers' ``fence``
    events; ``later_start``: when the next process of ``name`` started, None for the last one) gives that fence's
    state (``failed``, ``expired``); for the last process, a terminal registration ``reg`` of its pid gives the
    registration's state; a later process of ``name`` (which may start only once this one is not running), its
    exit status ``code``, or a registration whose process is gone says it ended (``failed``). Otherwise it is
    ``running`` (alive, or on another host and not fenced yet)."""
    from artcache.liveness import dead_reason

    if work["state"] != "running":
        return
    start = work.get("started") or 0.0
    mine = [f for f in fences if f.consumer == name and f.t >= start and (later_start is None or f.t < later_start)]
    own_reg = reg if reg is not None and later_start is None and reg.pid == work.get("pid") else None
    if mine:
        state, error = mine[-1].state, f"no end record; fenced by the producer: {mine[-1].reason}"
    elif own_reg is not None and own_reg.state != "running":
        state, error = own_reg.state, f"no end record; its registration: {own_reg.reason or own_reg.state}"
    elif later_start is not None:
        state, error = "failed", "no end record (killed); a later process of the same id took over"
    elif code is not None:
        state, error = "failed", f"no end record; its process ended ({role_outcome(code)}), not fenced yet"
    elif own_reg is not None and (gone := dead_reason(own_reg.identity)):
        state, error = "failed", f"no end record; {gone}, not fenced yet (no producer ran since)"
    else:
        return
    work["state"], work["error"] = state, error


def run_report(plan: RunPlan, producers: list[Role], consumers: dict[str, Role], wall: float,
               problems: list[str], *, cancel_signalled: dict[str, bool] | None = None, cancelled_by: int = 0,
               journal_pids: dict[str, int] | None = None) -> dict:
    """The run report: shared production (this run's producers, ``target.replicas`` of them, counted once: their
    journals folded together; ``producers`` lists each one's own) apart from each experiment's committed work
    (this run's consumer process, or for a group the rank 0 that registered: ``journal_pids``, experiment name →
    pid), plus the root-wide invariants.
    ``cancel_signalled``: producer name → the run sent it its cancel SIGTERM (:func:`producer_exit_ok`).
    ``cancelled_by``: the stop signal that cancelled the run (0: none); the exit code is then ``128 +`` it."""
    from artcache import registry
    from artcache.accounting import account
    from artcache.layout import CacheLayout

    layout = CacheLayout(Path(plan.cache_root))
    journals = {p.name: _events(layout.journal_of("producer", p.name, p.popen.pid)) for p in producers}
    each = []
    for p in producers:
        own = production(journals[p.name])
        each.append({"name": p.name, "pid": p.popen.pid, "exit_code": p.code, **own,
                     "exit_ok": producer_exit_ok(p.code, own["stop_reason"], (cancel_signalled or {}).get(p.name,
                                                                                                          False))})
    prod = production([ev for evs in journals.values() for ev in evs])
    prod["exit_code"] = next((p.code for p in producers if p.code != 0), 0) if producers else None
    fences = [ev for evs in journals.values() for ev in evs if isinstance(ev, J.Fence)]
    experiments = []
    for x in plan.experiments:
        role = consumers.get(x.name)
        pid = (journal_pids or {}).get(x.name, role.popen.pid) if role else 0
        work = committed_work(consumer_events(layout.journal_of("consumer", x.name, pid))) if role else \
            committed_work([])
        if x.skip:  # not started: its checkpoint is at its final step
            work["state"] = COMPLETED
        reg = registry.read(layout, x.name) if layout.consumers.is_dir() else None
        settle_state(x.name, work, fences=fences, reg=reg, code=role.code if role else None)
        summary = _summary_line(role.log) if role else {}
        experiments.append({
            "name": x.name, "draft": x.draft, "layer_ids": x.layer_ids, "view": x.view, "device": device_cell(x),
            "nproc": x.nproc,
            "window": x.window, "lr": x.lr, "seed": x.seed, "steps_planned": x.steps, "start_step": x.start_step,
            "exit_code": role.code if role else None, **work,
            "registration": reg.state if reg else "missing", "checkpoint": summary.get("checkpoint"),
            "skipped": x.skip, "best": summary.get("best"),
            "out_dir": x.out_dir, "log": str(role.log) if role else None, "consumer_summary": summary,
        })
        e = experiments[-1]
        if e["tau"] is not None:
            e["acceptance"] = e["tau"]
            e["acceptance_metric"] = ("tau (DSpark: expected acceptance length from alpha_k, incl. +1 bonus)"
                                      if x.draft == "dspark" else "tau (DFlash, incl. +1 bonus)")
        else:
            e["acceptance"] = summary.get("sim_acc_len")
            e["acceptance_metric"] = "simulated_acc_len (EAGLE-3, no bonus)" if e["acceptance"] is not None else ""
    ranges = [(x["cursor_start"], x["cursor_end"]) for x in experiments]
    distinct = _union_length(ranges)
    acc = account(layout) if layout.settings.is_file() else None
    ran = [x for x in experiments if not x.get("skipped")]
    checks = {
        "every_experiment_completed": all(x["exit_code"] == 0 and x["state"] == COMPLETED for x in ran),
        "failed_experiments_fenced": all(x["registration"] != "running" for x in experiments),
        "producer_exit_ok": all(p["exit_ok"] for p in each) and (bool(producers) or not consumers),
        "accounting_invariants": bool(acc) and not acc.violations,
    }
    exit_code = 128 + cancelled_by if cancelled_by else 0 if all(checks.values()) and not problems else 1
    return {
        "out": plan.out, "wall_s": wall, "exit_code": exit_code, "problems": problems, "checks": checks,
        "cancelled_by": _signal_name(cancelled_by) if cancelled_by else "",
        "target": plan.target, "captured_layer_ids": plan.captured_layer_ids, "dtype": plan.dtype,
        "plan_id": plan.plan_id,
        "shared_production": {**prod, "producers": each, "distinct_positions_consumed": distinct,
                              "captures_per_distinct_position": prod["captures"] / distinct if distinct else 0.0,
                              "window_bound_artifacts": plan.window_bound_artifacts},
        "experiments": experiments,
        "root_accounting": msgspec.to_builtins(acc) if acc else None,
    }


#: the per-experiment keys kept of each earlier run in ``history``
_HISTORY_KEYS = ("state", "exit_code", "steps_run", "first_step", "last_step", "cursor_start", "cursor_end",
                 "positions_committed", "first_loss", "final_loss", "acceptance", "error", "checkpoint")


def merge_earlier(report: dict, earlier_path: Path) -> dict:
    """This run's report merged with the earlier runs of the same run directory (their ``report.json``):
    ``runs`` lists every run (wall time, exit code, the experiments it ran); each experiment carries
    the ``history`` of its earlier runs; an experiment not started this run (complete) keeps its last
    run's figures, and one that is no longer in the config is kept, marked ``in_config: false``."""
    try:
        earlier = json.loads(earlier_path.read_text()) if earlier_path.is_file() else None
    except (OSError, ValueError):
        earlier = None
    this_run = {"wall_s": report["wall_s"], "exit_code": report["exit_code"], "problems": report["problems"],
                "experiments": [x["name"] for x in report["experiments"] if not x.get("skipped")]}
    if not isinstance(earlier, dict):
        report["runs"] = [this_run]
        for x in report["experiments"]:
            x.setdefault("history", [])
        return report
    runs = earlier.get("runs") or [{"wall_s": earlier.get("wall_s"), "exit_code": earlier.get("exit_code"),
                                    "problems": earlier.get("problems", []),
                                    "experiments": [x.get("name") for x in earlier.get("experiments", [])]}]
    report["runs"] = [*runs, this_run]
    before = {x.get("name"): x for x in earlier.get("experiments", []) if isinstance(x, dict)}
    for x in report["experiments"]:
        prior = before.pop(x["name"], None)
        if prior is None:
            x.setdefault("history", [])
            continue
        history = list(prior.get("history", []))
        if not prior.get("skipped"):
            history.append({k: prior.get(k) for k in _HISTORY_KEYS})
        x["history"] = history
        if x.get("skipped"):  # not run now: its figures are those of its last run
            for k in _HISTORY_KEYS:
                if k not in ("state",) and prior.get(k) is not None:
                    x[k] = prior[k]
            x["acceptance_metric"] = prior.get("acceptance_metric", "")
    for prior in before.values():
        report["experiments"].append({**prior, "in_config": False})
    return report


def write_report(plan: RunPlan, report: dict) -> None:
    out = Path(plan.out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(format_report(report) + "\n")
    for x in report["experiments"]:
        d = Path(x["out_dir"])
        d.mkdir(parents=True, exist_ok=True)
        (d / "report.json").write_text(json.dumps({
            "experiment": x, "run": str(out / "report.json"),
            "shared_production_note": "captures are the run's shared production, counted once in the run report; "
                                      "this file holds only this experiment's committed work"}, indent=2))


def format_report(r: dict) -> str:
    """The run report as text: shared production, then one row per experiment."""
    from artcache.report import table

    p = r["shared_production"]
    rows = [[x["name"], x["draft"], ",".join(map(str, x["layer_ids"])), x["device"], x["state"], x["exit_code"],
             x["steps_run"], f"{x['first_step']}-{x['last_step']}" if x["steps_run"] else "-",
             f"{x['cursor_start']}->{x['cursor_end']}", x["positions_committed"], x["requests"], x["hits"],
             x["misses"], round(x["first_loss"], 3) if x["first_loss"] is not None else "-",
             round(x["final_loss"], 3) if x["final_loss"] is not None else "-",
             round(x["acceptance"], 3) if x.get("acceptance") is not None else "-", x["registration"]]
            for x in r["experiments"]]
    lines = [
        f"## run {r['out']} ({r['wall_s']:.1f} s)"
        + (f"; cancelled by {r['cancelled_by']} (exit {r['exit_code']})" if r.get("cancelled_by") else ""), "",
        f"target {r['target']['name']}; captured layers {r['captured_layer_ids']} ({r['dtype']}), the union of "
        "the experiments' views", "",
        f"Shared production (this run's producer{'s' if len(p.get('producers', [])) > 1 else ''}, counted once):",
        f"  captures {p['captures']} ({p['recaptures']} recaptures) for {p['distinct_positions_consumed']} distinct "
        f"positions consumed ({p['captures_per_distinct_position']:.3f} per position); publications "
        f"{p['publications']} ({format_bytes(p['published_bytes'])}); failures {p['failures']}; evictions "
        f"{p['evictions']}; max retained {p['max_retained_artifacts']} artifacts "
        f"({format_bytes(p['max_retained_bytes'])}) against a window bound of {p['window_bound_artifacts']} (the "
        "experiments' windows and held-out splits, at most the plan's samples); "
        f"producer exit {p['exit_code']}",
        *(f"  {q['name']} (pid {q['pid']}): captures {q['captures']}, publications {q['publications']}, exit "
          f"{q['exit_code']}" for q in p.get("producers", []) if len(p["producers"]) > 1), "",
        "Per experiment (each one's own committed work; requests are not production and are never summed into it):",
        "```",
        table(["experiment", "draft", "layers", "device", "state", "exit", "steps", "step range", "cursor",
               "positions", "requests", "hits", "misses", "loss first", "loss last", "accept", "registration"], rows),
        "```", "",
        "accept: DFlash tau over the last 10 steps including the +1 bonus token; DSpark tau = 1 + sum_k prod_i<=k "
        "alpha_i over the last 10 steps (incl. +1 bonus); EAGLE-3 simulated_acc_len (no bonus).", "",
        "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()),
    ]
    lines.extend(f"problem: {x}" for x in r["problems"])
    for x in r["experiments"]:
        if x["error"]:
            lines.append(f"{x['name']}: {x['error']}")
    return "\n".join(lines)


# ---- artcache report RUN_DIR ---------------------------------------------------------------------------

def _last_eval(metrics_csv: Path) -> dict:
    """The last held-out evaluation in a ``metrics.csv`` (``eval/*`` rows of its highest step), or {} (no file,
    no evaluation yet). A torn last line (a consumer writing now, or killed mid-row) is skipped.

    Raises:
        DataError: the file is damaged elsewhere, or cannot be read (names the file and the line).
    """
    from artcache.trainers.tracking import read_metrics

    try:
        rows = [r for r in read_metrics(metrics_csv) if r[1].startswith("eval/")]
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise DataError(f"metrics file {str(metrics_csv)!r} cannot be read: {exc.strerror or exc}") from None
    if not rows:
        return {}
    step = max(r[0] for r in rows)
    return {"step": step, **{tag[len("eval/"):]: v for st, tag, v in rows if st == step}}


def _experiment_config_damage(e: Experiment) -> str | None:
    """What is wrong with experiment ``e``'s own ``config.toml`` (``artcache run`` writes one in its directory
    before anything starts: the run's config with ``e`` as its only experiment), or None (sound, or no
    directory: nothing of ``e`` on disk)."""
    path = Path(e.out) / "config.toml"
    if not Path(e.out).is_dir():
        return None
    if not path.is_file():
        return f"{path} is missing (artcache run writes one into every experiment's directory)"
    try:
        own = load_run_config(path, source=saved_config_source(path))
    except (ConfigError, msgspec.ValidationError) as exc:
        return str(exc)
    names = [x.name for x in own.experiments]
    if names != [e.name]:
        return (f"{path} is empty or damaged: it names {f'the experiments {names}' if names else 'no experiment'}; "
                f"accepted: the config artcache run writes, naming {e.name!r} alone")
    return None


def _checkpoint_state(path: Path | None, damage: list[str]):
    """``read_state(path)``, or None (no checkpoint, or an unreadable state.json or one that does not match
    its recorded digest: its reason appended to ``damage``)."""
    from artcache.trainers.checkpoint import read_state

    if path is None:
        return None
    try:
        return read_state(path)
    except (ConfigError, IntegrityError) as exc:
        damage.append(str(exc))
        return None


def run_dir_report(out: str | Path) -> dict:
    """What a run directory holds, read from disk (every run of it): each experiment's state, steps (``steps``:
    the step of its latest checkpoint, what a resume continues from; ``steps_trained``: the highest step any of
    its consumer processes ran, checkpointed or not; ``steps_planned``), last evaluation, checkpoints
    (``latest``, ``best``) and the committed work of each of its consumer processes, apart from the shared
    production of every producer of the cache root (counted once).

    An experiment whose files are damaged (its own ``config.toml``, a checkpoint's ``state.json``, its
    ``metrics.csv`` other than a torn last line, its registration) is reported with state ``damaged`` and
    each reason in ``damage``; what could be read of it is reported too, and so are the other experiments.
    ``damaged`` lists ``"NAME: reason"`` for every such reason (empty when the directory is sound).

    Raises:
        ConfigError: ``out`` is not a run directory (no ``config.toml`` written by ``artcache run``), or its
            ``config.toml`` cannot be read or names no experiment (empty or damaged).
    """
    from artcache import registry
    from artcache.layout import CacheLayout
    from artcache.trainers.checkpoint import best_checkpoint, find_checkpoint, list_checkpoints

    if not str(out).strip():
        raise ConfigError("run directory '' is empty; accepted: the out directory of an artcache run")
    given, out = out, Path(out).expanduser().absolute()
    if not out.exists():
        raise ConfigError(f"{str(given)!r} does not exist; accepted: the out directory of an artcache run")
    if not (out / "config.toml").is_file():
        raise ConfigError(f"{str(out)!r} is not a run directory of artcache run (no config.toml); accepted: the out "
                          "directory of an artcache run (for a cache root use artcache inspect --cache)")
    cfg = load_run_config(out / "config.toml", source=saved_config_source(out / "config.toml"))
    if not cfg.experiments:
        raise ConfigError(f"{str(out / 'config.toml')!r} names no experiment (empty or damaged); accepted: the "
                          "config.toml artcache run writes (each experiment's own copy is in "
                          "experiments/<name>/config.toml)")
    cfg = resolve(cfg)
    layout = CacheLayout(Path(cfg.cache.root))
    jdir = layout.journal
    prod_events = [ev for f in sorted(jdir.glob("producer-*.jsonl")) for ev in _events(f)] if jdir.is_dir() else []
    shared = production(prod_events)
    shared["producer_processes"] = len(list(jdir.glob("producer-*.jsonl"))) if jdir.is_dir() else 0
    fences = [ev for ev in prod_events if isinstance(ev, J.Fence)]
    experiments, ranges = [], []
    for e in cfg.experiments:
        files = (sorted(jdir.glob(f"consumer-{e.name}-*.jsonl"), key=lambda f: f.stat().st_mtime)
                 if jdir.is_dir() else [])
        processes = [committed_work(consumer_events(f)) for f in files]
        ranges.extend((w["cursor_start"], w["cursor_end"]) for w in processes)
        damage = [d] if (d := _experiment_config_damage(e)) else []
        try:
            reg = registry.read(layout, e.name) if layout.consumers.is_dir() else None
        except (CacheRootError, UnsafePath) as exc:
            reg = None
            damage.append(str(exc))
        processes.sort(key=lambda w: w["started"] or 0.0)
        for i, w in enumerate(processes):  # a process with no end record: what the producer and registry say of it
            later = processes[i + 1]["started"] if i + 1 < len(processes) else None
            settle_state(e.name, w, fences=fences, reg=reg, later_start=later)
        run_dir = Path(e.out)
        latest, best = find_checkpoint(run_dir), best_checkpoint(run_dir)
        st = _checkpoint_state(latest, damage)
        best_st = _checkpoint_state(best, damage) if best != latest else st
        if reg is not None and reg.checkpoint_cursor >= 0 and not damage and (st is None
                                                                             or st.cursor < reg.checkpoint_cursor):
            have = "no checkpoint" if st is None else f"its latest at cursor {st.cursor} (step {st.step})"
            damage.append(f"its registration records a durable checkpoint at cursor {reg.checkpoint_cursor}, but "
                          f"{run_dir / 'checkpoints'} holds {have}: checkpoints were removed or lost")
        try:
            last_eval = _last_eval(run_dir / "metrics.csv")
        except DataError as exc:
            last_eval = {}
            damage.append(str(exc))
        step = st.step if st else 0
        trained = max([step, *(w["last_step"] for w in processes if w["last_step"] is not None)])
        state = ("damaged" if damage else COMPLETED if st is not None and step >= e.steps
                 else (reg.state if reg else "not started"))
        experiments.append({
            "name": e.name, "draft": e.draft, "state": state, "damage": damage, "error": reg.reason if reg else "",
            "steps": step, "steps_trained": trained, "steps_planned": e.steps, "cursor": st.cursor if st else 0,
            "last_eval": last_eval,
            "checkpoints": [s for s, _ in list_checkpoints(run_dir)],
            "latest": latest.name if latest else None,
            "best": {"checkpoint": best.name, **({k: v for k, v in (best_st.eval or {}).items()
                                                  if isinstance(v, (int, float))})} if best and best_st else None,
            "processes": processes, "out_dir": str(run_dir)})
    shared["distinct_positions_consumed"] = _union_length(ranges)
    return {"out": str(out), "cache_root": str(layout.root), "shared_production": shared, "experiments": experiments,
            "damaged": [f"{x['name']}: {d}" for x in experiments for d in x["damage"]]}


def _checkpoint_cell(steps: list[int]) -> str:
    """The report's checkpoints cell: how many, then the steps they are at (``3 (2, 4, 6)``); ``-`` for none. A
    bare step list read like a count (a single checkpoint at step 6 showed ``6``)."""
    return f"{len(steps)} ({', '.join(map(str, steps))})" if steps else "-"


def format_run_dir_report(r: dict) -> str:
    """:func:`run_dir_report` as text: shared production (counted once), then each experiment, then each
    experiment's committed work per consumer process (never added into production)."""
    from artcache.report import table

    p = r["shared_production"]
    rows = []
    for x in r["experiments"]:
        ev = x["last_eval"]
        shown = ", ".join(f"{k} {v:.3g}" for k, v in ev.items() if k in ("loss", "tau", "replay_tau", "sim_acc_len"))
        best = x["best"]
        rows.append([x["name"], x["draft"], x["state"], x.get("steps_trained", x["steps"]),
                     f"{x['steps']}/{x['steps_planned']}",
                     f"step {ev['step']}: {shown}" if ev else "-",
                     _checkpoint_cell(x["checkpoints"]), x["latest"] or "-",
                     f"{best['checkpoint']}" + (f" ({best.get('replay_tau', best.get('tau', best.get('loss'))):.3g})"
                                                if any(k in best for k in ("replay_tau", "tau", "loss")) else "")
                     if best else "-"])
    lines = [f"## run directory {r['out']}", "", f"cache root {r['cache_root']}", "",
             f"Shared production ({p['producer_processes']} producer process(es) of this root, counted once): "
             f"captures {p['captures']} ({p['recaptures']} recaptures) for {p['distinct_positions_consumed']} distinct "
             f"positions consumed; publications {p['publications']} ({format_bytes(p['published_bytes'])}); failures "
             f"{p['failures']}; evictions {p['evictions']}", "",
             "Experiments:", "```",
             table(["experiment", "draft", "state", "trained (step)", "checkpointed (step/planned)", "last eval",
                    "checkpoints (at steps)", "latest", "best"], rows),
             "```", "trained: the highest step its processes ran; checkpointed: the step of its latest checkpoint "
             "(a resume continues from there).", "",
             "Committed work per consumer process (each experiment's own; not production):"]
    for x in r["experiments"]:
        for i, w in enumerate(x["processes"], 1):
            lines.append(f"  {x['name']} #{i}: {w['state']}, steps {w['first_step']}-{w['last_step']} "
                         f"({w['steps_run']} run), cursor {w['cursor_start']}->{w['cursor_end']}, requests "
                         f"{w['requests']} ({w['hits']} hits, {w['misses']} misses)"
                         + (f"; {w['error']}" if w["error"] else ""))
        if not x["processes"]:
            lines.append(f"  {x['name']}: no consumer process yet")
    if r["damaged"]:
        lines += ["", "DAMAGED (what could be read is shown above):", *(f"  {d}" for d in r["damaged"])]
    return "\n".join(lines)


__all__ = ["ExperimentPlan", "RunPlan", "cancel_producer", "check_checkpoint", "consumer_spec_path", "device_cell",
           "draft_view", "place_groups", "producer_gpus", "producer_ids", "replica_placement", "replica_specs",
           "run_producers",
           "format_plan", "producer_spec_path",
           "format_run_dir_report", "journaled_stop", "layer_union", "merge_earlier", "plan_run", "producer_exit_ok",
           "resolve", "role_outcome", "run_dir_report", "run_experiments", "settle_state", "view_index"]
