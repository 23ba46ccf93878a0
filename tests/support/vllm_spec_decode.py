"""Run vLLM with an exported draft as the speculative model and print its acceptance figures as JSON.

Standalone (imports only vLLM): run it with the Python that has vLLM, e.g.
``/tmp/vllmenv/bin/python tests/support/vllm_spec_decode.py --target DIR --draft DIR --method dflash --k 3``.
Used by tests/vllm/test_export_vllm.py and docs/export.md. The vLLM CPU settings of docs/export.md are
applied unless already set.

Output: one stdout line ``VLLM_SPEC_RESULT <json>`` (vLLM logs around it) with ``drafts``,
``draft_tokens``, ``accepted_tokens``,
``accepted_per_pos`` (list, K entries), ``mean_acceptance_length`` = 1 + accepted / drafts (vLLM's
definition: **includes the +1 bonus token**), ``texts`` (the greedy generations),
``prompt_token_ids`` / ``output_token_ids`` (per prompt), ``output_tokens``, ``seconds``, ``prompts``
(how many), ``k``, ``max_tokens``, ``dtype``.

``--prompts-file FILE``: the prompts from a JSON file instead of the built-in four: a list whose items are
chat message lists (``[{"role", "content"}, ...]``) or user strings, or an object with such a list under
``"prompts"`` (bench/heldout_prompts.py writes one, with the ``"prompt_token_ids"`` regenerate fed the
target). Each prompt is rendered as ``artcache regenerate`` renders it (chat template,
``add_generation_prompt=True``, tokenized without special tokens) and given to vLLM as token ids; if the
file has ``"prompt_token_ids"``, the rendered ids must equal them (exit 2 otherwise). Generation then also
stops at regenerate's stop tokens (EOS and ``<|im_end|>`` / ``<|eot_id|>`` / ``<end_of_turn>`` where the
tokenizer has them). ``--prompts N`` takes the first N of the file (default: all). Without the flag the
behaviour is unchanged (the built-in prompts as chat text, cycled to ``--prompts``).
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


def stop_token_ids(tok) -> list[int]:
    """artcache.data.regenerate.stop_token_ids, repeated here (this script imports only vLLM)."""
    vocab = tok.get_vocab()
    ids: list[int] = []
    for value in (tok.eos_token_id, vocab.get("<|im_end|>"), vocab.get("<|eot_id|>"), vocab.get("<end_of_turn>")):
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def load_prompts_file(path: str) -> tuple[list[list[dict]], list[list[int]] | None]:
    """(chat message lists, the recorded prompt token ids or None); SystemExit(2) naming a bad item."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    recorded = None
    if isinstance(data, dict):
        recorded = data.get("prompt_token_ids")
        data = data.get("prompts")
    if not isinstance(data, list) or not data:
        print(f"--prompts-file {path!r}: expected a non-empty JSON list of chat message lists or user strings (or "
              "an object with one under 'prompts')", file=sys.stderr)
        raise SystemExit(2)
    out = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            out.append([{"role": "user", "content": item}])
        elif isinstance(item, list) and item and all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                       for m in item):
            out.append(item)
        else:
            print(f"--prompts-file {path!r}: item {i} is neither a user string nor a list of "
                  "{'role', 'content'} messages", file=sys.stderr)
            raise SystemExit(2)
    if recorded is not None and len(recorded) != len(out):
        print(f"--prompts-file {path!r}: {len(recorded)} prompt_token_ids for {len(out)} prompts", file=sys.stderr)
        raise SystemExit(2)
    return out, recorded


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="exported draft directory (omit: no speculation)")
    ap.add_argument("--method", default=None, help="dflash | eagle3 (hf-format drafts)")
    ap.add_argument("--speculators", action="store_true",
                    help="the draft is in speculators format (it names its verifier by name: the target is given)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=None,
                    help="how many prompts (default 4; with --prompts-file: all of the file)")
    ap.add_argument("--prompts-file", default=None, help="JSON prompts (see the module docstring)")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype (target and draft)")
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
              dtype=a.dtype, disable_log_stats=False, seed=0)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    if a.prompts_file is None:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True)
                   for p in (PROMPTS * 8)[: 4 if a.prompts is None else a.prompts]]
    else:  # rendered as artcache regenerate renders a prompt, given as token ids
        messages, recorded = load_prompts_file(a.prompts_file)
        n = len(messages) if a.prompts is None else a.prompts
        prompts = []
        for i, m in enumerate(messages[:n]):
            text = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if recorded is not None and list(recorded[i]) != list(ids):
                print(f"--prompts-file {a.prompts_file!r}: prompt {i} renders to other token ids than the file "
                      "records (chat template or tokenizer differ)", file=sys.stderr)
                return 2
            prompts.append({"prompt_token_ids": ids})
        params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, stop_token_ids=stop_token_ids(tok))
    t0 = time.time()
    outs = llm.generate(prompts, params)
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
    res.update(prompts=len(outs), k=a.k if a.draft else 0, max_tokens=a.max_tokens, dtype=a.dtype)
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
