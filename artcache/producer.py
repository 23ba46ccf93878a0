"""The producer: owns the target, the scheduler, capture and publication, and eviction.

One loop iteration (:meth:`Producer.tick`):

1. read registrations; fence consumers whose process died (same host id) or whose heartbeat counter
   made no progress for ``heartbeat_timeout_s`` on this process's monotonic clock (artcache.liveness);
2. decide retention (:func:`artcache.eviction.decide`: live windows and leases always kept, the
   rest kept by future need while it fits the disk budget) and evict what it names;
3. take one batch from its capture queue (demand misses first, then the lookaheads in order of need,
   inside the budget; with ``--fill`` the rest of the plan after them);
4. for each fingerprint, take its striped lock without blocking (held ⇒ someone else is capturing:
   skip, counted as coalesced), re-check ``objects/``; capture the batch in one forward pass;
   publish each artifact (temp file, fsync, rename); release the locks.

With nothing to do it sleeps ``poll_interval_s`` (backpressure: it never runs ahead of a window,
except with ``fill``).
Per-pass work is bounded by the plan's length and the number of consumers, not by window widths
(a window wider than two epochs adds no sample: :func:`artcache.eviction.decide` looks no further).

Failure semantics: a capture ends in exactly one ``publish`` or ``capture_failure`` journal line (or, if
the producer is killed, in neither: "lost in a crash"). Transient write errors are retried with backoff
over seconds within one capture (:data:`PUBLISH_BACKOFF_S`); a capture that still fails counts as one
failed attempt, and after :data:`MAX_ATTEMPTS` the producer gives up on the fingerprint
(``failed/<fp>.json``); on a full disk (ENOSPC, EDQUOT) at once, not after 3 tries against the same full disk.
A give-up on a full disk is withdrawn by the same producer once the
filesystem has room again (:meth:`Producer.retry_space_bound`, looked at every :data:`SPACE_RETRY_S`), so a
consumer restarted after space was freed is served without restarting the producer (and a waiting one keeps
waiting). A full disk stops nothing else either: a dead consumer's fence that cannot be written is retried
every pass, journal lines are held in memory (artcache.journal). Any other error in the publisher thread
stops the producer (exit 1, the error on stderr); signals stop it at any point.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from artcache import journal as J
from artcache import registry, store
from artcache.contract import BACKENDS, CaptureContract, stored_dtype
from artcache.crashpoints import crash_point
from artcache.data.sources import DataSource
from artcache.errors import (
    ArtcacheError,
    CaptureFailed,
    ConfigError,
    DiskBudgetExceeded,
    IntegrityError,
    JournalError,
    LockTimeout,
    ProducerFailed,
    PublishError,
)
from artcache.eviction import (
    AUTO_BUDGET,
    RateEstimator,
    Reader,
    RetentionDecision,
    decide,
    evict_pass,
    expire_leases,
    retention_rule,
)
from artcache.fingerprint import PlanFingerprints
from artcache.fsio import atomic_write, free_space, is_space_error, remove_orphan_parts, space_reserve
from artcache.layout import SUBDIRS, CacheLayout, check_id
from artcache.liveness import HeartbeatWatch, dead_reason, from_token, this_process
from artcache.locking import Timeout, cache_lock
from artcache.payload import close_all, describe, new_spec, parse_payload_url, remote_for
from artcache.ranges import Count, DiskBudget, MaxLength, NonNegative, NonNegativeFloat, Positive, check_ranges
from artcache.report import first_few, format_bytes
from artcache.rolespec import spec_digest
from artcache.scheduler import SchedulerLimits, next_batch, window_bound
from artcache.settings import RootSettings, check_compatible, init_settings, load_settings
from artcache.shutdown import Cancelled, GracefulShutdown

log = logging.getLogger("artcache.producer")

#: capture attempts per fingerprint before the producer gives up on it (``failed/<fp>.json``: consumers
#: waiting on it then raise CaptureFailed with the error).
MAX_ATTEMPTS = 3
#: delays (seconds) between the tries of one publication that fails with a retryable errno: transient
#: errors are retried over ~15 s before the capture counts as one failed attempt
PUBLISH_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
#: seconds between the producer's passes over tmp/ for orphaned temp files
ORPHAN_PASS_S = 30.0
#: seconds between "waiting for consumers" lines while --expect-consumers holds capture back
EXPECT_NOTE_S = 30.0
#: seconds between the producer's looks at free space while it holds give-ups caused by a full disk
SPACE_RETRY_S = 10.0
#: seconds the producer waits for a dead consumer's registration lock before retrying the fence next pass
#: (a SIGSTOPped consumer may hold it; waiting the default 30 s killed the producer with LockTimeout)
FENCE_LOCK_TIMEOUT_S = 1.0


class ProducerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Producer settings (CLI flags map onto these fields).

    Attributes:
        cache: cache root directory. target: ``smollm2-135m-instruct`` or an HF directory.
        dataset: ``sharegpt``, ``synthetic`` or a data file, planned as its one source of weight 1
            (:func:`artcache.plan.as_sources`).
        sources, eval: a weighted mix of data sources replacing ``dataset``, and a separate evaluation source
            (:class:`artcache.plan.PlanSpec`, docs/data.md).
        seed, max_length, max_samples: the plan (see :class:`artcache.plan.PlanSpec`).
        draft_layers: number of DFlash draft layers; captured ids follow :func:`artcache.layer_ids.dflash_layer_ids`.
        layer_ids: explicit output-of-layer ids (overrides ``draft_layers``).
        device: ``cpu`` or ``cuda[:i]``. devices: two or more devices (``cuda:0``, ``cuda:1``) to place the
            target over with transformers' ``device_map`` (decoder layers in contiguous blocks,
            :func:`artcache.target.layer_device_map`), instead of ``device``; the first takes the inputs and
            gathers the captured layers. hf backend only. tensor_parallel_size: ranks of a torch.distributed
            group the target is sharded over by its tensor-parallel plan (gloo on ``cpu``, NCCL on ``cuda``,
            rank r on ``cuda:r``; on the CPU, ``threads`` 0 gives each rank cores / N threads;
            :mod:`artcache.backends.tensor_parallel`); rank 0 is this producer. hf
            backend, HF checkpoints only. Neither is part of the contract: the artifacts and their fingerprints
            are those of a one-device producer. dtype: stored dtype of the hidden states (``fp8`` =
            ``float8_e4m3fn`` codes with one fp32 scale per token row per layer, :mod:`artcache.fp8`).
        compute_dtype: dtype the target runs in; ``auto`` = float32 on CPU (bf16 matmuls are ~6x
            slower than fp32 on CPUs without AVX512-BF16/AMX), bfloat16 on CUDA.
        limits: scheduler limits. poll_interval_s: sleep when idle (seconds).
        max_inflight_batches: captured batches waiting for the publisher thread (capture of the
            next batch overlaps publication of the previous ones).
        heartbeat_timeout_s: a consumer whose heartbeat counter this producer saw make no progress for
            longer (on its own monotonic clock) is fenced as expired.
        lease_ttl_s: a lease or temp file whose holder's pid cannot be checked from here (another host or
            pid namespace) and that this producer has seen unchanged for longer is expired / removed.
        exit_when_done: exit once no consumer can come: at least one consumer has registered for this producer
            (at least ``expect_consumers`` until ``expect_timeout_s`` passes) and none has been live for
            ``done_grace_s`` seconds. A registration counts in any state it is in now, unless it was already
            terminal (completed, cancelled, failed, expired) when this producer started: that one is an earlier
            run's, and counts only once registered again (e.g. ``consume --resume``). A registration running at
            start counts (``artcache run`` registers its consumers before it starts the producer). With no
            registration that counts it waits ``expect_timeout_s`` for a first one (saying so in the log), then
            stops with :class:`ProducerFailed` (exit 1: it served nobody, e.g. every consumer died before
            registering); it never waits forever.
        expect_consumers: capture nothing until this many consumers have registered (a start
            line, not a step barrier: consumers started together then share every capture); after
            ``expect_timeout_s`` it starts anyway, so a consumer that died at start-up blocks no one.
        expect_timeout_s: seconds to wait for consumers to register: the ``expect_consumers`` start line,
            and ``exit_when_done``'s wait for a first registration.
        idle_exit_s: exit after this many seconds with no live consumer (0 = never).
        producer_id: journal id. threads: torch CPU threads (0 = torch default).
        template_options: chat template keyword arguments (e.g. ``{"enable_thinking": False}``); part of
            the plan id and of the contract's template digest, so of every fingerprint.
        group_shared: create the root (and its subdirectories) mode 2770, group read/write with setgid,
            instead of the private 0700 (see docs/protocol.md, "Security").
        backend: ``hf`` (transformers, forward hooks) or ``vllm`` (a vLLM engine with
            ``extract_hidden_states``; needs the ``artcache[vllm]`` extra, see docs/vllm.md). Recorded in
            the contract, so the two never share artifacts.
        disk_budget: bytes the retained artifacts may take, ``"auto"`` (what the root holds plus
            :data:`BUDGET_FREE_FRACTION` of the filesystem's free space at start, :func:`default_budget`), or 0
            (none). It picks the retention rule (:func:`artcache.eviction.retention_rule`): none keeps only the
            live windows, pinned held-out ranges and leases (disk use bounded by the windows); a budget keeps,
            beyond them, what a live consumer will read again while it fits. Live windows and leases are kept
            whatever it is. On a root whose payloads live in a remote store (``payload``) it budgets the payload
            bytes (the manifests record them); ``auto`` is refused there (ConfigError: the store's capacity, its
            holders' memory, is unknown here), and so is ``fill`` without a budget in bytes.
        retention: ``""`` (follow ``disk_budget``), ``need`` or ``windows``: may only repeat what the budget
            says (:func:`artcache.eviction.retention_rule` refuses a contradiction).
        fill: capture every sample of the plan (after what live consumers need), then exit; without
            ``disk_budget`` its budget is ``auto``. The fill is recorded in the root's journal
            (:func:`artcache.journal.fill_recorded`): later producers keep what it published whatever their rule.
        evict_fill: on a filled root, let retention evict the fill's artifacts like any others (and record
            that the root is no longer filled); said at start.
        payload: where the artifacts' tensors go: ``posix`` (files in the root), ``mooncake://HOST:PORT``
            (Mooncake Store, manifests in the root; docs/scale-out.md), or ``""``: what an existing root
            records (``posix`` for a new one). An explicit value must match the root's.
    """

    cache: str
    target: str = "smollm2-135m-instruct"
    dataset: str = "sharegpt"
    sources: list[DataSource] = []
    eval: DataSource | None = None
    seed: NonNegative = 0
    max_length: MaxLength = 512
    max_samples: Count = 2000
    draft_layers: int = 5
    layer_ids: list[int] | None = None
    device: str = "cpu"
    devices: list[str] = msgspec.field(default_factory=list)
    tensor_parallel_size: Count = 1
    dtype: str = "bfloat16"
    compute_dtype: str = "auto"
    limits: SchedulerLimits = msgspec.field(default_factory=SchedulerLimits)
    max_inflight_batches: Count = 2
    poll_interval_s: NonNegativeFloat = 0.02
    heartbeat_timeout_s: Positive = 30.0
    lease_ttl_s: Positive = 600.0
    exit_when_done: bool = False
    done_grace_s: NonNegativeFloat = 5.0
    expect_consumers: NonNegative = 0  # 0: none
    expect_timeout_s: Positive = 300.0
    idle_exit_s: NonNegativeFloat = 0.0  # 0: never
    producer_id: str = "producer"
    threads: NonNegative = 0
    template_options: dict[str, bool | int | float | str] = msgspec.field(default_factory=dict)
    group_shared: bool = False
    backend: str = "hf"
    disk_budget: DiskBudget | Literal["auto"] = 0  # bytes, at most 2**60; 0: none (the windows rule)
    retention: str = ""
    fill: bool = False
    evict_fill: bool = False
    payload: str = ""

    def validate(self) -> None:
        """The ranges declared on the fields (the plan's and the scheduler limits' included). Raises ConfigError
        naming the flag (``--heartbeat-timeout``, ``--batch-samples``: :func:`flag_of`), the value and what is
        accepted (:func:`artcache.ranges.check_ranges`)."""
        check_ranges(self, flag_of)
        if self.fill and self.evict_fill:
            raise ConfigError("--fill and --evict-fill contradict each other (a fill keeps the whole plan): give one")
        retention_rule(self.disk_budget, self.retention, self.fill)
        if self.devices and self.tensor_parallel_size > 1:
            raise ConfigError(f"--devices {','.join(self.devices)} and --tensor-parallel-size "
                              f"{self.tensor_parallel_size} are two placements: give one")
        if len(set(self.devices)) != len(self.devices):
            raise ConfigError(f"--devices {','.join(self.devices)} names a device twice; give each once")
        if self.backend != "hf" and (len(self.devices) > 1 or self.tensor_parallel_size > 1):
            flag = "--devices" if self.devices else "--tensor-parallel-size"
            raise ConfigError(f"{flag} is not accepted with --backend {self.backend}: vLLM's tensor-parallel workers "
                              "cannot hand their captures to artcache; use --backend hf (docs/scale-out.md)")
        if self.backend == "vllm" and self.limits.prefill_chunk:
            raise ConfigError(f"--prefill-chunk {self.limits.prefill_chunk} is invalid with --backend vllm: accepted "
                              "0 there (vLLM schedules its own chunked prefill within --batch-tokens)")
        if self.tensor_parallel_size > 1 and self.limits.prefill_chunk:
            raise ConfigError(f"--prefill-chunk {self.limits.prefill_chunk} is invalid with --tensor-parallel-size "
                              f"{self.tensor_parallel_size}: accepted 0 there (the follower ranks run one pass)")

    @property
    def first_device(self) -> str:
        """Where inputs go and captures are gathered: ``devices[0]`` when devices are given, else ``device``."""
        return self.devices[0] if self.devices else self.device


#: ``artcache producer`` flags not named ``--<field>`` (``_s`` dropped, ``_`` as ``-``); a scheduler limit by its
#: dotted path from :class:`ProducerConfig`
FLAGS = {"dataset": "--data", "sources": "--data", "eval": "--eval-data", "producer_id": "--id",
         "template_options": "--chat-template-option",
         "limits.max_batch_samples": "--batch-samples", "limits.max_batch_tokens": "--batch-tokens",
         "limits.max_queue": "--max-queue", "limits.prefill_chunk": "--prefill-chunk"}


def flag_of(field: str) -> str:
    """The ``artcache producer`` flag of a :class:`ProducerConfig` field (dotted path: ``limits.max_queue``)."""
    return FLAGS.get(field) or "--" + field.rpartition(".")[2].removesuffix("_s").replace("_", "-")


def root_flag(setting: str) -> str:
    """The flag a root mismatch names for a :class:`ProducerConfig` setting
    (:func:`artcache.settings.check_compatible`): :func:`flag_of`; the captured layers as
    ``--layer-ids/--draft-layers``."""
    return "--layer-ids/--draft-layers" if setting == "layer_ids" else flag_of(setting)


#: the default disk budget: this share of the free space beyond the filesystem's reserve
#: (:func:`artcache.fsio.space_reserve`, the one publication keeps free)
BUDGET_FREE_FRACTION = 0.9


def default_budget(layout: CacheLayout, retained: int) -> tuple[int, str]:
    """(budget bytes, how it was derived): what the root holds now plus :data:`BUDGET_FREE_FRACTION` of the
    filesystem's free space beyond its reserve (:func:`artcache.fsio.space_reserve`: 64 MiB or 5 %, the
    bytes publication never fills; a separate 1 GiB reserve here made the default 0 on filesystems below
    ~1.1 GiB)."""
    usage = shutil.disk_usage(layout.objects)
    reserve = space_reserve(usage.total)
    free = max(0, usage.free - reserve)
    budget = retained + int(BUDGET_FREE_FRACTION * free)
    return budget, (f"{format_bytes(retained)} retained + {BUDGET_FREE_FRACTION:.0%} of the "
                    f"{format_bytes(usage.free)} free on {layout.objects} beyond a {format_bytes(reserve)} reserve")


def budget_over_filesystem(layout: CacheLayout, budget: int, retained: int, key: str = "--disk-budget") -> str:
    """The start warning for a disk budget the root's filesystem cannot hold: more than what the root retains plus
    the free space (a budget above the filesystem's size always is); ``""`` when it fits. Such a budget never
    binds: captures fail for space (ENOSPC) first, while the accounting still shows room in the budget. The root
    need not exist yet (its nearest existing directory is measured). ``key``: the setting the warning names (the
    producer's flag, or ``cache.disk_budget`` for ``artcache run``'s plan)."""
    try:
        free, size, _ = free_space(layout.objects)
    except OSError:
        return ""
    if budget <= retained + free:
        return ""
    what = (f"the filesystem's size, {format_bytes(size)} ({size} bytes)" if budget > size else
            f"the {format_bytes(retained)} the root holds plus the {format_bytes(free)} free ({retained + free} bytes; "
            f"filesystem size {format_bytes(size)})")
    name = "disk budget" if key.startswith("--") else key
    return (f"{name} {format_bytes(budget)} ({budget} bytes) exceeds {what} of {layout.objects}: the budget "
            f"will not bind, captures fail for space (ENOSPC) first; give a {key} that fits (or auto)")


def describe_retention(policy: str, budget: int, how: str = "") -> str:
    """The start line that says which retention rule holds (:func:`artcache.eviction.retention_rule`) and,
    under ``need``, the budget (``how``: where it came from)."""
    if policy == "windows":
        return ("retention: the windows-only rule (no --disk-budget): what lies outside every live window, pinned "
                "held-out range and lease is evicted, so the root never holds more than the live windows need; give "
                "--disk-budget BYTES (or auto) to keep what consumers will read again")
    return (f"retention by future need inside a disk budget of {format_bytes(budget)} ({budget} bytes; {how}): "
            "beyond the live windows, what a live consumer will read again is kept while it fits")


class SizeModel:
    """Bytes of an artifact of ``T`` tokens: ``overhead + per_token × T``.

    ``per_token`` comes from the capture (layers × hidden size × stored dtype size, plus 5 bytes of
    token id and loss mask) when the hidden size is known, else from the largest bytes per token
    published; ``overhead`` (the safetensors header: contract, fingerprint and digests) is the largest
    excess any published artifact showed, 4 KiB until one was published. An estimate, used to keep
    captures inside the budget.
    """

    def __init__(self, per_token: int = 0) -> None:
        self.per_token = per_token
        self.overhead = 4 << 10 if per_token else 0
        self._seen = False

    def observe(self, tokens: int, nbytes: int) -> None:
        if not self.per_token or not self._seen and self.overhead == 0:
            self.per_token = max(self.per_token, -(-nbytes // max(1, tokens)))
        if not self._seen:
            self.overhead = 0
            self._seen = True
        self.overhead = max(self.overhead, nbytes - self.per_token * tokens)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.overhead + self.per_token * tokens


@dataclass
class ProducerStats:
    captures: int = 0
    publications: int = 0
    failures: int = 0
    evictions: int = 0
    recaptures: int = 0
    coalesced: int = 0
    busy_s: float = 0.0
    max_retained: int = 0
    max_retained_bytes: int = 0
    budget_bytes: int = 0
    binding_passes: int = 0
    evictions_by_reason: dict[str, int] = field(default_factory=dict)
    fill_complete: bool = False
    ever_published: set[str] = field(default_factory=set)
    follower: bool = False  # a tensor-parallel rank above 0 under torchrun: it ran forward passes only


def prepare_root(cfg: ProducerConfig):
    """Create/open the cache root, resolve the target, build or load the plan, write artcache.json.

    Returns:
        (layout, settings, plan, target_info, tokenizer)

    Raises:
        ConfigError: bad settings, or the root holds another contract/plan.
        DataError: the dataset yields no usable sample.
    """
    from artcache.layer_ids import check_layer_ids, dflash_layer_ids
    from artcache.plan import PlanSpec, ensure_plan, plan_id_for
    from artcache.target import closed_to_group, load_tokenizer, resolve_target

    try:
        dtype = stored_dtype(cfg.dtype)  # "fp8" is stored as float8_e4m3fn (artcache.fp8)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.compute_dtype not in ("bfloat16", "float16", "float32", "auto"):
        raise ConfigError(f"compute_dtype {cfg.compute_dtype!r} not accepted: use bfloat16, float16, float32 or auto")
    check_id(cfg.producer_id, "producer id")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"--backend {cfg.backend!r} is not accepted: use one of {', '.join(BACKENDS)}")
    if cfg.backend == "vllm":
        from artcache.backends.vllm import require_vllm

        require_vllm()  # before anything is written
    info = resolve_target(cfg.target)
    if cfg.tensor_parallel_size > 1:
        from artcache.target import is_random

        if is_random(info):
            raise ConfigError(f"--tensor-parallel-size {cfg.tensor_parallel_size} needs an HF checkpoint; --target "
                              f"{cfg.target!r} is a random-weight benchmark target (stored embeddings only): use "
                              "--devices, or one device")
    if cfg.backend == "vllm":
        from artcache.target import is_random

        if is_random(info):
            raise ConfigError(f"--target {cfg.target!r} is a random-weight benchmark target (stored embeddings "
                              "only) that vLLM cannot load; use --backend hf, or a full HF checkpoint")
    if info.max_positions and cfg.max_length > info.max_positions:
        raise ConfigError(f"--max-length {cfg.max_length} is invalid for target {info.name!r}: accepted an integer "
                          f"<= {info.max_positions}, its max_position_embeddings")
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids else \
        dflash_layer_ids(info.num_layers, cfg.draft_layers, flag_of("draft_layers"))
    # an explicit --layer-ids is a new root's capture set: each id once (the formula's ids are left as they are)
    check_layer_ids(layer_ids, info.num_layers, f"--layer-ids {','.join(map(str, layer_ids))}" if cfg.layer_ids
                    else f"layer ids {layer_ids} (dflash_layer_ids of --draft-layers {cfg.draft_layers})",
                    target=info.name, unique=bool(cfg.layer_ids))
    payload_url = parse_payload_url(cfg.payload) if cfg.payload else None
    spec = PlanSpec(dataset=cfg.dataset, sources=tuple(cfg.sources), eval=cfg.eval, seed=cfg.seed,
                    max_length=cfg.max_length, max_samples=cfg.max_samples,
                    template_options=dict(cfg.template_options))
    cfg.limits.validate(cfg.max_length, lambda field: flag_of(f"limits.{field}"))
    layout = CacheLayout(_abspath(cfg.cache))
    if layout.root.exists() and not layout.root.is_dir():
        raise ConfigError(f"--cache {cfg.cache!r} exists and is not a directory; give a directory path")
    for parent in layout.root.parents:
        if (parent / "artcache.json").is_file():
            raise ConfigError(f"--cache {cfg.cache!r} is inside the cache root {str(parent)!r}; give a directory "
                              "outside any cache root")
    _check_cache_dir(layout, cfg.cache)
    tok = load_tokenizer(info)
    contract = capture_contract(info, tok, layer_ids=layer_ids, dtype=dtype, compute_dtype=cfg.compute_dtype,
                                device=cfg.first_device, max_length=cfg.max_length,
                                template_options=spec.template_options, backend=cfg.backend)
    recorded = None
    if layout.settings.is_file():  # an initialised root: refuse another contract/plan before writing
        current = load_settings(layout)
        check_compatible(current, contract, plan_id_for(spec, tok), layout, spec=spec, name_of=root_flag)
        recorded = current.payload
        if cfg.payload and payload_url != (recorded.url if recorded else None):
            raise ConfigError(f"--payload {cfg.payload!r}: cache root {layout.root} keeps its payloads in "
                              f"{describe(recorded)}; give --payload {describe(recorded)} (or leave it out)")
    if payload_url is not None and recorded is None:  # before anything is written: the store must answer
        from artcache.payload_mooncake import client_for

        client_for(payload_url)  # kept open: this process publishes through it
    try:
        created = layout.create(group_shared=cfg.group_shared)
    except ArtcacheError:  # UnsafePath & co keep their own type
        raise
    except OSError as exc:  # e.g. a parent that is a file, /proc, a read-only mount
        raise ConfigError(f"--cache {cfg.cache!r} cannot be created as a cache root ({exc.strerror or exc}); give "
                          "a directory path on a writable filesystem") from None
    try:
        with cache_lock(layout.lock_path("root")):
            plan = ensure_plan(spec, tok, layout.plans, target_vocab_size=info.vocab_size)
            settings = init_settings(layout, RootSettings(
                plan_id=plan.plan_id, contract=contract, target_path=str(info.path),
                heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                payload=recorded or (new_spec(payload_url) if payload_url else None)))
        if cfg.group_shared and Path(cfg.target).expanduser().is_dir():  # a name: each user resolves it himself
            closed = closed_to_group(info.path, layout.root.stat().st_gid)
            if closed is not None:
                log.warning("--group-shared: the target %s cannot be read by the root's group (%s): a teammate's "
                            "consumer on this root will be refused at start; chmod -R g+rX the target (and g+x its "
                            "parents) or capture from a directory the group can read", info.path, closed)
        if settings.heartbeat_timeout_s != cfg.heartbeat_timeout_s:
            log.warning("this producer fences consumers silent for %g s (--heartbeat-timeout), but %s records "
                        "%g s from the root's creation, which `artcache fsck` uses for consumers of other hosts",
                        cfg.heartbeat_timeout_s, layout.settings, settings.heartbeat_timeout_s)
    except BaseException:
        # bad input leaves nothing behind: remove exactly the directories this call created
        for path in reversed(created):
            shutil.rmtree(path, ignore_errors=True)
        raise
    return layout, settings, plan, info, tok


def capture_contract(info, tokenizer, *, layer_ids, dtype: str, compute_dtype: str, device: str, max_length: int,
                     template_options: dict, backend: str) -> CaptureContract:
    """The capture contract of target ``info`` (:class:`artcache.target.TargetInfo`) with ``tokenizer``: the one
    place it is built, by the producer (:func:`prepare_root`) and by ``artcache run``'s plan before anything starts
    (so the two cannot differ).

    Args:
        layer_ids: the captured output-of-layer ids, in artifact order. dtype: the stored dtype (an alias such as
            ``fp8`` is stored as its full name, :func:`artcache.contract.stored_dtype`). compute_dtype: the
            target's (``auto``: :func:`resolve_compute_dtype` on ``device``). max_length: tokens per sample.
        template_options: the chat template's keyword arguments (part of the template digest). backend: ``hf``
            or ``vllm``.

    Raises:
        ValueError: ``dtype`` is not a stored dtype or an alias of one.
    """
    from artcache.target import template_digest, tokenizer_digest

    return CaptureContract(
        target_name=info.name, target_revision=info.revision, target_config_hash=info.config_hash,
        target_weights_digest=info.weights_digest, layer_ids=tuple(layer_ids), dtype=stored_dtype(dtype),
        compute_dtype=resolve_compute_dtype(compute_dtype, device), max_length=max_length,
        tokenizer_digest=tokenizer_digest(tokenizer), template_digest=template_digest(tokenizer, template_options),
        backend=backend)


def _check_cache_dir(layout: CacheLayout, given: str) -> None:
    """For an existing directory that is not yet a root: refuse one holding files named like a root's
    subdirectories (a clear ConfigError instead of create()'s UnsafePath), and warn when it holds anything
    else (say a mistyped home or data directory): the cache's directories would be created beside it
    (artcache never touches files it did not create, but they are easy to mistake for each other)."""
    if layout.settings.exists() or not layout.root.is_dir():
        return
    entries = os.listdir(layout.root)
    clash = [n for n in SUBDIRS if n in entries and not (layout.root / n).is_dir()]
    if clash:
        raise ConfigError(f"--cache {given!r} holds {', '.join(clash)} as file(s), where a cache root keeps "
                          "directories of those names; give an empty or new directory")
    foreign = sorted(n for n in entries if n not in SUBDIRS and n != "lost+found")
    if foreign:
        log.warning("--cache %s is not empty and not an artcache root (it holds %s); the cache's "
                    "directories are created beside them. Give an empty or new directory unless this is "
                    "intended", layout.root, first_few(foreign))


def resolve_compute_dtype(compute_dtype: str, device: str) -> str:
    """``auto`` → float32 on CPU, bfloat16 on CUDA; anything else unchanged."""
    if compute_dtype != "auto":
        return compute_dtype
    return "float32" if device == "cpu" else "bfloat16"


def _abspath(p: str):
    return Path(p).expanduser().absolute()


class Producer:
    """The producer loop over one cache root. See the module docstring for one iteration."""

    def __init__(self, layout: CacheLayout, settings: RootSettings, plan, backend, cfg: ProducerConfig,
                 journal: J.JournalWriter, hidden_size: int = 0) -> None:
        """``hidden_size``: the target's (sizes the first captures against the budget; 0: learned from
        the first publications)."""
        self.spec = spec_digest(cfg)  # the settings as given (producer_start.spec; artcache.rolespec)
        policy = retention_rule(cfg.disk_budget, cfg.retention, cfg.fill)  # ConfigError on a contradiction
        remote = remote_for(layout) is not None
        if remote and cfg.fill and not cfg.disk_budget:
            raise ConfigError("--fill on a root whose payloads live in a remote store needs --disk-budget BYTES (at "
                              "most the payload holders' memory): artcache cannot see that store's capacity")
        if remote and cfg.disk_budget == AUTO_BUDGET:
            raise ConfigError("--disk-budget auto derives the budget from the free space of the root's filesystem, "
                              "which says nothing about the remote store that holds this root's payloads: give "
                              "--disk-budget BYTES (at most the payload holders' memory)")
        cfg = msgspec.structs.replace(cfg, retention=policy)
        self.layout = layout
        self.settings = settings
        self.contract = settings.contract
        self.plan = plan
        self.fps = self.fp_of = PlanFingerprints(self.contract, plan)  # sample index -> fingerprint
        t0 = time.monotonic()
        self._fp_list, self._index_of, self._canon = self.fps.table()  # every sample's fingerprint, once
        self._lengths = np.array([plan.sample(i).input_ids.shape[0] for i in range(len(plan))], dtype=np.int64)
        if time.monotonic() - t0 > 5:
            log.info("fingerprinted %d plan samples in %.1f s", len(plan), time.monotonic() - t0)
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}.get(self.contract.dtype, 0)
        self.sizes = SizeModel(len(self.contract.layer_ids) * hidden_size * itemsize + 5
                               if hidden_size and itemsize else 0)
        self.rates = RateEstimator()
        for fp, nbytes in store.list_objects(layout).items():  # what a previous producer published
            if fp in self._index_of:
                self.sizes.observe(int(self._lengths[self._index_of[fp]]), nbytes)
        self.backend = backend
        self.cfg = cfg
        self.journal = journal
        self.pid = cfg.producer_id
        self.stats = ProducerStats()
        self._published: dict[str, int] = store.list_objects(layout)
        self._seen_consumers: set[str] = set()
        self._failed: dict[str, int] = {}  # fp -> failed attempts; given up at max_attempts (at once for space)
        self._attempts: dict[str, int] = {}  # fp -> capture attempts that failed (what a give-up marker says)
        self._space_bound: dict[str, int] = {}  # fp given up on a full disk -> its estimated bytes
        self._last_error: dict[str, str] = {}  # fp whose last capture attempt failed -> the error (--fill's report)
        self._next_space_look = 0.0
        self._state = threading.Lock()  # guards _published, _inflight, _failed and stats
        self._inflight: dict[str, int] = {}  # captured, not yet published: fp -> estimated bytes
        self._fresh: dict[str, int] | None = None  # published during an eviction pass (see evict)
        self._last_retained: tuple[int, int, int] | None = None
        self._none_running_since: float | None = None
        self._started = time.monotonic()
        self._next_nobody_note = self._started
        self._lock_held_seen: set[str] = set()
        #: fingerprints whose capture flock another producer held at this producer's last capture attempt: its
        #: next batch is taken from the queue after them (:meth:`tick`), so replicas on one root split the work
        self._held_elsewhere: set[str] = set()
        self._fence_space_noted: set[str] = set()  # dead consumers whose fence failed for space (logged once)
        self._any_live = False
        self._registered: set[str] = set()  # ids registered for this producer (see _ended_before), any state now
        #: id -> generation of each registration already terminal when this producer started: an earlier run's,
        #: which counts for ``exit_when_done`` / ``expect_consumers`` only once registered again (generation bumped)
        self._ended_before = {r.consumer_id: r.generation for r in registry.read_all(layout)
                              if r.state in registry.TERMINAL}
        self._beats = HeartbeatWatch(cfg.heartbeat_timeout_s)  # consumers' heartbeat progress
        self._lease_watch = HeartbeatWatch(cfg.lease_ttl_s)  # leases of holders it cannot check
        self._tmp_watch = HeartbeatWatch(cfg.lease_ttl_s)  # temp files of writers it cannot check
        self._next_orphan_pass = time.monotonic() + ORPHAN_PASS_S
        self._next_expect_note = 0.0
        self._last_failure = ""
        self.stop_event = threading.Event()
        self._publisher_error: BaseException | None = None
        self._publish_queue: queue.Queue = queue.Queue(maxsize=cfg.max_inflight_batches)
        self._publisher_thread = threading.Thread(target=self._publisher, daemon=True, name="artcache-publisher")
        self._publisher_thread.start()
        self._idle_since = time.monotonic()
        self._seed_history()
        retained = sum(self._published.values())
        if policy == "windows":
            self.budget, how = 0, ""
        elif isinstance(cfg.disk_budget, int) and cfg.disk_budget:
            self.budget, how = cfg.disk_budget, "--disk-budget"
        else:
            budget, how = default_budget(layout, retained)
            self.budget, how = budget, (f"--disk-budget auto, {how}" if cfg.disk_budget else
                                        f"--fill without --disk-budget: auto, {how}")
        self.stats.budget_bytes = self.budget
        # a filled root keeps what it was filled with unless --evict-fill says otherwise
        self.fill_kept: np.ndarray = np.empty(0, dtype=np.int64)
        filled = self._filled
        self.fill_note = ""
        if filled and self._published:
            mine = [(self._index_of[fp], n) for fp, n in self._published.items() if fp in self._index_of]
            nbytes = sum(n for _, n in mine)
            what = f"{len(mine)} artifacts of a --fill ({format_bytes(nbytes)})"
            if cfg.evict_fill:
                self.fill_note = (f"--evict-fill: the root holds {what}; no longer kept as a fill, so the "
                                  f"{'windows rule' if policy == 'windows' else 'disk budget'} may evict them")
            else:
                self.fill_kept = np.asarray(sorted(i for i, _ in mine), dtype=np.int64)
                over = (f", beyond the disk budget of {format_bytes(self.budget)}" if policy == "need"
                        and nbytes > self.budget else "")
                self.fill_note = (f"the root holds {what}: kept whatever the retention rule{over} (--evict-fill "
                                  "lets retention evict them)")
        elif cfg.evict_fill:  # asked for, but there is no fill to release: said, not silently ignored
            self.fill_note = ("--evict-fill: this root holds no artifacts of a --fill, so it changes nothing "
                              "(retention is as the rule says)")
        self.budget_note = describe_retention(policy, self.budget, how)
        self._remote = remote
        if policy == "need" and not remote:
            over = budget_over_filesystem(layout, self.budget, retained)
            if over:
                log.warning("%s", over)
        self.evict_fill = bool(cfg.evict_fill and filled)
        self._decision = RetentionDecision(budget=self.budget)
        self._decision_inflight = True
        self._fill_stuck = False  # --fill: the queue holds only samples the budget cannot take
        self._batch_s = 0.0  # recent capture batch latency (what a consumer would wait for one)

    # -- helpers ---------------------------------------------------------------------------
    def _seed_history(self) -> None:
        """Fingerprints published before (by any producer): a new capture of one is a recapture. Also whether
        the root is filled (:func:`artcache.journal.fill_recorded`)."""
        events = J.read_events(self.layout.journal).events
        for ev in events:
            if isinstance(ev, J.Publish):
                self.stats.ever_published.add(ev.fp)
        self._filled = J.fill_recorded(events)

    def length_of(self, sample: int) -> int:
        """Tokens of plan sample ``sample``."""
        return int(self._lengths[sample])

    def _emit(self, ev, hold: bool = True) -> None:
        """Journal ``ev``; on a full disk it is held in memory in order (:class:`artcache.journal.JournalWriter`)."""
        self.journal.emit(ev, hold=hold)

    # -- liveness --------------------------------------------------------------------------
    def live_registrations(self) -> list[registry.Registration]:
        """The running registrations whose consumers are alive; fences (and journals) the dead ones: process
        gone (same host id: ``failed``) or no heartbeat progress for the timeout (``expired``)."""
        live = []
        regs = registry.read_all(self.layout)
        self._registered.update(r.consumer_id for r in regs if self._ended_before.get(r.consumer_id) != r.generation)
        running = [r for r in regs if r.state == "running"]
        self._beats.prune(r.consumer_id for r in running)
        for reg in running:
            progress = self._beats.observe(reg.consumer_id, reg.progress_token())
            reason, state = dead_reason(reg.identity), "failed"
            if reason is None and progress.silent:
                reason, state = dead_reason(None, progress), "expired"
            if reason:
                try:
                    fenced = registry.fence(self.layout, reg.consumer_id, state, reason, reg.generation,
                                            timeout=FENCE_LOCK_TIMEOUT_S)
                except LockTimeout:  # a paused consumer can hold its own lock: retry next pass, keep its window
                    log.warning("cannot fence consumer %s yet (%s): its registration lock is held; retrying "
                                "next pass", reg.consumer_id, reason)
                    live.append(reg)
                    continue
                except OSError as exc:  # a full disk: retry next pass; dead, so its window protects nothing
                    if not is_space_error(exc):
                        raise
                    if reg.consumer_id not in self._fence_space_noted:
                        self._fence_space_noted.add(reg.consumer_id)
                        log.warning("cannot fence consumer %s yet (%s): writing its registration failed (%s); "
                                    "retrying every pass, and its window no longer keeps artifacts, so eviction "
                                    "can free space", reg.consumer_id, reason, exc)
                    continue
                self._fence_space_noted.discard(reg.consumer_id)
                if fenced:
                    self._emit(J.Fence(producer=self.pid, consumer=reg.consumer_id,
                                       generation=reg.generation + 1, state=state, reason=reason))
                    log.warning("fenced consumer %s (%s): %s", reg.consumer_id, state, reason)
                continue
            live.append(reg)
            self._seen_consumers.add(reg.consumer_id)
        self._any_live = bool(live)
        return live

    # -- retention and eviction ---------------------------------------------------------------
    def readers(self, live: list[registry.Registration]) -> list[Reader]:
        """The live registrations as :func:`artcache.eviction.decide` sees them (rates observed now)."""
        now = time.monotonic()
        out = []
        for reg in live:
            self.rates.observe(reg.consumer_id, reg.generation, reg.cursor, now)
            out.append(Reader.of(reg, self.plan.order(reg.epoch_len), self.rates.rate(reg.consumer_id)))
        self.rates.forget(r.consumer_id for r in live)
        return out

    def evict(self, live: list[registry.Registration]) -> RetentionDecision:
        """Decide retention for this pass and evict what the decision names (never a live lease)."""
        live_ids = {r.consumer_id: r.identity for r in live}  # with identities: lease expiry
        with self._state:
            self._fresh = {}  # what the publisher thread publishes from now on (after the listing below)
        objects = store.list_objects(self.layout)
        live_leases, expired = expire_leases(self.layout, live_ids, lease_ttl_s=self.cfg.lease_ttl_s,
                                             lease_watch=self._lease_watch)
        for lease, reason in expired:
            self._emit(J.LeaseExpire(producer=self.pid, fp=lease.fp, lease=lease.name, reason=reason))
        n = len(self.plan)
        sizes = np.zeros(n, dtype=np.int64)
        foreign = []  # files named like fingerprints that no plan sample has: nobody can read them
        for fp, nbytes in objects.items():
            i = self._index_of.get(fp)
            if i is None:
                foreign.append(fp)
            else:
                sizes[i] = max(nbytes, 1)
        with self._state:
            inflight = dict(self._inflight)
        self._decision_inflight = bool(inflight) or not self._publish_queue.empty()
        blocked = [self._index_of[fp] for fp, k in self._failed.items() if k >= MAX_ATTEMPTS and fp in self._index_of]
        est = self.sizes(self._lengths)
        index = self._index_of
        decision = decide(
            self.readers(live), sizes=sizes, budget=self.budget, est_size=est, fp_of=self._fp_list.__getitem__,
            leased=[index[fp] for fp in live_leases if fp in index], keep=self.fill_kept,
            inflight=[index[fp] for fp in inflight if fp in index], blocked=blocked, canon=self._canon,
            max_queue=self.cfg.limits.max_queue, fill=self.cfg.fill, policy=self.cfg.retention,
            urgent_s=self.cfg.poll_interval_s + 2 * self._batch_s)
        reasons = {self._fp_list[i]: why for i, why in decision.evict.items()}
        reasons.update((fp, "unneeded") for fp in foreign)
        res = evict_pass(self.layout, reasons, live_ids, objects=objects, live_leases=live_leases)
        for fp, nbytes in res.evicted.items():
            self.stats.evictions += 1
            why = reasons[fp]
            self.stats.evictions_by_reason[why] = self.stats.evictions_by_reason.get(why, 0) + 1
            self._emit(J.Evict(producer=self.pid, fp=fp, nbytes=nbytes, reason=why))
        with self._state:
            # what is on disk now: the pass's listing (minus what it evicted) plus what the publisher thread
            # published since that listing. Not the old map: an artifact that vanished (quarantined by a
            # reader, removed by fsck) must become capturable again (test_regression_quarantined_artifact_
            # is_recaptured_by_a_running_producer)
            fresh = {fp: n for fp, n in self._fresh.items() if fp not in res.evicted}
            self._published = {**res.retained, **fresh}
            self._fresh = None
        self.stats.binding_passes += decision.binding
        self._decision = decision
        self._note_retained(live)
        return decision

    def _note_retained(self, live) -> None:
        """Journal the published artifacts (the producer's map of objects/), against the live window bound
        and the budget; only changes (the journal must not grow while idle)."""
        with self._state:
            nbytes = sum(self._published.values())
            d = self._decision
            key = (len(self._published), nbytes, window_bound(live, len(self.plan)), d.binding,
                   d.windows_exceed_budget)
            self.stats.max_retained = max(self.stats.max_retained, key[0])
            self.stats.max_retained_bytes = max(self.stats.max_retained_bytes, nbytes)
            if key == self._last_retained:
                return
            self._last_retained = key
        self._emit(J.Retained(producer=self.pid, artifacts=key[0], nbytes=key[1], window_bound=key[2],
                              budget=self.budget if self.cfg.retention == "need" else 0, binding=key[3],
                              windows_exceed_budget=key[4]))

    def _fit_budget(self, batch: list) -> list:
        """The batch without what would take the retained bytes over the budget (demand always stays:
        a blocked consumer is served whatever the budget). The decision fitted it already; this catches an
        eviction a lease prevented since."""
        if self.cfg.retention != "need":
            return batch
        with self._state:
            used = sum(self._published.values()) + sum(self._inflight.values())
        out = []
        for w in batch:
            est = int(self.sizes(self._lengths[w.sample]))
            if not w.demand and used + est > self.budget:
                continue
            used += est
            out.append(w)
        return out

    # -- capture ---------------------------------------------------------------------------
    def tick(self) -> bool:
        """One scheduling pass. Returns True if it captured anything.

        Raises:
            ProducerFailed: the publisher thread failed (see :meth:`_publisher`).
        """
        self._raise_if_publisher_failed()
        self.journal.flush_held()  # events held while the disk was full: written once space is back
        live = self.live_registrations()
        decision = self.evict(live)
        if time.monotonic() >= self._next_orphan_pass:
            self._next_orphan_pass = time.monotonic() + ORPHAN_PASS_S
            cleanup_orphans(self.layout, self._tmp_watch)
            with contextlib.suppress(FileNotFoundError):  # bounded memory: forget leases that are gone
                self._lease_watch.prune(os.listdir(self.layout.leases))
        self.retry_space_bound()
        if not self.cfg.fill and (not live or self._expecting()):
            return False
        if not len(decision.capture_samples):
            return False
        batch = self._fit_budget(next_batch(self._queue_head(decision), self.length_of, self.cfg.limits))
        self._fill_stuck = not batch
        return bool(batch) and self.capture_batch(batch, live)

    def _queue_head(self, decision) -> list:
        """The head of the capture queue the next batch is taken from, in the queue's order (demand first): without
        the fingerprints another producer on the root was capturing at the last attempt (:attr:`_held_elsewhere`),
        so a second producer captures the next ones instead of waiting on the same locks; the plain head when
        nothing else is left (those locks are probed again: a producer that died released them)."""
        k = self.cfg.limits.max_batch_samples
        head = decision.head(k + len(self._held_elsewhere))
        rest = [w for w in head if w.fp not in self._held_elsewhere]
        return rest or head[:k]

    def fill_missing(self) -> list[str]:
        """Fingerprints of the plan neither published nor given up (``--fill`` is complete without any)."""
        with self._state:
            return [fp for fp in dict.fromkeys(self._fp_list)
                    if fp not in self._published and self._failed.get(fp, 0) < MAX_ATTEMPTS]

    def fill_given_up(self) -> list[str]:
        """Fingerprints of the plan not published whose last capture failed (a full disk, a failing backend; also
        once a full-disk give-up was withdrawn): a ``--fill`` that leaves any is incomplete (:meth:`fill_shortfall`)."""
        with self._state:
            return [fp for fp in dict.fromkeys(self._fp_list) if fp not in self._published and fp in self._last_error]

    def fill_shortfall(self) -> str:
        """``--fill``: why the plan is not all published, in one phrase ("" when it is): how many samples are
        missing, how many of them captures failed for (with the last error) and how many the budget left out."""
        failed = set(self.fill_given_up())
        left = [fp for fp in self.fill_missing() if fp not in failed]
        if not failed and not left:
            return ""
        why = []
        if failed:
            why.append(f"{len(failed)} given up after failed captures (last: {self._last_failure})")
        if left:
            why.append(f"{len(left)} do not fit the disk budget of {format_bytes(self.budget)}")
        return f"{len(failed) + len(left)} of the plan's {len(self.plan)} samples are missing: {'; '.join(why)}"

    def fill_done(self) -> bool:
        """``--fill``: the last decision, taken with nothing in flight, left nothing to capture (every plan
        sample published or given up) or only what the budget leaves out."""
        return not self._decision_inflight and (not len(self._decision.capture_samples) or self._fill_stuck)

    def _expecting(self) -> bool:
        """True while ``--expect-consumers`` holds capture back (fewer registered, not timed out); says so in
        the log every :data:`EXPECT_NOTE_S` seconds (a silent wait reads like a hang)."""
        waited = time.monotonic() - self._started
        if len(self._seen_consumers) >= self.cfg.expect_consumers or waited >= self.cfg.expect_timeout_s:
            return False
        if time.monotonic() >= self._next_expect_note:
            self._next_expect_note = time.monotonic() + EXPECT_NOTE_S
            log.info("--expect-consumers %d: %d registered (%s); capturing nothing until all have, or in %.0fs",
                     self.cfg.expect_consumers, len(self._seen_consumers), ", ".join(sorted(self._seen_consumers)),
                     self.cfg.expect_timeout_s - waited)
        return True

    def capture_batch(self, batch, live) -> bool:
        """Lock, capture one batch in one forward pass, and hand it to the publisher thread.

        The striped locks are held until the batch is published (the publisher releases them), so
        another producer never captures the same fingerprint meanwhile. At most
        ``max_inflight_batches`` captured batches wait for publication (backpressure).
        """
        locks = []
        todo = []
        self._held_elsewhere = set()
        for w in batch:
            lock = cache_lock(self.layout.fingerprint_lock(w.fp, self.settings.lock_stripes), timeout=0,
                              thread_local=False)
            try:
                lock.acquire()
            except Timeout:  # another producer is capturing it: count that once per fingerprint
                self._held_elsewhere.add(w.fp)
                if w.fp not in self._lock_held_seen:
                    self._lock_held_seen.add(w.fp)
                    self.stats.coalesced += len(w.consumers)
                    self._emit(J.Coalesced(producer=self.pid, fp=w.fp, requesters=len(w.consumers),
                                           reason="lock-held"))
                continue
            if store.exists(self.layout, w.fp):  # another holder published meanwhile
                lock.release()
                with self._state:
                    self._published[w.fp] = 0
                continue
            locks.append(lock)
            todo.append(w)
        if not todo:
            return False
        samples = [self.plan.sample(w.sample) for w in todo]
        # the duration from the monotonic clock, the wall clock only for the batch's timestamp: a wall-clock
        # step must not make busy time negative (journal capture_batch: end = start + the measured duration)
        t0, m0 = time.time(), time.perf_counter()
        try:
            outputs = self.backend.capture(samples)
        except ProducerFailed:  # a failure the producer cannot retry (a tensor-parallel group out of step)
            for lock in locks:
                lock.release()
            raise
        except Exception as exc:  # a failed forward: every fingerprint in it failed once more
            for lock in locks:
                lock.release()
            for w in todo:
                self._fail(w.fp, exc, stage="forward")
            return False
        dt = time.perf_counter() - m0
        t1 = t0 + dt
        crash_point("capture.after-forward")
        self.stats.busy_s += dt
        self._batch_s = dt if not self._batch_s else 0.8 * self._batch_s + 0.2 * dt
        tokens = sum(int(s.input_ids.shape[0]) for s in samples)
        longest = max(int(s.input_ids.shape[0]) for s in samples)
        self._emit(J.CaptureBatch(producer=self.pid, fps=[w.fp for w in todo], samples=len(todo),
                                  tokens=tokens, padded_tokens=longest * len(todo), start=t0, end=t1,
                                  demand=sum(w.demand for w in todo)))
        # a backend whose batch has ready() (hf on a GPU) gives its NaN/Inf flags there, in the publisher
        finite = [False] * len(todo) if hasattr(outputs, "ready") else (
            getattr(self.backend, "last_finite", None) or [False] * len(todo))
        for w, s in zip(todo, samples, strict=True):
            recapture = w.fp in self.stats.ever_published
            self.stats.captures += 1
            self.stats.recaptures += recapture
            self._emit(J.Capture(producer=self.pid, fp=w.fp, positions=sorted(w.positions),
                                 tokens=int(s.input_ids.shape[0]), recapture=recapture, demand=w.demand))
            if len(w.consumers) > 1:
                self.stats.coalesced += len(w.consumers) - 1
                self._emit(J.Coalesced(producer=self.pid, fp=w.fp, requesters=len(w.consumers) - 1))
        with self._state:
            self._inflight.update((w.fp, int(self.sizes(self._lengths[w.sample]))) for w in todo)
        item = (todo, outputs, finite, locks, live)
        while True:  # never block for good: the publisher may have died, a signal may stop us
            try:
                self._publish_queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self._publisher_error is not None or not self._publisher_thread.is_alive():
                    self._abandon(item)
                    self._raise_if_publisher_failed()
                    raise ProducerFailed("the publisher thread stopped") from None

    def _raise_if_publisher_failed(self) -> None:
        exc = self._publisher_error
        if exc is not None:
            raise ProducerFailed(f"publishing failed, the producer stops: {type(exc).__name__}: {exc}") from exc

    def _abandon(self, item) -> None:
        """Release the locks of a captured batch that will never be published (after a publisher failure);
        its captures stay unsettled in the journal, as a crash would leave them."""
        todo, _outputs, _finite, locks, _live = item
        for lock in locks:
            with contextlib.suppress(Exception):
                lock.release()
        with self._state:
            for w in todo:
                self._inflight.pop(w.fp, None)

    def _publisher(self) -> None:
        """Publisher thread: publishes captured batches in order, then releases their locks.

        It cannot die silently: any exception (a journal write, an unsafe path, a lock error) is kept in
        ``_publisher_error``, the producer is stopped (``stop_event``) and every queued batch's locks are
        released; the main loop then raises :class:`ProducerFailed` (exit 1)."""
        try:
            while True:
                item = self._publish_queue.get()
                if item is None:
                    return
                todo, outputs, finite, locks, live = item
                try:
                    self._publish_batch(todo, outputs, finite)
                finally:
                    self._abandon(item)  # releases the locks, clears in-flight
                self._note_retained(live)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self._publisher_error = exc
            log.error("the publisher thread failed: %s: %s", type(exc).__name__, exc)
            self.stop_event.set()
            self._abandon_queued()

    def _publish_batch(self, todo, outputs, finite) -> None:
        ready = getattr(outputs, "ready", None)
        if ready is not None:  # a GPU capture's host copies finish here, beside the next prefill
            try:
                finite = ready()
            except Exception as exc:  # the copies failed: every fingerprint of the batch failed once
                for w in todo:
                    self._fail(w.fp, exc)
                return
        for w, tensors, checked in zip(todo, outputs, finite, strict=True):
            self._publish(w.fp, tensors, values_checked=checked, tokens=self.length_of(w.sample))


    def _publish(self, fp: str, tensors, values_checked: bool = False, tokens: int = 0) -> None:
        """Publish one capture: retryable errors are retried after each delay of :data:`PUBLISH_BACKOFF_S`
        (interrupted by a stop); the capture then ends in one ``publish`` or one ``capture_failure``.
        ``tokens``: the sample's length, to learn bytes per token (the budget's size estimate)."""
        delays = iter(PUBLISH_BACKOFF_S)
        tries = 0
        while True:
            tries += 1
            try:
                nbytes = store.publish(self.layout, fp, self.contract, tensors, values_checked=values_checked,
                                       verify_tokens=True)
            except PublishError as exc:
                delay = next(delays, None) if exc.retryable else None
                if delay is not None:
                    log.warning("publishing %s failed (%s, try %d); retrying in %gs", fp, exc, tries, delay)
                    if not self.stop_event.wait(delay):
                        continue
                self._fail(fp, exc, tries=tries)
                return
            except IntegrityError as exc:
                self._fail(fp, exc, tries=tries)
                return
            with self._state:
                self.stats.publications += 1
                self.stats.ever_published.add(fp)
                self._published[fp] = nbytes
                self._last_error.pop(fp, None)
                if tokens:
                    self.sizes.observe(tokens, nbytes)
                if self._fresh is not None:
                    self._fresh[fp] = nbytes
            self._emit(J.Publish(producer=self.pid, fp=fp, nbytes=nbytes))
            with contextlib.suppress(FileNotFoundError):  # published after all: clear an old give-up
                os.unlink(self.layout.failure_path(fp))
            return

    def _fail(self, fp: str, exc: BaseException, tries: int = 1, stage: str = "publish") -> None:
        """One failed capture attempt of ``fp`` (``stage`` ``forward``: the forward pass failed, no capture was
        journaled; ``publish``: a journaled capture was not published after ``tries`` writes). After
        :data:`MAX_ATTEMPTS` attempts the producer gives up on ``fp``: ``failed/<fp>.json`` names this
        producer incarnation, so a later one supersedes it (:func:`supersede_failure_markers`)."""
        space = is_space_error(exc)
        with self._state:
            self.stats.failures += 1
            attempts = self._attempts[fp] = self._attempts.get(fp, 0) + 1
            # a full disk gives up at once (until space is back: retry_space_bound), instead of burning the
            # attempts back-to-back in the same millisecond against the same full disk
            self._failed[fp] = max(self._failed.get(fp, 0) + 1, MAX_ATTEMPTS if space else 0)
            total = self._failed[fp]
        retryable = bool(getattr(exc, "retryable", False))
        error = f"{type(exc).__name__}: {exc}" + (f" ({self._space_note()})" if space and not self._remote else "")
        self._last_failure = error
        with self._state:
            self._last_error[fp] = error
        self._emit(J.CaptureFailure(producer=self.pid, fp=fp, attempts=tries, retryable=retryable, error=error,
                                    stage=stage))
        if space:
            log.error("capture of %s failed (%s, attempt %d): %s; given up until the filesystem has room again "
                      "(looked at every %gs)", fp, stage, attempts, error, SPACE_RETRY_S)
        else:
            log.error("capture of %s failed (%s, attempt %d of %d, retryable=%s): %s", fp, stage, total,
                      MAX_ATTEMPTS, retryable, exc)
        if total >= MAX_ATTEMPTS:  # give up: tell consumers waiting on it instead of letting them hang
            me = this_process()
            # "space": withdrawn once space is back, so a waiting consumer keeps waiting (artcache.client)
            record = {"fingerprint": fp, "attempts": attempts, "retryable": retryable, "error": error,
                      "producer": me.token(), "hostname": me.hostname, "space": space}
            with contextlib.suppress(OSError):
                atomic_write(self.layout.failure_path(fp), [json.dumps(record).encode()], self.layout.tmp,
                             durable=False)
            if space:
                index = self._index_of.get(fp)
                est = int(self.sizes(self._lengths[index])) if index is not None else 0
                with self._state:
                    self._space_bound[fp] = est

    def _space_note(self) -> str:
        """What a write that failed for space says of it: the objects' filesystem is full, its free bytes and the
        disk budget beside what the root retains (a budget does not reserve space: the filesystem fills first
        when it is shared or smaller than the budget)."""
        try:
            free, size, _ = free_space(self.layout.objects)
        except OSError:
            return f"the filesystem of {self.layout.objects} is full"
        with self._state:
            retained = sum(self._published.values())
        budget = (f"disk budget {format_bytes(self.budget)} ({self.budget} bytes), {format_bytes(retained)} retained"
                  if self.cfg.retention == "need" else
                  f"no disk budget (the windows-only rule), {format_bytes(retained)} retained")
        lower = " or lower --disk-budget" if self.cfg.retention == "need" else ""
        return (f"the filesystem of {self.layout.objects} is full (or its quota is): {format_bytes(free)} ({free} "
                f"bytes) free of {format_bytes(size)}; {budget}; free space there{lower}")

    def retry_space_bound(self, now: float | None = None) -> list[str]:
        """Withdraw the give-ups caused by a full disk (ENOSPC, EDQUOT) once the objects' filesystem has
        room for the largest of them plus its reserve (:func:`artcache.fsio.space_reserve`): their
        ``failed/<fp>.json`` markers are removed and their attempts forgotten, so they are captured again when
        a consumer needs them (before, only a new producer retried them: a consumer restarted after space was
        freed died at once on the old marker). Looks every :data:`SPACE_RETRY_S` seconds while any is held.
        Returns the fingerprints withdrawn (empty when none, or when the space is not back)."""
        now = time.monotonic() if now is None else now
        if not self._space_bound or now < self._next_space_look:
            return []
        self._next_space_look = now + SPACE_RETRY_S
        try:
            free, size, _ = free_space(self.layout.objects)
        except OSError:
            return []
        with self._state:
            need = max(self._space_bound.values()) + space_reserve(size)
            if free < need:
                return []
            fps = list(self._space_bound)
            self._space_bound.clear()
            for fp in fps:
                self._failed.pop(fp, None)
                self._attempts.pop(fp, None)
        for fp in fps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.layout.failure_path(fp))
        log.info("free space is back on %s (%d B free, %d B needed): retrying %d capture(s) given up on a full "
                 "disk", self.layout.objects, free, need, len(fps))
        return fps

    # -- main loop -------------------------------------------------------------------------
    def done(self) -> bool:
        """``--exit-when-done``'s "no consumer can come": at least one consumer registered for this producer (any
        state now, but not one already terminal when it started and not registered since; at least
        ``expect_consumers`` of them until ``expect_timeout_s`` passes) and none is live."""
        if self._any_live:
            return False
        need = self.cfg.expect_consumers if time.monotonic() - self._started < self.cfg.expect_timeout_s else 0
        return len(self._registered) >= max(1, need)

    def _raise_if_nobody_came(self) -> None:
        """``--exit-when-done`` with no registration on the root: log the wait every :data:`EXPECT_NOTE_S`
        seconds, and raise :class:`ProducerFailed` once ``expect_timeout_s`` has passed (without it, a
        producer that never saw a consumer would wait forever)."""
        waited = time.monotonic() - self._started
        if waited >= self.cfg.expect_timeout_s:
            raise ProducerFailed(f"--exit-when-done: no consumer registered on {self.cfg.cache} in "
                                 f"{self.cfg.expect_timeout_s:g}s (--expect-timeout); nothing was served")
        if time.monotonic() >= self._next_nobody_note:
            self._next_nobody_note = time.monotonic() + EXPECT_NOTE_S
            log.info("--exit-when-done: no consumer has registered yet; stopping in %.0fs if none does",
                     self.cfg.expect_timeout_s - waited)

    def run(self) -> None:
        """Loop until stopped (signal, ``exit_when_done`` or ``idle_exit_s``).

        Raises:
            ProducerFailed: the publisher thread failed, or (``exit_when_done``) no consumer registered
                within ``expect_timeout_s``; the producer stopped (journal ``producer_stop``
                with reason ``failed: ...`` when the journal still takes it).
        """
        self._emit(J.ProducerStart(producer=self.pid, pid=os.getpid(), contract_id=self.contract.contract_id,
                                   plan_id=self.settings.plan_id, budget_bytes=self.budget,
                                   policy=self.cfg.retention, fill=self.cfg.fill, evict_fill=self.evict_fill,
                                   kept_fill=len(self.fill_kept), spec=self.spec),
                           hold=False)  # a producer that cannot journal its start does not start
        reason = "stopped"
        try:
            while not self.stop_event.is_set():
                worked = self.tick()
                if worked:
                    self._idle_since = time.monotonic()
                    continue
                if self.cfg.fill and self.fill_done():
                    shortfall = self.fill_shortfall()
                    self.stats.fill_complete = not shortfall
                    reason = ("plan filled" if not shortfall else f"plan incomplete: {shortfall}"
                              if self.fill_given_up() else "plan does not fit the budget")
                    break
                if self._any_live:  # as read by this pass's live_registrations()
                    self._idle_since = time.monotonic()
                    self._none_running_since = None
                elif self.cfg.exit_when_done and not self._registered:
                    self._raise_if_nobody_came()
                elif self.cfg.exit_when_done and self.done():
                    # wait a grace period: a sibling may register a moment after the others finished
                    now = time.monotonic()
                    self._none_running_since = self._none_running_since or now
                    if now - self._none_running_since >= self.cfg.done_grace_s:
                        reason = "all consumers finished"
                        break
                elif self.cfg.idle_exit_s and time.monotonic() - self._idle_since > self.cfg.idle_exit_s:
                    reason = f"idle for {self.cfg.idle_exit_s:.0f}s"
                    break
                self.stop_event.wait(self.cfg.poll_interval_s)
            else:
                reason = "signal"
            self._raise_if_publisher_failed()
            self.drain()
            self._raise_if_publisher_failed()
            # final pass: what no live consumer needs stays while it fits the budget (a later run reads it)
            self.evict(self.live_registrations())
        except BaseException as exc:
            reason = f"failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.drain()
            try:
                self._emit(J.ProducerStop(producer=self.pid, reason=reason))
            except JournalError as exc:  # the journal itself may be what failed: the stop is still logged
                log.error("could not journal the producer's stop (%s): %s", reason, exc)

    def drain(self) -> None:
        """Wait until every captured batch is published and stop the publisher thread (or, after the
        publisher failed, release what is still queued). Never blocks for good."""
        while self._publisher_thread.is_alive():
            try:
                self._publish_queue.put(None, timeout=0.1)
                break
            except queue.Full:
                continue
        self._publisher_thread.join()
        self._abandon_queued()  # after a failure: batches that will never be published

    def _abandon_queued(self) -> None:
        """:meth:`_abandon` every batch still queued for the publisher (the end-of-queue marker is dropped): once the
        publisher has failed, or stopped with batches left behind."""
        while True:
            try:
                item = self._publish_queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._abandon(item)

    def check_outcome(self) -> None:
        """Raise :class:`ProducerFailed` when every capture this producer attempted failed (a backend that
        fails every batch must not exit 0)."""
        st = self.stats
        if st.failures and not st.publications:
            raise ProducerFailed(f"every capture failed ({st.failures} failed attempt(s), 0 publications); last: "
                                 f"{self._last_failure}")

def run_producer(cfg: ProducerConfig) -> ProducerStats:
    """Check the settings (:meth:`ProducerConfig.validate`: ConfigError before anything is written), prepare
    the root, load the target once, and run the loop. Used by ``artcache producer``.

    SIGINT/SIGTERM follow :mod:`artcache.shutdown` from the moment the target is loaded until it returns (the
    previous handlers are restored then).

    Raises:
        artcache.shutdown.Cancelled: a first SIGINT / SIGTERM stopped the loop and the producer shut down cleanly
            (the batch in hand published or failed, the publisher drained, ``producer_stop`` journaled, the journal,
            backend and presence lock closed: nothing half-written): a KeyboardInterrupt carrying the signal
            (exit status ``128 + signal``, as a cancelled consume) and the counts of :func:`stats_summary`.
        ProducerFailed / DiskBudgetExceeded: every capture failed, or an unsignalled ``--fill`` is incomplete.
    """
    import torch

    from artcache.backends.hf import HFCaptureBackend
    from artcache.target import load_target_model, quiet_transformers

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    quiet_transformers()
    if cfg.tensor_parallel_size > 1:
        from artcache.backends.tensor_parallel import follow, launched_rank

        launched = launched_rank()
        if launched is not None and launched[0] > 0:  # under torchrun: ranks > 0 only run the forward passes
            follow(cfg.device)
            return ProducerStats(follower=True)
    layout, settings, plan, info, _tok = prepare_root(cfg)
    if cfg.fill and _plan_published(layout, settings, plan):  # a filled root: no target to load, nothing to do
        log.info("--fill: %s already holds every sample of plan %s (%d): nothing to capture", layout.root,
                 plan.plan_id[:12], len(plan))
        if not J.fill_recorded(J.read_events(layout.journal).events):
            _record_fill(layout, settings, cfg)
        return ProducerStats(fill_complete=True)
    supersede_failure_markers(layout)  # before the (slow) target load: a consumer must not see them meanwhile
    if settings.contract.backend == "vllm":
        from artcache.backends.vllm import VLLMCaptureBackend  # lazy: vLLM is an optional extra

        backend = VLLMCaptureBackend(info.path, settings.contract, device=cfg.device,
                                     max_num_batched_tokens=cfg.limits.max_batch_tokens)
    elif cfg.tensor_parallel_size > 1:
        from artcache.backends.tensor_parallel import TensorParallelGroup, load_tensor_parallel

        group = TensorParallelGroup(cfg.tensor_parallel_size, cfg.device)
        threads = cfg.threads
        if not threads and group.device.type == "cpu":  # the ranks share this machine's cores
            threads = max(1, (os.cpu_count() or 1) // group.size)
            torch.set_num_threads(threads)
        try:
            group.share_spec({"path": str(info.path), "contract": msgspec.json.encode(settings.contract).decode(),
                              "threads": threads})
            model = load_tensor_parallel(str(info.path), getattr(torch, settings.contract.compute_dtype), group)
        except BaseException:
            group.close()
            raise
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        log.info("target sharded over %d ranks (tensor parallel, %s): rank 0 holds %d of its %d parameters",
                 group.size, torch.distributed.get_backend(), local, sum(p.numel() for p in model.parameters()))
        backend = HFCaptureBackend(model, settings.contract, device=group.device, group=group)
    else:
        dtype = getattr(torch, settings.contract.compute_dtype)
        model = load_target_model(info, device=cfg.device, dtype=dtype, devices=cfg.devices)
        backend = HFCaptureBackend(model, settings.contract, device=cfg.first_device,
                                   prefill_chunk=cfg.limits.prefill_chunk)
        if len(cfg.devices) > 1:
            log.info("target placed over %s (decoder layers in contiguous blocks)", ",".join(cfg.devices))
    journal = J.JournalWriter(layout.journal_path("producer", cfg.producer_id))
    producer = Producer(layout, settings, plan, backend, cfg, journal, hidden_size=info.hidden_size)
    # SIGINT/SIGTERM: the first sets stop_event (the loop finishes its batch and exits cleanly), a second stops
    # at once (KeyboardInterrupt through the finally below); the previous handlers come back on the way out
    shutdown = GracefulShutdown("producer", event=producer.stop_event, asked="finishing the current batch")
    shutdown.install()
    presence = claim_producer_presence(layout)
    cleanup_orphans(layout)
    log.info("%s%s", producer.budget_note, "; --fill: the whole plan, then exit" if cfg.fill else "")
    if producer.fill_note:  # an eviction of filled artifacts is said at start
        (log.warning if producer.evict_fill else log.info)("%s", producer.fill_note)
    log.info("producer ready: plan %s (%d samples), layers %s, root %s", plan.plan_id[:12], len(plan),
             list(settings.contract.layer_ids), layout.root)
    try:
        producer.run()
    finally:
        shutdown.restore()
        journal.close(remove_if_empty=True)  # a start refused on a full disk leaves no empty journal behind
        backend.close()
        if presence is not None:
            presence.release()
        close_all()
    producer.check_outcome()
    if shutdown.signum:  # stopped by a signal, after the clean shutdown above
        raise Cancelled(shutdown.signum, stats_summary(producer.stats))
    if cfg.fill and not producer.stats.fill_complete and not producer.stop_event.is_set():
        shortfall = producer.fill_shortfall()
        if producer.fill_given_up():  # captures failed (a full disk): not a budget to raise
            raise ProducerFailed(f"--fill incomplete: {shortfall} (what was captured stays published; a later "
                                 "--fill captures the rest)")
        raise DiskBudgetExceeded(f"--fill incomplete: {shortfall}; raise --disk-budget (what fitted stays "
                                 "published)")
    return producer.stats


def stats_summary(stats: ProducerStats) -> dict[str, int]:
    """The counts a producer's closing line gives (``artcache producer``): captures, publications, evictions,
    recaptures and failures of this process."""
    return {"captures": stats.captures, "publications": stats.publications, "evictions": stats.evictions,
            "recaptures": stats.recaptures, "failures": stats.failures}


def _record_fill(layout: CacheLayout, settings: RootSettings, cfg: ProducerConfig) -> None:
    """Journal a ``--fill`` that found the plan published already (a start and a stop, no capture), so the root
    is recorded as filled (:func:`artcache.journal.fill_recorded`) even when a run that was not a fill published
    the plan."""
    journal = J.JournalWriter(layout.journal_path("producer", cfg.producer_id))
    try:
        journal.emit(J.ProducerStart(producer=cfg.producer_id, pid=os.getpid(),
                                     contract_id=settings.contract.contract_id, plan_id=settings.plan_id,
                                     policy="need", fill=True), hold=False)
        journal.emit(J.ProducerStop(producer=cfg.producer_id, reason="plan filled"), hold=False)
    finally:
        journal.close(remove_if_empty=True)


def _plan_published(layout: CacheLayout, settings: RootSettings, plan) -> bool:
    """Whether ``objects/`` holds every sample of ``plan`` (one listing, every fingerprint)."""
    objects = store.list_objects(layout)
    return all(fp in objects for fp in PlanFingerprints(settings.contract, plan).table()[0])


#: presence locks a warned producer waits for (see claim_producer_presence)
_PRESENCE_WAITERS: list = []


def claim_producer_presence(layout: CacheLayout):
    """Hold ``locks/producer.lock`` (flock) for this producer's life, so a second producer on the root is
    noticed. Returns the held lock (release it at exit), or None after logging a warning when another live
    process holds it; a daemon thread then waits for the lock and holds it until this process exits. A second
    producer is safe (each fingerprint is still captured once, under its capture flock) but loads the target
    again and evicts by the same windows, which is rarely intended."""
    lock = cache_lock(layout.lock_path("producer"), timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        log.warning("another producer is running on %s (it holds %s): both capture and evict for the same "
                    "consumers (each fingerprint is still captured once); stop one unless two producers are "
                    "intended", layout.root, layout.lock_path("producer"))
        # take the lock over when the holder exits, so a third producer started after that still sees this
        # one (the kernel drops the flock when this process dies; the thread never blocks shutdown)
        waiter = cache_lock(layout.lock_path("producer"), timeout=-1, thread_local=False)
        _PRESENCE_WAITERS.append(waiter)  # referenced for the process's life: a collected lock releases itself
        threading.Thread(target=lambda: waiter.acquire(poll_interval=1.0), name="producer-presence",
                         daemon=True).start()
        return None
    return lock


def cleanup_orphans(layout: CacheLayout, watch: HeartbeatWatch | None = None) -> int:
    """Remove temp files in ``tmp/`` whose writer is provably gone; returns how many were removed.

    Same host id: the writer's pid is gone (or reused). Another host or pid namespace, or a legacy name:
    only with a ``watch`` (the producer's), once the file was seen unchanged (inode, size, mtime) for the
    watch's timeout on this process's monotonic clock. Never a live writer's file. The sweep itself is
    :func:`artcache.fsio.remove_orphan_parts` over every temp suffix ``tmp/`` holds (``.part``, ``.evict``, ...)."""
    return remove_orphan_parts(layout.tmp, suffix="", watch=watch)


def supersede_failure_markers(layout: CacheLayout) -> int:
    """Remove every give-up marker (``failed/<fp>.json``) that this process did not write: a starting
    producer tries every fingerprint again, so an earlier incarnation's "gave up" no longer holds
    Returns how many were removed."""
    d = layout.root / "failed"
    me = this_process()
    removed = 0
    for entry in list(os.scandir(d)) if d.is_dir() else []:
        if not entry.name.endswith(".json") or entry.is_symlink():
            continue
        if marker_writer(Path(entry.path)) == me.token():
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed += 1
    if removed:
        log.info("superseded %d give-up marker(s) of an earlier producer in %s", removed, d)
    return removed


def marker_writer(path) -> str:
    """The producer identity token a give-up marker records ("" for a legacy or unreadable one)."""
    try:
        record = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return ""
    token = record.get("producer", "") if isinstance(record, dict) else ""
    return token if isinstance(token, str) and from_token(token) is not None else ""


__all__ = ["FLAGS", "ArtcacheError", "CaptureFailed", "Producer", "ProducerConfig", "flag_of", "prepare_root",
           "run_producer"]
