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
import dataclasses
import json
import os
import queue
import statistics
import threading
import time
from pathlib import Path

import torch

from artcache.bench.provenance import record
from artcache.fsio import atomic_write


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


def synthetic_capture(seq: int, layers: int, hidden: int, seed: int = 0, pin: bool = False,
                      dtype: str = "bfloat16") -> dict:
    """One artifact's tensors of the given shape: ``hidden_states`` [seq, layers, hidden] (standard normal
    values) in ``dtype``, ``input_ids`` [seq] int32, ``loss_mask`` [seq] uint8; for ``float8_e4m3fn`` the
    fp8 codes and ``hidden_scales`` [seq, layers] fp32 (:func:`artcache.fp8.quantize_rows`). ``pin``: in
    page-locked memory, as the CUDA capture backend delivers them."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(seq, layers, hidden, generator=g, dtype=torch.float32)
    out = {"input_ids": torch.randint(0, 32000, (seq,), generator=g, dtype=torch.int32),
           "loss_mask": torch.ones(seq, dtype=torch.uint8)}
    if dtype == "float8_e4m3fn":
        from artcache.fp8 import quantize_rows

        out["hidden_states"], out["hidden_scales"] = quantize_rows(hs)
    else:
        out["hidden_states"] = hs.to(getattr(torch, dtype))
    if pin:
        out = {k: v.pin_memory() for k, v in out.items()}
    return out


def _write_file(path: Path, data, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def io_components(root: Path, tensors: dict, reps: int) -> dict:
    """Where a publish and a read spend their time: each primitive the store uses, timed alone on this
    root over one artifact's bytes (medians, seconds): the NaN/Inf scan, xxh3-128 of the data, the write
    into the page cache (no fsync), the fsync after it, rename + directory fsync, a read into a fresh
    buffer and into a reused one (page cache hot), and the allocation of a fresh buffer."""
    from artcache import hashing
    from artcache.fsio import fsync_dir
    from artcache.store import all_finite

    data = memoryview(tensors["hidden_states"].reshape(-1).view(torch.uint8).numpy())
    path, other = root / "component.bin", root / "component-renamed.bin"
    times: dict[str, list[float]] = {k: [] for k in ("finite_scan", "hash", "write_cache", "fsync",
                                                     "rename_dirsync", "read_fresh_buffer", "read_reused_buffer",
                                                     "alloc_fresh_buffer")}
    reuse = bytearray(data.nbytes)

    def clock(key, fn):
        t0 = time.perf_counter()
        fn()
        times[key].append(time.perf_counter() - t0)

    def read_into(buf):
        with open(other, "rb", buffering=0) as f:
            view = memoryview(buf)
            got = 0
            while got < len(view) and (n := f.readinto(view[got:])):
                got += n

    for _ in range(reps + 1):
        clock("finite_scan", lambda: all_finite(tensors["hidden_states"]))
        clock("hash", lambda: hashing.digest_bytes(data))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            clock("write_cache", lambda fd=fd: [os.write(fd, data[i:i + (1 << 30)])
                                               for i in range(0, data.nbytes, 1 << 30)])
            clock("fsync", lambda fd=fd: os.fsync(fd))
        finally:
            os.close(fd)
        clock("rename_dirsync", lambda: (os.replace(path, other), fsync_dir(root)))
        clock("alloc_fresh_buffer", lambda: bytearray(data.nbytes))
        clock("read_fresh_buffer", lambda: read_into(bytearray(data.nbytes)))
        clock("read_reused_buffer", lambda: read_into(reuse))
        other.unlink()
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    out["bytes"] = data.nbytes
    out.update(_odirect(root, data, reps))
    return out


def _odirect(root: Path, data: memoryview, reps: int) -> dict:
    """O_DIRECT write + fsync of one artifact's bytes from a page-aligned buffer (8 MiB writes), and the
    read that follows it (from the device: O_DIRECT leaves nothing in the page cache), in seconds; {} where
    the filesystem refuses O_DIRECT. Measured to decide whether publish should bypass the page cache."""
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return {}
    size = data.nbytes - data.nbytes % 4096
    buf = mmap.mmap(-1, size)
    buf[:] = data[:size]
    view = memoryview(buf)
    path = root / "component-direct.bin"
    writes, reads = [], []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
            try:
                for off in range(0, size, 8 << 20):
                    os.pwrite(fd, view[off:off + (8 << 20)], off)
                os.fsync(fd)
            finally:
                os.close(fd)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            reads.append(time.perf_counter() - t0)
            path.unlink()
    except OSError:
        return {}
    finally:
        view.release()
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return {"odirect_write_fsync": statistics.median(writes[1:]),
            "read_after_odirect_write": statistics.median(reads[1:])}


#: store I/O versions measured side by side (``--io-variants``): ``legacy`` is the path before the fp8 and I/O rework
#: (hash the whole data section, then write; read the whole file into a fresh buffer, then hash)
IO_VARIANTS = {
    "legacy": {"stream": False, "reuse_buffers": False},
    "stream": {"hash_thread": False, "writeback": False},
    "stream+hash-thread": {"writeback": False},
    "no-tail": {"tail_bytes": 8 << 20},  # the default before reads took their last chunk in 1 MiB pieces
    "default": {},  # stream + hash thread + writeback + 1 MiB read tail (store.IOSettings defaults)
    "default+fallocate": {"fallocate": True},
}


def io_bench(roots: list[Path], device: torch.device, seq: int, layers: int, hidden: int, reps: int,
             raw_bytes: int, variants: list[str] | None = None, dtype: str = "bfloat16") -> dict:
    """The store's I/O against the raw device, side by side in each repetition, on each root.

    Per repetition: the raw figures (:func:`disk_bandwidth`: ``raw_bytes`` written in 64 MiB chunks with
    one fsync; its page-cache read into one reused 64 MiB buffer) and one artifact-sized write + fsync;
    then for each store I/O version (:data:`IO_VARIANTS`): ``store.publish`` of a new artifact of shape
    [seq, layers, hidden] with its values already checked (the GPU producer's path: the backend checks
    NaN/Inf on the device), with the host NaN/Inf scan (the CPU producer's path), and two artifacts by
    two threads at once; then ``store.read`` of each (header, hash, structure; no token check), each
    artifact dropped before the next read (as a consumer does). Medians over ``reps`` (one warm-up
    repetition first, discarded). Ratios: publish / raw write+fsync, read+verify / raw page-cache read.
    ``dtype`` ``float8_e4m3fn`` stores the fp8 form (:mod:`artcache.fp8`) of the same values.
    """
    import shutil

    from artcache import store
    from artcache.contract import CaptureContract
    from artcache.layout import CacheLayout

    variants = variants or ["legacy", "default"]
    pin = device.type == "cuda"
    contract = CaptureContract(
        target_name="synthetic", target_revision="none", target_config_hash="none", target_weights_digest="none",
        layer_ids=tuple(range(layers)), dtype=dtype, compute_dtype="bfloat16", max_length=seq,
        tokenizer_digest="none", template_digest="none")
    tensors = synthetic_capture(seq, layers, hidden, pin=pin, dtype=dtype)
    out: dict = {"shape": [seq, layers, hidden], "dtype": dtype, "reps": reps, "raw_bytes": raw_bytes,
                 "variants": {v: IO_VARIANTS[v] for v in variants}, "io_defaults": dataclasses.asdict(store.IO),
                 "roots": {}}
    counter = iter(range(1, 10**9))
    for root in roots:
        base = root / "io-bench"
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        layout = CacheLayout(base / "cache")
        layout.create()
        raw_keys = ("raw_write_fsync_Bps", "raw_read_pagecache_Bps", "raw_artifact_write_fsync_Bps")
        var_keys = ("publish_Bps", "publish_host_scan_Bps", "publish_2threads_Bps", "read_verify_Bps")
        series: dict = {k: [] for k in raw_keys}
        series.update({v: {k: [] for k in var_keys} for v in variants})
        nbytes = 0
        for rep in range(reps + 1):
            keep = rep > 0  # the first repetition warms up
            raw = disk_bandwidth(base, raw_bytes)
            t0 = time.perf_counter()
            _write_file(base / "raw-artifact.bin", tensors["hidden_states"].reshape(-1).view(torch.uint8).numpy())
            raw_art = tensors["hidden_states"].numel() * tensors["hidden_states"].element_size() / (
                time.perf_counter() - t0)
            (base / "raw-artifact.bin").unlink()
            if keep:
                series["raw_write_fsync_Bps"].append(raw["write_fsync_Bps"])
                series["raw_read_pagecache_Bps"].append(raw["read_pagecache_Bps"])
                series["raw_artifact_write_fsync_Bps"].append(raw_art)
            for v in variants:
                with store.io_settings(**IO_VARIANTS[v]):
                    fps, rates = [], []
                    for checked in (True, False):
                        fps.append(f"{next(counter):040x}")
                        t0 = time.perf_counter()
                        nbytes = store.publish(layout, fps[-1], contract, tensors, values_checked=checked)
                        rates.append(nbytes / (time.perf_counter() - t0))
                    pair = [f"{next(counter):040x}" for _ in range(2)]
                    threads = [threading.Thread(target=store.publish, args=(layout, fp, contract, tensors),
                                                kwargs={"values_checked": True}) for fp in pair]
                    t0 = time.perf_counter()
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    rates.append(2 * nbytes / (time.perf_counter() - t0))
                    reads = []
                    for fp in fps + pair:
                        t0 = time.perf_counter()
                        art = store.read(layout, fp, contract, pin=pin)
                        reads.append(art.nbytes / (time.perf_counter() - t0))
                        del art
                    for fp in fps + pair:
                        store.remove(layout, fp)
                if keep:
                    for k, r in zip(var_keys, rates, strict=False):
                        series[v][k].append(r)
                    series[v]["read_verify_Bps"].extend(reads)
        row: dict = {k: statistics.median(series[k]) for k in raw_keys}
        row["artifact_bytes"] = nbytes
        for v in variants:
            med = {k: statistics.median(series[v][k]) for k in var_keys}
            med["publish_over_raw"] = med["publish_Bps"] / row["raw_write_fsync_Bps"]
            med["publish_host_scan_over_raw"] = med["publish_host_scan_Bps"] / row["raw_write_fsync_Bps"]
            med["publish_2threads_over_raw"] = med["publish_2threads_Bps"] / row["raw_write_fsync_Bps"]
            med["read_verify_over_pagecache"] = med["read_verify_Bps"] / row["raw_read_pagecache_Bps"]
            row[v] = med
        row["series"] = series
        row["components_s"] = io_components(base, tensors, reps)
        out["roots"][str(root)] = row
        shutil.rmtree(base, ignore_errors=True)
    return out


def _capture_publish(backend, samples, layout, contract, batches: int, publishers: int, counter) -> dict:
    """The producer's pipeline: capture ``batches`` batches on this thread while ``publishers`` threads wait
    for each batch's host copies (``ready()``) and publish it (at most 2 batches waiting, as
    ``max_inflight_batches``). Steady-state samples/s = the samples of batches 2..n over the time between the
    first and the last batch's publication (the pipeline's fill and drain left out). Published artifacts
    are removed afterwards (eviction, not timed)."""
    from artcache.store import publish, remove

    q: queue.Queue = queue.Queue(maxsize=2)
    done: list[float] = []
    fps: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def publisher():
        while (item := q.get()) is not None:
            try:
                finite = item.ready()
                for t, ok in zip(item, finite, strict=True):
                    with lock:
                        fp = f"{next(counter):040x}"
                        fps.append(fp)
                    publish(layout, fp, contract, t, values_checked=ok)
                with lock:
                    done.append(time.perf_counter())
            except BaseException as exc:  # re-raised below
                errors.append(exc)

    threads = [threading.Thread(target=publisher) for _ in range(publishers)]
    for th in threads:
        th.start()
    t0 = time.perf_counter()
    for _ in range(batches):
        q.put(backend.capture(samples))
    for _ in threads:
        q.put(None)
    for th in threads:
        th.join()
    total = time.perf_counter() - t0
    for fp in fps:
        remove(layout, fp)
    if errors:
        raise errors[0]
    done.sort()
    return {"steady_samples_per_s": (len(done) - 1) * len(samples) / (done[-1] - done[0]),
            "end_to_end_samples_per_s": batches * len(samples) / total}


def producer_bench(arch: str, device: torch.device, seq: int, batch: int, reps: int, roots: list[Path],
                   peak: float, dtypes: list[str], batches: int = 8, publishers: list[int] | None = None,
                   raw: dict | None = None) -> dict:
    """Plain prefill, capture (hooks, cut after the deepest captured layer, device NaN check, fp8
    quantisation on the device for an fp8 contract, D2H into pinned memory on a side stream) and capture +
    publish into each root (:func:`_capture_publish`), per stored dtype, all in one run; the limit of
    capture + publish is min(plain prefill, raw write+fsync / artifact bytes) with the raw figure of the
    io part of the same run (``raw``: root -> bytes/s), when it ran. Then ``store.read`` of published
    artifacts, each dropped before the next (as a consumer does)."""
    from artcache.backends.hf import HFCaptureBackend
    from artcache.contract import CaptureContract
    from artcache.layer_ids import dflash_layer_ids
    from artcache.layout import CacheLayout
    from artcache.plan import PlanSpec, build_synthetic_plan
    from artcache.store import publish, read, remove
    from artcache.target import load_target_model, resolve_target

    publishers = publishers or [1]
    info = resolve_target(f"random:{arch}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_target_model(info, device=device, dtype=dtype)
    layer_ids = dflash_layer_ids(info.num_layers, 5)
    plan = build_synthetic_plan(PlanSpec(dataset="synthetic", max_length=seq, max_samples=batch * (reps + 4)),
                                target_vocab_size=info.vocab_size)
    samples = [plan.sample(i) for i in range(batch)]
    ids = torch.stack([s.input_ids.long() for s in samples]).to(device)
    n_params = sum(p.numel() for n, p in model.model.named_parameters() if "embed_tokens" not in n)
    per_layer = n_params / info.num_layers
    cfg = model.config
    attn = 2 * seq * seq * cfg.num_attention_heads * getattr(cfg, "head_dim",
                                                             cfg.hidden_size // cfg.num_attention_heads)

    def flops(layers: int) -> float:  # 2·params·tokens + causal attention (QKᵀ and AV, half the square)
        return batch * (2 * per_layer * layers * seq + layers * attn)

    with torch.inference_mode():
        plain = _timed(lambda: model.model(input_ids=ids, use_cache=False), device, reps)
    plain_rate = batch / statistics.median(plain)
    out = {"arch": arch, "seq": seq, "batch": batch, "layer_ids": layer_ids, "batches_per_rep": batches,
           "plain_prefill_s": statistics.median(plain), "plain_samples_per_s": plain_rate,
           "plain_tokens_per_s": batch * seq / statistics.median(plain),
           "plain_mfu": flops(info.num_layers) / statistics.median(plain) / peak, "dtypes": {}}
    counter = iter(range(1, 10**12))
    for stored in dtypes:
        contract = CaptureContract(
            target_name=info.name, target_revision=info.revision, target_config_hash=info.config_hash,
            target_weights_digest=info.weights_digest, layer_ids=tuple(layer_ids), dtype=stored,
            compute_dtype=str(dtype).removeprefix("torch."), max_length=seq, tokenizer_digest="none",
            template_digest="none")
        backend = HFCaptureBackend(model, contract, device=device)
        capture = _timed(lambda backend=backend: backend.capture(samples).ready(), device, reps)
        captured = backend.capture(samples)
        captured.ready()
        row = {"capture_s": statistics.median(capture), "capture_samples_per_s": batch / statistics.median(capture),
               "capture_mfu": flops(max(layer_ids) + 1) / statistics.median(capture) / peak, "roots": {}}
        for root in roots:
            layout = CacheLayout(root / f"producer-{stored}")
            layout.create()
            nbytes = publish(layout, "e" * 40, contract, captured[0], values_checked=True)
            remove(layout, "e" * 40)
            r: dict = {"artifact_bytes": nbytes}
            for n in publishers:
                runs = [_capture_publish(backend, samples, layout, contract, batches, n, counter)
                        for _ in range(max(1, reps // 2))]
                r[f"capture_publish_{n}pub_samples_per_s"] = statistics.median(x["steady_samples_per_s"] for x in runs)
                r[f"capture_publish_{n}pub_end_to_end_samples_per_s"] = statistics.median(
                    x["end_to_end_samples_per_s"] for x in runs)
            raw_bps = (raw or {}).get(str(root))
            limit = min(plain_rate, raw_bps / nbytes) if raw_bps else plain_rate
            r["limit_samples_per_s"] = limit
            r["limit_is"] = "disk" if raw_bps and raw_bps / nbytes < plain_rate else "prefill"
            for n in publishers:
                r[f"capture_publish_{n}pub_over_limit"] = r[f"capture_publish_{n}pub_samples_per_s"] / limit
            fps = [f"{next(counter):040x}" for _ in range(4)]
            for fp in fps:
                publish(layout, fp, contract, captured[0], values_checked=True)
            def read_all(layout=layout, fps=fps, contract=contract):
                for fp in fps:  # each artifact dropped before the next read, as a consumer does
                    read(layout, fp, contract, pin=device.type == "cuda")

            rd = _timed(read_all, device, 3, 1)
            r["read_verify_Bps"] = len(fps) * nbytes / statistics.median(rd)
            for fp in fps:
                remove(layout, fp)
            row["roots"][str(root)] = r
        backend.close()
        out["dtypes"][stored] = row
    return out


def consumer_bench(arch: str, device: torch.device, seq: int, anchors: int, blocks: list[int], steps: int,
                   root: Path | None, peak: float, dtypes: list[str] | None = None) -> dict:
    """DFlash steps/s with the batch in GPU memory and fed from a cache root of each stored dtype through
    the consumer's own data path (read + verify into pinned memory on a reader thread, then the
    consumer's ``collate``: host-to-device copy, fp8 dequantised on the device)."""
    import msgspec
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
    dtypes = dtypes or ["bfloat16"]
    caches = {}  # stored dtype -> (layout, contract, fingerprints)
    if root is not None:
        from artcache.fp8 import stored_hidden

        for stored in dtypes:
            c = msgspec.structs.replace(contract, dtype=stored)
            layout = CacheLayout(root / f"consumer-cache-{stored}")
            layout.create()
            fps = []
            g = torch.Generator().manual_seed(0)
            for i in range(8):
                s = plan.sample(i)
                hs = torch.randn(seq, m, info.hidden_size, generator=g).to(torch.bfloat16)
                t = {**stored_hidden(hs, getattr(torch, stored)), "input_ids": s.input_ids, "loss_mask": s.loss_mask}
                fps.append(f"{i + 1:040x}")
                publish(layout, fps[-1], c, t)
            caches[stored] = (layout, c, fps)
    results = {}
    try:
        for block in blocks:
            dcfg = DFlashConfig.from_target(hf, num_layers=5, block_size=block, num_anchors=anchors,
                                            mask_token_id=mask_id, num_context_layers=m)
            results[f"B{block}"] = _consumer_block(dcfg, embed, lm_head, plan.sample(0), device, steps, peak,
                                                   caches, info.hidden_size)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:  # the roots' 16 artifacts (~1.5 GB at Qwen3-8B's shape) go with the part
        import shutil

        for layout, _c, _fps in caches.values():
            shutil.rmtree(layout.root, ignore_errors=True)
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


def _consumer_block(dcfg, embed, lm_head, sample, device, steps, peak, caches: dict, hidden_size) -> dict:
    """Steps/s of one DFlash draft, fed from GPU memory and from each cache of ``caches``."""
    from artcache.client import Leased
    from artcache.store import read
    from artcache.trainers.consumer.reader import collate
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
    for stored, (layout, contract, fps) in caches.items():
        # the consumer's data path: a reader thread reads + verifies + pins ahead (depth 2); the training
        # thread collates (host-to-device without blocking; fp8 dequantised on the device) and steps
        q: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        def reader(layout=layout, contract=contract, fps=fps, q=q, stop=stop):
            i = 0
            while not stop.is_set():
                q.put(Leased(i, read(layout, fps[i % len(fps)], contract, pin=device.type == "cuda"), ""))
                i += 1

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        cached = _timed(lambda q=q: step(collate([q.get()], device).hidden), device, steps)
        stop.set()
        while th.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            th.join(timeout=0.05)
        row[f"from_cache_{stored}_steps_per_s"] = 1 / statistics.median(cached)
        row[f"cache_{stored}_over_memory"] = row[f"from_cache_{stored}_steps_per_s"] / row["in_memory_steps_per_s"]
    return row


def _io_summary(io: dict) -> str:
    lines = [f"artifact {io['dtype']} {io['shape']}; GB/s (ratio to the raw figure of the same root and run)",
             f"{'root / version':<34} {'raw w+fsync':>11} {'publish':>13} {'host scan':>13} {'2 threads':>13} "
             f"{'page cache':>10} {'read+verify':>13}"]
    for root, r in io["roots"].items():
        lines.append(f"{root:<34} {r['raw_write_fsync_Bps'] / 1e9:>11.2f} {'':>13} {'':>13} {'':>13} "
                     f"{r['raw_read_pagecache_Bps'] / 1e9:>10.2f}   (artifact {r['artifact_bytes']:,} B; "
                     f"raw artifact-size write+fsync {r['raw_artifact_write_fsync_Bps'] / 1e9:.2f})")
        for v in io["variants"]:
            m = r[v]
            lines.append(f"  {v:<32} {'':>11} {m['publish_Bps'] / 1e9:>6.2f} ({m['publish_over_raw']:.2f}) "
                         f"{m['publish_host_scan_Bps'] / 1e9:>6.2f} ({m['publish_host_scan_over_raw']:.2f}) "
                         f"{m['publish_2threads_Bps'] / 1e9:>6.2f} ({m['publish_2threads_over_raw']:.2f}) "
                         f"{'':>10} {m['read_verify_Bps'] / 1e9:>6.2f} ({m['read_verify_over_pagecache']:.2f})")
        c = r["components_s"]
        lines.append("  components, ms per artifact: " + ", ".join(
            f"{k} {v * 1e3:.1f}" for k, v in c.items() if k != "bytes"))
    return "\n".join(lines)


def _producer_summary(p: dict) -> str:
    lines = [f"plain prefill {p['plain_samples_per_s']:.2f} samples/s (batch {p['batch']}, seq {p['seq']})"]
    for d, row in p["dtypes"].items():
        lines.append(f"{d}: capture {row['capture_samples_per_s']:.2f} samples/s")
        for root, r in row["roots"].items():
            pubs = ", ".join(f"{k.split('_')[2]} {v:.2f} ({r[k.replace('samples_per_s', 'over_limit')]:.2f})"
                             for k, v in r.items() if k.startswith("capture_publish_") and
                             k.endswith("pub_samples_per_s"))
            lines.append(f"  {root}: {r['artifact_bytes']:,} B/artifact; capture+publish samples/s (of limit) {pubs}; "
                         f"limit {r['limit_samples_per_s']:.2f} ({r['limit_is']}); read+verify "
                         f"{r['read_verify_Bps'] / 1e9:.2f} GB/s")
    return "\n".join(lines)


PARTS = ("matmul", "io", "producer", "consumer")


def main(argv: list[str] | None = None) -> None:

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for micro.json (unless --json names the file)")
    ap.add_argument("--json", default=None, help="write the machine-readable result here (e.g. "
                    "bench/results/<date>-h200-micro.json); default OUT/micro.json")
    ap.add_argument("--arch", default="qwen3-8b")
    ap.add_argument("--seq", type=int, default=3072)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--roots", default="/tmp/artcache-micro")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", default=None, help=f"comma list of parts to run, of {','.join(PARTS)}; default "
                    "all on CUDA, matmul,io on CPU (a CPU cannot run the 8B-shaped prefill)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip")
    ap.add_argument("--io-layers", type=int, default=5, help="io part: captured layers per artifact")
    ap.add_argument("--io-hidden", type=int, default=4096, help="io part: hidden size (Qwen3-8B: 4096)")
    ap.add_argument("--raw-bytes", type=int, default=2 << 30, help="size of the raw write+fsync file (bytes)")
    ap.add_argument("--io-variants", default="legacy,default",
                    help=f"io part: store I/O versions to measure side by side, of {','.join(IO_VARIANTS)}")
    ap.add_argument("--dtypes", default="bfloat16,fp8", help="producer part: stored dtypes to capture + publish")
    ap.add_argument("--batches", type=int, default=8, help="producer part: batches per capture + publish run")
    ap.add_argument("--publishers", default="1,2", help="producer part: publisher thread counts to measure")
    ap.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                    help="io part: also measure fp8 artifacts (bytes per artifact against bf16)")
    args = ap.parse_args(argv)
    from artcache.contract import stored_dtype

    try:
        [stored_dtype(d) for d in args.dtypes.split(",")]
    except ValueError as exc:
        ap.error(f"--dtypes: {exc}")
    device = torch.device(args.device)
    parts = (args.parts.split(",") if args.parts else list(PARTS) if device.type == "cuda" else ["matmul", "io"])
    bad = [p for p in parts + [p for p in args.skip.split(",") if p] if p not in PARTS]
    if bad:
        ap.error(f"--parts/--skip {','.join(bad)} not accepted: use a comma list of {','.join(PARTS)}")
    parts = [p for p in parts if p not in args.skip.split(",")]
    bad = [v for v in args.io_variants.split(",") if v and v not in IO_VARIANTS]
    if bad:
        ap.error(f"--io-variants {','.join(bad)} not accepted: use a comma list of {','.join(IO_VARIANTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    roots = [Path(r) for r in args.roots.split(",") if r]
    report = {**record("artcache.bench.gpu_micro", argv, device, roots),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": str(torch.__version__), "random_weights": True, "parts": parts}
    dest = Path(args.json) if args.json else out / "micro.json"
    dest.parent.mkdir(parents=True, exist_ok=True)

    def save(done: str | None) -> None:  # after every part: a run cut short keeps the parts it finished
        now = time.monotonic()
        if done:
            report["parts_done"] = report.get("parts_done", []) + [done]
            report.setdefault("part_wall_s", {})[done] = now - t_start - sum(report.get("part_wall_s", {}).values())
        report["wall_s"] = now - t_start
        atomic_write(dest, [json.dumps(report, indent=1).encode()], dest.parent, durable=False)

    t_start = time.monotonic()
    peak = float("nan")
    if "matmul" in parts:
        report["matmul_peak_flops"] = peak = matmul_peak(device)
        print(f"matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
        save("matmul")
    if "io" in parts:
        variants = [v for v in args.io_variants.split(",") if v]
        report["io"] = io_bench(roots, device, args.seq, args.io_layers, args.io_hidden, args.reps, args.raw_bytes,
                                variants)
        print(_io_summary(report["io"]), flush=True)
        if args.fp8:
            report["io_fp8"] = io_bench(roots, device, args.seq, args.io_layers, args.io_hidden, args.reps,
                                        args.raw_bytes, ["default"], dtype="float8_e4m3fn")
            print(_io_summary(report["io_fp8"]), flush=True)
            report["fp8_bytes_over_bf16"] = {
                r: report["io_fp8"]["roots"][r]["artifact_bytes"] / report["io"]["roots"][r]["artifact_bytes"]
                for r in report["io"]["roots"]}
            print("fp8 artifact bytes / bf16: " + ", ".join(f"{r} {x:.4f}" for r, x in
                                                            report["fp8_bytes_over_bf16"].items()), flush=True)
        save("io")
    if "producer" in parts:
        raw = {r: row["raw_write_fsync_Bps"] for r, row in report.get("io", {}).get("roots", {}).items()}
        report["producer"] = producer_bench(
            args.arch, device, args.seq, args.batch, args.reps, roots, peak,
            [stored_dtype(d) for d in args.dtypes.split(",")], args.batches,
            [int(n) for n in args.publishers.split(",")], raw)
        print(json.dumps(report["producer"], indent=1), flush=True)
        print(_producer_summary(report["producer"]), flush=True)
        save("producer")
    if "consumer" in parts:
        report["consumer"] = consumer_bench(args.arch, device, args.seq, args.anchors,
                                            [int(b) for b in args.blocks.split(",")], args.steps,
                                            roots[0] if roots else None, peak,
                                            [stored_dtype(d) for d in args.dtypes.split(",")])
        print(json.dumps(report["consumer"], indent=1), flush=True)
        save("consumer")
    save(None)
    print(f"wrote {dest} ({report['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
