"""The ``artcache`` command line: producer, consume, inspect, bench."""

from __future__ import annotations

import functools
import json
import logging
import sys

import click
import msgspec

from artcache.errors import ArtcacheError, CacheRootError, ConfigError


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    for noisy in ("filelock", "urllib3", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _errors(fn):
    """Turn artcache errors into one clear line on stderr and a nonzero exit (2 = bad input)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ConfigError, ValueError, CacheRootError) as exc:
            # a missing / uninitialised cache root is bad input too (README: exit status 2)
            if not isinstance(exc, ArtcacheError) and not isinstance(exc, msgspec.ValidationError):
                raise
            click.echo(f"artcache: error: {exc}", err=True)
            sys.exit(2)
        except ArtcacheError as exc:
            click.echo(f"artcache: error: {type(exc).__name__}: {exc}", err=True)
            sys.exit(1)

    return wrapper


def _check_device(device: str) -> None:
    """Reject a device torch cannot use before anything is loaded or written."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is not accepted: use cpu, cuda or cuda:<index>")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"--device {device!r}: no CUDA device is visible; use --device cpu")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"--device {device!r}: only {n} CUDA device(s) visible (cuda:0..cuda:{n - 1})")


def _check_min(name: str, value: float, low: float, *, strict: bool = False, accepted: str = "") -> None:
    """ConfigError naming ``--name value`` unless value >= low (> low when ``strict``)."""
    if value < low or (strict and value == low) or value != value:  # NaN compares false
        raise ConfigError(f"--{name} {value} is not accepted: "
                          f"{accepted or ('a number > ' if strict else 'a number >= ') + str(low)}")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(package_name="artcache")
def main(verbose: bool) -> None:
    """artcache: capture a target's hidden states once, train many drafts from them."""
    _setup_logging(verbose)


@main.command()
@click.option("--cache", required=True, help="Cache root directory (created if absent).")
@click.option("--target", default="smollm2-135m-instruct", help="Target: the embedded name or an HF directory.")
@click.option("--data", "dataset", default="sharegpt", help="'sharegpt' (embedded) or a ShareGPT-format JSON/JSONL file.")
@click.option("--seed", default=0, type=int, help="Plan shuffle seed.")
@click.option("--max-length", default=512, type=int, help="Tokens per sample (truncated).")
@click.option("--max-samples", default=2000, type=int, help="Samples in the plan (positions wrap around).")
@click.option("--draft-layers", default=5, type=int, help="DFlash draft layers; captured ids follow the DFlash formula.")
@click.option("--layer-ids", default=None, help="Explicit output-of-layer ids, comma separated (overrides --draft-layers).")
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--dtype", default="bfloat16", type=click.Choice(["bfloat16", "float16", "float32"]),
              help="Stored dtype of the captured hidden states.")
@click.option("--compute-dtype", default="auto", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="Dtype the target runs in (auto: float32 on CPU, bfloat16 on CUDA).")
@click.option("--batch-samples", default=8, type=int, help="Max samples per capture batch.")
@click.option("--batch-tokens", default=8192, type=int, help="Max padded tokens per capture batch.")
@click.option("--max-queue", default=1024, type=int, help="Max queued fingerprints per scheduling pass.")
@click.option("--heartbeat-timeout", default=30.0, type=float, help="Seconds before a silent consumer is fenced.")
@click.option("--exit-when-done", is_flag=True, help="Exit once every registered consumer has finished.")
@click.option("--done-grace", default=10.0, type=float,
              help="With --exit-when-done: seconds with no running consumer before exiting.")
@click.option("--expect-consumers", default=0, type=int,
              help="Capture nothing until this many consumers have registered (a start line).")
@click.option("--idle-exit", default=0.0, type=float, help="Exit after this many idle seconds with no consumer (0: never).")
@click.option("--threads", default=0, type=int, help="torch CPU threads (0: torch's default).")
@click.option("--id", "producer_id", default="producer", help="Producer id (journal file name).")
@_errors
def producer(cache, target, dataset, seed, max_length, max_samples, draft_layers, layer_ids, device, dtype,
             compute_dtype, batch_samples, batch_tokens, max_queue, heartbeat_timeout, exit_when_done, done_grace,
             expect_consumers, idle_exit, threads,
             producer_id):
    """Run the target and publish captures for every live consumer window. Stop with Ctrl-C."""
    from artcache.producer import ProducerConfig, run_producer
    from artcache.scheduler import SchedulerLimits

    _check_min("threads", threads, 0, accepted="0 (torch's default) or a positive integer")
    _check_min("heartbeat-timeout", heartbeat_timeout, 0, strict=True, accepted="seconds > 0")
    _check_min("idle-exit", idle_exit, 0, accepted="seconds >= 0 (0: never)")
    _check_device(device)
    ids = None
    if layer_ids:
        try:
            ids = [int(x) for x in layer_ids.split(",")]
        except ValueError:
            raise ConfigError(f"--layer-ids {layer_ids!r}: expected comma-separated integers, e.g. 1,8,14") from None
    cfg = ProducerConfig(
        cache=cache, target=target, dataset=dataset, seed=seed, max_length=max_length, max_samples=max_samples,
        draft_layers=draft_layers, layer_ids=ids, device=device, dtype=dtype, compute_dtype=compute_dtype,
        limits=SchedulerLimits(max_queue=max_queue, max_batch_samples=batch_samples, max_batch_tokens=batch_tokens),
        heartbeat_timeout_s=heartbeat_timeout, exit_when_done=exit_when_done, done_grace_s=done_grace,
        expect_consumers=expect_consumers, idle_exit_s=idle_exit,
        producer_id=producer_id, threads=threads)
    stats = run_producer(cfg)
    click.echo(f"producer done: {stats.captures} captures, {stats.publications} publications, "
               f"{stats.evictions} evictions, {stats.recaptures} recaptures, {stats.failures} failures", err=True)


@main.command()
@click.option("--cache", required=True, help="Cache root made by `artcache producer`.")
@click.option("--draft", default="dflash", help="Draft algorithm: dflash.")
@click.option("--window", default="64:256", help="LOOKBEHIND:LOOKAHEAD in positions.")
@click.option("--id", "consumer_id", default=None, help="Consumer id (default: <draft>-b<block size>).")
@click.option("--block-size", default=16, type=int, help="DFlash block size B.")
@click.option("--anchors", default=64, type=int, help="Anchors (blocks) per sequence.")
@click.option("--draft-layers", default=None, type=int, help="Draft layers (default: one per captured layer).")
@click.option("--batch-size", default=2, type=int, help="Sequences per optimizer step.")
@click.option("--steps", default=100, type=int, help="Optimizer steps.")
@click.option("--lr", default=6e-4, type=float, help="Peak learning rate.")
@click.option("--seed", default=0, type=int)
@click.option("--device", default="cpu", help="cpu or cuda[:i].")
@click.option("--threads", default=0, type=int, help="torch CPU threads (0: torch's default).")
@click.option("--out", "out_dir", default="", help="Run directory for checkpoints (default ./runs/<id>).")
@click.option("--demand-timeout", default=600.0, type=float, help="Seconds to wait for one position.")
@click.option("--log-every", default=10, type=int)
@_errors
def consume(cache, draft, window, consumer_id, block_size, anchors, draft_layers, batch_size, steps, lr, seed,
            device, threads, out_dir, demand_timeout, log_every):
    """Train one draft on the cache root at its own pace."""
    from trainers.consumer import ConsumerConfig, parse_window, run_consumer

    if draft not in ("dflash",):
        raise ConfigError(f"--draft {draft!r} is not supported; accepted: dflash")
    lookbehind, lookahead = parse_window(window)
    _check_min("threads", threads, 0, accepted="0 (torch's default) or a positive integer")
    _check_min("demand-timeout", demand_timeout, 0, strict=True, accepted="seconds > 0")
    _check_device(device)
    cfg = ConsumerConfig(
        cache=cache, consumer_id=consumer_id or f"{draft}-b{block_size}", draft=draft, lookbehind=lookbehind,
        lookahead=lookahead, block_size=block_size, num_anchors=anchors, draft_layers=draft_layers,
        batch_size=batch_size, steps=steps, lr=lr, seed=seed, device=device, threads=threads, out_dir=out_dir,
        demand_timeout_s=demand_timeout, log_every=log_every)
    cfg.validate()
    summary = run_consumer(cfg)
    click.echo(json.dumps(summary), err=False)


@main.command()
@click.option("--cache", required=True, help="Cache root.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@_errors
def inspect(cache, as_json):
    """Lease and eviction accounting, per consumer and in total, with invariant checks."""
    from pathlib import Path

    from artcache.accounting import account
    from artcache.layout import CacheLayout
    from artcache.report import format_accounting

    layout = CacheLayout(Path(cache).expanduser().absolute())
    layout.require()
    acc = account(layout)
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(acc)).decode())
    else:
        click.echo(format_accounting(acc))
    if acc.violations:
        sys.exit(3)


@main.command()
@click.option("--scenario", default="1p3c", type=click.Choice(["1p1c", "1p3c", "all"]))
@click.option("--device", default="cpu", type=click.Choice(["cpu", "cuda"]))
@click.option("--out", "out_dir", default="bench-out", help="Output directory (one subdirectory per scenario).")
@click.option("--warmup", default=None, type=int, help="Warm-up steps per consumer (default: 5 cpu, 30 cuda).")
@click.option("--steps", default=None, type=int, help="Measured steps per consumer (default: 30 cpu, 150 cuda).")
@click.option("--target", default="smollm2-135m-instruct", help="Target name or HF directory.")
@click.option("--data", "dataset", default="sharegpt", help="'sharegpt', 'synthetic' or a ShareGPT-format file.")
@click.option("--max-length", default=512, type=int)
@click.option("--max-samples", default=2000, type=int, help="Samples in the plan.")
@click.option("--anchors", default=None, type=int, help="Anchors per sequence (default: 32 cpu, 256 cuda).")
@click.option("--batch-size", default=1, type=int, help="Sequences per optimizer step.")
@click.option("--draft-layers", default=5, type=int, help="DFlash draft layers (one captured layer each).")
@click.option("--window", default="64:256")
@click.option("--allow-shared-gpu", is_flag=True, help="Allow two roles on one GPU (every report line says so).")
@_errors
def bench(scenario, device, out_dir, warmup, steps, target, dataset, max_length, max_samples, anchors, batch_size,
          draft_layers, window, allow_shared_gpu):
    """Run 1-producer/N-consumer scenarios on fresh cache roots and report."""
    from bench.run import BenchConfig, run_bench

    cfg = BenchConfig(scenario=scenario, device=device, out_dir=out_dir,
                      warmup=warmup if warmup is not None else (30 if device == "cuda" else 5),
                      steps=steps if steps is not None else (150 if device == "cuda" else 30),
                      target=target, dataset=dataset, max_length=max_length, max_samples=max_samples,
                      anchors=anchors if anchors is not None else (256 if device == "cuda" else 32),
                      batch_size=batch_size, draft_layers=draft_layers, window=window,
                      allow_shared_gpu=allow_shared_gpu)
    ok = run_bench(cfg)
    sys.exit(0 if ok else 1)


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


if __name__ == "__main__":
    main()
