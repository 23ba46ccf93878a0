"""Micro-benchmarks of artcache's parts against the hardware's limits, measured side by side in one run.

``python -m artcache.bench.gpu_micro --out DIR [--arch qwen3-8b] [--seq 3072] [--roots /tmp/x,/dev/shm/x]``

1. bf16 matmul rate (8192³), the ceiling MFU figures are taken against.
2. Raw disk bandwidth per cache root: large sequential write + fsync, page-cache read.
3. Producer: plain prefill (all layers, no capture) vs capture (hooks, cut after the deepest captured
   layer, device-to-host copy into pinned memory) vs capture + publish into each root; samples/s,
   tokens/s, MFU; then ``store.read`` bandwidth of the published artifacts.
4. DFlash consumer (5 layers, ``--anchors`` anchors, block sizes 4/8/16): steps/s with the batch
   already in GPU memory vs fed from the cache root (read + verify + host-to-device each step), and
   MFU from torch's FLOP counter.

Targets are random-weight models of real architectures (``random:<arch>``): throughput does not
depend on weight values. Medians over the timed repetitions; all figures come from this one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import threading
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def matmul_peak(device: torch.device, n: int = 8192) -> float:
    """Measured dense bf16 matmul rate in FLOP/s (median of 10 after warm-up)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = _timed(lambda: a @ b, device, 10, 3)
    return 2 * n**3 / statistics.median(times)


def disk_bandwidth(root: Path, size: int = 2 << 30, chunk: int = 64 << 20) -> dict:
    """Sequential write+fsync and page-cache read of one ``size``-byte file under ``root`` (bytes/s)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "raw-bandwidth.bin"
    buf = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // chunk):
            f.write(buf)
        os.fsync(f.fileno())
    write = size / (time.perf_counter() - t0)
    rbuf = bytearray(chunk)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(rbuf):
            pass
    read = size / (time.perf_counter() - t0)
    path.unlink()
    return {"write_fsync_Bps": write, "read_pagecache_Bps": read, "bytes": size}


def producer_bench(arch: str, device: torch.device, seq: int, batch: int, reps: int, roots: list[Path],
                   peak: float) -> dict:
    from artcache.backends.hf import HFCaptureBackend
    from artcache.contract import CaptureContract
    from artcache.layer_ids import dflash_layer_ids
    from artcache.layout import CacheLayout
    from artcache.plan import PlanSpec, build_synthetic_plan
    from artcache.store import publish, read
    from artcache.target import load_target_model, resolve_target

    info = resolve_target(f"random:{arch}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_target_model(info, device=device, dtype=dtype)
    layer_ids = dflash_layer_ids(info.num_layers, 5)
    contract = CaptureContract(
        target_name=info.name, target_revision=info.revision, target_config_hash=info.config_hash,
        target_weights_digest=info.weights_digest, layer_ids=tuple(layer_ids), dtype="bfloat16",
        compute_dtype=str(dtype).removeprefix("torch."), max_length=seq, tokenizer_digest="none",
        template_digest="none")
    plan = build_synthetic_plan(PlanSpec(dataset="synthetic", max_length=seq, max_samples=batch * (reps + 4)),
                                target_vocab_size=info.vocab_size)
    samples = [plan.sample(i) for i in range(batch)]
    ids = torch.stack([s.input_ids.long() for s in samples]).to(device)
    n_params = sum(p.numel() for n, p in model.model.named_parameters() if "embed_tokens" not in n)
    per_layer = n_params / info.num_layers
    cfg = model.config
    attn = 2 * seq * seq * cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)

    def flops(layers: int) -> float:  # 2·params·tokens + causal attention (QKᵀ and AV, half the square)
        return batch * (2 * per_layer * layers * seq + layers * attn)

    with torch.inference_mode():
        plain = _timed(lambda: model.model(input_ids=ids, use_cache=False), device, reps)
    backend = HFCaptureBackend(model, contract, device=device)
    capture = _timed(lambda: backend.capture(samples), device, reps)
    out = {"arch": arch, "seq": seq, "batch": batch, "layer_ids": layer_ids,
           "plain_prefill_s": statistics.median(plain), "capture_s": statistics.median(capture),
           "plain_samples_per_s": batch / statistics.median(plain),
           "capture_samples_per_s": batch / statistics.median(capture),
           "plain_tokens_per_s": batch * seq / statistics.median(plain),
           "plain_mfu": flops(info.num_layers) / statistics.median(plain) / peak,
           "capture_mfu": flops(max(layer_ids) + 1) / statistics.median(capture) / peak,
           "roots": {}}
    captured = backend.capture(samples)
    artifact_bytes = sum(t["hidden_states"].numel() * 2 for t in captured) / batch
    out["artifact_bytes"] = artifact_bytes
    for root in roots:
        layout = CacheLayout(root / "cache")
        layout.create()
        counter = iter(range(10**9))

        def capture_publish(layout=layout, counter=counter):
            # the producer's pipeline: capture here, publish on a thread (at most 2 batches waiting)
            q: queue.Queue = queue.Queue(maxsize=2)

            def publisher():
                while (item := q.get()) is not None:
                    for t, ok in item:
                        publish(layout, f"{next(counter):040x}", contract, t, values_checked=ok)

            th = threading.Thread(target=publisher)
            th.start()
            for _ in range(4):
                q.put(list(zip(backend.capture(samples), backend.last_finite, strict=True)))
            q.put(None)
            th.join()

        cp = _timed(capture_publish, device, reps, warmup=1)
        fps = [f"{i:040x}" for i in range(4 * batch * (reps + 1))]
        rd = _timed(lambda layout=layout, fps=fps: [read(layout, fp, contract, pin=device.type == "cuda")
                                                    for fp in fps], device, 3, 0)
        pub_only = _timed(lambda layout=layout, t=captured[0]: publish(layout, "f" * 40, contract, t), device, 5, 1)
        out["roots"][str(root)] = {
            "disk": disk_bandwidth(root),
            "capture_publish_samples_per_s": 4 * batch / statistics.median(cp),
            "publish_Bps": artifact_bytes / statistics.median(pub_only),
            "read_verify_Bps": len(fps) * artifact_bytes / statistics.median(rd),
        }
    backend.close()
    return out


def consumer_bench(arch: str, device: torch.device, seq: int, anchors: int, blocks: list[int], steps: int,
                   root: Path | None, peak: float) -> dict:
    from transformers import AutoConfig

    from artcache.contract import CaptureContract
    from artcache.layout import CacheLayout
    from artcache.plan import PlanSpec, build_synthetic_plan, choose_mask_token
    from artcache.store import publish
    from artcache.target import load_embedding_and_lm_head, resolve_target
    from artcache.trainers.dflash import DFlashConfig

    info = resolve_target(f"random:{arch}")
    embed, lm_head = load_embedding_and_lm_head(info)
    plan = build_synthetic_plan(PlanSpec(dataset="synthetic", max_length=seq, max_samples=8),
                                target_vocab_size=info.vocab_size)
    mask_id = choose_mask_token(None, info.vocab_size, plan)
    hf = AutoConfig.from_pretrained(info.path)
    m = 5
    contract = CaptureContract(
        target_name=info.name, target_revision=info.revision, target_config_hash=info.config_hash,
        target_weights_digest=info.weights_digest, layer_ids=tuple(range(m)), dtype="bfloat16",
        max_length=seq, tokenizer_digest="none", template_digest="none")
    layout = None
    fps = []
    if root is not None:
        layout = CacheLayout(root / "consumer-cache")
        layout.create()
        for i in range(8):
            s = plan.sample(i)
            t = {"hidden_states": torch.randn(seq, m, info.hidden_size, dtype=torch.bfloat16),
                 "input_ids": s.input_ids, "loss_mask": s.loss_mask}
            fps.append(f"{i + 1:040x}")
            publish(layout, fps[-1], contract, t)
    results = {}
    for block in blocks:
        dcfg = DFlashConfig.from_target(hf, num_layers=5, block_size=block, num_anchors=anchors,
                                        mask_token_id=mask_id, num_context_layers=m)
        results[f"B{block}"] = _consumer_block(dcfg, embed, lm_head, plan.sample(0), device, steps, peak,
                                               layout, fps, contract, info.hidden_size)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"arch": arch, "seq": seq, "anchors": anchors, "draft_layers": 5, "blocks": results}


def dflash_step_flops(cfg, seq: int, supervised_tokens: int) -> float:
    """Model FLOPs of one DFlash training step on one sequence (forward + backward), dense attention as
    executed (the block mask is applied inside a dense SDPA). Trainable matmuls count 3× their forward
    (forward, input grad, weight grad); the frozen lm_head 2× (no weight grad). Rows reaching the
    lm_head: anchors × (B − 1), capped by the supervised tokens."""
    n, b, h = cfg.num_anchors, cfg.block_size, cfg.hidden_size
    s = n * b  # block (query) tokens
    k = seq + s  # keys: context + blocks
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = (2 * s * h * q_dim + 2 * k * h * 2 * kv_dim + 2 * s * q_dim * h
                 + 2 * s * 3 * h * cfg.intermediate_size + 2 * 2 * s * k * q_dim)
    fc = 2 * seq * cfg.num_context_layers * h * h
    rows = min(n * (b - 1), supervised_tokens * (b - 1))
    lm_head = 2 * rows * h * cfg.vocab_size
    return 3 * (cfg.num_layers * per_layer + fc) + 2 * lm_head


def _consumer_block(dcfg, embed, lm_head, sample, device, steps, peak, layout, fps, contract, hidden_size) -> dict:
    """Steps/s of one DFlash draft, fed from GPU memory and (with ``layout``) from the cache."""
    from artcache.store import read
    from artcache.trainers.dflash import DFlashDraft, dflash_loss, sample_anchors

    model = DFlashDraft(dcfg, embed.to(device), lm_head.to(device))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    seq, m = sample.input_ids.shape[0], dcfg.num_context_layers
    ids = sample.input_ids.long()[None].to(device)
    mask = sample.loss_mask.bool()[None]
    hidden_gpu = torch.randn(1, seq, m, hidden_size, dtype=torch.bfloat16, device=device)

    def step(hidden):
        a, v = sample_anchors(mask, dcfg.num_anchors, gen)
        a, v = a.to(device), v.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(hidden, ids, a, v)
            loss, _ = dflash_loss(model, out, ids, mask.to(device), a, v)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    step(hidden_gpu)
    step_flops = dflash_step_flops(dcfg, seq, int(mask.sum()))
    mem = _timed(lambda: step(hidden_gpu), device, steps)
    row = {"in_memory_steps_per_s": 1 / statistics.median(mem), "flops_per_step": step_flops,
           "mfu": step_flops / statistics.median(mem) / peak}
    if layout is not None:
        # the consumer's data path: a reader thread reads + verifies + pins ahead (depth 2), the
        # training thread copies host-to-device without blocking and steps
        q: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        def reader():
            i = 0
            while not stop.is_set():
                q.put(read(layout, fps[i % len(fps)], contract, pin=device.type == "cuda").hidden_states)
                i += 1

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        cached = _timed(lambda: step(q.get()[None].to(device, non_blocking=True)), device, steps)
        stop.set()
        while th.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            th.join(timeout=0.05)
        row["from_cache_steps_per_s"] = 1 / statistics.median(cached)
        row["cache_over_memory"] = row["from_cache_steps_per_s"] / row["in_memory_steps_per_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="qwen3-8b")
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--roots", default="/tmp/artcache-micro")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: producer,consumer")
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    roots = [Path(r) for r in args.roots.split(",") if r]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": str(torch.__version__), "random_weights": True}
    report["matmul_peak_flops"] = peak = matmul_peak(device)
    print(f"matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    if "producer" not in args.skip:
        report["producer"] = producer_bench(args.arch, device, args.seq, args.batch, args.reps, roots, peak)
        print(json.dumps(report["producer"], indent=1), flush=True)
    if "consumer" not in args.skip:
        report["consumer"] = consumer_bench(args.arch, device, args.seq, args.anchors,
                                            [int(b) for b in args.blocks.split(",")], args.steps,
                                            roots[0] if roots else None, peak)
        print(json.dumps(report["consumer"], indent=1), flush=True)
    (out / "micro.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
