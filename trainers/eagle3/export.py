"""Export an EAGLE-3 draft to the checkpoint layout vLLM's EAGLE-3 Llama draft loads.

What was verified, and where (public sources read through the search tool; nothing copied):

- vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM.load_weights`` and
  ``LlamaModel.load_weights``): keys ``fc.weight``, ``midlayer.*`` (renamed to ``layers.0.*``), ``norm.weight``,
  ``lm_head.weight``; ``d2t`` is loaded into ``draft_id_to_target_id`` (target id = draft id + d2t[draft id]);
  ``t2d`` is skipped; ``embed_tokens`` is optional (absent -> the target's embedding is shared). Inside the
  layer: ``self_attn.{q,k,v}_proj`` (stacked into ``qkv_proj``, input width 2H), ``self_attn.o_proj``,
  ``mlp.{gate,up}_proj`` (stacked), ``mlp.down_proj``, ``input_layernorm`` (applied to the embedding),
  ``hidden_norm`` (applied to the hidden state), ``post_attention_layernorm``; with the default
  ``norm_before_residual=False`` the residual is the un-normed hidden state, exactly as
  :class:`artcache.trainers.eagle3.model.Eagle3Draft` computes. No q/k norm, no biases (``attention_bias`` false).
- vLLM's model registry maps the architectures ``LlamaForCausalLMEagle3`` and ``Eagle3LlamaForCausalLM`` to
  that class; the draft config carries ``draft_vocab_size`` (default: ``vocab_size``).
- vLLM ``gpu_model_runner._get_eagle3_aux_layers_from_config`` reads ``eagle_aux_hidden_state_layer_ids``
  from the draft config (top level first, then ``eagle_config``); these ids are **input-of-layer** (the
  target's default is ``(2, L // 2, L - 3)``), i.e. output-of-layer + 1.
- vllm-project/speculators ``Eagle3SpeculatorConfig`` / ``Eagle3DraftModel`` use the same weight names
  (``fc``, ``layers.0`` / ``midlayer``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and also load ``t2d``; their
  config format (``speculators_model_type: eagle3`` + ``transformer_layer_config``) is written by
  :func:`export_checkpoint_files` for ``--format speculators``: ``layers.0.*`` for ``midlayer.*`` (vLLM maps
  ``midlayer.`` to ``layers.0.``) and ``norm_before_residual: false`` explicitly (vLLM reads this format with a
  default of true).

The parameter names of :class:`~artcache.trainers.eagle3.model.Eagle3Draft` already are these keys, so
:func:`export_state_dict` is a filtered, cast copy of ``model.state_dict()`` and
``model.load_state_dict(export_state_dict(model))`` round-trips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.layer_ids import eagle3_layer_ids, output_of_layer_to_vllm_id, vllm_id_to_output_of_layer
from artcache.trainers.draft import ExportedDraft
from artcache.trainers.export import (
    DTYPE_NAMES,
    SPECULATORS_VERSION,
    check_keys,
    decode_draft_config,
    read_export,
    speculators_config,
    text_config,
)
from artcache.trainers.export_check import ExportLayout, check_fc_reads, export_fields, refuse

from .config import EAGLE3_NUM_AUX, Eagle3Config
from .model import FROZEN_BUFFERS, Eagle3Draft

__all__ = ["EXPORT_ARCHITECTURE", "SERVING_NAMES", "TARGET_TENSORS", "check_vocab_map", "eagle3_config_from_export",
           "export_checkpoint_files", "export_config", "export_layout", "export_state_dict", "load_eagle3_export",
           "read_published"]

#: The architecture name written into the exported config.json (vLLM maps it to Eagle3LlamaForCausalLM).
EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"
#: artcache key prefix -> serving key prefix: speculators' ``layers.0.*`` is artcache's (and vLLM's,
#: SpecForge's) ``midlayer.*``.
SERVING_NAMES = (("midlayer.", "layers.0."),)
#: keys a published EAGLE-3 layout may carry that are the target's frozen tensors: speculators' and
#: SpecForge's ``embed_tokens.weight`` (speculators' loader reads it from the checkpoint: absent, it stays
#: zeros), speculators' ``verifier_*`` (ignored on save, but tolerated).
TARGET_TENSORS = {"embed_tokens.weight": "embed", "verifier_lm_head.weight": "lm_head",
                  "verifier_norm.weight": "final_norm"}


def export_state_dict(model: Eagle3Draft, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Draft weights under vLLM's EAGLE-3 keys, ready for ``safetensors.torch.save_file``.

    Keys: ``fc.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
    ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
    ``norm.weight``, ``lm_head.weight`` (floating, cast to ``dtype`` if given), ``d2t`` (int64 [V_d]) and
    ``t2d`` (bool [V]). The frozen target tensors are never exported. Tensors are detached, contiguous
    copies on CPU.

    Raises:
        ConfigError: ``dtype`` is not a floating dtype.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"export dtype must be a floating dtype, got {dtype}")
    out: dict[str, Tensor] = {}
    for key, t in model.state_dict().items():
        if key in FROZEN_BUFFERS:
            continue
        t = t.detach().to("cpu")
        if key == "d2t":
            t = t.long()
        elif key == "t2d":
            t = t.bool()
        elif dtype is not None:
            t = t.to(dtype)
        out[key] = t.contiguous().clone()
    return out


def export_config(cfg: Eagle3Config, target_hf_config: Any, *, dtype: torch.dtype = torch.bfloat16,
                  aux_layer_ids: list[int] | None = None) -> dict:
    """The draft's ``config.json`` (a dict) for vLLM's EAGLE-3 Llama draft.

    Args:
        cfg: the draft config.
        target_hf_config: the target's transformers config (or anything with ``num_hidden_layers``;
            ``max_position_embeddings``, ``bos_token_id``, ``eos_token_id`` are copied when present).
        dtype: the dtype the weights are saved in (``torch_dtype``).
        aux_layer_ids: the captured layers in the **output-of-layer** convention; default
            :func:`eagle3_layer_ids` of the target. Written as vLLM input-of-layer ids (+1) under the top-level
            ``eagle_aux_hidden_state_layer_ids`` (which vLLM reads first) and unchanged under
            ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the only key SGLang reads; its target adds 1).

    Raises:
        ConfigError: the target config lacks ``num_hidden_layers``, its hidden size differs from the
            draft's, ``aux_layer_ids`` is not 3 ids in ``[0, L)``, or ``dtype`` is unsupported.
    """
    tc = target_hf_config.get_text_config() if hasattr(target_hf_config, "get_text_config") else target_hf_config
    L = getattr(tc, "num_hidden_layers", None)
    if not isinstance(L, int):
        raise ConfigError(f"target config has no integer num_hidden_layers (got {L!r})")
    hidden = getattr(tc, "hidden_size", cfg.hidden_size)
    if hidden != cfg.hidden_size:
        raise ConfigError(f"target hidden_size={hidden} != the draft's hidden_size={cfg.hidden_size}: export against "
                          "the target the draft was trained for (--target)")
    ids = eagle3_layer_ids(L) if aux_layer_ids is None else list(aux_layer_ids)
    if len(ids) != EAGLE3_NUM_AUX or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L
                                         for i in ids):
        raise ConfigError(f"aux_layer_ids must be {EAGLE3_NUM_AUX} output-of-layer ids in [0, {L}), got {ids!r}")
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype must be one of {list(DTYPE_NAMES.values())}, got {dtype}")
    vllm_ids = [output_of_layer_to_vllm_id(i) for i in ids]
    out: dict[str, Any] = {
        "architectures": [EXPORT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", None) or 2048),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "torch_dtype": DTYPE_NAMES[dtype],
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        # SGLang reads only this one and adds 1 itself: output-of-layer ids (vLLM reads the top level first)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
    }
    for key in ("bos_token_id", "eos_token_id"):
        v = getattr(tc, key, None)
        if v is not None:
            out[key] = v
    return out


def _model_from_checkpoint(state, weights: dict[str, Tensor], what: str) -> tuple[Eagle3Draft, Eagle3Config]:
    """An :class:`~artcache.trainers.eagle3.Eagle3Draft` holding the checkpoint's weights (strict keys). The
    frozen target tensors are zero-stride placeholders: export never reads them."""
    cfg = decode_draft_config(state.draft_config, Eagle3Config, what)
    if "d2t" not in weights or "t2d" not in weights:
        raise ConfigError(f"{what}: no d2t/t2d vocab map in model.safetensors or extra.safetensors")
    V, H = cfg.vocab_size, cfg.hidden_size
    zero = torch.zeros((), dtype=torch.float32)
    model = Eagle3Draft(cfg, zero.expand(V, H), zero.expand(H), zero.expand(V, H), weights["d2t"], weights["t2d"])
    check_keys(weights, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()}, what)
    model.load_state_dict(weights, strict=True)
    return model, cfg


def _aux_layer_ids(state, L: int) -> list[int] | None:
    """The checkpoint's auxiliary layers (output-of-layer), without the trailing ``L - 1`` only training reads."""
    ids = state.view_layer_ids
    if not ids:
        return None
    ids = list(ids)
    if len(ids) == 4 and ids[-1] == L - 1:  # aux layers + the last layer (target logits), training only
        ids = ids[:3]
    return ids


def export_checkpoint_files(state, weights: dict[str, Tensor], target_cfg: Any, fmt: str, dtype: torch.dtype,
                            verifier: str, k: int | None, what: str, target_embed: Tensor | None = None
                            ) -> ExportedDraft:
    """An EAGLE-3 checkpoint's ``config.json`` and serving tensors (``Draft.export`` of EAGLE-3): ``hf``
    as :func:`export_config` / :func:`export_state_dict`; ``speculators`` wraps the same layer config,
    writes ``layers.0.*`` for ``midlayer.*`` and carries the target's input embedding as
    ``embed_tokens.weight`` (``target_embed``, [V, H], cast to ``dtype``): speculators' ``Eagle3DraftModel``
    reads it from the checkpoint (it lists it as may-be-missing, and a missing one stays zeros, so every
    token embedding would be 0). ``k``: the proposal length (default: the TTT unroll).

    Raises:
        ConfigError: the draft config, vocab map or weights do not fit the checkpoint's config, or the
            speculators format without the target's embedding (a config-only ``--target``).
    """
    tc = text_config(target_cfg)
    model, cfg = _model_from_checkpoint(state, weights, what)
    ids = _aux_layer_ids(state, tc.num_hidden_layers)
    hf = export_config(cfg, target_cfg, dtype=dtype, aux_layer_ids=ids)
    tensors = export_state_dict(model, dtype=dtype)
    if fmt == "hf":
        return ExportedDraft(hf, tensors, ids)
    if target_embed is None:
        raise ConfigError(f"{what}: the speculators EAGLE-3 format carries the target's embedding "
                          "(embed_tokens.weight), and the --target given has no weights; give the target's HF "
                          "directory with its *.safetensors (or its name)")
    if tuple(target_embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ConfigError(f"{what}: the target's embedding is {tuple(target_embed.shape)}, the draft needs "
                          f"[{cfg.vocab_size}, {cfg.hidden_size}]")
    layer_cfg = {k2: v for k2, v in hf.items() if k2 not in (
        "architectures", "eagle_aux_hidden_state_layer_ids", "eagle_config", "draft_vocab_size",
        "target_hidden_size", "norm_before_residual")}
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_config("eagle3", cfg.ttt_steps if k is None else int(k), verifier, tc),
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": hf["eagle_aux_hidden_state_layer_ids"],
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    out = {next((s + n[len(p):] for p, s in SERVING_NAMES if n.startswith(p)), n): t for n, t in tensors.items()}
    out["embed_tokens.weight"] = target_embed.detach().to("cpu", dtype).contiguous()
    return ExportedDraft(config, out, ids)


def _eagle3_fields(config: dict, num_target_layers: int | None) -> tuple[dict, list[int] | None, str]:
    """(Eagle3Config fields, auxiliary layer ids **output-of-layer** or None when the layout leaves them to
    the default, layout label) of an EAGLE-3 ``config.json``.

    Layouts: artcache's exports, vLLM / SpecForge ``LlamaForCausalLMEagle3`` (``eagle_aux_hidden_state_layer_ids``
    top level or in ``eagle_config``, input-of-layer; absent: EAGLE-3's default), speculators ``eagle3``
    (``transformer_layer_config``, a Llama layer).

    Raises:
        ConfigError: a missing field, a layer-id field that is no list of integers in range
            (:func:`~artcache.trainers.export_check.export_fields`), or an option artcache's EAGLE-3 does not
            compute (``norm_before_residual`` true — speculators' default —, ``norm_before_fc``, ``fc_norm``,
            more than one layer, a non-Llama layer, biases).
    """
    typed = export_fields(config)
    try:
        if typed.speculators_model_type == "eagle3":
            layer, label = dict(config["transformer_layer_config"]), "speculators eagle3"
            if config.get("norm_before_residual", True):
                raise ConfigError("norm_before_residual true (speculators' default when absent): artcache's EAGLE-3 "
                                  "keeps the un-normed hidden state as the residual")
            if config.get("norm_before_fc"):
                raise ConfigError("norm_before_fc true: artcache's EAGLE-3 has no norm before fc")
        elif any("Eagle3" in a for a in typed.architectures or []):
            layer, label = config, "hf LlamaForCausalLMEagle3 (vLLM / SpecForge)"
            if config.get("norm_before_residual"):
                raise ConfigError("norm_before_residual true: artcache's EAGLE-3 keeps the un-normed residual")
            if config.get("fc_norm") or config.get("norm_output") is False:
                raise ConfigError("fc_norm / norm_output false: artcache's EAGLE-3 does not compute them")
        else:
            raise ConfigError(f"not an EAGLE-3 config (architectures {config.get('architectures')!r})")
        if layer.get("model_type", "llama") != "llama" or int(layer.get("num_hidden_layers", 1)) != 1:
            raise ConfigError(f"model_type {layer.get('model_type')!r}, num_hidden_layers "
                              f"{layer.get('num_hidden_layers')}: artcache's EAGLE-3 is one Llama decoder layer")
        if layer.get("attention_bias") or layer.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias true: artcache's EAGLE-3 projections have no bias")
        theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
        fields = dict(hidden_size=layer["hidden_size"], num_heads=layer["num_attention_heads"],
                      num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
                      head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                      intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
                      draft_vocab_size=config.get("draft_vocab_size", layer["vocab_size"]),
                      rope_theta=float(theta if theta is not None else 10000.0),
                      rms_norm_eps=float(layer["rms_norm_eps"]))
        aux = typed.eagle_aux_hidden_state_layer_ids or (typed.eagle_config.eagle_aux_hidden_state_layer_ids
                                                         if typed.eagle_config else None)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"EAGLE-3 config lacks or mistypes a field the loader needs: {exc!r}") from exc
    if aux is None:
        ids = eagle3_layer_ids(num_target_layers) if num_target_layers else None
    else:
        ids = [vllm_id_to_output_of_layer(i) for i in aux]
    return fields, ids, label


def eagle3_config_from_export(config: dict) -> tuple[Eagle3Config, list[int]]:
    """An EAGLE-3 ``config.json`` read the way an engine does: (config, vLLM **input-of-layer** aux ids).

    Raises:
        ConfigError: see :func:`_eagle3_fields`; the aux layer ids must be recorded.
    """
    fields, ids, _ = _eagle3_fields(config, None)
    if ids is None:
        raise ConfigError("EAGLE-3 config records no eagle_aux_hidden_state_layer_ids")
    try:
        return msgspec.convert(fields, Eagle3Config), [output_of_layer_to_vllm_id(i) for i in ids]
    except msgspec.ValidationError as exc:
        raise ConfigError(f"EAGLE-3 config does not describe a draft artcache builds: {exc}") from exc


def read_published(config: dict, num_target_layers: int) -> dict | None:
    """A published EAGLE-3 ``config.json`` as a draft config for the seed loader: the fields of
    :func:`_eagle3_fields` plus ``layer_ids`` (the three auxiliary layers, then ``L - 1``: the layer the
    target logits come from, which every EAGLE-3 reads), ``target_name`` (speculators' verifier) and the
    ``layout``; None when it is not an EAGLE-3 layout."""
    typed = export_fields(config)
    spec = typed.speculators_model_type
    if spec != "eagle3" and (spec is not None or not any("Eagle3" in a for a in typed.architectures or [])):
        return None
    fields, ids, label = _eagle3_fields(config, num_target_layers)
    fields["layer_ids"] = [*ids, num_target_layers - 1]
    fields["layout"] = label
    name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if name:
        fields["target_name"] = name
    return fields


def load_eagle3_export(directory: str | Path, embed: Tensor, target_norm_weight: Tensor, target_lm_head: Tensor,
                       dtype: torch.dtype = torch.float32):
    """Build a fresh :class:`~artcache.trainers.eagle3.Eagle3Draft` from an exported directory alone (either
    format) and load it with strict keys. Returns (model, vLLM input-of-layer aux ids). A carried
    ``embed_tokens.weight`` must equal ``embed``.

    Raises:
        ConfigError: unreadable files, a config the loader cannot use, or keys/shapes that differ.
    """
    config, tensors = read_export(directory)
    cfg, aux = eagle3_config_from_export(config)
    tensors = {next((p + n[len(s):] for p, s in SERVING_NAMES if n.startswith(s)), n): t for n, t in tensors.items()}
    carried = tensors.pop("embed_tokens.weight", None)
    if carried is not None and not torch.equal(carried, embed.to(carried.dtype)):
        raise ConfigError(f"exported EAGLE-3 draft {directory}: embed_tokens.weight is not the target's embedding")
    if "d2t" not in tensors or "t2d" not in tensors:
        raise ConfigError(f"exported EAGLE-3 draft {directory} lacks its vocab map (d2t, t2d)")
    model = Eagle3Draft(cfg, embed, target_norm_weight, target_lm_head, tensors["d2t"], tensors["t2d"], dtype=dtype)
    check_keys(tensors, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()},
                f"exported EAGLE-3 draft {directory}")
    model.load_state_dict(tensors, strict=True)
    return model, aux


def check_vocab_map(d2t: Tensor, t2d: Tensor, vocab_size: int, draft_vocab_size: int, where: str) -> None:
    """The draft-to-target vocabulary map an engine reads: ``d2t`` int64 [V_d] (target id = draft id + d2t), all
    target ids distinct and in ``[0, V)``, and ``t2d`` bool [V] marking exactly those ids.

    Raises:
        ConfigError: one line naming ``d2t`` or ``t2d`` and what is wrong (a wrong map loads and proposes other
            tokens than the draft predicts).
    """
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab_size,):
        raise refuse(where, "d2t", f"{d2t.dtype} {tuple(d2t.shape)}", f"int64 [{draft_vocab_size}] (draft_vocab_size)")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise refuse(where, "t2d", f"{t2d.dtype} {tuple(t2d.shape)}", f"bool [{vocab_size}] (vocab_size)")
    target = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t
    if bool(((target < 0) | (target >= vocab_size)).any()) or int(target.unique().numel()) != draft_vocab_size:
        raise refuse(where, "d2t", "maps draft ids to target ids outside [0, vocab_size) or to one id twice",
                     f"distinct target ids in [0, {vocab_size}) (target id = draft id + d2t[draft id])")
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[target].all()):
        raise refuse(where, "t2d", f"marks {int(t2d.sum())} ids, not the {draft_vocab_size} d2t maps to",
                     "true exactly at the target ids of d2t")


def export_layout(config: dict, tensors: dict[str, Tensor], where: str) -> ExportLayout:
    """The :class:`~artcache.trainers.export_check.ExportLayout` of an exported EAGLE-3 directory (either format),
    read as vLLM, speculators and SGLang read it: :func:`eagle3_config_from_export` (norm placement, one Llama
    layer, no biases, the aux ids) plus the top-level ``eagle_aux_hidden_state_layer_ids`` of the hf format
    (absent, vLLM reads ``eagle_config``'s ids as input-of-layer while SGLang reads them as output-of-layer),
    ``eagle_config``'s ids = top-level - 1, three aux ids, the target width, untied embeddings, the vocabulary map
    (:func:`check_vocab_map`) and every tensor under its key with its shape.

    Raises:
        ConfigError: one line naming the key (see :func:`artcache.trainers.export_check.refuse`).
    """
    cfg, aux = eagle3_config_from_export(config)
    ids = [vllm_id_to_output_of_layer(i) for i in aux]
    spec = config.get("speculators_model_type") == "eagle3"
    if not spec:
        if config.get("eagle_aux_hidden_state_layer_ids") is None:
            raise refuse(where, "eagle_aux_hidden_state_layer_ids", "absent at the top level: vLLM then reads "
                         "eagle_config's ids as input-of-layer ids, SGLang as output-of-layer ids",
                         f"the input-of-layer ids {aux} at the top level")
        sg = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if sg is not None and list(sg) != ids:
            raise refuse(where, "eagle_config.eagle_aux_hidden_state_layer_ids", f"{sg} is not the top-level ids "
                         f"{aux} - 1 (SGLang reads this key as output-of-layer ids and adds 1)", f"{ids}")
    if len(ids) != EAGLE3_NUM_AUX:
        raise refuse(where, "eagle_aux_hidden_state_layer_ids", f"{aux}: {len(ids)} layers",
                     f"{EAGLE3_NUM_AUX} ids (fc reads {EAGLE3_NUM_AUX} target states)")
    check_fc_reads(tensors, aux, cfg.hidden_size, "aux_hidden_state_layer_ids" if spec
                   else "eagle_aux_hidden_state_layer_ids", where)
    layer = config.get("transformer_layer_config") or config
    if layer.get("tie_word_embeddings") or config.get("tie_word_embeddings"):
        raise refuse(where, "tie_word_embeddings", "true: the engine uses the target's embedding as the draft's "
                     "lm_head", "false")
    own = {next((p + n[len(s):] for p, s in SERVING_NAMES if n.startswith(s)), n): t for n, t in tensors.items()}
    embed = own.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise refuse(where, "embed_tokens.weight", f"{tuple(embed.shape)}", f"[{cfg.vocab_size}, {cfg.hidden_size}]")
    if spec and embed is None:
        raise refuse(where, "embed_tokens.weight", "absent: speculators' Eagle3DraftModel then embeds every "
                     "token as zeros", "the target's input embedding")
    if "d2t" not in own or "t2d" not in own:
        raise refuse(where, "d2t / t2d", "absent: the engine takes draft ids for target ids",
                     "the draft's vocabulary map")
    check_vocab_map(own["d2t"], own["t2d"], cfg.vocab_size, cfg.draft_vocab_size, where)
    V, H = cfg.vocab_size, cfg.hidden_size
    with torch.device("meta"):
        meta = Eagle3Draft(cfg, torch.empty(V, H), torch.empty(H), torch.empty(V, H), own["d2t"].to("meta"),
                           own["t2d"].to("meta"))
    check_keys(own, {k: tuple(v.shape) for k, v in meta.trainable_state_dict().items()},
               f"export check: {where}: tensors")
    return ExportLayout(
        draft="eagle3", fmt="speculators" if spec else "hf", layer_ids=ids, hidden_size=H,
        vocab_size=V, draft_vocab_size=cfg.draft_vocab_size, vllm_method="eagle3",
        vllm_classes=("vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM",),
        speculators_class="speculators.models.eagle3.core.Eagle3DraftModel" if spec else None,
        norm_before_residual=False)
