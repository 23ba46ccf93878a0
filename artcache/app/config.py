"""Typed run configuration: one TOML or YAML file for a target, its data, its capture, its cache root,
a list of draft experiments and the bench, plus ``section.field=value`` overrides.

A file (all sections optional; every field has a default except an experiment's ``name``)::

    out = "runs/two-lrs"              # run directory: cache root, logs, reports, one dir per experiment
    [target]                          # the frozen target and the producer's device
    name = "smollm2-135m-instruct"
    [data]                            # the plan
    max_length = 256
    [capture]                         # layers and capture batching (layer_ids: default = union of views,
                                      # + the last layer for a held-out replay: replay_layer)
    batch_samples = 4
    [cache]                           # cache root, liveness, where the tensors go (payload)
    heartbeat_timeout_s = 30.0
    [[experiments]]                   # one consumer each
    name = "lr-hi"
    lr = 1e-3
    [bench]                           # `artcache bench --config`
    scenario = "1p3c"
    [slurm]                           # `artcache run --launcher slurm` (artcache/app/slurm.py)
    gpus_per_node = 8

Overrides (``artcache run --config FILE experiments.0.lr=1e-3 data.max_length=128``) name a field by
its dotted path; an experiment is addressed by index or by name (``experiments.lr-hi.lr=1e-3``);
``experiments.N.consumer.<field>`` sets a further :class:`artcache.trainers.consumer.ConsumerConfig` field.
The value text is parsed by the field's type (``1,8,14`` or ``[1, 8, 14]`` for a list of ints,
``none`` for an optional field). Unknown fields, unknown override paths and type errors raise
:class:`ConfigError` naming the field and the accepted fields or values; nothing is started.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from artcache.app.values import data_flags, parse_bytes, parse_disk_budget, parse_template_options
from artcache.data.sources import DataSource
from artcache.errors import ConfigError
from artcache.eviction import retention_rule
from artcache.fsio import atomic_write
from artcache.layout import check_id
from artcache.ranges import (
    BlockSize,
    Count,
    DiskBudget,
    MaxLength,
    NonNegative,
    NonNegativeFloat,
    Positive,
    describe_number,
    field_message,
    is_range_error,
    parse_window,
    path_of,
    range_message,
)
from artcache.scheduler import SchedulerLimits
from artcache.trainers import DRAFT_NAMES

DType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "fp8"]
DRAFTS = DRAFT_NAMES  # the registered drafts (artcache.trainers.ADAPTERS)

# Ranges are declared on the fields (artcache.ranges): msgspec checks them in :func:`convert`, whose ConfigError
# names the field, the bad value and what is accepted.


class TargetSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The frozen target (``[target]``).

    Attributes:
        name: ``smollm2-135m-instruct``, ``random:<arch>``, an HF directory (config.json + safetensors) or a
            Hugging Face hub id ``ORG/NAME[@REVISION]`` (from huggingface_hub's cache; ``HF_HUB_OFFLINE`` honoured).
        device: the producer's device, ``cpu`` or ``cuda[:i]``; experiments default to it.
        devices: two or more devices (``["cuda:0", "cuda:1"]``) the producer places the target over with
            transformers' ``device_map`` (decoder layers in contiguous blocks) instead of ``device``; ``[]``: none.
        tensor_parallel_size: ranks of a torch.distributed group the producer shards the target over by its
            tensor-parallel plan (gloo on ``cpu``, NCCL on ``cuda``); 1: none. Neither placement changes an
            artifact or its fingerprint (docs/scale-out.md).
        dtype: stored dtype of the captured hidden states (one per cache root); ``fp8`` (stored as
            ``float8_e4m3fn``): e4m3 codes with one fp32 scale per token row per layer (docs/format.md).
        compute_dtype: dtype the target runs in; ``auto`` = float32 on CPU, bfloat16 on CUDA.
        threads: the producer's torch CPU threads (0 = torch's default).
        replicas: producer processes ``artcache run`` starts on the one cache root (the target data-parallel),
            each with its own producer id (``producer``, ``producer-1``, ...) and device: on a CPU all on ``cpu``; on
            CUDA replica r on the r-th GPU from ``target.device``'s (with ``devices``: the r-th block of as many; a
            tensor-parallel target on CUDA is refused more than one). Each fingerprint is still captured once (its
            capture flock) and demand still comes before lookahead in every replica's queue (docs/scale-out.md).
    """

    name: str = "smollm2-135m-instruct"
    device: str = "cpu"
    devices: list[str] = []
    tensor_parallel_size: Count = 1
    dtype: DType = "bfloat16"
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    threads: NonNegative = 0
    replicas: Count = 1


class DataSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The plan (``[data]``): see :class:`artcache.plan.PlanSpec`.

    Attributes:
        dataset: ``sharegpt`` (embedded), ``synthetic`` or a data file, planned as its one source of weight 1
            (:func:`artcache.plan.as_sources`).
        seed: plan shuffle seed. max_length: tokens per sample (truncated). max_samples: plan length
            (with ``sources``: the training samples of the mix).
        template_options: chat template keyword arguments (e.g. ``enable_thinking = false``); part of
            the plan and of every fingerprint.
        sources: ``[[data.sources]]`` tables (``path``, ``weight``, ``split``, ``max_samples``): a weighted mix of
            dataset folders and parquet / arrow / JSON / JSONL files in the OpenAI ``messages`` or ShareGPT
            ``conversations`` schema, replacing ``dataset`` (:class:`artcache.data.sources.DataSource`,
            :func:`artcache.plan.build_mixed_plan`; docs/data.md).
        eval: ``[data.eval]`` (``path``, ``split``, ``max_samples``): a separate evaluation source; its samples
            end the plan as the held-out split every experiment evaluates on and never trains on.
    """

    dataset: str = "sharegpt"
    seed: NonNegative = 0
    max_length: MaxLength = 512
    max_samples: Count = 2000
    template_options: dict[str, bool | int | float | str] = {}
    sources: list[DataSource] = []
    eval: DataSource | None = None


class CaptureSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the producer captures and how it batches (``[capture]``).

    Attributes:
        layer_ids: output-of-layer ids to capture, in artifact order. ``None``: the sorted union of
            the experiments' views (or the DFlash ids for ``draft_layers`` with no experiment). When
            given with experiments it must contain every experiment's view; each id once (a view may
            repeat an id, a capture set may not: :func:`artcache.layer_ids.check_layer_ids`).
        replay_layer: with ``layer_ids`` left out, also capture the target's last layer ``L - 1``
            (output-of-layer, before the final norm) when an experiment evaluates on a held-out split
            (``consumer.eval_samples`` > 0) and no view reads it: the held-out greedy replay
            (``replay_tau``) needs the target's own argmax. ``false``: the union of the views only (that
            evaluation then reports data-token figures only). See :func:`capture_layers`.
        draft_layers: DFlash draft layers of an experiment that does not say, and of the producer
            or bench alone (captured ids follow :func:`artcache.layer_ids.dflash_layer_ids`).
        batch_samples, batch_tokens, max_queue: scheduler limits (samples and padded tokens per
            capture batch; queued fingerprints per pass).
        prefill_chunk: prefill a longer sample in chunks of this many tokens through the target's KV cache
            (hf backend; 0: one pass); a sample longer than ``batch_tokens`` needs it
            (:class:`artcache.scheduler.SchedulerLimits`).
        backend: ``hf`` (transformers) or ``vllm`` (the ``artcache[vllm]`` extra).
    """

    layer_ids: list[int] | None = None
    replay_layer: bool = True
    draft_layers: int = 5
    batch_samples: Count = 8
    batch_tokens: Count = 8192
    max_queue: Count = 1024
    prefill_chunk: NonNegative = 0
    backend: Literal["hf", "vllm"] = "hf"


class CacheSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The cache root and liveness (``[cache]``).

    Attributes:
        root: cache root directory; ``""`` = ``<out>/cache``.
        heartbeat_timeout_s: a consumer silent this long is fenced as expired (seconds).
        done_grace_s: ``artcache run``: the producer exits this long after the last experiment ended.
        demand_timeout_s: an experiment gives up waiting for one position after this long (seconds).
        group_shared: create the root group-shared (mode 2770, setgid) instead of private (0700).
        disk_budget: bytes the retained artifacts may take, or ``"auto"`` (from the filesystem's free space at
            start): an integer, or text as ``--disk-budget`` takes it (``"100M"``, ``"1.5G"``: K, M, G, T are
            powers of 1024; ``"auto"`` in any case); 0: none, the windows-only rule (only live windows, pinned
            ranges and leases are kept). A budget means retention by future need
            (:func:`artcache.eviction.retention_rule`); live windows and leases are kept whatever it is.
        retention: ``""`` (follow ``disk_budget``), ``need`` or ``windows``: may only repeat what the budget says.
        payload: where the artifacts' tensors live: ``posix`` (files in the root) or ``mooncake://HOST:PORT``
            (Mooncake Store; the root keeps a manifest per artifact); ``""`` = what the root records
            (``posix`` for a new root). See docs/scale-out.md.
    """

    root: str = ""
    heartbeat_timeout_s: Positive = 30.0
    done_grace_s: NonNegativeFloat = 5.0
    demand_timeout_s: Positive = 600.0
    group_shared: bool = False
    disk_budget: DiskBudget | Literal["auto"] = 0
    retention: Literal["", "need", "windows"] = ""
    payload: str = ""


class Experiment(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One draft experiment (``[[experiments]]``): one consumer process with its own weights, optimizer,
    LR, RNG, cursor, checkpoints and run directory.

    Attributes:
        name: the consumer id (unique in the run; letters, digits, ``._-``; not digits only: ``experiments.N`` in an
            override is the entry at index N).
        draft: ``dflash`` or ``eagle3``.
        draft_layers: DFlash draft layers (default ``capture.draft_layers``); its view is
            ``dflash_layer_ids(L, draft_layers)``. EAGLE-3's view is ``eagle3_capture_ids(L)``.
        layer_ids: an explicit ordered view (output-of-layer ids), replacing the draft's formula.
        dtype: hidden-state dtype this draft expects; must be ``target.dtype`` (``None``: any).
        block_size (B; default DFlash 16, DSpark 7), anchors (per sequence; default 64, DSpark 512 on cuda,
            64 on cpu): a draft that does not use an option (EAGLE-3) refuses it. batch_size (positions per
            step). steps: the stop (raise it to extend a run); ``consumer.epochs`` instead (never both: refused,
            :func:`check_horizon`) is turned into steps from the plan by ``artcache run``. lr_total_steps: the LR
            schedule horizon (default: steps; on a resume, the checkpoint's).
        lr (peak), warmup_frac, seed, window (``LOOKBEHIND:LOOKAHEAD`` positions).
        device: ``""`` = ``target.device``. threads: torch CPU threads (0 = torch's default).
        out: run directory (checkpoints, config); ``""`` = ``<out>/experiments/<name>``.
        resume: ``true``: continue from this experiment's own checkpoint (its step, cursor, optimizer,
            RNG; refused when there is none); ``false``: start fresh (refused when its out holds
            checkpoints); left out: resume when its out holds checkpoints, else start fresh. An experiment
            whose checkpoint is at its final step is complete and is not started again.
        init_from: a seed for this draft's weights (``--init-from``: an artcache checkpoint or run
            directory, an artcache export, a published z-lab / speculators / SpecForge draft), checked
            against the experiment before anything starts (:mod:`artcache.trainers.seed`).
        checkpoint_optimizer: save optimizer and RNG state in checkpoints (false: weights-only checkpoints,
            which can seed a run or be exported but not be resumed).
        log_every: metrics line every this many steps.
        consumer: further :class:`artcache.trainers.consumer.ConsumerConfig` fields, passed as they are; a field
            the experiment holds under a key of its own (:data:`EXPERIMENT_CONSUMER_KEYS`: ``layer_ids``,
            ``draft_layers``, ``num_anchors`` as ``anchors``, ...) is refused here, naming that key.
            ``nproc`` > 1 makes the experiment a group of ranks; on CUDA each rank gets a GPU of its own,
            ``devices`` or the first free after the producer's (:func:`artcache.app.experiments.place_groups`).
        env: environment variables of this experiment's consumer process (``artcache run`` only).
    """

    name: str
    draft: Literal[DRAFT_NAMES] = "dflash"
    draft_layers: Count | None = None
    layer_ids: list[int] | None = None
    dtype: DType | None = None
    block_size: BlockSize | None = None  # the anchor and at least one MASK slot, at most 64
    anchors: Count | None = None
    batch_size: Count = 2
    steps: Count = 100
    lr_total_steps: Count | None = None
    lr: Positive = 6e-4
    warmup_frac: float = 0.04
    seed: int = 0
    window: str = "64:256"
    device: str = ""
    threads: NonNegative = 0
    out: str = ""
    resume: bool | None = None
    init_from: str = ""
    checkpoint_optimizer: bool = True
    log_every: Count = 10
    consumer: dict[str, Any] = {}
    env: dict[str, str] = {}


class BenchSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``artcache bench --config`` (``[bench]``); target, data and ``capture.draft_layers`` come from
    their sections. ``None`` counts take the bench's device default (see ``artcache bench --help``).
    ``save``: each consumer's final checkpoint (``weights``, ``full`` with optimizer state, or ``none``).
    ``consumer_ranks``: ranks of every consumer (each a ``torch.distributed`` group; gloo on a CPU)."""

    scenario: str = "1p3c"
    device: Literal["cpu", "cuda"] = "cpu"
    out: str = "bench-out"
    warmup: int | None = None
    steps: int | None = None
    anchors: int | None = None
    batch_size: int = 1
    window: str = ""  # "": the scenario's (64:256; hetero 2:8)
    allow_shared_gpu: bool = False
    timeout_s: float = 1800.0
    modes: str = ""
    disk_budget: DiskBudget = 0
    budget_fraction: float = 0.25
    save: Literal["none", "weights", "full"] = "weights"
    consumer_ranks: Count = 1


class SlurmSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``artcache run --launcher slurm`` (``[slurm]``): the sbatch script it writes (artcache/app/slurm.py).

    Attributes:
        partition, account, qos: ``#SBATCH`` values (``""``: the cluster's default).
        time: the job's time limit (``HH:MM:SS`` or any ``--time`` value).
        nodes: nodes of the job; 0 = as few as the GPUs need (``gpus_per_node`` each).
        gpus_per_node: GPUs of one node (a role never spans nodes).
        producer_gpus: GPUs of the producer's step (the target; >1 for a target sharded over one node's GPUs).
        experiment_gpus: GPUs of each experiment's step; of each task of it for an experiment of N ranks
            (``consumer.nproc``: one step of N tasks, ``--gpus-per-task``).
        cpus_per_role: ``--cpus-per-task`` of every step.
        placement: ``spread`` (the producer on the first node, experiment i on node i mod nodes) or ``pack``
            (fill each node's GPUs before the next).
        python: the interpreter every node runs (``""``: the one running ``artcache run``; it must exist at the
            same path on every node, e.g. a venv on the shared filesystem).
        setup: shell lines run at the start of the job (``module load ...``, ``source venv/bin/activate``).
        sbatch_args: further ``#SBATCH`` lines, e.g. ``["--mem=0", "--exclusive"]``.
        step_args: further ``srun`` arguments of every step.
        env: environment variables exported in the job (every step inherits them).
        root_wait_s: seconds the job waits for the producer to create the cache root before it gives up.
    """

    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = "04:00:00"
    nodes: NonNegative = 0
    gpus_per_node: Count = 8
    producer_gpus: NonNegative = 1
    experiment_gpus: NonNegative = 1
    cpus_per_role: Count = 1
    placement: Literal["spread", "pack"] = "spread"
    python: str = ""
    setup: list[str] = []
    sbatch_args: list[str] = []
    step_args: list[str] = []
    env: dict[str, str] = {}
    root_wait_s: Positive = 600.0


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A whole run: the sections above. ``out``: the run directory of ``artcache run``, a directory existing or
    creatable (an existing file, or a path under one, is refused before anything starts, as is such a
    ``cache.root`` or experiment ``out``)."""

    out: str = "runs/run"
    target: TargetSection = msgspec.field(default_factory=TargetSection)
    data: DataSection = msgspec.field(default_factory=DataSection)
    capture: CaptureSection = msgspec.field(default_factory=CaptureSection)
    cache: CacheSection = msgspec.field(default_factory=CacheSection)
    experiments: list[Experiment] = []
    bench: BenchSection = msgspec.field(default_factory=BenchSection)
    slurm: SlurmSection = msgspec.field(default_factory=SlurmSection)

    def experiment(self, name: str) -> Experiment:
        """The experiment called ``name``; ConfigError naming the accepted names otherwise."""
        for e in self.experiments:
            if e.name == name:
                return e
        raise ConfigError(f"no experiment {name!r} in this config; accepted: "
                          f"{', '.join(e.name for e in self.experiments) or '(none: add [[experiments]])'}")


# ---- files -------------------------------------------------------------------------------------------

SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def _yaml_loader():
    """PyYAML's SafeLoader, with YAML 1.2 floats (``1e-3`` is a float, not the string "1e-3"), refusing what
    TOML refuses or YAML 1.1 reads in a way a user does not mean: a key given twice in one mapping (PyYAML keeps
    the last silently) and an unquoted base-60 integer (``window: 4:8`` is read as 248). Each raises
    ConfigError naming the key and its line."""
    import yaml

    sexagesimal = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+$")

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for key_node, value_node in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float)) and key in seen:  # an unhashable key: PyYAML's refusal
                    raise ConfigError(f"key {key!r} is given twice in one table (line {line}); give it once")
                seen.add(key) if isinstance(key, (str, int, float)) else None
                if (isinstance(value_node, yaml.ScalarNode) and value_node.tag == "tag:yaml.org,2002:int"
                        and value_node.style is None and sexagesimal.match(value_node.value)):
                    raise ConfigError(f"{key}: {value_node.value} (line {line}) is read by YAML 1.1 as the base-60 "
                                      f"number {self.construct_object(value_node)}; quote it: "
                                      f"{key}: \"{value_node.value}\"")
            return super().construct_mapping(node, deep)

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|"
                   r"^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]+(?:[eE][-+]?[0-9]+)?$|"
                   r"^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
        list("-+0123456789."))
    return Loader


def read_file(path: str | Path, source: str | None = None) -> dict:
    """The raw table of a config file (TOML, YAML or JSON by suffix). Raises ConfigError, naming the file as
    ``source`` (default ``--config 'PATH'``: a saved config read back, e.g. by ``artcache report``, names itself)."""
    p = Path(path).expanduser()
    source = source or f"--config {str(path)!r}"
    if p.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"{source}: unknown file type {p.suffix!r}; accepted: {', '.join(SUFFIXES)}")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source} is not UTF-8 text (byte {exc.start}: {exc.reason}); accepted: a "
                          f"TOML, YAML or JSON file") from None
    try:
        if p.suffix.lower() == ".toml":
            raw = tomllib.loads(text)
        elif p.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass
    except ConfigError as exc:  # the loader's own refusals (a duplicate key, a base-60 number)
        raise ConfigError(f"{source}: {exc}") from None
    except Exception as exc:  # tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError
        raise ConfigError(f"{source} is not valid {p.suffix.lstrip('.').upper()}: "
                          f"{str(exc).splitlines()[0]}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a table of sections, "
                          f"got {type(raw).__name__}")
    return raw


# ---- type walking ------------------------------------------------------------------------------------

_INFO = mi.type_info(RunConfig)


def _strip_none(t: mi.Type) -> tuple[mi.Type, bool]:
    """(the non-None member of an optional type, whether None is accepted)."""
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        if len(rest) == 1:
            return rest[0], len(rest) != len(t.types)
    return t, False


def _describe(t: mi.Type, seconds: bool = False, ranges: bool = True) -> str:
    """What a field of type ``t`` accepts, in words (``ranges``: with its declared range)."""
    t, optional = _strip_none(t)
    names = {mi.BoolType: "true or false", mi.StrType: "a string"}
    if isinstance(t, mi.UnionType):  # e.g. cache.disk_budget: bytes or "auto"
        text = " or ".join(_describe(x, seconds, ranges) for x in t.types if not isinstance(x, mi.NoneType))
    elif isinstance(t, mi.LiteralType):
        text = "one of " + ", ".join('""' if v == "" else str(v) for v in t.values)  # "" visible, not a gap
    elif isinstance(t, mi.ListType):
        item = _describe(t.item_type)
        noun = item.removeprefix("an ").removeprefix("a ")
        # "a list of strings", but "a list, each an integer >= 0 (...)": a plural "s" only after a bare noun
        text = f"a list of {noun}s" if " " not in noun else f"a list, each {item}"
    elif isinstance(t, mi.StructType):
        text = "a table with fields " + ", ".join(f.name for f in t.fields)
    elif isinstance(t, mi.DictType):
        text = "a table"
    elif isinstance(t, (mi.IntType, mi.FloatType)):
        text = describe_number(t, seconds) if ranges else "an integer" if isinstance(t, mi.IntType) else "a number"
    else:
        text = names.get(type(t), "a value")
    return text + (" or none" if optional else "")


def _fields(t: mi.StructType) -> dict[str, mi.Field]:
    return {f.encode_name: f for f in t.fields}


def type_at(path: list[str]) -> mi.Type:
    """The declared type of a dotted path of :class:`RunConfig` (list indices/names skip the list)."""
    t: mi.Type = _INFO
    for seg in path:
        t, _ = _strip_none(t)
        if isinstance(t, mi.StructType):
            f = _fields(t).get(seg)
            if f is None:
                return mi.AnyType()
            t = f.type
        elif isinstance(t, mi.ListType):
            t = t.item_type
        elif isinstance(t, mi.DictType):
            t = t.value_type
        else:
            return mi.AnyType()
    return t


def _section_name(path: list[str]) -> str:
    return ".".join(path) if path else "the top level"


def check_unknown(raw: Any, t: mi.Type = _INFO, path: list[str] | None = None, source: str = "config") -> None:
    """Raise ConfigError for the first key that no struct of the config declares, naming the accepted
    fields of its table (msgspec's own message does not list them)."""
    path = path or []
    t, _ = _strip_none(t)
    if isinstance(t, mi.StructType) and isinstance(raw, dict):
        fields = _fields(t)
        for key, value in raw.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown field {'.'.join([*path, str(key)])!r}; accepted fields of "
                                  f"{_section_name(path)}: {', '.join(fields)}")
            check_unknown(value, fields[key].type, [*path, key], source)
    elif isinstance(t, mi.ListType) and isinstance(raw, list):
        for i, item in enumerate(raw):  # a named item (an experiment) by its name, as every other message names it
            name = item.get("name") if isinstance(item, dict) else None
            check_unknown(item, t.item_type, [*path, name if isinstance(name, str) and name else str(i)], source)


def _value_at(raw: Any, path: list[str]) -> tuple[bool, Any]:
    """(found, value) at a dotted path of a raw table (list items by index)."""
    node = raw
    for seg in path:
        if isinstance(node, dict) and seg in node:
            node = node[seg]
        elif isinstance(node, list) and seg.isdigit() and int(seg) < len(node):
            node = node[int(seg)]
        else:
            return False, None
    return True, node


#: fields holding a byte count, each with the parser of its CLI flag: the file, overrides and flags accept the flag's
#: spellings (``100M``, ``1.5G``, ``auto`` any case for ``cache.disk_budget``) and refuse the same values
_BYTE_FIELDS: dict[tuple[str, str], Any] = {("cache", "disk_budget"): parse_disk_budget,
                                            ("bench", "disk_budget"): lambda v: parse_bytes(v, "disk-budget")}


def _parse_byte_fields(raw: dict, source: str) -> None:
    """Turn the :data:`_BYTE_FIELDS` of ``raw`` (given as text or an integer) into what their fields hold, in
    place. Raises ConfigError naming the field, the value and the accepted forms (the flag's message)."""
    for (section, name), parse in _BYTE_FIELDS.items():
        table = raw.get(section)
        if not isinstance(table, dict) or name not in table:
            continue
        value = table[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            continue  # left to msgspec, which names the type expected
        try:
            table[name] = parse(value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {str(exc).replace('--disk-budget', f'{section}.{name}')}") from None


def _by_name(raw: dict, where: str) -> str:
    """``experiments.<i>.<field>`` → ``experiments.<name>.<field>`` when entry ``i`` has a valid name: the key the
    user wrote in the file (``[[experiments]] name = ...``) or in an override (``experiments.<name>.lr=...``); an
    entry without a usable name keeps its index."""
    parts = where.split(".")
    if len(parts) < 2 or parts[0] != "experiments" or not parts[1].isdigit():
        return where
    items = raw.get("experiments")
    i = int(parts[1])
    name = items[i].get("name") if isinstance(items, list) and i < len(items) and isinstance(items[i], dict) else None
    try:
        check_id(name, "experiment name")
    except (ValueError, TypeError):
        return where
    return ".".join(["experiments", name, *parts[2:]])


def convert(raw: dict, source: str = "config") -> RunConfig:
    """Validate a raw table into a :class:`RunConfig`. Raises ConfigError naming the field, the bad
    value's problem and what the field accepts."""
    check_unknown(raw, source=source)
    _parse_byte_fields(raw, source)
    try:
        cfg = msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as exc:
        where, problem = path_of(exc)
        accepted = _describe(type_at(where.split(".")), where.endswith("_s")) if where else ""
        found, value = _value_at(raw, where.split(".")) if where else (False, None)
        where = _by_name(raw, where)
        if found and is_range_error(problem, value):  # a declared range (msgspec.Meta) the value is outside of
            raise ConfigError(f"{source}: {range_message(where, value, accepted)}") from None
        raise ConfigError(f"{source}: {where or 'top level'}: {problem}"
                          + (f"; accepted: {accepted}" if accepted else "")) from None
    check_run_config(cfg, source)
    check_horizon(raw, cfg, source)
    return cfg


def check_horizon(raw: dict, cfg: RunConfig, source: str = "config") -> None:
    """One horizon per experiment: ``steps`` and ``consumer.epochs`` (> 0) both given in the raw table (the
    file, its overrides and the CLI flags) say twice how long to train, so they are refused; with ``epochs``
    alone :func:`artcache.app.experiments.plan_run` turns it into ``steps`` from the plan (the dry run, the run
    and a rerun then walk the same steps).

    Raises:
        ConfigError: naming both values and the two ways on.
    """
    items = raw.get("experiments") if isinstance(raw.get("experiments"), list) else []
    for i, (item, e) in enumerate(zip(items, cfg.experiments, strict=False)):
        epochs = e.consumer.get("epochs", 0)
        if isinstance(item, dict) and "steps" in item and isinstance(epochs, int) and epochs > 0:
            raise ConfigError(f"{source}: experiments.{i} ({e.name!r}) gives steps {e.steps} and consumer.epochs "
                              f"{epochs}, which both say how long to train; give one of them (leave steps out to "
                              "train by epochs)")


def check_run_config(cfg: RunConfig, source: str = "config") -> None:
    """Checks the field types cannot declare: experiment names valid, unique and not numbers (an override's
    ``experiments.N`` is an index), windows well formed, layer id lists not empty (ranges are declared on the
    fields and checked by :func:`convert`)."""
    seen = set()
    for i, e in enumerate(cfg.experiments):
        try:
            check_id(e.name, "experiment name")
        except ValueError as exc:
            raise ConfigError(f"{source}: experiments.{i}.name: {exc}") from None
        if e.name.isdigit():  # experiments.N.FIELD names the entry at index N: a name N would be ambiguous
            raise ConfigError(f"{source}: experiments.{i}.name {e.name!r} is a number, which an override "
                              f"experiments.{e.name}.FIELD=VALUE reads as an index; accepted: a name with a letter "
                              "or another character of A-Z a-z _ . -")
        if e.name in seen:
            raise ConfigError(f"{source}: experiments.{i}.name {e.name!r} is used twice; names must be unique")
        seen.add(e.name)
        parse_window(e.window, f"{source}: experiments.{e.name}.window")
        homed = [k for k in e.consumer if k in EXPERIMENT_CONSUMER_KEYS]
        if homed:  # one home: the plan, its capture union and the dry run read the experiment's key
            key = EXPERIMENT_CONSUMER_KEYS[homed[0]]
            raise ConfigError(f"{source}: experiments.{e.name}.consumer.{homed[0]} is the experiment's own setting: "
                              f"set experiments.{e.name}.{key} instead"
                              + (" (LOOKBEHIND:LOOKAHEAD)" if key == "window" else "")
                              + " (the key the run's plan, capture union and dry run read)")
        if e.layer_ids is not None and not e.layer_ids:
            raise ConfigError(f"{source}: experiments.{e.name}.layer_ids is empty: give output-of-layer ids, or leave "
                              "it out for the draft's default view")
    if cfg.capture.layer_ids is not None and not cfg.capture.layer_ids:
        raise ConfigError(f"{source}: capture.layer_ids is empty: give output-of-layer ids, or leave it out for "
                          "the union of the experiments' views")
    try:  # cache.retention may only repeat what cache.disk_budget says
        retention_rule(cfg.cache.disk_budget, cfg.cache.retention)
    except ConfigError as exc:
        raise ConfigError(f"{source}: cache: {str(exc).replace('--disk-budget', 'disk_budget').replace('--', '')}"
                          ) from None


# ---- overrides ---------------------------------------------------------------------------------------

_NONE = ("none", "null", "~")
_BOOL = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def parse_override(text: str) -> tuple[list[str], str]:
    """``"experiments.0.lr=1e-3"`` → (["experiments", "0", "lr"], "1e-3"). Raises ConfigError."""
    key, sep, value = text.partition("=")
    path = key.strip().split(".")
    if not sep or not key.strip() or any(not s.strip() for s in path):
        raise ConfigError(f"override {text!r} is not SECTION.FIELD=VALUE (e.g. data.max_length=256 or "
                          "experiments.0.lr=1e-3)")
    return [s.strip() for s in path], value.strip()


def _loose(text: str) -> Any:
    """A value of a free-form table (``consumer``): a TOML value if it parses as one, else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_value(text: str, t: mi.Type, where: str) -> Any:
    """Parse override text by the field's declared type. Raises ConfigError naming ``where``."""
    inner, optional = _strip_none(t)
    if optional and text.lower() in _NONE:
        return None

    def bad(extra: str = "") -> ConfigError:
        return ConfigError(f"override {where}={text!r}: expected {_describe(t, ranges=False)}{extra}")

    if isinstance(inner, mi.StrType):
        return text
    if isinstance(inner, mi.BoolType):
        if text.lower() not in _BOOL:  # the spellings this parser takes, not only TOML's true and false
            spell = [", ".join(k for k, v in _BOOL.items() if v is flag) for flag in (True, False)]
            raise bad(f" (accepted, any case: {spell[0]} or {spell[1]}"
                      + (f"; {', '.join(_NONE)} for none" if optional else "") + ")")
        return _BOOL[text.lower()]
    if isinstance(inner, mi.IntType):
        try:
            return int(text)
        except ValueError:
            raise bad() from None
    if isinstance(inner, mi.FloatType):
        try:
            return float(text)
        except ValueError:
            raise bad() from None
    if isinstance(inner, mi.LiteralType):
        if text not in inner.values:
            raise bad()
        return text
    if isinstance(inner, mi.ListType) and not isinstance(inner.item_type, mi.StructType):
        body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        items = [s.strip() for s in body.split(",")] if body.strip() else []
        if "" in items:  # "1,,2" or "1,": an empty item is a typo, never skipped (the CLI refuses it too)
            raise bad()
        return [parse_value(s, inner.item_type, f"{where}[{i}]") for i, s in enumerate(items)]
    if isinstance(inner, (mi.StructType, mi.ListType, mi.DictType)):
        raise ConfigError(f"override {where}={text!r}: {where} is {_describe(inner)}; override one of its fields "
                          f"({where}.FIELD=VALUE)")
    return _loose(text)


def _consumer_bool(name: str) -> mi.Type | None:
    """The declared type of ConsumerConfig field ``name`` when it is a bool (optional or not), else None: an
    ``experiments.N.consumer.NAME=VALUE`` override of a bool takes the spellings a typed bool field does
    (``yes``, ``on``, ``1`` ...; regression: the free-form table's TOML parse refused all but true and false)."""
    from artcache.trainers.consumer.config import ConsumerConfig

    t = next((f.type for f in mi.type_info(ConsumerConfig).fields if f.name == name), None)
    return t if t is not None and isinstance(_strip_none(t)[0], mi.BoolType) else None


def apply_override(raw: dict, path: list[str], value: Any, *, text: bool = True) -> None:
    """Set ``path`` in the raw table (creating absent section tables). ``text``: ``value`` is override
    text to parse by the field's type; otherwise an already typed value (a CLI flag's).

    Raises ConfigError for a path that names no field (listing the accepted ones), an experiment
    index or name that does not exist, or a value its field does not accept.
    """
    where = ".".join(path)
    node: Any = raw
    t: mi.Type = _INFO
    for depth, seg in enumerate(path):
        last = depth == len(path) - 1
        here = path[:depth]
        t, _ = _strip_none(t)
        if isinstance(t, mi.StructType):
            fields = _fields(t)
            if seg not in fields:
                raise ConfigError(f"override {where}: unknown field {seg!r} in {_section_name(here)}; accepted: "
                                  f"{', '.join(fields)}")
            ft = fields[seg].type
            if last:  # a byte count's text is parsed by its flag's parser in convert
                node[seg] = (parse_value(value, ft, where) if text and isinstance(value, str)
                             and tuple(path) not in _BYTE_FIELDS else value)
                return
            inner, _ = _strip_none(ft)
            if isinstance(inner, mi.ListType):
                node = node.setdefault(seg, [])
            else:
                nxt = node.get(seg)
                if not isinstance(nxt, dict):
                    nxt = node[seg] = {}
                node = nxt
            t = ft
        elif isinstance(t, mi.ListType):
            if not isinstance(node, list):
                raise ConfigError(f"override {where}: {_section_name(here)} is not a list in this config")
            names = [str(x.get("name")) if isinstance(x, dict) else "?" for x in node]
            if seg.isdigit() and int(seg) < len(node):
                node = node[int(seg)]
            elif seg in names:
                node = node[names.index(seg)]
            else:
                raise ConfigError(f"override {where}: no {_section_name(here)} entry {seg!r}; accepted: an index "
                                  f"0..{len(node) - 1} or a name ({', '.join(names)})" if node else
                                  f"override {where}: {_section_name(here)} is empty in this config")
            if last:
                raise ConfigError(f"override {where}: name a field of the entry, e.g. {where}.lr=1e-3")
            t = t.item_type
        elif isinstance(t, mi.DictType):
            if not last:
                nxt = node.get(seg)
                if not isinstance(nxt, dict):
                    nxt = node[seg] = {}
                node = nxt
                t = t.value_type
                continue
            vt = _consumer_bool(seg) if here[-1:] == ["consumer"] else None
            node[seg] = parse_value(value, vt or t.value_type, where) if text and isinstance(value, str) else value
            return
        else:
            raise ConfigError(f"override {where}: {_section_name(here)} is a single value, it has no field {seg!r}")


def saved_config_source(path: str | Path) -> str:
    """How errors name a config ``artcache run`` saved (a run's or an experiment's ``config.toml``, read back
    by ``report`` and ``inspect``): by its path, not as ``--config``, which that command has not."""
    return f"the saved run config {str(path)!r}"


def load_run_config(path: str | Path | None = None, overrides: tuple[str, ...] | list[str] = (),
                    flags: dict[str, Any] | None = None, source: str | None = None) -> RunConfig:
    """Read ``path`` (or start from the defaults), apply ``overrides`` then ``flags`` (dotted path → a CLI
    flag's value: typed, or text parsed by the field's type) and validate. Raises ConfigError, naming the
    file as ``source`` (default ``--config 'PATH'``; see :func:`read_file`)."""
    source = source or (f"--config {str(path)!r}" if path else "config")
    raw = read_file(path, source) if path else {}
    check_unknown(raw, source=source)
    for text in overrides:
        dotted, value = parse_override(text)
        apply_override(raw, dotted, value)
    for dotted, value in (flags or {}).items():  # a flag's text (e.g. --layer-ids 1,8) parses like an override
        apply_override(raw, dotted.split("."), value)
    return convert(raw, source)


# ---- saving ------------------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_table(header: str, table: dict, lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if v is not None and not isinstance(v, dict)
               and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))}
    lines.append(header)
    lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
    name = header.strip("[]")
    for k, v in table.items():
        if isinstance(v, dict) and v:
            lines.append("")
            _toml_table(f"[{name}.{_toml_key(k)}]", v, lines)
    for k, v in table.items():  # a list of tables ([[data.sources]]) after the tables: TOML's array of tables
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                lines.append("")
                _toml_table(f"[[{name}.{_toml_key(k)}]]", item, lines)


def dump_toml(cfg: RunConfig) -> str:
    """The config as TOML (``None`` fields left out: every optional field defaults to ``None``);
    :func:`load_run_config` reads it back to an equal config."""
    data = msgspec.to_builtins(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, (dict, list)) and v is not None]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append("")
            _toml_table(f"[{k}]", v, lines)
    for item in data.get("experiments", []):
        lines.append("")
        _toml_table("[[experiments]]", item, lines)
    return "\n".join(lines) + "\n"


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config as TOML and return its path (:func:`artcache.fsio.atomic_write`: temp file,
    fsync, rename, directory fsync; PublishError on an OSError, ``path`` untouched)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = "# resolved artcache run config (defaults filled in); rerun with --config this file\n" + dump_toml(cfg)
    atomic_write(p, [text.encode()], p.parent)
    return p


# ---- CLI flags as shortcuts --------------------------------------------------------------------------

#: ``artcache producer`` flag (parameter name) → config path. Flags not listed are process settings.
PRODUCER_FLAGS = {
    "cache": "cache.root", "target": "target.name", "dataset": "data.dataset", "seed": "data.seed",
    "max_length": "data.max_length", "max_samples": "data.max_samples", "draft_layers": "capture.draft_layers",
    "layer_ids": "capture.layer_ids", "device": "target.device", "dtype": "target.dtype",
    "compute_dtype": "target.compute_dtype", "batch_samples": "capture.batch_samples",
    "batch_tokens": "capture.batch_tokens", "max_queue": "capture.max_queue", "prefill_chunk": "capture.prefill_chunk",
    "heartbeat_timeout": "cache.heartbeat_timeout_s", "done_grace": "cache.done_grace_s", "threads": "target.threads",
    "template_options": "data.template_options", "group_shared": "cache.group_shared", "backend": "capture.backend",
    "eval_data": "data.eval",
    "disk_budget": "cache.disk_budget", "retention": "cache.retention", "payload": "cache.payload",
    "devices": "target.devices", "tensor_parallel_size": "target.tensor_parallel_size",
}
PRODUCER_PROCESS_FLAGS = ("exit_when_done", "expect_consumers", "expect_timeout", "idle_exit", "producer_id",
                          "fill", "evict_fill")

#: ``artcache consume --experiment NAME`` flag → field of that experiment (``E.`` prefix) or config path.
CONSUME_FLAGS = {
    "cache": "cache.root", "draft": "E.draft", "window": "E.window", "block_size": "E.block_size",
    "anchors": "E.anchors", "draft_layers": "E.draft_layers", "batch_size": "E.batch_size", "steps": "E.steps",
    "lr": "E.lr", "seed": "E.seed", "device": "E.device", "threads": "E.threads", "out_dir": "E.out",
    "demand_timeout": "cache.demand_timeout_s", "log_every": "E.log_every", "compile_mode": "E.consumer.compile",
    "commit_interval": "E.consumer.commit_interval_s", "reader": "E.consumer.reader",
    "nproc": "E.consumer.nproc", "grad_accum": "E.consumer.grad_accum", "group_timeout": "E.consumer.group_timeout_s",
    "cp": "E.consumer.cp", "shard": "E.consumer.shard",
}

#: ``artcache bench`` flag → config path.
BENCH_FLAGS = {
    "scenario": "bench.scenario", "device": "bench.device", "out_dir": "bench.out", "warmup": "bench.warmup",
    "steps": "bench.steps", "target": "target.name", "dataset": "data.dataset", "max_length": "data.max_length",
    "max_samples": "data.max_samples", "anchors": "bench.anchors", "batch_size": "bench.batch_size",
    "draft_layers": "capture.draft_layers", "window": "bench.window", "allow_shared_gpu": "bench.allow_shared_gpu",
    "modes": "bench.modes", "disk_budget": "bench.disk_budget", "budget_fraction": "bench.budget_fraction",
    "save": "bench.save", "consumer_ranks": "bench.consumer_ranks",
}


def flag_paths(verb: str, explicit: dict[str, Any], experiment: str | None = None) -> dict[str, Any]:
    """Explicit CLI flags of ``verb`` → {config path: value}. A flag with no config field raises
    ConfigError (it cannot be combined with ``--config``) unless it is a process setting."""
    table = {"producer": PRODUCER_FLAGS, "consume": CONSUME_FLAGS, "bench": BENCH_FLAGS}[verb]
    process = PRODUCER_PROCESS_FLAGS if verb == "producer" else ("consumer_id",) if verb == "consume" else ()
    out = {}
    for name, value in explicit.items():
        if name in process:
            continue
        path = table.get(name)
        if path is None:
            if verb == "consume" and name in Experiment.__struct_fields__:
                path = f"E.{name}"
            elif verb == "consume":
                path = f"E.consumer.{name}"
            else:
                raise ConfigError(f"--{name.replace('_', '-')} has no config field; with --config leave it out "
                                  "or set the value in the file")
        if path == "data.dataset":  # repeatable --data PATH[:WEIGHT], --eval-data: data.dataset or data.sources
            out.update(data_flags(value))
            continue
        if path == "data.eval":
            value = {"path": value}
        if path.startswith("E."):
            path = f"experiments.{experiment}.{path[2:]}"
        if path == "data.template_options":
            value = parse_template_options(value)
        elif path == "cache.disk_budget":
            value = parse_disk_budget(value)
        elif path == "target.devices":
            value = [d.strip() for d in str(value).split(",") if d.strip()]
        elif path == "bench.disk_budget":
            value = parse_bytes(value, "disk-budget")
        out[path] = value
    return out


# ---- views and the union ---------------------------------------------------------------------------

def draft_view(e: Experiment, num_layers: int, default_draft_layers: int = 5) -> list[int]:
    """The ordered output-of-layer ids experiment ``e``'s draft reads.

    DFlash: ``dflash_layer_ids(L, n)`` (DFlash arXiv:2602.06036 / z-lab ``build_target_layer_ids``);
    EAGLE-3: ``eagle3_capture_ids(L)`` = three aux layers then ``L - 1`` (EAGLE-3 arXiv:2503.01840);
    DSpark: ``dspark_layer_ids(L, n)`` = the DFlash ids then ``L - 1`` (DSpark arXiv:2607.05147);
    an explicit ``layer_ids`` replaces the formula. Raises ConfigError for ids the target lacks.
    The same list as the consumer's ``Draft.needed_layer_ids`` (the drafts' adapters), computed here
    without building the draft.
    """
    # imported here: artcache.layer_ids imports torch, which `artcache --help` and the light verbs never need
    from artcache.layer_ids import check_layer_ids, dflash_layer_ids, dspark_layer_ids, eagle3_capture_ids

    if e.layer_ids is not None:
        ids = list(e.layer_ids)
    elif e.draft in ("dflash", "dspark"):
        key = f"experiments.{e.name}.draft_layers" if e.draft_layers else "capture.draft_layers"
        ids = (dflash_layer_ids if e.draft == "dflash" else dspark_layer_ids)(
            num_layers, e.draft_layers or default_draft_layers, key)
    else:
        ids = list(eagle3_capture_ids(num_layers))
    check_layer_ids(ids, num_layers, f"experiment {e.name!r}: layer ids {ids}")
    return ids  # an id may repeat (EAGLE-3 on a 6-layer target: [1, 2, 2, 5]); the view reads it twice


def layer_union(views: list[list[int]]) -> list[int]:
    """The layers one capture must hold to serve every view: their union, ascending."""
    return sorted({i for v in views for i in v})


def evaluates(e: Experiment) -> bool:
    """Whether experiment ``e`` has a held-out evaluation (``consumer.eval_samples`` an int > 0; a bad
    value is the consumer config's to refuse)."""
    n = e.consumer.get("eval_samples", 0)
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def capture_layers(cfg: RunConfig, num_layers: int) -> tuple[list[int], list[str]]:
    """The layers a run captures when ``capture.layer_ids`` is left out, ascending: the union of the
    experiments' views (:func:`layer_union`), plus the target's last layer ``L - 1`` when an experiment
    evaluates (:func:`evaluates`), no view reads ``L - 1`` and ``capture.replay_layer`` is true (the
    held-out greedy replay, ``replay_tau``, needs ``argmax(lm_head(final_norm(h_{L-1})))``).

    Returns:
        (the output-of-layer ids, the names of the evaluating experiments the added ``L - 1`` serves; ``[]``
        when nothing was added).

    Raises:
        ConfigError: as :func:`draft_view` (ids the target lacks).
    """
    union = layer_union([draft_view(e, num_layers, cfg.capture.draft_layers) for e in cfg.experiments])
    last = num_layers - 1
    # a data.eval source is the held-out split of every experiment (artcache.plan.Plan.heldout)
    served = [e.name for e in cfg.experiments if evaluates(e) or cfg.data.eval is not None] \
        if cfg.capture.replay_layer and last not in union else []
    return (sorted([*union, last]) if served else union), served


def cache_root(cfg: RunConfig) -> str:
    """The cache root path: ``cache.root`` or ``<out>/cache``."""
    return cfg.cache.root or str(Path(cfg.out) / "cache")


#: :class:`artcache.scheduler.SchedulerLimits` field → its ``[capture]`` path (the name a limit is reported by)
CAPTURE_PATHS = {"max_queue": "capture.max_queue", "max_batch_samples": "capture.batch_samples",
                 "max_batch_tokens": "capture.batch_tokens", "prefill_chunk": "capture.prefill_chunk"}


def producer_config(cfg: RunConfig, **process: Any):
    """:class:`artcache.producer.ProducerConfig` from a run config (``capture.layer_ids`` as it is:
    ``artcache run`` fills in the union before saving). ``process``: exit_when_done, expect_consumers,
    expect_timeout and idle_exit (seconds), producer_id."""
    from artcache.producer import ProducerConfig  # imports torch: not at the CLI's start

    extra = {k: v for k, v in process.items() if v is not None}
    for name in ("idle_exit", "expect_timeout"):
        if name in extra:
            extra[f"{name}_s"] = extra.pop(name)
    layer_ids = list(cfg.capture.layer_ids) if cfg.capture.layer_ids else None
    if layer_ids is None and cfg.experiments:  # a producer started by hand for a run config: what `run` captures
        from artcache.target import resolve_target

        layer_ids, _ = capture_layers(cfg, resolve_target(cfg.target.name).num_layers)
    return ProducerConfig(
        cache=cache_root(cfg), target=cfg.target.name, dataset=cfg.data.dataset, seed=cfg.data.seed,
        sources=list(cfg.data.sources), eval=cfg.data.eval,
        max_length=cfg.data.max_length, max_samples=cfg.data.max_samples, draft_layers=cfg.capture.draft_layers,
        layer_ids=layer_ids, device=cfg.target.device, devices=list(cfg.target.devices),
        tensor_parallel_size=cfg.target.tensor_parallel_size, dtype=cfg.target.dtype,
        compute_dtype=cfg.target.compute_dtype,
        limits=SchedulerLimits(max_queue=cfg.capture.max_queue, max_batch_samples=cfg.capture.batch_samples,
                               max_batch_tokens=cfg.capture.batch_tokens, prefill_chunk=cfg.capture.prefill_chunk),
        heartbeat_timeout_s=cfg.cache.heartbeat_timeout_s, done_grace_s=cfg.cache.done_grace_s,
        threads=cfg.target.threads, template_options=dict(cfg.data.template_options),
        group_shared=cfg.cache.group_shared, backend=cfg.capture.backend, disk_budget=cfg.cache.disk_budget,
        retention=cfg.cache.retention, payload=cfg.cache.payload, **extra)


def experiment_dir(cfg: RunConfig, e: Experiment) -> str:
    return e.out or str(Path(cfg.out) / "experiments" / e.name)


def consumer_fields(cfg: RunConfig, e: Experiment, consumer_id: str | None = None) -> dict[str, Any]:
    """The :class:`artcache.trainers.consumer.ConsumerConfig` fields of experiment ``e`` (a plain dict)."""
    lookbehind, lookahead = parse_window(e.window, f"experiments.{e.name}.window")
    fields: dict[str, Any] = {
        "cache": cache_root(cfg), "consumer_id": consumer_id or e.name, "draft": e.draft,
        "lookbehind": lookbehind, "lookahead": lookahead,
        "batch_size": e.batch_size, "steps": e.steps, "lr": e.lr, "warmup_frac": e.warmup_frac, "seed": e.seed,
        "device": e.device or cfg.target.device, "threads": e.threads, "out_dir": experiment_dir(cfg, e),
        "demand_timeout_s": cfg.cache.demand_timeout_s, "log_every": e.log_every,
    }
    if e.draft in ("dflash", "dspark"):
        fields["draft_layers"] = e.draft_layers or cfg.capture.draft_layers
    elif e.draft_layers is not None:
        fields["draft_layers"] = e.draft_layers
    for name, value in (("block_size", e.block_size), ("num_anchors", e.anchors), ("lr_total_steps", e.lr_total_steps)):
        if value is not None:
            fields[name] = value
    if e.layer_ids is not None:
        fields["layer_ids"] = list(e.layer_ids)
    if e.resume:
        fields["resume"] = True
    if e.init_from:
        fields["init_from"] = e.init_from
    if not e.checkpoint_optimizer:
        fields["checkpoint_optimizer"] = False
    owned = [k for k in RUN_OWNED_CONSUMER_FIELDS if k in e.consumer]
    if owned:
        raise ConfigError(f"experiments.{e.name}.consumer.{owned[0]}: set by the run, not per experiment "
                          f"({RUN_OWNED_CONSUMER_FIELDS[owned[0]]})")
    fields.update(e.consumer)
    return fields


#: consumer settings an experiment holds under a key of its own (``experiments.<name>.<key>``), which the run's
#: plan, its capture union and the dry run read: the same setting under ``consumer`` is refused (it would reach
#: the consumer only, so the plan would not be what runs)
EXPERIMENT_CONSUMER_KEYS = {
    **{k: k for k in ("batch_size", "block_size", "checkpoint_optimizer", "device", "draft", "draft_layers",
                      "init_from", "layer_ids", "log_every", "lr", "lr_total_steps", "resume", "seed", "steps",
                      "threads", "warmup_frac")},
    "num_anchors": "anchors", "lookbehind": "window", "lookahead": "window"}

#: consumer settings the run itself sets for every experiment (an override would point two experiments at one
#: registration, or an experiment at another root than its producer's), with where each comes from
RUN_OWNED_CONSUMER_FIELDS = {"consumer_id": "the experiment's name: rename the experiment",
                             "cache": "cache.root, the root the run's producer fills",
                             "out_dir": "out/<experiment name>: set out"}


def consumer_config(cfg: RunConfig, name: str, consumer_id: str | None = None):
    """The experiment's validated :class:`artcache.trainers.consumer.ConsumerConfig`. Raises ConfigError naming a
    setting this consumer does not have (e.g. ``resume`` before the consumer supports it)."""
    from artcache.trainers.consumer import ConsumerConfig

    e = cfg.experiment(name)
    fields = consumer_fields(cfg, e, consumer_id)
    accepted = ConsumerConfig.__struct_fields__
    unknown = [k for k in fields if k not in accepted]
    if unknown:
        names = [k for k in (*accepted, *Experiment.__struct_fields__)
                 if k not in RUN_OWNED_CONSUMER_FIELDS and k not in ("name", "consumer")]
        close = difflib.get_close_matches(unknown[0], names, n=1)
        home = ("" if not close else f"; did you mean experiments.{name}.{close[0]}?"
                if close[0] in Experiment.__struct_fields__ and close[0] not in EXPERIMENT_CONSUMER_KEYS
                else f"; did you mean {consumer_key(e, close[0])}?")
        raise ConfigError(f"experiments.{name}.consumer.{unknown[0]}: the consumer has no setting {unknown[0]!r}"
                          + (home or " (`artcache consume --help` lists its settings)"))
    try:
        ccfg = msgspec.convert(fields, ConsumerConfig)
    except msgspec.ValidationError as exc:
        where, problem = path_of(exc)
        field = where.split(".")[0]
        key = consumer_key(e, field) + where[len(field):] if field else f"experiments.{name}.consumer"
        message = field_message(ConsumerConfig, field, fields.get(field), problem, key)
        declared = next((f.type for f in mi.type_info(ConsumerConfig).fields if f.name == field), None)
        if declared is not None and " is invalid: accepted " not in message:  # a type or choice: say what is accepted
            message += f"; accepted: {_describe(declared, field.endswith('_s'))}"
        raise ConfigError(message) from None
    try:
        ccfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"experiment {name!r}: {run_keys(str(exc), cfg, e)}") from None
    return ccfg


#: the experiment key of each consumer setting an experiment sets itself (:data:`EXPERIMENT_CONSUMER_KEYS`, and its
#: run directory, which the run sets from ``out``)
_EXPERIMENT_KEYS = {**EXPERIMENT_CONSUMER_KEYS, "out_dir": "out"}


def consumer_key(e: Experiment, field: str) -> str:
    """The run-config key that sets ConsumerConfig ``field`` for experiment ``e``: under ``consumer`` when the
    experiment sets it there, else its experiment key (``experiments.a.anchors``, ``experiments.a.window``),
    ``capture.draft_layers`` for a draft's layers the experiment leaves to the run, ``cache.demand_timeout_s``, else
    ``experiments.<name>.consumer.<field>``."""
    if field in e.consumer:
        return f"experiments.{e.name}.consumer.{field}"
    if field == "demand_timeout_s":
        return "cache.demand_timeout_s"
    if field == "draft_layers" and e.draft_layers is None:
        return "capture.draft_layers"
    if field in _EXPERIMENT_KEYS:
        return f"experiments.{e.name}.{_EXPERIMENT_KEYS[field]}"
    return f"experiments.{e.name}.consumer.{field}"


def run_keys(message: str, cfg: RunConfig, e: Experiment) -> str:
    """``message`` (the consumer's, naming ``artcache consume`` flags: ``--eval-interval 5 needs ...``) with each
    consumer flag replaced by the run-config key that sets it for experiment ``e`` (:func:`consumer_key`). Other
    text is left as it is."""
    from artcache.trainers.consumer import ConsumerConfig
    from artcache.trainers.consumer.config import flag_of

    keys = {flag_of(field): consumer_key(e, field) for field in ConsumerConfig.__struct_fields__}
    keys["--window"] = f"experiments.{e.name}.window"
    return name_keys(message, keys)


def name_keys(message: str, keys: Mapping[str, str]) -> str:
    """``message`` with every flag of ``keys`` (``--steps``, as a whole word) replaced by what it maps to (the
    run-config key that set the value: ``bench.steps``). Other text is left as it is."""
    if not keys:
        return message
    pattern = "|".join(re.escape(f) for f in sorted(keys, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])(?:{pattern})(?![\w-])", lambda m: keys[m.group(0)], message)


def file_keys(verb: str, params: Iterable[Any], explicit: Mapping[str, Any]) -> dict[str, str]:
    """For ``artcache producer|bench --config FILE``: {CLI flag: run-config key} of the verb's flags that were
    *not* given on the command line (their values came from the file or an override), so an error about such a
    value names the key the user set (:func:`name_keys`). ``params``: the command's click parameters."""
    table = {"producer": PRODUCER_FLAGS, "bench": BENCH_FLAGS}[verb]
    return {opt: table[p.name] for p in params if p.name in table and p.name not in explicit
            for opt in p.opts if opt.startswith("--")}


def bench_config(cfg: RunConfig):
    """:class:`artcache.bench.run.BenchConfig` from a run config (unset counts stay None: the bench fills in
    its device and scenario defaults, :data:`artcache.bench.run.DEVICE_DEFAULTS`)."""
    from artcache.bench.run import BenchConfig

    b = cfg.bench
    values = {  # None counts: the device's / scenario's defaults, filled in by artcache.bench.run.resolved
        "scenario": b.scenario, "device": b.device, "out_dir": b.out, "warmup": b.warmup, "steps": b.steps,
        "target": cfg.target.name, "dataset": cfg.data.dataset, "max_length": cfg.data.max_length,
        "max_samples": cfg.data.max_samples, "anchors": b.anchors,
        "batch_size": b.batch_size, "window": b.window, "allow_shared_gpu": b.allow_shared_gpu,
        "draft_layers": cfg.capture.draft_layers, "timeout_s": b.timeout_s, "modes": b.modes,
        "disk_budget": b.disk_budget, "budget_fraction": b.budget_fraction, "save": b.save,
        "consumer_ranks": b.consumer_ranks,
    }
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    if b.modes and "modes" not in names:
        raise ConfigError(f"bench.modes {b.modes!r} is not supported by this bench")
    return BenchConfig(**{k: v for k, v in values.items() if k in names})


__all__ = ["CAPTURE_PATHS", "BenchSection", "CacheSection", "CaptureSection", "DataSection", "Experiment", "RunConfig",
           "SlurmSection", "TargetSection", "apply_override", "bench_config", "capture_layers", "consumer_config",
           "convert", "dump_toml", "evaluates", "file_keys", "load_run_config", "name_keys", "parse_override",
           "producer_config", "read_file", "save_config", "saved_config_source"]
