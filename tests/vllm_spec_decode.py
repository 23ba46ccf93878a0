"""Run vLLM with an exported draft as the speculative model and print its acceptance figures as JSON.

Standalone (imports only vLLM): run it with the Python that has vLLM, e.g.
``/tmp/vllmenv/bin/python tests/vllm_spec_decode.py --target DIR --draft DIR --method dflash --k 3``.
Used by tests/test_export_vllm.py and docs/export.md. CPU settings from ../shared/REAL_INPUTS.md are
applied unless already set.

Output: one stdout line ``VLLM_SPEC_RESULT <json>`` (vLLM logs around it) with ``drafts``,
``draft_tokens``, ``accepted_tokens``,
``accepted_per_pos`` (list, K entries), ``mean_acceptance_length`` = 1 + accepted / drafts (vLLM's
definition: **includes the +1 bonus token**), ``texts`` (the greedy generations),
``prompt_token_ids`` / ``output_token_ids`` (per prompt), ``output_tokens``, ``seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

#: The result line's prefix (vLLM also logs to stdout, before and after it).
RESULT_PREFIX = "VLLM_SPEC_RESULT "

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short Python function that returns the factorial of n.",
    "What are three tips for staying productive when working from home?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="exported draft directory (omit: no speculation)")
    ap.add_argument("--method", default=None, help="dflash | eagle3 (hf-format drafts)")
    ap.add_argument("--speculators", action="store_true",
                    help="the draft is in speculators format (it names its verifier by name: the target is given)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    a = ap.parse_args()
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "2"), ("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
                 ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")):
        os.environ.setdefault(k, v)

    from vllm import LLM, SamplingParams

    spec, model = None, a.target
    if a.draft:  # a speculators-format draft names its verifier by name only: the target is given too
        spec = {"model": a.draft, "num_speculative_tokens": a.k}
        if a.method:
            spec["method"] = a.method
    llm = LLM(model=model, speculative_config=spec, enforce_eager=True, max_model_len=a.max_model_len,
              dtype="bfloat16", disable_log_stats=False, seed=0)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in (PROMPTS * 8)[: a.prompts]]
    t0 = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=a.max_tokens))
    seconds = time.time() - t0
    res = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    for m in llm.get_metrics():
        if m.name in names:
            res[names[m.name]] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            res["accepted_per_pos"] = [int(v) for v in m.values]
    res["mean_acceptance_length"] = 1 + res["accepted_tokens"] / res["drafts"] if res["drafts"] else None
    res["texts"] = [o.outputs[0].text for o in outs]
    res["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outs]
    res["output_token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    res["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    res["seconds"] = seconds
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
