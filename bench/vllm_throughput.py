"""Capture throughput of the ``vllm`` backend against the ``hf`` backend, and vLLM prefill with against
without hidden-state extraction, on the same ShareGPT plan samples in one process.

Three capture paths run on the same batches, interleaved (the order rotates every repetition so a
change of machine load hits all three alike); the report gives the median tokens/s of each:

- ``hf``: :class:`artcache.backends.hf.HFCaptureBackend` (forward hooks; the pass stops after the
  deepest captured layer; padded batch);
- ``vllm+extract``: :class:`artcache.backends.vllm.VLLMCaptureBackend` (``extract_hidden_states`` and
  artcache's connector; the full model plus one sampled token; rows handed back in memory);
- ``vllm``: a plain vLLM engine on the same target, ``max_tokens=1``, no extraction (prefill only).

Tokens are the samples' real tokens (no padding counted). Needs the ``artcache[vllm]`` extra. The
``vllm-throughput`` suite's piece (``artcache bench --suite vllm-throughput``, :mod:`artcache.bench.suites`) runs
:func:`main` at the sizes of docs/vllm.md's figures (``--max-length 512 --samples 8 --batch 4 --reps 5``).
Figures and the machine they came from: docs/vllm.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name or HF directory")
    p.add_argument("--data", default="sharegpt", help="'sharegpt' or a ShareGPT-format file")
    p.add_argument("--max-length", type=int, default=512, help="tokens per sample (truncated)")
    p.add_argument("--samples", type=int, default=8, help="plan samples measured (split into batches)")
    p.add_argument("--batch", type=int, default=4, help="samples per capture call")
    p.add_argument("--reps", type=int, default=5, help="repetitions over all batches (medians over them)")
    p.add_argument("--draft-layers", type=int, default=5, help="captured layers (DFlash formula)")
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype both backends run in (bf16 is slow on CPUs without native bf16 matmuls)")
    p.add_argument("--skip-plain", action="store_true", help="do not start the vLLM engine without extraction")
    p.add_argument("--out", default="", help="write the report as JSON here")
    args = p.parse_args(argv)
    for name in ("samples", "batch", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} is not accepted: an integer >= 1")
    return args


def _plain_server(conn, target_path: str, dtype: str, max_model_len: int, budget: int) -> None:
    """Child process: a vLLM engine without extraction; times ``generate`` (max_tokens=1) per batch."""
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(model=target_path, dtype=dtype, enforce_eager=True, enable_prefix_caching=False,
                   max_model_len=max_model_len, max_num_batched_tokens=budget, seed=0)
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    conn.send(time.perf_counter() - t0)
    while True:
        prompts = conn.recv()
        if prompts is None:
            break
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        conn.send(time.perf_counter() - t0)


class _PlainEngine:
    """Parent side of :func:`_plain_server`. ``run(batch)`` blocks while the child prefills the batch."""

    def __init__(self, target_path: str, dtype: str, max_model_len: int, budget: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_plain_server, args=(child, target_path, dtype, max_model_len, budget),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(900):
            self.close()
            raise RuntimeError("the vLLM engine without extraction did not start within 900 s")
        self.startup_s = self.conn.recv()

    def run(self, batch) -> None:
        self.conn.send([s.input_ids.tolist() for s in batch])
        self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(60)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


def main(argv=None) -> dict:
    args = _parse(argv)
    import msgspec
    import torch

    from artcache.backends.hf import HFCaptureBackend
    from artcache.backends.vllm import VLLMCaptureBackend, configure_environment, require_vllm
    from artcache.producer import ProducerConfig, prepare_root
    from artcache.target import load_target_model

    require_vllm()
    configure_environment("cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(tempfile.mkdtemp(prefix="artcache-vllm-bench-"))
    load0 = os.getloadavg()
    plain = None
    try:
        _layout, settings, plan, info, _tok = prepare_root(ProducerConfig(
            cache=str(work / "cache"), target=args.target, dataset=args.data, max_length=args.max_length,
            max_samples=max(args.samples, 16), draft_layers=args.draft_layers, compute_dtype=args.compute_dtype,
            backend="vllm"))
        contract = settings.contract
        samples = [plan.sample(i) for i in range(min(args.samples, len(plan)))]
        batches = [samples[i:i + args.batch] for i in range(0, len(samples), args.batch)]
        tokens = [sum(int(s.input_ids.shape[0]) for s in b) for b in batches]

        # vLLM keeps its KV connector in process-global state: an engine without extraction cannot share
        # this process with the extracting one, so it runs in a child process, driven batch by batch
        plain = None if args.skip_plain else _PlainEngine(info.path, contract.compute_dtype, contract.max_length + 1,
                                                          args.batch * (args.max_length + 1))
        t0 = time.perf_counter()
        vx = VLLMCaptureBackend(info.path, contract, max_num_batched_tokens=args.batch * (args.max_length + 1))
        startup_extract = time.perf_counter() - t0
        model = load_target_model(info, device="cpu", dtype=getattr(torch, contract.compute_dtype))
        hf = HFCaptureBackend(model, msgspec.structs.replace(contract, backend="hf"))
        paths = {"hf": hf.capture, "vllm+extract": vx.capture}
        startup_plain = None
        if plain is not None:
            startup_plain = plain.startup_s
            paths["vllm"] = plain.run
        for fn in paths.values():  # warm-up (allocations, first-call kernels)
            fn(batches[0])
        rates: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for b, n_tok in zip(batches, tokens, strict=True):
                for name in order:
                    t0 = time.perf_counter()
                    paths[name](b)
                    rates[name].append(n_tok / (time.perf_counter() - t0))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{n} {statistics.median(r[-len(batches):]):.0f} tok/s" for n, r in rates.items()), flush=True)
        hf.close()
        vx.close()
    finally:
        if plain is not None:
            plain.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {n: statistics.median(r) for n, r in rates.items()}
    report = {
        "cpu": _cpu_model(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
        "vllm": __import__("vllm").__version__, "torch_threads": torch.get_num_threads(),
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "target": info.name, "compute_dtype": contract.compute_dtype, "stored_dtype": contract.dtype,
        "layer_ids": list(contract.layer_ids), "max_length": args.max_length, "samples": len(samples),
        "batch": args.batch, "reps": args.reps, "tokens_per_batch": tokens,
        "startup_s": {"vllm+extract": startup_extract, "vllm": startup_plain},
        "median_tok_s": med, "all_tok_s": rates,
        "vllm_over_hf": med["vllm+extract"] / med["hf"],
        "extract_over_plain": med["vllm+extract"] / med["vllm"] if "vllm" in med else None,
        # per batch and repetition, the two paths measured back to back: robust to slow load drift
        "paired_vllm_over_hf": _paired(rates, "vllm+extract", "hf"),
        "paired_extract_over_plain": _paired(rates, "vllm+extract", "vllm") if "vllm" in med else None,
    }
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def _paired(rates: dict[str, list[float]], a: str, b: str) -> dict[str, float]:
    """Median and quartiles of rate(a) / rate(b) over the measurements of the same batch and repetition."""
    ratios = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def format_report(r: dict) -> str:
    lines = [f"{r['target']} on {r['cpu']} ({r['cores']} cores), compute {r['compute_dtype']}, "
             f"{r['samples']} samples x {r['reps']} reps, batches of {r['batch']}, max length {r['max_length']}, "
             f"layers {r['layer_ids']}; load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}",
             "", "| path | median tok/s |", "|---|---:|"]
    lines += [f"| {n} | {v:.0f} |" for n, v in r["median_tok_s"].items()]
    lines.append("")
    p = r["paired_vllm_over_hf"]
    lines.append(f"vllm+extract / hf = {r['vllm_over_hf']:.2f} (paired per batch: median {p['median']:.2f}, "
                 f"quartiles {p['q1']:.2f}-{p['q3']:.2f})")
    if r["extract_over_plain"] is not None:
        p = r["paired_extract_over_plain"]
        lines.append(f"vllm+extract / vllm (no extraction) = {r['extract_over_plain']:.2f} (paired per batch: "
                     f"median {p['median']:.2f}, quartiles {p['q1']:.2f}-{p['q3']:.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
