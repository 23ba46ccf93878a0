"""fp8 quantisation error per captured layer on a real capture.

``python -m artcache.bench.fp8_error [--target smollm2-135m-instruct] [--data sharegpt] [--samples 32]
[--max-length 512] [--layer-ids 1,8,14,20,26,27,29] [--device cpu] [--json FILE]``

Captures ``--samples`` plan samples with the HF backend in float32 (the reference values), stores each
layer the way an fp8 root does (:func:`artcache.fp8.quantize_rows`: e4m3fn codes, one fp32 scale per token
row per layer) and as bf16, and prints per layer, over the real tokens of every sample:

- the relative Frobenius error ``||x̂ − x|| / ||x||`` of fp8 and of bf16 (the stored dtype fp8 replaces),
- the mean per-token cosine similarity of the fp8 values with the reference,
- the largest |x̂ − x| relative to its row's absmax.

The default layers are the union SmolLM2's DFlash (5 draft layers) and EAGLE-3 drafts read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from artcache.bench.provenance import record


def measure(target: str, data: str, samples: int, max_length: int, layer_ids: list[int] | None,
            device: str, batch: int = 4) -> dict:
    from artcache.backends.hf import HFCaptureBackend
    from artcache.contract import CaptureContract
    from artcache.fp8 import dequantize_rows, quantize_rows
    from artcache.layer_ids import dflash_layer_ids, eagle3_capture_ids
    from artcache.plan import PlanSpec, build_plan
    from artcache.target import load_target_model, load_tokenizer, resolve_target

    info = resolve_target(target)
    if not layer_ids:
        layer_ids = sorted(set(dflash_layer_ids(info.num_layers, 5)) | set(eagle3_capture_ids(info.num_layers)))
    tok = load_tokenizer(info)
    plan = build_plan(PlanSpec(dataset=data, max_length=max_length, max_samples=samples), tok,
                      target_vocab_size=info.vocab_size)
    model = load_target_model(info, device=device, dtype=torch.float32)
    contract = CaptureContract(target_name=info.name, target_revision=info.revision,
                               target_config_hash=info.config_hash, target_weights_digest=info.weights_digest,
                               layer_ids=tuple(layer_ids), dtype="float32", compute_dtype="float32",
                               max_length=max_length, tokenizer_digest="n/a", template_digest="n/a")
    backend = HFCaptureBackend(model, contract, device=device)
    m = len(layer_ids)
    sq = {k: torch.zeros(m, dtype=torch.float64) for k in ("ref", "fp8", "bf16")}
    cos_sum = torch.zeros(m, dtype=torch.float64)
    worst = torch.zeros(m, dtype=torch.float64)
    tokens = 0
    n = min(samples, len(plan))
    for start in range(0, n, batch):
        got = backend.capture([plan.sample(i) for i in range(start, min(n, start + batch))])
        got.ready()
        for item in got:
            x = item["hidden_states"].float()  # [T, m, H]
            codes, scales = quantize_rows(x)
            deq = dequantize_rows(codes, scales)
            bf = x.to(torch.bfloat16).float()
            sq["ref"] += x.double().square().sum(dim=(0, 2))
            sq["fp8"] += (deq - x).double().square().sum(dim=(0, 2))
            sq["bf16"] += (bf - x).double().square().sum(dim=(0, 2))
            cos_sum += torch.nn.functional.cosine_similarity(deq.double(), x.double(), dim=-1).sum(dim=0)
            amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            worst = torch.maximum(worst, ((deq - x).abs() / amax).amax(dim=(0, 2)).double())
            tokens += x.shape[0]
    backend.close()
    rows = []
    for j, layer in enumerate(layer_ids):
        ref = float(sq["ref"][j].sqrt())
        rows.append({"layer": layer, "fp8_rel_error": float(sq["fp8"][j].sqrt()) / ref,
                     "bf16_rel_error": float(sq["bf16"][j].sqrt()) / ref,
                     "fp8_mean_token_cosine": float(cos_sum[j]) / tokens,
                     "fp8_max_abs_error_over_row_absmax": float(worst[j])})
    return {"target": info.name, "dataset": data, "samples": n, "tokens": tokens, "max_length": max_length,
            "layer_ids": layer_ids, "compute_dtype": "float32", "layers": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--layer-ids", default="", help="comma list (output-of-layer); default DFlash-5 ∪ EAGLE-3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        ids = [int(x) for x in args.layer_ids.split(",") if x]
    except ValueError:
        ap.error(f"--layer-ids {args.layer_ids!r}: expected comma-separated integers")
    res = measure(args.target, args.data, args.samples, args.max_length, ids, args.device)
    res.update(record("artcache.bench.fp8_error", argv, args.device))
    print(f"{res['target']}, {res['samples']} samples of {res['dataset']} ({res['tokens']} tokens), float32 capture")
    print(f"{'layer':>5} {'fp8 rel. error':>15} {'bf16 rel. error':>16} {'fp8 mean cos':>13} "
          f"{'fp8 max err/absmax':>19}")
    for r in res["layers"]:
        print(f"{r['layer']:>5} {r['fp8_rel_error']:>15.5f} {r['bf16_rel_error']:>16.5f} "
              f"{r['fp8_mean_token_cosine']:>13.6f} {r['fp8_max_abs_error_over_row_absmax']:>19.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
