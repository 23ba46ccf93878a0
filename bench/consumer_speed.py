"""Consumer step speed on a GPU against its limits: steps/s, MFU, bytes read per second, the binding limit.

``python -m artcache.bench.consumer_speed --out DIR [--plan PART:VARIANT,...] [--steps 20] [--budget-s S]``

For each draft (DFlash, EAGLE-3) and variant, measured one after the other in one process on one GPU
so that the rows compare side by side (the speed options of :mod:`artcache.trainers.speed`: ``main`` =
the reference path with its host synchronisations, as the step once was; ``syncfree`` = no read-back in
the step, bf16 chunked lm_head loss; ``+compile`` / ``+graphs`` / ``liger``):

- **in memory**: the step of the consumer (``Draft.loss``, backward, clip, fused AdamW) on batches
  already on the GPU, timed over ``--steps`` steps after warm-up with one synchronisation at the end;
- **from the cache** (``cache-dflash`` / ``cache-eagle3`` parts): :func:`~artcache.trainers.consumer.run_consumer`
  itself on a root holding published artifacts of the SmolLM2 union (read + verify, reader-thread
  collate, journal, leases, cursor commits), steps/s from the run's own clock. The consumer's CUDA
  step is always sync-free, so there the variant picks only ``--loss-impl`` and ``--compile``
  (``main`` = ``--loss-impl reference --compile off``);
- a ``torch.profiler`` table of the in-memory step (self CUDA and self CPU time, per step), kernel
  launches and synchronisations per step.

MFU: analytic model FLOPs (:func:`dflash_step_flops`, :func:`eagle3_step_flops`) over the measured bf16
matmul rate of this run. Reads: artifact bytes per step × steps/s against the measured ``store.read``
rate of this run's root. Binding limit: the largest of FLOP time (flops / peak), read time (bytes /
read rate) and the host: ``host`` when the GPU is busy for less than 70 % of the step.
Every row gives steps/s, samples/s (sequences of the batch per second) and tokens/s, and its ratio to
the ``main`` row of the same draft and data source (``x_main``). The JSON (``DIR/consumer_speed.json``,
rewritten after every row so a run cut short keeps what it measured) records the command, the git
commit of the tree and the hardware (GPU, CUDA, CPU, torch).
Sizes: SmolLM2-135M shapes (``random:smollm2-135m``; synthetic 1024-token samples, batch 8), DFlash
B 16 / 64 anchors / 5 layers, EAGLE-3 7 TTT steps / 8192-token draft vocab; Qwen3-8B DFlash B 16 at
gpu_micro's shape (one 3072-token sequence, 256 anchors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from artcache.bench.gpu_micro import dflash_step_flops, matmul_peak
from artcache.bench.provenance import record
from artcache.telemetry import make_sampler

SMOL_UNION = [1, 8, 14, 20, 26, 27, 29]
DFLASH_VIEW = [1, 8, 14, 20, 27]
EAGLE3_VIEW = [1, 14, 26, 29]

#: variant -> (sync_free, ce_impl, compile, attn_impl); ``+flex``: DFlash / DSpark block attention by FlexAttention
VARIANTS = {
    "main": (False, "reference", "off", "sdpa"),
    "syncfree": (True, "chunked", "off", "sdpa"),
    "syncfree+compile": (True, "chunked", "on", "sdpa"),
    "syncfree+graphs": (True, "chunked", "graphs", "sdpa"),
    "syncfree+compile+flex": (True, "chunked", "on", "flex"),
    "syncfree+graphs+flex": (True, "chunked", "graphs", "flex"),
    "liger": (True, "liger", "off", "sdpa"),
}


#: what a plain run measures, in this order (the most telling figures first: before/after per draft)
DEFAULT_PLAN = (
    "dflash:main,dflash:syncfree,eagle3:main,eagle3:syncfree,cache-dflash:main,cache-dflash:syncfree,"
    "cache-eagle3:main,cache-eagle3:syncfree,dflash:syncfree+compile,eagle3:syncfree+compile,"
    "qwen3:main,qwen3:syncfree,cache-dflash:syncfree+compile,dflash:liger,dflash:syncfree+graphs"
)
PARTS = ("dflash", "eagle3", "dspark", "qwen3", "cache-dflash", "cache-eagle3")


def parse_plan(plan: str) -> list[tuple[str, str]]:
    """``PART:VARIANT[@N],...`` as pairs (``@N``: a from-cache row read by N read workers, ``--read-workers N``;
    without it 1); raises ValueError naming a bad part, variant or N and what is
    accepted."""
    out = []
    for entry in plan.split(","):
        part, _, variant = entry.strip().partition(":")
        if part not in PARTS:
            raise ValueError(f"plan entry {entry!r}: part {part!r} is not one of {', '.join(PARTS)}")
        base, at, workers = variant.partition("@")
        if base not in VARIANTS:
            raise ValueError(f"plan entry {entry!r}: variant {base!r} is not one of {', '.join(VARIANTS)}")
        if at and (not part.startswith("cache-") or not workers.isdigit() or not 1 <= int(workers) <= 64):
            raise ValueError(f"plan entry {entry!r}: '@{workers}' is accepted on cache-* parts only, as @N with "
                             "N in 1 .. 64 read workers")
        if VARIANTS[base][3] != "sdpa" and part not in ("dflash", "dspark", "qwen3"):
            raise ValueError(f"plan entry {entry!r}: +flex variants are in-memory rows of the block drafts (dflash, "
                             "dspark, qwen3): the consumer and EAGLE-3 run sdpa attention")
        out.append((part, variant))
    return out


def rates(row: dict, batch: int, seq: int) -> dict:
    """samples/s and tokens/s of a row's steps/s at ``batch`` sequences of ``seq`` positions."""
    return {
        "batch_size": batch,
        "seq_len": seq,
        "samples_per_s": row["steps_per_s"] * batch,
        "tokens_per_s": row["steps_per_s"] * batch * seq,
    }


def compare(rows: list[dict]) -> None:
    """Each row's ``x_main``: its steps/s over the ``main`` row of the same name and data; each from-cache row's
    ``from_cache_over_in_memory``: its steps/s over the in-memory row of the same name and variant of this run,
    when there is one (in place)."""
    ok = [r for r in rows if "error" not in r]
    base = {(r["name"], r["data"]): r["steps_per_s"] for r in ok if r.get("variant") == "main"}
    memory = {(r["name"], r["variant"]): r["steps_per_s"] for r in ok if r.get("data") == "in-memory"}
    for r in ok:
        b = base.get((r["name"], r["data"]))
        if b:
            r["x_main"] = r["steps_per_s"] / b
        m = memory.get((r["name"], r["variant"].partition("@")[0]))
        if r.get("data") == "from-cache" and m:
            r["from_cache_over_in_memory"] = r["steps_per_s"] / m


def eagle3_step_flops(cfg, seq: int, steps: int) -> float:
    """Model FLOPs of one EAGLE-3 TTT training step on one sequence (forward + backward), attention as
    executed (dense SDPA over the (i+1)·T keys of step i). Trainable matmuls 3× their forward; the frozen
    target head (soft labels, no gradient) once."""
    h, q, kv, i_sz = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    per = (
        2 * seq * 2 * h * (q + 2 * kv)
        + 2 * seq * q * h
        + 2 * seq * 3 * h * i_sz
        + 2 * seq * h * cfg.draft_vocab_size
    )
    attn = sum(2 * 2 * seq * (i + 1) * seq * q for i in range(steps))
    fc = 2 * seq * 3 * h * h
    return 3 * (steps * per + attn + fc) + 2 * seq * h * cfg.vocab_size


def dspark_step_flops(cfg, seq: int, supervised_tokens: int) -> float:
    """Model FLOPs of one DSpark training step on one sequence (forward + backward): DFlash's
    (:func:`~artcache.bench.gpu_micro.dflash_step_flops`, dense attention as executed) with every one of the B
    slots at the frozen lm_head (DFlash: B - 1; 2x, no weight grad), the target's head once more for the
    target distribution q_k of every slot (no gradient), and the Markov head (3x). Rows: anchors x B, capped
    by the supervised tokens x B."""
    n, b, h, v = cfg.num_anchors, cfg.block_size, cfg.hidden_size, cfg.vocab_size
    rows = min(n * b, supervised_tokens * b)
    extra_head = 2 * 2 * (rows - min(n * (b - 1), supervised_tokens * (b - 1))) * h * v
    target_head = 2 * rows * h * v
    markov = 3 * 2 * rows * cfg.markov_rank * v if cfg.markov_rank else 0
    return dflash_step_flops(cfg, seq, supervised_tokens) + extra_head + target_head + markov


def _arch_config(arch: str):
    from transformers import AutoConfig

    from artcache.target import RANDOM_ARCHS

    spec = dict(RANDOM_ARCHS[arch])
    spec.pop("architectures", None)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _frozen(v: int, h: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    emb = (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    head = (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return emb, head


def build(
    draft: str,
    arch: str,
    variant: str,
    device,
    *,
    layers: int,
    anchors: int = 64,
    block: int = 16,
    ttt: int = 7,
    draft_vocab: int = 8192,
):
    """A draft adapter of ``arch``'s shape on ``device`` with the variant's speed options."""
    from artcache.trainers.speed import SpeedOptions

    sync_free, impl, comp, attn = VARIANTS[variant]
    speed = SpeedOptions(sync_free=sync_free, ce_impl=impl, compile=comp, attn=attn)
    hf = _arch_config(arch)
    emb, head = _frozen(hf.vocab_size, hf.hidden_size, device)
    torch.manual_seed(0)
    if draft == "dflash":
        from artcache.trainers.dflash import DFlashConfig, DFlashDraft
        from artcache.trainers.dflash.adapter import DFlashAdapter

        cfg = DFlashConfig.from_target(
            hf,
            num_layers=5,
            block_size=block,
            num_anchors=anchors,
            mask_token_id=hf.vocab_size - 1,
            num_context_layers=layers,
        )
        model = DFlashDraft(cfg, emb, head)
        return DFlashAdapter(
            model, cfg, list(range(layers)), torch.Generator().manual_seed(0), speed=speed
        ), cfg
    if draft == "dspark":
        from artcache.trainers.dspark import DSparkConfig, DSparkDraft
        from artcache.trainers.dspark.adapter import DSparkAdapter

        cfg = DSparkConfig.from_target(hf, num_layers=5, block_size=block, num_anchors=anchors,
                                       mask_token_id=hf.vocab_size - 1, num_context_layers=layers)
        model = DSparkDraft(cfg, emb, head, torch.ones(hf.hidden_size, device=device))
        return DSparkAdapter(model, cfg, list(range(layers + 1)), torch.Generator().manual_seed(0), speed=speed), cfg
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft
    from artcache.trainers.eagle3.adapter import Eagle3Adapter
    from artcache.trainers.eagle3.vocab import build_vocab_map

    cfg = Eagle3Config.from_target(hf, draft_vocab_size=draft_vocab, ttt_steps=ttt)
    counts = torch.randint(0, 1000, (hf.vocab_size,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
    norm = torch.ones(hf.hidden_size, device=device)
    model = Eagle3Draft(cfg, emb, norm, head, d2t, t2d)
    return Eagle3Adapter(model, cfg, list(range(4)), speed=speed), cfg


def device_batches(b: int, seq: int, m: int, h: int, vocab: int, device, n: int = 3):
    """``n`` collated batches on ``device``: synthetic samples (first T/8 positions unsupervised)."""
    from artcache.trainers.draft import DraftBatch

    out = []
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(n):
        hidden = torch.randn(b, seq, m, h, generator=g, device=device).to(torch.bfloat16)
        ids = torch.randint(0, vocab - 64, (b, seq), generator=g, device=device)
        mask = torch.ones(b, seq, dtype=torch.bool, device=device)
        mask[:, : max(1, seq // 8)] = False
        valid = torch.ones(b, seq, dtype=torch.bool, device=device)
        out.append(DraftBatch(hidden, ids, mask, valid, supervised_host=(mask & valid).cpu()))
    return out


def train_step_fn(draft):
    params = [p for p in draft.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), fused=True)

    def step(batch):
        loss, sums = draft.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return sums

    return step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_in_memory(draft, batches, steps: int, warmup: int) -> dict:
    """Steps/s of the consumer's step on ``batches`` (cycled), one synchronisation after the timed steps."""
    step = train_step_fn(draft)
    t0 = time.perf_counter()
    for i in range(warmup):
        step(batches[i % len(batches)])
    _sync()
    warm_s = time.perf_counter() - t0
    pending = []
    t0 = time.perf_counter()
    for i in range(steps):
        pending.append(step(batches[i % len(batches)]))
    _sync()
    dt = (time.perf_counter() - t0) / steps
    from artcache.trainers.draft import PendingSums

    last = PendingSums.resolve_all(pending[-1:])[0]
    return {
        "step_ms": dt * 1e3,
        "steps_per_s": 1 / dt,
        "warmup_s": warm_s,
        "last_loss": draft.summary(last)["loss"],
    }


def profile_steps(draft, batches, steps: int = 6) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step = train_step_fn(draft)
    for i in range(3):
        step(batches[i % len(batches)])
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        _sync()
    return profile_figures(prof, steps)


def profile_figures(prof, steps: int) -> dict:
    """Per-step figures of ``steps`` profiled steps (``torch.profiler.profile``): device busy time (kernels and
    copies, ms), host-to-device copy time (ms), kernel launches, host syncs and ``cudaMemcpyAsync`` calls, and
    the tables by self CUDA and self CPU time."""
    ka = prof.key_averages()
    count = {e.key: e.count for e in ka}
    # kernels and copies only (device-side rows): an operator row repeats its kernels' time, and so does the
    # schedule's "ProfilerStep#N" range (regression: it doubled and more the busy time of a from-cache row, 45.7 ms
    # a step where the kernels took 11.3)
    device_rows = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.key.startswith("ProfilerStep")]
    gpu_us = sum(e.self_device_time_total for e in device_rows)
    htod_us = sum(e.self_device_time_total for e in device_rows if "HtoD" in e.key)
    table = ka.table(sort_by="self_cuda_time_total", row_limit=25)
    table_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=20)
    return {
        "gpu_busy_ms_per_step": gpu_us / steps / 1e3,
        "htod_ms_per_step": htod_us / steps / 1e3,
        "launches_per_step": (
            count.get("cudaLaunchKernel", 0)
            + count.get("cuLaunchKernelEx", 0)
            + count.get("cuLaunchKernel", 0)
        )
        / steps,
        "syncs_per_step": (count.get("cudaStreamSynchronize", 0) + count.get("cudaDeviceSynchronize", 0))
        / steps,
        "memcpy_per_step": count.get("cudaMemcpyAsync", 0) / steps,
        "table": table,
        "table_cpu": table_cpu,
    }


#: a profiled from-cache row (``--profile``): the profiler records the last PROFILE_WARMUP + PROFILE_ACTIVE steps;
#: the row's steps/s and utilisation come from the steps before them
PROFILE_WARMUP, PROFILE_ACTIVE = 5, 20


def limits(row: dict, flops: float, peak: float, bytes_per_step: float, read_bps: float | None) -> dict:
    """MFU, read rate and the binding limit of one measured row."""
    sps = row["steps_per_s"]
    out = {
        "flops_per_step": flops,
        "mfu": flops * sps / peak,
        "flop_floor_ms": flops / peak * 1e3,
        "bytes_per_step": bytes_per_step,
        "bytes_per_s": bytes_per_step * sps,
    }
    if read_bps:
        out["read_bandwidth_Bps"] = read_bps
        out["read_fraction"] = bytes_per_step * sps / read_bps
        out["read_floor_ms"] = bytes_per_step / read_bps * 1e3
    step_ms = 1e3 / sps
    busy = row.get("gpu_busy_ms_per_step")
    if busy is not None and busy < 0.7 * step_ms:
        out["binding"] = "host"
    elif read_bps and out["read_floor_ms"] > 0.7 * step_ms:
        out["binding"] = "reads"
    else:
        out["binding"] = "flops" if out["mfu"] > 0.35 else "gpu kernels (below the FLOP floor's rate)"
    return out


def make_root(
    root: Path,
    samples: int,
    device,
    target: str = "random:smollm2-135m",
    seq: int = 1024,
    union: list[int] = SMOL_UNION,
) -> dict:
    """A root (random target, synthetic ``seq``-token plan, the ``union`` captured) with every position
    published (random bf16 states, a pool of distinct tensors); the measured read + verify rate."""
    from artcache.fingerprint import PlanFingerprints
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.store import publish, read

    layout, settings, plan, info, _ = prepare_root(
        ProducerConfig(
            cache=str(root),
            target=target,
            dataset="synthetic",
            max_length=seq,
            max_samples=samples,
            layer_ids=union,
            device=str(device),
        )
    )
    fp_of = PlanFingerprints(settings.contract, plan)
    pool = [
        torch.randn(seq, len(union), info.hidden_size, device=device).to(torch.bfloat16).cpu()
        for _ in range(4)
    ]
    t0 = time.perf_counter()
    nbytes = 0
    for p in range(len(plan)):
        s = plan.sample(p)
        nbytes += publish(
            layout,
            fp_of(p),
            settings.contract,
            {
                "hidden_states": pool[p % 4][: s.input_ids.shape[0]],
                "input_ids": s.input_ids,
                "loss_mask": s.loss_mask,
            },
            durable=False,
            values_checked=True,
        )
    pub_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = min(64, len(plan))
    for p in range(n):
        read(layout, fp_of(p), settings.contract, pin=device.type == "cuda", verify_tokens=True)
    rd = time.perf_counter() - t0
    return {
        "artifact_bytes": nbytes / len(plan),
        "publish_s": pub_s,
        "read_verify_Bps": nbytes / len(plan) * n / rd,
    }


def from_cache(
    root: Path, draft: str, variant: str, steps: int, device, view: list[int] | None = None,
    profile_out: Path | None = None, run: int = 0, commit_interval_s: float | None = None, reader: str = "thread",
) -> dict:
    """``run_consumer`` on ``root`` for ``steps`` steps of 8 sequences (``run``: this row's index among the
    rows of the same draft and variant, so a repeated row is a consumer of its own with its own run directory;
    ``commit_interval_s``: the consumer's ``--commit-interval``, None: its default);
    steps/s from its journal's Step end times past the first steps (compilation, warm-up); ``host_ms_per_step``
    (the trainer thread's median ms per phase: :func:`artcache.trainers.consumer.session.host_ms_per_step`) and
    the device's NVML utilisation over the measured steps (``gpu_util_median_pct``: :func:`measured_rate_and_util`),
    which together say whether the device or the host's bookkeeping binds. With ``profile_out`` (a file) the last
    :data:`PROFILE_WARMUP` + :data:`PROFILE_ACTIVE` steps run under ``torch.profiler`` (its tables go there,
    :func:`profile_figures` into the row) and the rate is that of the steps before them.

    Raises:
        ValueError: ``profile_out`` with too few ``steps`` to measure a rate before the profiled window."""
    from artcache.trainers.consumer import ConsumerConfig, run_consumer
    from artcache.trainers.consumer.config import read_workers

    base, _, workers = variant.partition("@")
    _, impl, comp, attn = VARIANTS[base]
    if attn != "sdpa":
        raise ValueError(f"variant {variant!r}: the consumer runs sdpa attention; +flex rows are in memory only")
    kw = (
        dict(draft="dflash", block_size=16, num_anchors=64, layer_ids=view or DFLASH_VIEW)
        if draft == "dflash"
        else dict(draft="eagle3", ttt_steps=7, draft_vocab=8192, layer_ids=view or EAGLE3_VIEW)
    )
    cid = f"{draft}-{variant.replace('+', '-').replace('@', '-rw')}" + (f"-{run}" if run else "")
    cfg = ConsumerConfig(
        cache=str(root),
        consumer_id=cid,
        out_dir=str(root.parent / "runs" / cid),
        steps=steps,
        batch_size=8,
        lookbehind=64,
        lookahead=512,
        device=str(device),
        progress=False,
        tensorboard=False,
        log_every=50,
        demand_timeout_s=120,
        compile=comp,
        loss_impl=impl,
        read_workers=int(workers or 1),
        reader=reader,
        **({} if commit_interval_s is None else {"commit_interval_s": commit_interval_s}),
        **kw,
    )
    prof, hook, measured = None, None, steps
    if profile_out is not None:
        from torch.profiler import ProfilerActivity, profile, schedule

        measured = steps - PROFILE_WARMUP - PROFILE_ACTIVE
        if measured < 15:
            raise ValueError(f"a profiled from-cache row needs >= {15 + PROFILE_WARMUP + PROFILE_ACTIVE} steps "
                             f"(--cache-steps), got {steps}")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = profile(activities=activities,
                       schedule=schedule(wait=measured, warmup=PROFILE_WARMUP, active=PROFILE_ACTIVE, repeat=1))
        hook = lambda _step: prof.step()  # noqa: E731 - the profiler's clock is the consumer's step
    sampler = make_sampler([device.index or 0], period_s=0.1)
    sampler.start()
    try:
        with prof if prof is not None else contextlib.nullcontext():
            s = run_consumer(cfg, hook)
    finally:
        sampler.stop()
    # the run's own clock, past its first steps (compilation and warm-up): Step events' end times
    from artcache import journal as J
    from artcache.layout import CacheLayout

    events = [
        e for e in J.iter_file(CacheLayout(root).journal_path("consumer", cid)) if isinstance(e, J.Step)
    ]
    rate, util = measured_rate_and_util(sorted(e.t for e in events)[:measured], sampler, device.index or 0)
    figures = {}
    if prof is not None:
        figures = profile_figures(prof, PROFILE_ACTIVE)
        profile_out.write_text(figures.pop("table") + "\n\n" + figures.pop("table_cpu"))
    return {**figures,
        "steps": s["steps"],
        "seconds": s["seconds"],
        "steps_per_s": rate,
        "wait_s": s["wait_s"],
        "final_loss": s["final_loss"],
        "read_workers": read_workers(cfg),
        "commit_interval_s": cfg.commit_interval_s,
        "reader": cfg.reader,
        "host_ms_per_step": s["host_ms_per_step"],
        "gpu_util_median_pct": util,
    }


def measured_rate_and_util(step_ends: list[float], sampler, index: int = 0) -> tuple[float, float | None]:
    """Steps/s between the end of step ``skip`` and the last (``skip`` = min(10, a third): compilation and
    warm-up left out) from the steps' end times (epoch s), and the device's median NVML utilisation (%) over
    that same interval (None without samples there: no NVML). Regression: the utilisation was the median over
    the whole run, and the compile's idle GPU made it 0 % on the H200."""
    ts = sorted(step_ends)
    skip = min(10, len(ts) // 3)
    if len(ts) <= skip + 1:
        return float("nan"), None
    rate = (len(ts) - 1 - skip) / (ts[-1] - ts[skip])
    got = sampler.summary({index: "consumer"}, ts[skip], ts[-1]).get(f"cuda:{index}", {})
    return rate, got.get("util_median_pct") if got.get("over") == "interval" else None


def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--plan",
        default=DEFAULT_PLAN,
        help=f"comma list of PART:VARIANT in order; PART one of {', '.join(PARTS)} (dflash, eagle3, "
        f"qwen3: in memory; cache-*: run_consumer fed from a cache root); VARIANT one of {', '.join(VARIANTS)}",
    )
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiler tables")
    ap.add_argument("--steps", type=int, default=20, help="timed in-memory steps per row (after warm-up)")
    ap.add_argument("--cache-steps", type=int, default=60, help="run_consumer steps per from-cache row")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("BUDGET_S", "1e9")),
        help="stop starting new measurements after this many seconds",
    )
    ap.add_argument(
        "--switch-intervals-ms",
        type=_intervals,
        default=None,
        help="comma list of the interpreter's GIL switch intervals (sys.setswitchinterval, ms, > 0): the whole "
        "plan is run once per value, in order, each row recording its switch_interval_ms (default: once, at the "
        "interpreter's own 5 ms)",
    )
    ap.add_argument(
        "--commit-intervals",
        type=_commit_intervals,
        default=None,
        help="comma list of the consumer's --commit-interval values (seconds, 0 .. 10): each from-cache row of the "
        "plan is run once per value, in order (e.g. 0,0.25,0,0.25 alternates them), each recording its "
        "commit_interval_s; in-memory rows run once (default: the consumer's own default)",
    )
    ap.add_argument(
        "--readers",
        type=_readers,
        default=None,
        help="comma list of the consumer's --reader values (thread, process): each from-cache row of the plan is run "
        "once per value (and per --commit-intervals value), in order, each recording its reader (default: thread)",
    )
    ap.add_argument("--root", default="/tmp/artcache-consumer-speed",
                    help="scratch directory: its cache/ and runs/ of an earlier run are removed at start")
    return ap


def _commit_intervals(text: str) -> list[float]:
    """``--commit-intervals`` parsed: seconds in 0 .. MAX_COMMIT_INTERVAL_S (the consumer's ``--commit-interval``).
    argparse.ArgumentTypeError (a one-line usage error, exit 2) names a bad value."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: comma-separated seconds, e.g. 0,0.25") from None
    from artcache.trainers.consumer.config import MAX_COMMIT_INTERVAL_S

    bad = [v for v in values if not 0 <= v <= MAX_COMMIT_INTERVAL_S]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]:g} is not accepted: seconds in 0 .. {MAX_COMMIT_INTERVAL_S:g}")
    return values


def _readers(text: str) -> list[str]:
    """``--readers`` parsed: each ``thread`` or ``process`` (the consumer's ``--reader``); argparse.ArgumentTypeError
    names a bad value."""
    from artcache.trainers.consumer.reader_process import READERS

    values = [v.strip() for v in text.split(",")]
    bad = [v for v in values if v not in READERS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not accepted: comma-separated {' or '.join(READERS)}")
    return values


def _intervals(text: str) -> list[float]:
    """``--switch-intervals-ms`` parsed: positive milliseconds. argparse.ArgumentTypeError (a one-line usage
    error, exit 2) for anything else."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 1000 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of milliseconds in (0, 1000], e.g. 5,0.5")
    return values


def _print_table(report: dict) -> None:
    """The rows of ``report`` as one table on stdout (errors on their own line)."""
    print(
        "\nname                 variant           data        steps/s  samples/s  x main   MFU  GB/s read  binding",
        flush=True,
    )
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['name']:<20} {r['variant']:<17} {r['data']:<10}  ERROR {r['error'][:60]}")
            continue
        print(
            f"{r['name']:<20} {r['variant']:<17} {r['data']:<10} {r['steps_per_s']:8.1f} {r['samples_per_s']:10.1f} "
            f"{r.get('x_main', float('nan')):7.2f} {r['mfu']:5.3f} {r.get('bytes_per_s', 0) / 1e9:9.2f}  "
            f"{r.get('binding', '')} busy {r.get('gpu_busy_ms_per_step', float('nan')):.1f} ms "
            f"launch {r.get('launches_per_step', float('nan')):.0f} sync {r.get('syncs_per_step', float('nan')):.0f}"
            f" GIL switch {r.get('switch_interval_ms', 5.0):g} ms"
        )
        if r.get("host_ms_per_step"):  # a from-cache row: the trainer thread's median ms per phase, NVML util
            phases = " ".join(f"{k} {v:.1f}" for k, v in r["host_ms_per_step"].items())
            print(f"{'':<20} host ms/step: {phases}; GPU util {r.get('gpu_util_median_pct')} %; host-to-device "
                  f"{r.get('htod_ms_per_step', float('nan')):.1f} ms/step")
    print(
        f"commit {report['commit']}{' (dirty)' if report['dirty'] else ''}, total {report['seconds']:.0f}s",
        flush=True,
    )


#: the figures of the published root (:func:`make_root`), kept beside it under ``--root``
ROOT_INFO = "root.json"
#: what this benchmark writes under ``--root`` (the root of published artifacts, its figures, the consumers' run
#: directories)
SCRATCH = ("cache", "runs", ROOT_INFO)


def clear_scratch(root: Path) -> None:
    """Empty ``--root`` of an earlier run's ``cache`` and ``runs`` (regression: a second run on the same H200
    found the first's run directories and every from-cache row failed with "already holds checkpoints of an
    earlier run"). ValueError when ``root`` holds anything else (not this benchmark's: nothing is removed)."""
    if not root.exists():
        return
    if not root.is_dir():
        raise ValueError(f"--root {root} is not a directory: give a scratch directory (created if missing)")
    other = sorted(p.name for p in root.iterdir() if p.name not in SCRATCH)
    if other:
        raise ValueError(f"--root {root} holds {', '.join(other[:3])}, which this benchmark did not write: give an "
                         f"empty or missing directory (it writes and replaces only {', '.join(SCRATCH)} there)")
    for name in SCRATCH:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)  # root.json is a file: rmtree(ignore_errors=True) left it in place


def _shapes() -> dict:
    """Part -> (row name, draft, arch, ``device_batches`` args (batch, seq, target layers, hidden, vocab),
    FLOPs of one sequence as a function of the draft config, ``build`` keywords)."""
    smol = _arch_config("smollm2-135m")
    sup = 1024 - 1024 // 8
    q = _arch_config("qwen3-8b")
    return {
        "dflash": (
            "dflash-smollm2",
            "dflash",
            "smollm2-135m",
            (8, 1024, 5, smol.hidden_size, smol.vocab_size),
            lambda c: dflash_step_flops(c, 1024, sup),
            {"layers": 5},
        ),
        "eagle3": (
            "eagle3-smollm2",
            "eagle3",
            "smollm2-135m",
            (8, 1024, 4, smol.hidden_size, smol.vocab_size),
            lambda c: eagle3_step_flops(c, 1024, 7),
            {"layers": 4},
        ),
        "dspark": (  # DSpark's GPU defaults (DeepSpec's recipe): B 7, 512 anchors, 5 layers, Markov rank 256
            "dspark-smollm2",
            "dspark",
            "smollm2-135m",
            (8, 1024, 6, smol.hidden_size, smol.vocab_size),  # 5 context layers and L - 1
            lambda c: dspark_step_flops(c, 1024, sup),
            {"layers": 5, "anchors": 512, "block": 7},
        ),
        "qwen3": (
            "dflash-qwen3-8b-B16",
            "dflash",
            "qwen3-8b",
            (1, 3072, 5, q.hidden_size, q.vocab_size),
            lambda c: dflash_step_flops(c, 3072, 3072 - 3072 // 8),
            {"layers": 5, "anchors": 256},
        ),
    }


def _tiny_shapes() -> dict:
    """:func:`_shapes` at toy sizes (a random tiny-llama: 64 hidden, 64-token sequences, batch 2), to check the rows
    on any device; their figures measure nothing."""
    tiny = _arch_config("tiny-llama")
    h, v = tiny.hidden_size, tiny.vocab_size
    return {
        "dflash": ("dflash-tiny", "dflash", "tiny-llama", (2, 64, 5, h, v), lambda c: dflash_step_flops(c, 64, 56),
                   {"layers": 5, "anchors": 8}),
        "eagle3": ("eagle3-tiny", "eagle3", "tiny-llama", (2, 64, 4, h, v), lambda c: eagle3_step_flops(c, 64, 7),
                   {"layers": 4, "draft_vocab": 512}),
        "dspark": ("dspark-tiny", "dspark", "tiny-llama", (2, 64, 6, h, v), lambda c: dspark_step_flops(c, 64, 56),
                   {"layers": 5, "anchors": 8, "block": 7}),
        "qwen3": ("dflash-tiny-B16", "dflash", "tiny-llama", (1, 64, 5, h, v), lambda c: dflash_step_flops(c, 64, 56),
                  {"layers": 5, "anchors": 8}),
    }


#: the toy root of a tiny from-cache row: its target, sequence length, captured union and each draft's view
TINY_ROOT = {"target": "random:tiny-llama", "seq": 96, "union": [1, 2, 3, 4, 5, 7],
             "views": {"dflash": [1, 2, 3, 4, 5], "eagle3": [1, 3, 4, 7]}}


def measure_row(part: str, variant: str, *, device, out: Path, root: Path, peak: float, steps: int = 20,
                cache_steps: int = 60, profile: bool = True, commit_interval_s: float | None = None,
                reader: str = "thread", run: int = 0, tiny: bool = False) -> dict:
    """One row of the plan (``PART:VARIANT``, :func:`parse_plan`): the in-memory step timed over ``steps`` steps, or
    (``cache-*`` parts) :func:`from_cache` over ``cache_steps`` steps on the published root ``root/cache`` (made by
    :func:`make_root` with its figures in ``root/root.json`` when absent, then reused). ``peak``: the matmul rate
    (FLOP/s) MFU is taken against. ``out``: where profiler tables go (``profile``). ``run``: this row's index among
    the earlier rows of the same draft and variant (a repeated row is a consumer of its own). ``tiny``: toy shapes
    (:func:`_tiny_shapes`), 2 in-memory / 3 from-cache steps, no profile: a check that the row runs, on any device.
    Returns the row: name, variant, data, the timing's figures, :func:`rates` and :func:`limits`."""
    device = torch.device(device)
    shapes = _tiny_shapes() if tiny else _shapes()
    if tiny:
        steps, cache_steps, profile = 2, 3, False
    if not part.startswith("cache-"):
        name, draft, arch, bargs, flops_fn, kw = shapes[part]
        row = {"name": name, "variant": variant, "data": "in-memory"}
        d, cfg = build(draft, arch, variant, device, **kw)
        batches = device_batches(*bargs, device=device)
        if variant == "main":  # the step as it once was: the anchors' mask is read back from the device
            for b in batches:
                b.supervised_host = None
        row.update(time_in_memory(d, batches, steps, warmup=1 if tiny else 3 if VARIANTS[variant][2] == "off" else 4))
        if profile and part != "qwen3":
            prof = profile_steps(d, batches)
            (out / f"profile-{name}-{variant}.txt").write_text(prof.pop("table") + "\n\n" + prof.pop("table_cpu"))
            row.update(prof)
        row.update(rates(row, bargs[0], bargs[1]))
        row.update(limits(row, flops_fn(cfg) * bargs[0], peak, 0.0, None))
        return row
    draft = part.removeprefix("cache-")
    name, _, arch, bargs, flops_fn, kw = shapes[draft]
    row = {"name": name, "variant": variant, "data": "from-cache"}
    info_path = root / ROOT_INFO
    if not info_path.is_file():
        shutil.rmtree(root / "cache", ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        extra = {k: TINY_ROOT[k] for k in ("target", "seq", "union")} if tiny else {}
        info = make_root(root / "cache", 8 * cache_steps, device, **extra)
        info_path.write_text(json.dumps(info))
        print(json.dumps(info), flush=True)
    info = json.loads(info_path.read_text())
    prof_out = out / f"profile-{name}-from-cache-{variant}.txt" if profile else None
    if prof_out is not None and run:
        prof_out = prof_out.with_name(f"{prof_out.stem}-{run}{prof_out.suffix}")
    row.update(from_cache(root / "cache", draft, variant, cache_steps, device, profile_out=prof_out, run=run,
                          commit_interval_s=commit_interval_s, reader=reader,
                          view=TINY_ROOT["views"][draft] if tiny else None))
    cfg = build(draft, arch, "main", device, **kw)[1]
    row.update(rates(row, 8, TINY_ROOT["seq"] if tiny else 1024))
    row.update(limits(row, flops_fn(cfg) * 8, peak, 8 * info["artifact_bytes"], info["read_verify_Bps"]))
    return row


def main() -> None:
    ap = _arg_parser()
    args = ap.parse_args()
    try:
        plan = parse_plan(args.plan)
    except ValueError as exc:
        ap.error(str(exc))  # exit 2
    try:
        clear_scratch(Path(args.root))
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("consumer_speed measures a CUDA device; none is available", file=sys.stderr)
        raise SystemExit(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    t_start = time.time()
    report = {**record("artcache.bench.consumer_speed", device=device, roots=[Path(args.root)]),
              "device": torch.cuda.get_device_name(device),
              "torch": torch.__version__, "rows": []}
    report["matmul_peak_flops"] = peak = matmul_peak(device)
    print(f"matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)

    def save() -> None:
        compare(report["rows"])
        (out / "consumer_speed.json").write_text(json.dumps(report, indent=1))

    def over() -> bool:
        return time.time() - t_start > args.budget_s

    shapes = _shapes()
    intervals = args.switch_intervals_ms or [sys.getswitchinterval() * 1e3]
    consumers = [(c, r) for c in args.commit_intervals or [None] for r in args.readers or ["thread"]]
    runs = ((i, c, r, pv) for i in intervals for k, (c, r) in enumerate(consumers) for pv in plan
            if k == 0 or pv[0].startswith("cache-"))  # in-memory rows have no consumer settings: once
    for interval_ms, commit_s, reader, (part, variant) in runs:
        sys.setswitchinterval(interval_ms / 1e3)
        if over():
            print(f"skip {part}:{variant}: past --budget-s", flush=True)
            continue
        prior = sum(r["name"] == shapes[part.removeprefix("cache-")][0] and r["variant"] == variant
                    and r.get("data") == "from-cache" for r in report["rows"])  # a repeated from-cache row
        try:
            row = measure_row(part, variant, device=device, out=out, root=Path(args.root), peak=peak,
                              steps=args.steps, cache_steps=args.cache_steps, profile=args.profile,
                              commit_interval_s=commit_s, reader=reader, run=prior)
            if part.startswith("cache-") and "root" not in report:
                report["root"] = json.loads((Path(args.root) / ROOT_INFO).read_text())
        except Exception as exc:  # one failing variant must not lose the others' figures
            row = {
                "name": part,
                "variant": variant,
                "data": "from-cache" if part.startswith("cache-") else "in-memory",
                "error": f"{type(exc).__name__}: {exc}",
            }
            traceback.print_exc()
        row["switch_interval_ms"] = interval_ms
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()
        torch.cuda.empty_cache()
    report["seconds"] = time.time() - t_start
    save()
    _print_table(report)


if __name__ == "__main__":
    main()
