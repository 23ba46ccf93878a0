"""The ``artcache`` command line: producer, consume, inspect, bench."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
import msgspec
from click.core import ParameterSource

from artcache.app import config as C
from artcache.app.config import load_run_config, saved_config_source
from artcache.app.values import (
    check_device,
    data_flags,
    parse_bytes,
    parse_disk_budget,
    parse_layer_ids,
    parse_template_options,
)
from artcache.data.regenerate import BACKENDS as REGEN_BACKENDS
from artcache.data.regenerate import CACHES as REGEN_CACHES
from artcache.data.regenerate import DTYPES as REGEN_DTYPES
from artcache.data.sources import DataSource
from artcache.errors import ArtcacheError, CacheRootError, ConfigError
from artcache.layout import check_id
from artcache.logs import setup_logging
from artcache.ranges import NonNegativeFloat, check_value
from artcache.trainers import COMPILE_MODES, DRAFT_NAMES, LOSS_IMPLS


def _errors(fn):
    """Turn artcache errors into one clear line on stderr and the error class's exit status
    (``ArtcacheError.exit_code``: 2 = bad input, 1 = operational failure); a msgspec validation error of
    a config file is bad input too. A run a stop signal cancelled (its KeyboardInterrupt, after its own cleanup:
    a consumer's checkpoint and ``cancelled`` registration) exits ``128 + signal`` (130 SIGINT, 143 SIGTERM;
    :func:`artcache.shutdown.stop_exit_status`), not click's 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            from artcache.shutdown import cancelled_line, stop_exit_status

            code = stop_exit_status()
            click.echo(cancelled_line(code), err=True)
            sys.exit(code)
        except msgspec.ValidationError as exc:
            click.echo(f"artcache: error: {exc}", err=True)
            sys.exit(2)
        except ArtcacheError as exc:
            prefix = "" if exc.exit_code == 2 else f"{type(exc).__name__}: "
            click.echo(f"artcache: error: {prefix}{exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def parse_devices(text: str) -> list[str]:
    """``--devices cuda:0,cuda:1`` as a list, each checked by :func:`artcache.app.values.check_device` (``""``:
    none)."""
    devices = [d.strip() for d in text.split(",") if d.strip()] if text else []
    for dev in devices:
        check_device(dev, "--devices")
    return devices


def _check_fill_budget(fill: bool, given: str | None) -> None:
    """Refuse ``--disk-budget 0`` given with ``--fill``: 0 means no budget, the windows-only rule, which keeps no
    fill, while ``--fill`` retains by need (its budget ``auto`` when ``--disk-budget`` is left out). ``given``: the
    flag's text when it was given on the command line, else None.

    Raises:
        ConfigError: naming the value and what is accepted.
    """
    if fill and given is not None and parse_disk_budget(given) == 0:
        raise ConfigError(f"--disk-budget {given} (no budget: the windows-only rule, which keeps no fill) cannot go "
                          "with --fill; accepted: BYTES, auto, or leave --disk-budget out (auto)")


def _with_config(verb: str):
    """Add ``--config FILE`` (plus ``SECTION.FIELD=VALUE`` overrides; ``--experiment NAME`` for consume)
    to a verb. With a file the settings come from it, then the overrides, then the flags given on the
    command line (flags stay shortcuts for their config fields, see artcache/config.py)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, config=None, experiment=None, overrides=(), spec=None, write_spec=None, **kwargs):
            if write_spec:
                click.get_current_context().meta[_WRITE_SPEC] = write_spec
            if spec:
                ctx = click.get_current_context()
                given = [k for k in kwargs if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE
                         and k != "as_json"]  # how the summary is printed: no setting
                given += ["config"] * bool(config) + ["experiment"] * bool(experiment) + list(overrides)
                if given:
                    raise ConfigError(f"--spec {spec} holds every setting of this {verb}; leave out "
                                      f"{', '.join(g if '=' in g else '--' + g.replace('_', '-') for g in given)}")
                return _run_spec(verb, spec)
            if not config:
                if overrides or experiment:
                    raise ConfigError(f"{' '.join(overrides) or '--experiment ' + str(experiment)}: overrides and "
                                      "--experiment need --config FILE")
                if "cache" in kwargs and not kwargs["cache"]:
                    raise ConfigError("--cache DIR is required (or --config FILE, whose cache.root is used)")
                return fn(*args, **kwargs)
            ctx = click.get_current_context()
            explicit = {k: v for k, v in kwargs.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE
                        and k != "as_json"}  # how the summary is printed: no config field
            if verb == "consume" and not experiment:
                raise ConfigError("consume --config FILE needs --experiment NAME (one of the file's experiments)")
            cfg = C.load_run_config(config, overrides, C.flag_paths(verb, explicit, experiment))
            if verb == "consume":  # its messages name the run-config keys already (C.run_keys)
                _start("consumer", C.consumer_config(cfg, experiment, kwargs.get("consumer_id")))
                return
            try:
                if verb == "producer":
                    _check_fill_budget(kwargs["fill"], explicit.get("disk_budget"))
                    _start("producer", C.producer_config(cfg, **{k: kwargs[k] for k in C.PRODUCER_PROCESS_FLAGS}))
                else:
                    from artcache.bench.run import run_bench

                    # the resolved config beside the scenarios' reports, once the settings are checked
                    ok = run_bench(C.bench_config(cfg), on_start=lambda out: C.save_config(cfg, out / "config.toml"))
                    sys.exit(0 if ok else 1)
            except ConfigError as e:  # a value the file set is named by its key (bench.steps), not by its flag
                keyed = C.name_keys(str(e), C.file_keys(verb, ctx.command.params, explicit))
                if keyed == str(e):
                    raise
                raise type(e)(keyed) from e

        wrapper = click.argument("overrides", nargs=-1)(wrapper)
        if verb in ("producer", "consume"):
            wrapper = click.option("--spec", default=None, type=click.Path(dir_okay=False),
                                   help=f"A {'consumer' if verb == 'consume' else 'producer'} spec file (what "
                                   "artcache run, its Slurm job and the bench hand each role; artcache/rolespec.py): "
                                   "every setting, no other flag.")(wrapper)
            wrapper = click.option("--write-spec", default=None, type=click.Path(dir_okay=False),
                                   help="Write the spec file the other flags (or --config) build, then exit instead "
                                   "of running; start it later with --spec FILE (e.g. from your own job "
                                   "script).")(wrapper)
        if verb == "consume":
            wrapper = click.option("--experiment", default=None,
                                   help="With --config: the experiment (by name) this consumer runs.")(wrapper)
        return click.option("--config", default=None, type=click.Path(dir_okay=False),
                            help="Run config (TOML/YAML); SECTION.FIELD=VALUE arguments override it, flags "
                                 "given on the command line override both.")(wrapper)

    return deco


#: ``click`` context meta key: ``--write-spec FILE`` was given (:func:`_start` writes the spec instead of running)
_WRITE_SPEC = "artcache.write_spec"


def _run_spec(verb: str, path: str) -> None:
    """Run the producer or consumer a spec file describes (:func:`artcache.rolespec.read_spec`)."""
    from artcache.rolespec import read_spec

    if verb == "producer":
        from artcache.producer import ProducerConfig

        _start("producer", read_spec(path, "producer", ProducerConfig))
    else:
        from artcache.trainers.consumer import ConsumerConfig

        _start("consumer", read_spec(path, "consumer", ConsumerConfig))


def _start(role: str, cfg) -> None:
    """The one place the CLI starts a producer or consumer, whichever way its settings came (flags, ``--config``,
    ``--spec``): ``cfg`` (a :class:`~artcache.producer.ProducerConfig` / :class:`~artcache.trainers.consumer.
    ConsumerConfig`) is checked, then run, or with ``--write-spec FILE`` written as the role's spec file (no device
    check: the spec may be for another machine)."""
    cfg.validate()
    out = click.get_current_context().meta.get(_WRITE_SPEC)
    if out:
        from artcache.rolespec import write_spec

        click.echo(f"{role} spec written: {write_spec(out, role, cfg)}", err=True)
        return
    check_device(cfg.device)
    if role == "producer":
        from artcache.producer import run_producer, stats_summary
        from artcache.shutdown import Cancelled

        for dev in cfg.devices:
            check_device(dev, "--devices")
        try:
            stats = run_producer(cfg)
        except Cancelled as exc:  # after a clean shutdown: the closing line, then 128 + the signal, as consume
            click.echo(f"producer stopped by {signal_name(exc.signum)} (exit {exc.exit_status}): "
                       f"{_counts(exc.summary or {})}", err=True)
            sys.exit(exc.exit_status)
        if not stats.follower:  # a tensor-parallel rank above 0 captured nothing itself
            click.echo(f"producer done: {_counts(stats_summary(stats))}", err=True)
    else:
        from artcache.trainers.consumer import run_consumer

        _finish_consume(run_consumer, cfg, bool(click.get_current_context().params.get("as_json")))


def _counts(summary: dict) -> str:
    """A producer's closing counts (:func:`artcache.producer.stats_summary`) as words."""
    return ", ".join(f"{summary.get(k, 0)} {k}" for k in ("captures", "publications", "evictions", "recaptures",
                                                          "failures"))


def _finish_consume(run_consumer, cfg, as_json: bool) -> None:
    """Run the consumer and end the process as a person expects: a short summary on stdout (the summary's JSON
    line with ``--json``); exit 0 when it finished, 128 + the signal's number when SIGINT (130) or SIGTERM (143)
    stopped it after its checkpoint (never click's ``Aborted!``)."""
    from artcache.report import format_consume_summary
    from artcache.shutdown import Cancelled

    try:
        summary = run_consumer(cfg)
    except Cancelled as exc:
        name = signal_name(exc.signum)
        if as_json and exc.summary is not None:
            click.echo(json.dumps(exc.summary))
        else:
            click.echo(format_consume_summary(exc.summary, name))
        sys.exit(exc.exit_status)
    except KeyboardInterrupt:  # a stop before the consumer installed its handlers (loading, registering)
        from artcache.shutdown import stop_exit_status

        code = stop_exit_status()
        click.echo(format_consume_summary(None, signal_name(code - 128)))
        sys.exit(code)
    if summary is not None:  # None: a rank > 0 of a group (rank 0 prints the group's summary)
        click.echo(json.dumps(summary) if as_json else format_consume_summary(summary))


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``an interrupt`` for 0 (unknown)."""
    import signal

    return signal.Signals(signum).name if signum else "an interrupt"


#: the target flag of the commands that load one (producer, regenerate)
TARGET_OPTION = click.option("--target", default="smollm2-135m-instruct",
                             help="Target: the embedded name, an HF directory or a Hugging Face hub id (ORG/NAME).")


class _OneLineUsageError(click.ClickException):
    """A click usage error (bad flag value, unknown option or verb) shown as the one ``artcache: error:`` line
    every other bad input gets, with click's exit status 2 (click prints usage, a hint and the error: 4
    lines)."""

    def __init__(self, error: click.UsageError) -> None:
        where = error.ctx.command_path if error.ctx is not None else "artcache"
        super().__init__(f"{error.format_message()} (`{where} --help` lists what is accepted)")
        self.exit_code = error.exit_code

    def show(self, file=None) -> None:
        click.echo(f"artcache: error: {self.format_message()}", err=True, file=file)


class _Verbs(click.Group):
    """The ``artcache`` group: usage errors of the group and of every verb are one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise _OneLineUsageError(exc) from exc

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _OneLineUsageError(exc) from exc


@click.group(cls=_Verbs, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="artcache")
def main(verbose: bool) -> None:
    """artcache: capture a target's hidden states once, train many drafts from them."""
    setup_logging(verbose)


@main.command()
@click.option("--cache", default=None, help="Cache root directory (created if absent); required without --config.")
@TARGET_OPTION
@click.option("--data", "dataset", multiple=True, default=("sharegpt",), metavar="PATH[:WEIGHT]",
              help="'sharegpt' (embedded), 'synthetic' (fixed-length random tokens, speed only) or a data "
              "file (read as one source of weight 1). Repeat it (or add :WEIGHT) to mix data sources by weight: "
              "dataset folders (save_to_disk) and parquet/arrow/JSON/JSONL files, OpenAI messages or ShareGPT schema "
              "(docs/data.md).")
@click.option("--eval-data", default=None, metavar="PATH",
              help="A separate evaluation source: its samples end the plan as the held-out split every consumer "
              "evaluates on (docs/data.md).")
@click.option("--seed", default=0, type=int, help="Plan shuffle seed.")
@click.option("--max-length", default=512, type=int, help="Tokens per sample (truncated).")
@click.option("--max-samples", default=2000, type=int, help="Samples in the plan (positions wrap around).")
@click.option("--draft-layers", default=5, type=int,
              help="DFlash draft layers; captured ids follow the DFlash formula.")
@click.option("--layer-ids", default=None,
              help="Explicit output-of-layer ids, comma separated, each once (overrides --draft-layers).")
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--devices", default="", metavar="DEV,DEV,...",
              help="Place the target over these devices (e.g. cuda:0,cuda:1) with transformers' device_map: decoder "
              "layers in contiguous blocks, inputs and captures on the first (instead of --device; hf backend).")
@click.option("--tensor-parallel-size", default=1, type=int,
              help="Shard the target over N ranks of a torch.distributed group by its tensor-parallel plan (gloo on "
              "--device cpu, NCCL on cuda: rank r on cuda:r); this process is rank 0 and starts the others (or run "
              "under torchrun --nproc-per-node N). hf backend, HF checkpoints. Artifacts as from one device.")
@click.option("--dtype", default="bfloat16",
              type=click.Choice(["bfloat16", "float16", "float32", "fp8", "float8_e4m3fn"]),
              help="Stored dtype of the captured hidden states. fp8 (= float8_e4m3fn): e4m3 codes with one fp32 "
              "scale per token row per layer, half the bytes of bf16, dequantised on read (docs/format.md).")
@click.option("--compute-dtype", default="auto", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Dtype the target runs in (auto: float32 on CPU, bfloat16 on CUDA).")
@click.option("--batch-samples", default=8, type=int, help="Max samples per capture batch.")
@click.option("--batch-tokens", default=8192, type=int, help="Max padded tokens per capture batch.")
@click.option("--max-queue", default=1024, type=int, help="Max queued fingerprints per scheduling pass.")
@click.option("--prefill-chunk", default=0, type=int,
              help="Prefill a longer sample in chunks of this many tokens through the target's KV cache (hf "
              "backend; 0: one pass). A sample longer than --batch-tokens needs it. Values equal one pass's to "
              "the compute dtype's rounding; fingerprints do not depend on it.")
@click.option("--heartbeat-timeout", default=30.0, type=float,
              help="Seconds a consumer's heartbeat counter may stay still (on this producer's clock) "
                   "before it is fenced.")
@click.option("--exit-when-done", is_flag=True,
              help="Exit once no consumer can come: one has registered (any state; not one that had already ended "
                   "when the producer started) and none is live for --done-grace.")
@click.option("--done-grace", default=5.0, type=float,
              help="With --exit-when-done: seconds with no running consumer before exiting.")
@click.option("--expect-consumers", default=0, type=int,
              help="Capture nothing until this many consumers have registered (a start line).")
@click.option("--expect-timeout", default=300.0, type=float,
              help="Seconds to wait for consumers to register: the --expect-consumers start line, and "
                   "--exit-when-done's wait for a first consumer (none by then: exit 1).")
@click.option("--idle-exit", default=0.0, type=float,
              help="Exit after this many idle seconds with no consumer (0: never).")
@click.option("--threads", default=0, type=int, help="torch CPU threads (0: torch's default).")
@click.option("--id", "producer_id", default="producer", help="Producer id (journal file name).")
@click.option("--chat-template-option", "template_options", multiple=True, metavar="NAME=VALUE",
              help="Chat template option, e.g. enable_thinking=false (repeatable; part of every fingerprint).")
@click.option("--group-shared", is_flag=True,
              help="Create the cache root group-shared (mode 2770, setgid) instead of private (0700).")
@click.option("--backend", default="hf", type=click.Choice(["hf", "vllm"]),
              help="Capture backend: hf (transformers) or vllm (needs the artcache[vllm] extra; docs/vllm.md).")
@click.option("--disk-budget", default="0", metavar="BYTES|auto",
              help="Retain by future need: beyond the live windows, keep what live consumers will read again while the "
              "retained artifacts fit BYTES (at most 2**60; suffixes K, M, G, T: powers of 1024), or auto (what the "
              "root holds + 90% of the filesystem's free space beyond its reserve, min(64 MiB, 5%)). 0 or left out: "
              "no budget, the windows-only rule (disk use bounded by the live windows). The rule is said at start.")
@click.option("--retention", default=None, type=click.Choice(["need", "windows"]),
              help="Only repeats what --disk-budget says (need: a budget was given; windows: none); a contradiction "
              "is refused.")
@click.option("--fill", is_flag=True, help="Capture the whole plan (after what live consumers need), then exit; "
              "its budget is auto unless --disk-budget says otherwise. The root is recorded as filled: later runs "
              "read it with no capture, and their producers keep it whatever their rule (see --evict-fill).")
@click.option("--evict-fill", is_flag=True, help="On a filled root: let this producer's retention rule evict the "
              "fill's artifacts like any others (said at start; the root is no longer filled).")
@click.option("--payload", default="", help="Where the tensors go: posix (files in the cache root) or "
              "mooncake://HOST:PORT (Mooncake Store; manifests stay in the root; docs/scale-out.md). Default: what "
              "the root records, posix for a new root.")
@_errors
@_with_config("producer")
def producer(cache, target, dataset, seed, max_length, max_samples, draft_layers, layer_ids, device, dtype,
             compute_dtype, batch_samples, batch_tokens, max_queue, heartbeat_timeout, exit_when_done, done_grace,
             expect_consumers, expect_timeout, idle_exit, threads,
             producer_id, template_options=(), group_shared=False, backend="hf", disk_budget="0", retention=None,
             fill=False, evict_fill=False, payload="", devices="", tensor_parallel_size=1, prefill_chunk=0,
             eval_data=None):
    """Run the target and publish captures for every live consumer window.

    Stop it with Ctrl-C (SIGINT) or SIGTERM: it finishes the batch in hand (published, or failed and journaled),
    drains its publisher, journals its stop and closes its journal, backend and presence lock, so nothing is left
    half-written; a second signal stops it at once. Exit status: 0 when it ended by itself (--exit-when-done,
    --idle-exit, a complete --fill), 130 stopped by SIGINT (Ctrl-C), 143 by SIGTERM (both after that shutdown, as
    `artcache consume`), 1 a failure (e.g. every capture failed), 2 bad input."""
    from artcache.producer import ProducerConfig
    from artcache.scheduler import SchedulerLimits

    check_device(device)
    _check_fill_budget(fill, disk_budget if click.get_current_context().get_parameter_source("disk_budget")
                       == ParameterSource.COMMANDLINE else None)
    device_list = parse_devices(devices)
    ids = parse_layer_ids(layer_ids)
    data = data_flags(dataset, eval_data)
    cfg = ProducerConfig(
        cache=cache, target=target, dataset=data.get("data.dataset", "sharegpt"),
        sources=[msgspec.convert(x, DataSource) for x in data.get("data.sources", [])],
        eval=msgspec.convert(data["data.eval"], DataSource) if "data.eval" in data else None, seed=seed,
        max_length=max_length, max_samples=max_samples,
        draft_layers=draft_layers, layer_ids=ids, device=device, devices=device_list,
        tensor_parallel_size=tensor_parallel_size, dtype=dtype, compute_dtype=compute_dtype,
        limits=SchedulerLimits(max_queue=max_queue, max_batch_samples=batch_samples, max_batch_tokens=batch_tokens,
                               prefill_chunk=prefill_chunk),
        heartbeat_timeout_s=heartbeat_timeout, exit_when_done=exit_when_done, done_grace_s=done_grace,
        expect_consumers=expect_consumers, expect_timeout_s=expect_timeout, idle_exit_s=idle_exit,
        producer_id=producer_id, threads=threads, template_options=parse_template_options(template_options),
        group_shared=group_shared, backend=backend, disk_budget=parse_disk_budget(disk_budget),
        retention=retention or "", fill=fill, evict_fill=evict_fill, payload=payload)
    _start("producer", cfg)


@main.command()
@click.option("--cache", default=None, help="Cache root made by `artcache producer`; required without --config.")
@click.option("--draft", default="dflash", help=f"Draft algorithm: {', '.join(DRAFT_NAMES)}.")
@click.option("--window", default="64:256", help="LOOKBEHIND:LOOKAHEAD in positions (each 0 to 2**24).")
@click.option("--id", "consumer_id", default=None,
              help="Consumer id (default: dflash-b<block size>, dspark-b<block size> or eagle3).")
@click.option("--block-size", default=None, type=int, help="Block size B, 2 to 64 (default: DFlash 16, DSpark 7).")
@click.option("--anchors", default=None, type=int,
              help="Anchors (blocks) per sequence, at most the root's --max-length (default 64; DSpark: 512 on "
                   "cuda, 64 on cpu).")
@click.option("--draft-layers", default=None, type=int, help="Draft layers (default: one per captured layer).")
@click.option("--layer-ids", default=None, help="Explicit ordered view of captured output-of-layer ids, comma "
              "separated (default: the draft's formula; EAGLE-3: three auxiliary ids then L-1).")
@click.option("--batch-size", default=2, type=int, help="Sequences per optimizer step.")
@click.option("--steps", default=100, type=int, help="Optimizer steps to run (the stop; raise it to extend a run; "
              "may run past one pass: later epochs reshuffled, the held-out split never read).")
@click.option("--epochs", default=0, type=int,
              help="Passes over the plan's training part instead of --steps (steps = epochs x samples // batch size).")
@click.option("--lr-total-steps", default=None, type=int,
              help="LR schedule horizon in steps (default: --steps; on --resume the checkpoint's).")
@click.option("--lr", default=6e-4, type=float, help="Peak learning rate.")
@click.option("--seed", default=0, type=int)
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--threads", default=0, type=int, help="torch CPU threads (0: torch's default).")
@click.option("--out", "out_dir", default="", help="Run directory for checkpoints (default ./runs/<id>).")
@click.option("--demand-timeout", default=600.0, type=float, help="Seconds to wait for one position.")
@click.option("--log-every", default=10, type=int)
@click.option("--ttt-steps", default=None, type=int, help="EAGLE-3 training-time-test unroll steps (default 7).")
@click.option("--draft-vocab", default=None, type=int, help="EAGLE-3 pruned draft vocabulary size (default 32000).")
@click.option("--markov-rank", default=None, type=int,
              help="DSpark Markov head rank r (default 256; 0: no Markov head).")
@click.option("--markov-head", default=None, type=click.Choice(["vanilla", "gated"]),
              help="DSpark Markov head: vanilla (default; what vLLM serves) or gated.")
@click.option("--save-every", default=0, type=int,
              help="Checkpoint every N steps (0: only at the end and when cancelled).")
@click.option("--keep-checkpoints", default=3, type=int, help="Keep the newest N checkpoints (0: all); N + 1 "
              "must fit in the free space under --out while one is written (checked before step 1).")
@click.option("--checkpoint-optimizer/--no-checkpoint-optimizer", default=True,
              help="Save the optimizer and RNG state in checkpoints (what --resume needs). --no-checkpoint-optimizer: "
              "weights-only checkpoints, a third of the bytes with AdamW; --init-from and export read them, "
              "--resume refuses them.")
@click.option("--resume", is_flag=True, help="Continue this --id from its checkpoint in --out (cursor, step, "
              "optimizer, RNG); refused unless the registry recorded that checkpoint.")
@click.option("--init-from", default="", help="Seed the draft's weights only from an artcache checkpoint or run "
              "directory, an artcache export or a published z-lab / speculators / SpecForge draft (a model.safetensors "
              "file or its directory); checked against this run first, strict keys.")
@click.option("--init-override", "init_overrides", multiple=True, metavar="FIELD",
              help="With --init-from: accept a difference in block_size, mask_token or target (repeatable).")
@click.option("--min-vocab-coverage", default=None, type=float,
              help="EAGLE-3 with --init-from: least share of the plan's supervised tokens the seed's own vocab map "
              "must cover (default 0.5).")
@click.option("--keep-vocab-map", is_flag=True, default=None,
              help="EAGLE-3 with --init-from: train with the seed's vocab map even below --min-vocab-coverage.")
@click.option("--eval-samples", default=0, type=int,
              help="Held-out split: the plan's last N samples, never trained on (0: no evaluation).")
@click.option("--eval-interval", default=0, type=int,
              help="Evaluate on the held-out split every N steps (0: only at the end).")
@click.option("--eval-anchors", default=None, type=int,
              help="DFlash: evaluate at most N evenly spaced anchors per held-out sample (default 0: every eligible "
              "anchor; costly on a CPU).")
@click.option("--best-metric", default=None,
              help="Held-out figure checkpoints/best follows, one the draft's evaluation gives (default replay_tau "
              "when the root captures L-1, else the draft's acceptance figure; losses, ece, *_mae and "
              "replay_truncated_frac are minimised, a *_bias figure's magnitude too, any other maximised; "
              "docs/training.md lists them).")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr (only on a terminal).")
@click.option("--tensorboard/--no-tensorboard", default=True,
              help="TensorBoard scalars in <out>/tensorboard when installed (metrics.csv always).")
@click.option("--tracker", "trackers", multiple=True, type=click.Choice(("wandb", "mlflow")),
              help="Also send the scalars to W&B or MLflow (repeatable; the extras of those names): one run per "
              "consumer, named by its id; their settings from WANDB_* / MLFLOW_TRACKING_URI.")
@click.option("--tracker-project", default="artcache", help="The W&B project / MLflow experiment of --tracker runs.")
@click.option("--compile", "compile_mode", default="auto", type=click.Choice(COMPILE_MODES),
              help="torch.compile the draft: auto (on on CUDA for runs of >= 2,000 steps, else off), off, on, graphs "
                   "(with CUDA graphs); on and graphs are CUDA only. A group (--nproc N) on CUDA refuses both.")
@click.option("--loss-impl", default="auto", type=click.Choice(LOSS_IMPLS),
              help="lm_head cross-entropy: auto (chunked bf16 on CUDA, reference on a CPU), reference, chunked, "
              "liger (CUDA; pip install 'artcache[liger]').")
@click.option("--length-bucket", default=64, type=int,
              help="With --compile on|graphs on CUDA: pad batch lengths to a multiple of N positions; 0: none.")
@click.option("--pack-tokens", default=0, type=int,
              help="Packing: each of the --batch-size rows holds whole plan positions back to back up to N tokens "
                   "(N >= the root's max length; attention, position ids and anchors per document); 0: off.")
@click.option("--read-workers", default=1, type=int,
              help="Artifacts of one batch read at once (1 .. 64; more hide per-file latency on a slow or network "
                   "filesystem).")
@click.option("--commit-interval", default=0.25, type=float,
              help="Commit the cursor at most every S seconds (0 .. 10; 0: after every step); also at once when the "
                   "committed window would hold the reader back, before checkpoints and evaluations, at the end.")
@click.option("--reader", default="thread", type=click.Choice(("thread", "process")),
              help="Where the reader runs: thread (beside the trainer) or process (a child process of its own that "
                   "reads into shared memory: its Python never holds the trainer's GIL; Linux).")
@click.option("--nproc", default=1, type=int,
              help="Ranks of this consumer: a torch.distributed group (gloo on a CPU, nccl on CUDA: rank r on "
                   "cuda:r) that is one consumer to the cache; each optimizer step consumes --nproc x --grad-accum x "
                   "--batch-size positions. Under torchrun the group is torchrun's (WORLD_SIZE).")
@click.option("--cp", default=1, type=int,
              help="Context parallelism (DFlash, DSpark, EAGLE-3): each sequence split across N ranks of the group, "
                   "attention over their all-gathered context keys/values; --nproc is the world size (data-parallel "
                   "ranks x N) and must be a multiple of N. 1: off.")
@click.option("--grad-accum", default=1, type=int,
              help="Micro-batches of --batch-size per optimizer step on each rank; the update equals one step over "
                   "the whole batch; the LR schedule and --steps count optimizer steps.")
@click.option("--shard", default="none", type=click.Choice(("none", "full")),
              help="How a group (--nproc N) holds the draft: none (each rank a full copy; DDP) or full (FSDP2: each "
                   "rank 1/N of the weights, gradients and AdamW state, for a draft that does not fit one device). "
                   "The same updates either way; full needs --nproc >= 2.")
@click.option("--group-timeout", default=60.0, type=float,
              help="Seconds a rank of a group waits in a collective for the others before the group stops "
                   "(init_process_group's timeout; 0 < S <= 3600).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the run's summary as one JSON line instead of lines for a person. Exit status: 0 "
                   "finished, 130 stopped by SIGINT (Ctrl-C), 143 by SIGTERM (both after the final checkpoint).")
@_errors
@_with_config("consume")
def consume(cache, draft, window, consumer_id, block_size, anchors, draft_layers, layer_ids, batch_size, steps,
            lr_total_steps, lr, seed, device, threads, out_dir, demand_timeout, log_every, ttt_steps, draft_vocab,
            markov_rank, markov_head, save_every, keep_checkpoints, checkpoint_optimizer, resume, init_from,
            init_overrides, min_vocab_coverage, keep_vocab_map, eval_samples, eval_interval, eval_anchors,
            best_metric, progress, tensorboard, compile_mode, loss_impl, length_bucket, read_workers, commit_interval,
            reader="thread", epochs=0, nproc=1, grad_accum=1, group_timeout=60.0, as_json=False, pack_tokens=0,
            trackers=(), tracker_project="artcache", cp=1, shard="none"):
    """Train one draft on the cache root at its own pace."""
    from artcache.trainers.consumer import ConsumerConfig, default_block_size, parse_window

    if epochs > 0 and click.get_current_context().get_parameter_source("steps") == ParameterSource.COMMANDLINE:
        raise ConfigError(f"--epochs {epochs} and --steps {steps} both say how long to train; give one of them")

    if draft not in DRAFT_NAMES:
        raise ConfigError(f"--draft {draft!r} is not supported; accepted: {', '.join(DRAFT_NAMES)}")
    if not trackers and click.get_current_context().get_parameter_source("tracker_project") == \
            ParameterSource.COMMANDLINE:
        raise ConfigError(f"--tracker-project {tracker_project!r} needs --tracker wandb or --tracker mlflow (it names "
                          "their run's project / experiment); add one, or leave it out")
    if consumer_id is not None:  # checked as given: an empty --id fell back to the default id silently
        check_id(consumer_id, "--id")
    lookbehind, lookahead = parse_window(window)
    view = parse_layer_ids(layer_ids)
    check_device(device)
    cfg = ConsumerConfig(
        cache=cache, consumer_id=consumer_id or (
            draft if default_block_size(draft) is None else f"{draft}-b{block_size or default_block_size(draft)}"),
        draft=draft, lookbehind=lookbehind,
        lookahead=lookahead, block_size=block_size, num_anchors=anchors, draft_layers=draft_layers, layer_ids=view,
        batch_size=batch_size, steps=steps, epochs=epochs, lr_total_steps=lr_total_steps, lr=lr, seed=seed,
        device=device, threads=threads, out_dir=out_dir,
        demand_timeout_s=demand_timeout, log_every=log_every, ttt_steps=ttt_steps, draft_vocab=draft_vocab,
        markov_rank=markov_rank, markov_head=markov_head,
        save_every=save_every, keep_checkpoints=keep_checkpoints, checkpoint_optimizer=checkpoint_optimizer,
        resume=resume, init_from=init_from,
        init_overrides=[x for item in init_overrides for x in item.split(",") if x],
        min_vocab_coverage=min_vocab_coverage, keep_vocab_map=keep_vocab_map or None,
        eval_samples=eval_samples, eval_interval=eval_interval, eval_anchors=eval_anchors, best_metric=best_metric,
        progress=progress, tensorboard=tensorboard, trackers=list(trackers), tracker_project=tracker_project,
        compile=compile_mode, loss_impl=loss_impl,
        length_bucket=length_bucket, read_workers=read_workers, commit_interval_s=commit_interval,
        reader=reader, nproc=nproc, grad_accum=grad_accum, group_timeout_s=group_timeout, pack_tokens=pack_tokens,
        cp=cp, shard=shard)
    _start("consumer", cfg)


@main.command()
@click.option("--cache", required=True, help="Cache root (or an `artcache run` directory: its cache root).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@_errors
def inspect(cache, as_json):
    """Lease and eviction accounting, per consumer and in total, with invariant checks, and the retention
    decision the root's state implies now (budget, kept and evicted by reason)."""
    from artcache.accounting import account
    from artcache.layout import CacheLayout
    from artcache.report import format_accounting
    from artcache.settings import load_settings

    path = Path(cache).expanduser().absolute()
    saved = None  # the saved run config the root comes from, when --cache is a run directory
    if not (path / "artcache.json").is_file() and (path / "config.toml").is_file():
        # an `artcache run` directory: its cache root (regression: inspect refused a run directory)
        from artcache.app.experiments import resolve

        saved = path / "config.toml"
        cfg = load_run_config(saved, source=saved_config_source(saved))
        if not cfg.cache.root:  # artcache run saves it resolved; without it the root would be a default one
            raise ConfigError(f"{saved_config_source(saved)} names no cache root (empty or damaged: no "
                              "cache.root); accepted: the config.toml artcache run writes, or --cache the cache "
                              "root itself (the directory holding artcache.json)")
        path = Path(resolve(cfg).cache.root)
    layout = CacheLayout(path)
    try:
        load_settings(layout)  # an unreadable artcache.json is named (exit 2), as fsck does, never reported "ok"
    except CacheRootError as exc:
        if saved is None:
            raise
        # the root came from a file the user did not name: say which, so they know where the path came from
        raise CacheRootError(f"{saved_config_source(saved)} names cache.root {str(path)!r}: {exc}") from None
    acc = account(layout, retention_now=True)
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(acc)).decode())
    else:
        click.echo(format_accounting(acc))
    if acc.violations:
        sys.exit(3)


#: the bench flags a --suite run takes (the others are the scenarios')
_SUITE_FLAGS = ("suite", "suite_resume", "time_budget", "scale", "pieces", "device", "out_dir")


@main.command()
@click.option("--scenario", default="1p3c", type=click.Choice(["1p1c", "1p3c", "hetero", "all"]),
              help="all = 1p1c and 1p3c; hetero: three consumers of different speeds started at different times, "
              "run under retention by need, the windows-only rule, a budget too small, and the fast one alone.")
@click.option("--device", default="cpu", type=click.Choice(["cpu", "cuda"]))
@click.option("--out", "out_dir", default="bench-out", help="Output directory (one subdirectory per scenario).")
@click.option("--warmup", default=None, type=int, help="Warm-up steps per consumer (default: 3 cpu, 30 cuda).")
@click.option("--steps", default=None, type=int, help="Measured steps per consumer (default: 15 cpu, 150 cuda).")
@click.option("--target", default="smollm2-135m-instruct",
              help="Target name, HF directory or Hugging Face hub id (ORG/NAME).")
@click.option("--data", "dataset", default="sharegpt", help="'sharegpt', 'synthetic' or a data file (docs/data.md).")
@click.option("--max-length", default=0, type=int, help="Tokens per sample (default: 512; hetero on cpu 128).")
@click.option("--max-samples", default=2000, type=int, help="Samples in the plan.")
@click.option("--anchors", default=None, type=int, help="Anchors per sequence (default: 64 cpu, 256 cuda).")
@click.option("--batch-size", default=1, type=int, help="Sequences per optimizer step.")
@click.option("--draft-layers", default=5, type=int, help="DFlash draft layers (one captured layer each).")
@click.option("--window", default="", help="LOOKBEHIND:LOOKAHEAD (default: the scenario's; 64:256, hetero 2:8).")
@click.option("--allow-shared-gpu", is_flag=True, help="Allow two roles on one GPU (every report line says so).")
@click.option("--modes", default="", help="Comma-separated subset of artcache,naive,lockstep,windows,tight,solo run "
              "in this one invocation (default: artcache,naive,lockstep for 1p3c, artcache alone for 1p1c, "
              "artcache,windows,tight,solo for hetero).")
@click.option("--disk-budget", default="0", metavar="BYTES",
              help="Disk budget of the artcache (and solo) producer (default: hetero: one that holds the whole run; "
              "1p1c/1p3c: none, the producer's windows-only rule).")
@click.option("--budget-fraction", default=0.25, type=float,
              help="tight mode: its budget is the live windows' floor plus this share of the room between it and the "
                   "artcache one (too small for the fast consumer's lead, yet keepable).")
@click.option("--save", default="weights", type=click.Choice(["none", "weights", "full"]),
              help="Each consumer's final checkpoint: weights only, with optimizer state (full) or none. Every "
              "mode's checkpoints and leftover artifacts are removed once its report figures are read.")
@click.option("--suite", default=None, metavar="NAME",
              help="Run a measurement suite instead of a scenario: retention-gap, gpu-micro, consumer-speed, offline, "
                   "fp8, training-curve, payload, vllm-throughput, packing (docs/benchmarks.md, 'Suites'). Its "
                   "result: <dir>/<NAME>.json.")
@click.option("--resume", "suite_resume", default=None, metavar="DIR",
              help="--suite: the suite's directory; pieces finished there are skipped (created on the first call).")
@click.option("--time-budget", "time_budget", default=None, type=float, metavar="S",
              help="--suite: start no piece after S seconds; then exit 75 naming the pieces left.")
@click.option("--scale", default="full", type=click.Choice(["full", "tiny"]),
              help="--suite: full (the documented sizes; GPU pieces need CUDA) or tiny (toy sizes on any device).")
@click.option("--pieces", default="", help="--suite: a comma list of its pieces (default: all).")
@click.option("--consumer-ranks", default=1, type=click.IntRange(min=1),
              help="Ranks of every consumer: each a torch.distributed group (gloo on cpu, one GPU a rank on cuda), "
              "one consumer to the cache, consuming ranks x --batch-size positions per step. Above 1 the lockstep "
              "baseline is left out (its consumers are one process each).")
@_errors
@_with_config("bench")
def bench(scenario, device, out_dir, warmup, steps, target, dataset, max_length, max_samples, anchors, batch_size,
          draft_layers, window, allow_shared_gpu, modes, disk_budget="0", budget_fraction=0.25, save="weights",
          suite=None, suite_resume=None, time_budget=None, scale="full", pieces="", consumer_ranks=1):
    """Run 1-producer/N-consumer scenarios on fresh cache roots and report, or a measurement suite (--suite) in
    pieces that resume."""
    ctx = click.get_current_context()
    scale_given = ctx.get_parameter_source("scale") == ParameterSource.COMMANDLINE
    if suite is not None or suite_resume is not None or time_budget is not None or pieces or scale_given:
        from artcache.bench.suites import main_suite

        if suite is None:
            raise ConfigError("--resume, --time-budget, --pieces and --scale belong to --suite NAME; give the suite")
        for flag, value in (("--resume", suite_resume), ("--out", out_dir)):
            if value is not None and not str(value).strip():
                raise ConfigError(f"{flag} '' is empty; accepted: a directory path")
        given = sorted(f"--{k.replace('_', '-')}" for k in ctx.params if k not in _SUITE_FLAGS
                       and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE)
        if given:
            raise ConfigError(f"{', '.join(given)}: scenario flag(s), not taken by --suite {suite}; a suite takes "
                              "--scale, --pieces, --resume, --time-budget, --device and --out")
        explicit = ctx.get_parameter_source("device") == ParameterSource.COMMANDLINE
        sys.exit(main_suite(suite, out_dir=out_dir, resume=suite_resume, device=device if explicit else None,
                            scale=scale, pieces=pieces, time_budget_s=time_budget))
    from artcache.bench.run import BenchConfig, run_bench

    cfg = BenchConfig(scenario=scenario, device=device, out_dir=out_dir,
                      warmup=warmup, steps=steps,  # None: the device's / scenario's default (bench.run)
                      target=target, dataset=dataset, max_length=max_length, max_samples=max_samples,
                      anchors=anchors,
                      batch_size=batch_size, draft_layers=draft_layers, window=window,
                      allow_shared_gpu=allow_shared_gpu, modes=modes,
                      disk_budget=parse_bytes(disk_budget, "disk-budget"), budget_fraction=budget_fraction,
                      save=save, consumer_ranks=consumer_ranks)
    ok = run_bench(cfg)
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="Run config (TOML/YAML) with [[experiments]].")
@click.argument("overrides", nargs=-1)
@click.option("--dry-run", is_flag=True, help="Print every experiment's resolved plan and requirements; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON.")
@click.option("--out", default=None, help="Shortcut for out=DIR (the run directory).")
@click.option("--target", default=None, help="Shortcut for target.name=NAME_OR_DIR.")
@click.option("--data", "dataset", multiple=True, metavar="PATH[:WEIGHT]",
              help="Shortcut for data.dataset=NAME_OR_FILE; repeated (or with :WEIGHT), for [[data.sources]] "
              "(docs/data.md).")
@click.option("--eval-data", default=None, metavar="PATH", help="Shortcut for data.eval.path=PATH.")
@click.option("--capture-rate", default=None, type=float, metavar="SAMPLES_PER_S",
              help="With --dry-run: the producer's capture rate for the capacity estimate (default: measured from the "
              "cache root's journal when a run used it, else assumed; docs/training.md, \"Capacity estimate\").")
@click.option("--step-rate", "step_rates", multiple=True, metavar="[NAME=]STEPS_PER_S",
              help="With --dry-run: an experiment's optimizer steps per second for the estimate (repeatable; without "
              "NAME=, every experiment's).")
@click.option("--device", default=None, help="Shortcut for target.device=DEV (experiments without a device follow).")
@click.option("--launcher", default="local", type=click.Choice(["local", "slurm"]),
              help="local: start the processes here; slurm: write an sbatch script of job steps ([slurm] section, "
              "docs/scale-out.md).")
@click.option("--submit", is_flag=True, help="With --launcher slurm: submit the script with sbatch.")
@click.option("--wait", "wait_job", is_flag=True, help="With --submit: wait for the job, then print each role's exit "
              "status and the root's inspect summary (exit 1 if any failed).")
@_errors
def run(config_path, overrides, dry_run, as_json, out, target, dataset, device, launcher="local", submit=False,
        wait_job=False, eval_data=None, capture_rate=None, step_rates=()):
    """One producer (capturing the union of the experiments' layers, plus the target's last layer for a held-out
    replay: capture.replay_layer) and one consumer per experiment.

    OVERRIDES are SECTION.FIELD=VALUE, e.g. data.max_length=256 experiments.0.lr=1e-3 (an experiment by
    index or name). Exits nonzero if any experiment failed; its siblings run to the end.
    """
    from artcache.app.experiments import format_plan, plan_run, run_experiments

    if (submit or wait_job) and launcher != "slurm":
        raise ConfigError("--submit and --wait need --launcher slurm")
    if wait_job and not submit:
        raise ConfigError("--wait needs --submit (it waits for the submitted job)")
    if not dry_run:
        given = [flag for flag, v in (("--json", as_json), ("--capture-rate", capture_rate is not None),
                                      ("--step-rate", step_rates)) if v]
        if given:
            one = len(given) == 1
            raise ConfigError(f"{' and '.join(given)} need{'s' if one else ''} --dry-run ({'it' if one else 'they'} "
                              f"only shape{'s' if one else ''} the dry run's output); add --dry-run, or leave "
                              f"{'it' if one else 'them'} out to start the run")
    flags = {"out": out, "target.name": target, "target.device": device, **data_flags(dataset, eval_data)}
    plan, resolved = plan_run(load_run_config(config_path, overrides, {k: v for k, v in flags.items() if v}),
                              local_devices=launcher == "local", source=f"--config {str(config_path)!r}")
    if launcher == "slurm":
        from artcache.app.slurm import launch

        if as_json:
            raise ConfigError("--json is for the local launcher's --dry-run; --launcher slurm --dry-run prints the "
                              "script")
        sys.exit(launch(plan, resolved, dry_run=dry_run, submit=submit, wait=wait_job))
    if dry_run:
        from artcache.app.estimate import (
            check_capture_rate,
            estimate,
            format_estimate,
            parse_step_rates,
            plan_length,
            skipped,
        )

        check_capture_rate(capture_rate)  # checked even where no estimate is made
        rates, why = parse_step_rates(step_rates, [x.name for x in plan.experiments]), skipped(plan)
        est = None if why else estimate(plan, resolved, plan_length(plan, resolved), capture_rate=capture_rate,
                                        step_rates=rates)
        if as_json:
            click.echo(msgspec.json.format(msgspec.json.encode(
                {**msgspec.to_builtins(plan), "estimate": msgspec.to_builtins(est)})).decode())
        else:
            click.echo(format_plan(plan) + "\n\n" + (format_estimate(est) if est is not None else
                                                     f"estimate: none ({why})"))
        return
    click.echo(format_plan(plan))
    sys.exit(run_experiments(plan, resolved))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@_errors
def report(run_dir, as_json):
    """Each experiment of an `artcache run` directory: state, step trained and step checkpointed, last
    evaluation, checkpoints, and the shared production (captures, counted once) apart from each experiment's
    committed work.

    An experiment with damaged files (its config.toml, a checkpoint's state.json, its metrics.csv) is
    reported as damaged with the reason, the others as usual, and the exit status is 1."""
    from artcache.app.experiments import format_run_dir_report, run_dir_report

    r = run_dir_report(run_dir)
    click.echo(json.dumps(r, indent=2) if as_json else format_run_dir_report(r))
    if r["damaged"]:
        names = sorted({x["name"] for x in r["experiments"] if x["damage"]})
        click.echo(f"artcache: error: run directory {r['out']}: experiment(s) {', '.join(names)} damaged "
                   f"({len(r['damaged'])} problem(s), listed in the report)", err=True)
        sys.exit(1)


@main.command("payload-holder")
@click.option("--payload", required=True, help="The Mooncake master: mooncake://HOST:PORT (as given to the producer).")
@click.option("--size", default="4GiB", help="Memory to mount for payloads (K/M/G/T = powers of 1024): at least the "
              "live windows' artifacts of every root using this store.")
@_errors
def payload_holder(payload, size):
    """Hold the memory of Mooncake payloads: mount a segment of --size and keep it until SIGTERM/Ctrl-C.

    Producers and consumers mount none, so they can exit or be killed without losing a payload. Stopping
    the holder loses the payloads in its segment (readers miss; the producer recaptures)."""
    import os
    import threading

    from artcache.payload import parse_payload_url
    from artcache.payload_mooncake import parse_size, run_holder
    from artcache.shutdown import GracefulShutdown

    url = parse_payload_url(payload)
    if url is None:
        raise ConfigError(f"--payload {payload!r}: a posix root keeps its payloads in its own files and needs no "
                          "holder; give mooncake://HOST:PORT")
    nbytes = parse_size(size)
    stop = threading.Event()
    with GracefulShutdown("payload holder", event=stop, asked="unmounting its segment"):
        run_holder(url, nbytes, stop, ready=lambda _c: click.echo(
            f"payload holder ready: {nbytes} B mounted at {url} (pid {os.getpid()}); stop with SIGTERM", err=True))
    click.echo("payload holder stopped: its payloads are gone from the store", err=True)


@main.command("verify-fs")
@click.argument("path", type=click.Path(exists=True, file_okay=False, writable=True))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per check.")
@_errors
def verify_fs(path, as_json):
    """Check that PATH's filesystem supports flock, O_EXCL, atomic same-directory rename and directory fsync."""
    from artcache.verify_fs import verify_filesystem

    res = verify_filesystem(path)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        for name, c in res["checks"].items():
            click.echo(f"{name:15s} {'ok' if c['ok'] else 'FAILED'}  {c['detail']}")
    if not res["ok"]:
        sys.exit(1)


@main.command()
@click.option("--cache", required=True, help="Cache root made by `artcache producer`.")
@click.option("--fix", is_flag=True, help="Repair what is found (only what provably belongs to no live process).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per finding.")
@click.option("--observe", default=None, type=float, metavar="SECONDS",
              help="Watch the heartbeat of running consumers whose pid cannot be checked from here (other hosts "
              "or pid namespaces) for up to this long [default: the root's heartbeat timeout; less judges none].")
@_errors
def fsck(cache, fix, as_json, observe):
    """Find orphans, bad artifacts, dead leases/consumers and stale locks; repair them with --fix.

    Exits 0 when no problem is left, 1 otherwise (without --fix: when any problem was found)."""
    from artcache.fsck import format_report
    from artcache.fsck import fsck as run_fsck

    check_value(observe, NonNegativeFloat | None, "--observe", seconds=True)
    rep = run_fsck(cache, fix=fix, observe_s=observe)
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(rep)).decode())
    else:
        click.echo(format_report(rep))
    sys.exit(0 if rep.ok else 1)


@main.command()
@click.option("--checkpoint", default=None,
              help="A consumer checkpoint (checkpoints/step-N) or run directory (uses its checkpoints/latest). "
                   "Without it, --out names an existing export directory that is only checked (see --check).")
@click.option("--format", "fmt", default="hf", type=click.Choice(["hf", "speculators"]),
              help="hf: vLLM's native draft layout; speculators: vllm-project/speculators' config format.")
@click.option("--out", "out_dir", required=True,
              help="Draft directory to create (config.json, model.safetensors); never the checkpoint or its run. "
                   "Without --checkpoint: the existing export directory to check.")
@click.option("--target", default=None,
              help="The target the draft was trained for (name, HF directory or hub id); supplies layer count and ids. "
                   "Default: the target_name the checkpoint's state.json records (its weights digest must match).")
@click.option("--dtype", default="bfloat16", type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Dtype of the exported weights.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing --out that is a previous export (a directory holding export.json).")
@click.option("--target-tensors/--no-target-tensors", default=True,
              help="DSpark --format hf: write the target's embed_tokens and lm_head into the export (default: "
                   "DeepSpec's from_pretrained reads them from the draft and leaves them random without them; "
                   "needs a --target with weights). --no-target-tensors leaves them out (vLLM shares the target's). "
                   "No other draft or format carries them.")
@click.option("--check/--no-check", default=True,
              help="Before the export is renamed into place, resolve it through the installed vLLM's and speculators' "
                   "own config and registry code and SGLang's EAGLE-3 layout, and refuse (one line naming the key) "
                   "an export that would load and serve wrong; an engine not installed is skipped and named "
                   "(docs/export.md, \"Checking an export\"). Default on; --no-check skips it.")
@_errors
def export(checkpoint, fmt, out_dir, target, dtype, overwrite, target_tensors, check):
    """Write a trained DFlash, EAGLE-3 or DSpark draft as a directory vLLM / speculators / SGLang load, checked
    against them (docs/export.md); without --checkpoint, check an existing export directory (--out)."""
    if checkpoint is None:
        from artcache.trainers.export_check import check_export

        if not check:
            raise ConfigError("--no-check without --checkpoint has nothing to do; accepted: --checkpoint to export, "
                              "or --check (the default) with --out naming an export directory to check")
        click.echo(json.dumps(check_export(out_dir, target).summary()))
        return
    from artcache.trainers.export import export_checkpoint

    res = export_checkpoint(checkpoint, out_dir, fmt, target=target, dtype=dtype, overwrite=overwrite,
                            target_tensors=target_tensors, check=check)
    click.echo(json.dumps(res.summary()))


@main.command()
@click.option("--checkpoint", required=True,
              help="A DSpark consumer checkpoint (checkpoints/step-N) or run directory (its checkpoints/latest) "
                   "trained with --eval-samples.")
@click.option("--against", default="replay", type=click.Choice(["replay", "alpha"]),
              help="What the cumulative confidence is calibrated against: replay (default; the observed "
                   "greedy-replay acceptance of the first k+1 proposals, what a serving threshold decides on) or "
                   "alpha (the teacher-forced cumulative alpha the head is trained on).")
@_errors
def calibrate(checkpoint, against):
    """Fit one temperature per slot to a DSpark draft's confidence head (STS, on the held-out split the run
    evaluated) and add them to the checkpoint (extra.safetensors; the report in calibration.json); `artcache
    export` then writes them into the exported config. Prints the cumulative-confidence ECE before and after
    (docs/training.md)."""
    from artcache.trainers.dspark.calibrate import calibrate_checkpoint

    rep = calibrate_checkpoint(checkpoint, against=against)
    click.echo(f"calibrated {rep['checkpoint']} against {rep['against']} on {rep['blocks']} held-out blocks of "
               f"{rep['samples']} samples: cumulative-confidence ECE (pooled over slots) "
               f"{rep['ece_cum_pooled_before']:.4f} -> {rep['ece_cum_pooled_after']:.4f} "
               f"(2-fold cross-validated {rep['ece_cum_pooled_after_crossval']:.4f}); "
               f"temperatures {', '.join(f'{t:.3g}' for t in rep['temperatures'])}", err=True)
    for k in rep["at_grid_edge"]:
        click.echo(f"warning: slot {k}'s temperature {rep['temperatures'][k]:.3g} is the edge of the grid "
                   "[0.05, 20]: the fit would go further (its ECE may still be far from 0)", err=True)
    click.echo(json.dumps({k: v for k, v in rep.items() if k != "method"}))


@main.command()
@click.option("--out", required=True, help="ShareGPT JSONL file to write (refused if it exists, unless --force).")
@TARGET_OPTION
@click.option("--data", "dataset", default="sharegpt",
              help="'sharegpt' (embedded) or a ShareGPT-format JSON/JSONL file.")
@click.option("--max-samples", default=1000, type=int, help="The first N usable records in file order.")
@click.option("--max-new-tokens", default=256, type=int, help="Generated tokens per answer at most.")
@click.option("--max-prompt-tokens", default=1024, type=int,
              help="Records whose rendered prompt is longer are skipped (counted), never truncated.")
@click.option("--backend", default="hf", type=click.Choice(REGEN_BACKENDS),
              help="hf (transformers generate) or vllm (needs the artcache[vllm] extra).")
@click.option("--batch-size", default=8, type=int, help="Prompts per generate call (hf; vllm schedules itself).")
@click.option("--temperature", default=0.0, type=float, help="0: greedy; > 0: sampling with --seed.")
@click.option("--seed", default=0, type=int, help="Sampling seed (with --temperature > 0).")
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--dtype", default="auto", type=click.Choice(REGEN_DTYPES),
              help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.")
@click.option("--chat-template-option", "template_options", multiple=True, metavar="NAME=VALUE",
              help="Chat template option, e.g. enable_thinking=false (repeatable; give the producer the same).")
@click.option("--threads", default=0, type=int, help="CPU threads (0: the default): torch's (hf), vLLM's bound CPUs.")
@click.option("--cache", default="auto", type=click.Choice(REGEN_CACHES),
              help="hf KV cache: auto (static on CUDA, dynamic on CPU), dynamic, or static (one padded shape, "
                   "the decode step compiled once on CUDA).")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr (only on a terminal).")
@_errors
def regenerate(out, target, dataset, max_samples, max_new_tokens, max_prompt_tokens, backend, batch_size,
               temperature, seed, device, dtype, template_options, threads, cache, force, progress):
    """Write a ShareGPT JSONL whose first assistant answers the target generated (docs/regenerate.md).

    Plan and capture it with `artcache producer --data OUT`. Prints a JSON summary on stdout."""
    from artcache.data.regenerate import RegenerateConfig
    from artcache.data.regenerate import regenerate as run_regenerate

    cfg = RegenerateConfig(out=out, target=target, dataset=dataset, max_samples=max_samples,
                           max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, backend=backend,
                           batch_size=batch_size, temperature=temperature, seed=seed, device=device, dtype=dtype,
                           force=force, threads=threads, template_options=parse_template_options(template_options),
                           progress=progress, cache=cache)
    cfg.validate()
    check_device(device)
    click.echo(json.dumps(run_regenerate(cfg).summary))


if __name__ == "__main__":
    main()
