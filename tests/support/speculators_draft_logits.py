"""Load an exported EAGLE-3 or DFlash draft with vllm-project/speculators' own loader and write its logits.

Standalone (imports only speculators, torch and safetensors): run it with a Python that has speculators,
e.g. ``/tmp/spec-venv/bin/python tests/support/speculators_draft_logits.py --draft DIR --inputs IN.safetensors
--out OUT.safetensors --verifier TARGET_DIR``. Used by tests/speculators/test_export_speculators.py and docs/export.md.

The draft is loaded by ``speculators.SpeculatorModel.from_pretrained`` (which resolves the class from the
config's ``speculators_model_type``: ``Eagle3DraftModel`` for ``eagle3``) and run through its own
``forward``; the logits are read off its ``lm_head`` by a forward hook (speculators' forward returns only
the argmax tokens of each TTT step).

Verifier: speculators resolves ``speculators_config.verifier.name_or_path`` (a Hugging Face id or a local
directory) with ``AutoConfig`` and reads ``embed_tokens`` / ``lm_head`` / ``model.norm`` from its weights.
artcache writes the target's *name* there (never a local path), which a hub lookup does not find for a
target artcache converted itself; ``--verifier DIR`` replaces it with that directory (the documented
"custom config" path of ``from_pretrained``). Omitted: the name in the export is used as is. (A cleared
``name_or_path`` does not help: speculators 0.9 then looks the verifier up on the hub as ``None``.)

Inputs (``--inputs``, safetensors): ``hidden_states`` float [1, T, n_aux * H] (the auxiliary layers'
hidden states concatenated in ``eagle_aux_hidden_state_layer_ids`` order) and ``input_ids`` int64 [1, T]
as speculators' forward takes them (TTT step 0 at position t reads ``input_ids[t]``, i.e. the token after
the one whose hidden state sits at t); optional ``position_ids`` int64 [1, T] (speculators' default:
``1 + arange(T)``). With speculators' default attention (``simple_flex_attention``) T must be a multiple
of 128 (its block mask is built in blocks of 128); ``--attn-implementation eager`` takes any T.

Output (``--out``, safetensors): EAGLE-3: ``logits`` float32 [steps, 1, T, V_d] (draft vocabulary, one
per TTT step) and ``draft_tokens`` int64 [steps, 1, T]. DFlash (``DFlashDraftModel``, whose forward is
its training step: it draws anchors at random among the positions ``loss_mask`` marks, the last
``block_size`` excluded; optional input ``loss_mask`` int [1, T], default all ones): every such position
is made an anchor (``max_anchors`` = their count, so the draw is all of them, sorted), ``anchors`` int64
[N] and ``logits`` float32 [N, block_size, V_d] (block n = ``[input_ids[p], MASK x (B-1)]`` at
positions p..p+B-1). Plus one stdout line ``SPECULATORS_RESULT <json>`` with the
loaded class, the export's keys the model lacks (``unexpected``), the model's keys the export lacks
(``missing``), the parameters still NaN after loading (speculators initialises embed_tokens / lm_head to
NaN so that an unloaded one shows), and the speculators version.
Exit status: 0 loaded and ran; 2 bad arguments; 1 speculators refused the export.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

#: The result line's prefix (speculators logs to stdout too).
RESULT_PREFIX = "SPECULATORS_RESULT "


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", required=True, help="exported draft directory (config.json, model.safetensors)")
    ap.add_argument("--inputs", required=True, help="safetensors with hidden_states, input_ids[, position_ids]")
    ap.add_argument("--out", required=True, help="safetensors file to write logits / draft_tokens to")
    ap.add_argument("--verifier", default=None,
                    help="replace speculators_config.verifier.name_or_path (the target's HF directory)")
    ap.add_argument("--ttt-steps", type=int, default=None, help="default: the config's speculative_tokens")
    ap.add_argument("--attn-implementation", default=None,
                    help="speculators' default (simple_flex_attention) when omitted; e.g. eager, sdpa")
    args = ap.parse_args()

    import safetensors.torch
    import torch
    from safetensors import safe_open
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.losses import resolve_loss_config

    draft = Path(args.draft)
    if not (draft / "config.json").is_file() or not (draft / "model.safetensors").is_file():
        print(f"--draft {args.draft!r}: no config.json + model.safetensors there", file=sys.stderr)
        return 2
    inputs = safetensors.torch.load_file(args.inputs)
    if "hidden_states" not in inputs or "input_ids" not in inputs:
        print(f"--inputs {args.inputs!r}: needs hidden_states and input_ids (has {sorted(inputs)})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # a busy 2-core machine: two OpenMP threads spin against each other

    config = SpeculatorModelConfig.from_pretrained(str(draft))
    if args.verifier is not None:
        config.speculators_config.verifier.name_or_path = args.verifier
    if args.attn_implementation is not None:
        config.transformer_layer_config._attn_implementation = args.attn_implementation
    try:
        model = SpeculatorModel.from_pretrained(str(draft), config=config, dtype=torch.float32)
    except Exception as exc:  # speculators' refusal, reported as such
        print(f"speculators refused {draft}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    model.eval()
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        file_keys = set(f.keys())
    model_keys = set(model.state_dict())
    nan = sorted(n for n, p in model.named_parameters() if p.is_floating_point() and bool(p.isnan().any()))

    logits: list = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().float()))
    hidden = inputs["hidden_states"].float()
    ids = inputs["input_ids"].long()
    kwargs = {"position_ids": inputs["position_ids"].long()} if "position_ids" in inputs else {}
    extra: dict = {}
    if config.speculators_model_type == "dflash":
        # every valid anchor is drawn (speculators samples max_anchors of them at random, then sorts them):
        # max_anchors = their count makes the draw the sorted list of all of them. The forward also computes
        # its training loss (against zero verifier states; unused): the eager CE needs no Triton
        loss_mask = inputs["loss_mask"].long() if "loss_mask" in inputs else torch.ones_like(ids)
        valid = loss_mask.bool().clone()
        valid[:, -config.block_size:] = False
        anchors = valid[0].nonzero().squeeze(-1)
        steps = config.block_size
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=ids, loss_mask=loss_mask, document_ids=torch.zeros_like(ids),
                  verifier_last_hidden_states=torch.zeros(1, ids.shape[1], config.transformer_layer_config.hidden_size),
                  max_anchors=int(anchors.numel()), loss_config=resolve_loss_config("ce", "eager"), **kwargs)
        out = {"logits": logits[-1].reshape(int(anchors.numel()), config.block_size, -1).contiguous(),
               "anchors": anchors.long().contiguous()}
        extra["mask_token_id"] = config.mask_token_id
    else:
        steps = args.ttt_steps or config.speculators_config.proposal_methods[0].speculative_tokens
        with torch.no_grad():
            tokens = model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps,
                           **kwargs)
        out = {"logits": torch.stack(logits).contiguous(), "draft_tokens": torch.stack(tokens).long().contiguous()}
    hook.remove()
    safetensors.torch.save_file(out, args.out)
    print(RESULT_PREFIX + json.dumps({
        "model_class": type(model).__name__, "unexpected": sorted(file_keys - model_keys),
        "missing": sorted(model_keys - file_keys), "nan_parameters": nan, "steps": steps,
        "attn_implementation": model.config.transformer_layer_config._attn_implementation,
        "verifier": model.config.speculators_config.verifier.name_or_path,
        "speculators_version": version("speculators"), **extra}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
