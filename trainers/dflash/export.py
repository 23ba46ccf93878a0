"""Export a DFlash draft to the layouts vLLM loads: the hf ``DFlashDraftModel`` directory (as
z-lab/dflash writes it) and the speculators ``dflash`` format (format-independent parts, layer-id
conventions and the upstream files checked: :mod:`artcache.trainers.export`).

**DFlash keys.** ``fc.weight`` [H, m·H]; ``hidden_norm.weight`` [H] (artcache's ``context_norm``: the
RMSNorm applied to ``fc``'s output before the per-layer k/v projections); per layer ``i``:
``layers.i.input_layernorm.weight``, ``layers.i.post_attention_layernorm.weight``,
``layers.i.self_attn.{q,k,v,o}_proj.weight``, ``layers.i.self_attn.{q,k}_norm.weight``,
``layers.i.mlp.{gate,up,down}_proj.weight``; ``norm.weight``. No ``embed_tokens`` / ``lm_head``: the
draft uses the target's frozen ones, and vLLM shares the target's when the checkpoint has none. The
attention is non-causal inside the block (``is_causal: false``; speculators:
``sliding_window_non_causal: true``, which vLLM 0.32 turns into ``dflash_config.causal = false``).
vLLM is run with ``num_speculative_tokens = B - 1`` (one bonus query plus B-1 MASK queries = one block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.layer_ids import dflash_layer_ids, output_of_layer_to_vllm_id, vllm_id_to_output_of_layer
from artcache.trainers.draft import ExportedDraft
from artcache.trainers.export import (
    DTYPE_NAMES,
    FORMATS,
    SPECULATORS_VERSION,
    check_keys,
    decode_draft_config,
    read_export,
    speculators_config,
    text_config,
)
from artcache.trainers.export_check import ExportLayout, check_fc_reads, export_fields, refuse

from .config import DFlashConfig
from .model import DFlashDraft

__all__ = ["DFLASH_ARCHITECTURE", "SERVING_NAMES", "TARGET_TENSORS", "block_layout", "check_mask_and_block",
           "dflash_config_from_export", "dflash_export_config", "dflash_export_state_dict", "export_checkpoint_files",
           "export_layout", "load_dflash_export", "read_published"]

#: The architecture vLLM's registry maps to its DFlash draft (``qwen3_dflash.DFlashQwen3ForCausalLM``).
DFLASH_ARCHITECTURE = "DFlashDraftModel"
#: artcache key prefix -> serving key prefix (every format; z-lab, speculators and SpecForge use the same).
SERVING_NAMES = (("context_norm.", "hidden_norm."),)
#: keys a published DFlash layout may carry that are the target's frozen tensors (speculators omits them on
#: save and reloads them from the verifier; a full-vocabulary ``lm_head`` is the verifier's own).
TARGET_TENSORS = {"embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "verifier_lm_head.weight": "lm_head",
                  "verifier_norm.weight": "final_norm"}


def export_checkpoint_files(state, weights: dict[str, Tensor], target_cfg: Any, fmt: str, dtype: torch.dtype,
                            verifier: str, num_speculative_tokens: int | None, what: str) -> ExportedDraft:
    """A DFlash checkpoint's ``config.json`` and serving tensors (``Draft.export`` of DFlash).

    The layer ids are the checkpoint's recorded view; checkpoints written before layer ids were
    recorded get the DFlash formula ``dflash_layer_ids(L, num_layers)``.

    Raises:
        ConfigError: the draft config, layer ids or weights do not fit (see :func:`dflash_export_config`,
            :func:`dflash_export_state_dict`).
    """
    cfg = decode_draft_config(state.draft_config, DFlashConfig, what)
    ids = state.view_layer_ids
    if not ids:  # checkpoints written before layer ids were recorded: the DFlash formula
        ids = dflash_layer_ids(int(text_config(target_cfg).num_hidden_layers), cfg.num_layers)
    config = dflash_export_config(cfg, list(ids), target_cfg, fmt, dtype=dtype, verifier=verifier,
                                  num_speculative_tokens=num_speculative_tokens)
    return ExportedDraft(config, dflash_export_state_dict(weights, cfg, dtype), list(ids))


def _check_ids(ids: Any, L: int, what: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in ids):
        raise ConfigError(f"{what}: layer ids {ids!r} must be a non-empty list of output-of-layer ids in [0, {L})")
    return [int(i) for i in ids]


def dflash_export_state_dict(weights: dict[str, Tensor], cfg: Any, dtype: torch.dtype | None = None
                             ) -> dict[str, Tensor]:
    """A DFlash draft's trainable tensors under the serving keys (``context_norm.`` -> ``hidden_norm.``).

    ``weights`` must be exactly ``DFlashDraft(cfg).trainable_state_dict()``'s keys with its shapes
    (checked against a meta-device draft, so nothing is allocated): a checkpoint of another draft or
    size is refused rather than exported half-right.

    Returns:
        CPU, contiguous tensors; floating ones cast to ``dtype`` when given.

    Raises:
        ConfigError: missing / unexpected keys or mismatched shapes (all named), or a non-floating dtype.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"export dtype must be a floating dtype, got {dtype}")
    meta = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    ref = DFlashDraft(cfg, meta, meta, dtype=torch.float32).trainable_state_dict()
    check_keys(weights, {k: tuple(v.shape) for k, v in ref.items()}, "DFlash checkpoint")
    out = {}
    for k, v in weights.items():
        name = next((s + k[len(n):] for n, s in SERVING_NAMES if k.startswith(n)), k)
        t = v.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def _qwen3_layer_config(cfg: Any, tc: Any, dtype: torch.dtype) -> dict:
    """The DFlash decoder-layer config (Qwen3 fields: q/k norms, no biases, plain RoPE)."""
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", None) or 8192),
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "is_causal": False,
        "dtype": DTYPE_NAMES[dtype],
        "torch_dtype": DTYPE_NAMES[dtype],
        **{k: getattr(tc, k) for k in ("bos_token_id", "eos_token_id") if getattr(tc, k, None) is not None},
    }


def dflash_export_config(cfg: Any, layer_ids: list[int], target_hf_config: Any, fmt: str = "hf", *,
                         dtype: torch.dtype = torch.bfloat16, verifier: str = "target",
                         num_speculative_tokens: int | None = None) -> dict:
    """The ``config.json`` dict of an exported DFlash draft.

    Args:
        cfg: the draft's :class:`~artcache.trainers.dflash.DFlashConfig`.
        layer_ids: captured layers in **output-of-layer** convention, in ``fc``'s input order.
        target_hf_config: the target's transformers config (num_hidden_layers, max_position_embeddings,
            token ids, architectures).
        fmt: ``"hf"`` or ``"speculators"``.
        verifier: the target's path or name (speculators' ``verifier.name_or_path``).
        num_speculative_tokens: speculators' proposal length; default ``B - 1`` (one block).

    Raises:
        ConfigError: sizes disagree with the target, ``layer_ids`` has the wrong length or range, or
            ``fmt`` / ``dtype`` is not accepted.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not accepted: one of {', '.join(FORMATS)}")
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype {dtype} is not accepted: one of {', '.join(DTYPE_NAMES.values())}")
    tc = text_config(target_hf_config)
    L = getattr(tc, "num_hidden_layers", None)
    if not isinstance(L, int):
        raise ConfigError(f"target config has no integer num_hidden_layers (got {L!r})")
    for name, ours in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        theirs = getattr(tc, name, None)
        if theirs != ours:
            raise ConfigError(f"target {name}={theirs} != the draft's {name}={ours}: export against the target "
                              "the draft was trained for (--target)")
    ids = _check_ids(layer_ids, L, "DFlash export")
    if len(ids) != cfg.num_context_layers:
        raise ConfigError(f"{len(ids)} layer ids {ids} for a draft whose fc reads num_context_layers="
                          f"{cfg.num_context_layers}")
    vllm_ids = [output_of_layer_to_vllm_id(i) for i in ids]
    B = cfg.block_size
    layer_cfg = _qwen3_layer_config(cfg, tc, dtype)
    if fmt == "hf":
        return {
            "architectures": [DFLASH_ARCHITECTURE],
            **layer_cfg,
            "num_target_layers": L,
            "target_hidden_size": cfg.hidden_size,
            "block_size": B,
            "dflash_config": {"block_size": B, "mask_token_id": cfg.mask_token_id, "target_layer_ids": ids,
                              "use_aux_hidden_state": True},
            "eagle_aux_hidden_state_layer_ids": vllm_ids,
        }
    k = B - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
    if k < 1:
        raise ConfigError(f"num_speculative_tokens={k} must be >= 1")
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": speculators_config("dflash", k, verifier, tc),
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": cfg.vocab_size,
        "block_size": B,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": vllm_ids,
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def _check_neutral(config: dict, layer: dict, dc: dict) -> None:
    """Refuse layout options artcache's DFlash does not compute (it would load and predict wrong)."""
    types = layer.get("layer_types") or []
    if any(t != "full_attention" for t in types) or layer.get("use_sliding_window"):
        raise ConfigError(f"layer_types {types} / use_sliding_window {layer.get('use_sliding_window')}: "
                          "artcache's DFlash attends the whole context (full_attention only)")
    if layer.get("is_causal") or dc.get("causal"):
        raise ConfigError("is_causal / dflash_config.causal true: artcache's DFlash block attention is bidirectional")
    for key, neutral in (("output_multiplier", 1.0), ("final_logit_softcapping", None), ("input_embedding_scale", 1.0),
                         ("projector_type", None), ("pure_draft_prefix_len", 0), ("shift_label", False)):
        if dc.get(key, neutral) not in (neutral, 0.0 if neutral is None else neutral):
            raise ConfigError(f"dflash_config.{key} {dc[key]!r}: artcache's DFlash does not compute it")
    if config.get("sample_from_anchor"):
        raise ConfigError("sample_from_anchor true (a DSpark-style draft): artcache's DFlash proposes after the anchor")
    if layer.get("attention_bias"):
        raise ConfigError("attention_bias true: artcache's DFlash projections have no bias")


def _published_fields(config: dict, num_target_layers: int | None) -> tuple[dict, list[int]]:
    """The DFlashConfig fields and the output-of-layer ids a DFlash ``config.json`` records
    (``mask_token_id`` / ``block_size`` None when absent).

    Layouts: artcache's exports (both formats), z-lab ``DFlashDraftModel`` (``dflash_config``:
    ``target_layer_ids`` output-of-layer, ``mask_token_id``, ``block_size``), SpecForge's (the same
    architecture; ``block_size`` at the top level, ``target_layer_ids`` absent = the DFlash formula over
    ``num_target_layers``), vllm-project/speculators ``dflash`` (``aux_hidden_state_layer_ids``
    input-of-layer, ``transformer_layer_config``). ``mask_token_id`` absent reads as None.

    Raises:
        ConfigError: a field the loader needs is missing, a layer-id field is no list of integers in range
            (:func:`~artcache.trainers.export_check.export_fields`), the two layer-id fields disagree, or the
            layout asks for something artcache's DFlash does not compute (sliding or causal attention,
            logit scaling, a reduced draft vocabulary, sampling from the anchor).
    """
    typed = export_fields(config)
    try:
        if typed.speculators_model_type == "dflash":
            layer, dc = config["transformer_layer_config"], {}
            if typed.aux_hidden_state_layer_ids is None:
                raise KeyError("aux_hidden_state_layer_ids")
            ids = [vllm_id_to_output_of_layer(i) for i in typed.aux_hidden_state_layer_ids]
            mask_id, B = config.get("mask_token_id"), config["block_size"]
            dvs = config.get("draft_vocab_size")
            if dvs is not None and dvs != layer["vocab_size"]:
                raise ConfigError(f"draft_vocab_size {dvs} != vocab_size {layer['vocab_size']}: a reduced-vocabulary "
                                  "DFlash draft; artcache's DFlash predicts over the target vocabulary")
        elif DFLASH_ARCHITECTURE in (typed.architectures or []):
            layer, dc = config, config.get("dflash_config") or {}
            ids = typed.dflash_config.target_layer_ids if typed.dflash_config else None
            if ids is None:  # SpecForge: the formula over the target's layers
                L = typed.num_target_layers or num_target_layers
                ids = dflash_layer_ids(int(L), int(config["num_hidden_layers"]), "num_hidden_layers")
            ids = list(ids)
            aux = typed.eagle_aux_hidden_state_layer_ids
            if aux is not None and [vllm_id_to_output_of_layer(i) for i in aux] != ids:
                raise ConfigError(f"eagle_aux_hidden_state_layer_ids {aux} is not target_layer_ids {ids} + 1")
            mask_id, B = dc.get("mask_token_id"), dc.get("block_size", config.get("block_size"))
        else:
            raise ConfigError(f"not an exported DFlash config (architectures {config.get('architectures')!r}, "
                              f"speculators_model_type {config.get('speculators_model_type')!r})")
        _check_neutral(config, layer, dc)
        theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
        fields = dict(
            hidden_size=layer["hidden_size"], num_layers=layer["num_hidden_layers"],
            num_heads=layer["num_attention_heads"], num_kv_heads=layer["num_key_value_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
            num_context_layers=len(ids), mask_token_id=mask_id, block_size=B,
            rope_theta=float(theta if theta is not None else 10000.0), rms_norm_eps=float(layer["rms_norm_eps"]))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"DFlash config lacks or mistypes a field the loader needs: {exc!r}") from exc
    return fields, list(ids)


def dflash_config_from_export(config: dict, num_target_layers: int | None = None) -> tuple[Any, list[int]]:
    """Read a DFlash ``config.json`` back the way a serving engine does: the draft's
    :class:`~artcache.trainers.dflash.DFlashConfig` and its layer ids, **output-of-layer**
    (layouts: :func:`_published_fields`).

    Raises:
        ConfigError: see :func:`_published_fields`; also no ``mask_token_id`` or block size recorded.
    """
    fields, ids = _published_fields(config, num_target_layers)
    try:
        return msgspec.convert(fields, DFlashConfig), ids
    except msgspec.ValidationError as exc:
        raise ConfigError(f"DFlash config does not describe a draft artcache builds: {exc}") from exc


def read_published(config: dict, num_target_layers: int) -> dict | None:
    """A published DFlash ``config.json`` as a draft config for the seed loader (:mod:`artcache.trainers.seed`),
    or None when it is not a DFlash layout. Adds ``target_name`` (speculators' verifier),
    ``num_target_layers`` (z-lab, SpecForge) and the ``layout``.

    Raises:
        ConfigError: see :func:`dflash_config_from_export`.
    """
    typed = export_fields(config)
    spec = typed.speculators_model_type
    if spec != "dflash" and (spec is not None or DFLASH_ARCHITECTURE not in (typed.architectures or [])):
        return None
    out, ids = _published_fields(config, num_target_layers)
    out["layer_ids"] = ids
    if spec == "dflash":
        out["layout"] = "speculators dflash"
        name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if name:
            out["target_name"] = name
    else:
        out["layout"] = "hf DFlashDraftModel (z-lab / SpecForge)"
        if typed.num_target_layers is not None:
            out["num_target_layers"] = typed.num_target_layers
    return out


def load_dflash_export(directory: str | Path, embed_weight: Tensor, lm_head_weight: Tensor,
                       dtype: torch.dtype = torch.float32):
    """Build a fresh :class:`~artcache.trainers.dflash.DFlashDraft` from an exported directory alone (its
    config.json and model.safetensors; the target's embedding and lm_head are supplied, as an engine
    shares them) and load the weights with strict keys in both directions.

    Returns:
        (model, output-of-layer ids).

    Raises:
        ConfigError: unreadable files, a config the loader cannot use, or keys/shapes that differ.
    """
    config, tensors = read_export(directory)
    cfg, ids = dflash_config_from_export(config)
    model = DFlashDraft(cfg, embed_weight, lm_head_weight, dtype=dtype)
    own = {next((n + k[len(sv):] for n, sv in SERVING_NAMES if k.startswith(sv)), k): v for k, v in tensors.items()}
    check_keys(own, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()},
                f"exported DFlash draft {directory}")
    model.load_state_dict(own, strict=True)
    return model, ids


def check_mask_and_block(mask_token_id: Any, block_size: Any, vocab_size: int, where: str, key: str) -> None:
    """A block draft's MASK id and block size as an engine reads them (``key``: where the MASK id sits).

    Raises:
        ConfigError: no MASK id, one outside ``[0, vocab_size)``, or a block size below 2 (named).
    """
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab_size:
        raise refuse(where, key, f"{mask_token_id!r}: the engine fills the block with another token than the "
                     "draft was trained on", f"the trained MASK id, an int in [0, {vocab_size})")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise refuse(where, "block_size", f"{block_size!r}", "the trained block size, an int >= 2")


def export_layout(config: dict, tensors: dict[str, Tensor], where: str) -> ExportLayout:
    """The :class:`~artcache.trainers.export_check.ExportLayout` of an exported DFlash directory (either format),
    read as vLLM and speculators read it: :func:`dflash_config_from_export` (layer ids, their two fields agreeing,
    bidirectional full attention, no ``sample_from_anchor``, full vocabulary), a MASK id and block size
    (:func:`check_mask_and_block`; hf: ``block_size`` = ``dflash_config.block_size``), speculators'
    ``sliding_window_non_causal: true`` written explicitly (absent, vLLM reads it as true and speculators as
    false) and every tensor under its key with its shape.

    Raises:
        ConfigError: one line naming the key (see :func:`artcache.trainers.export_check.refuse`).
    """
    cfg, ids = dflash_config_from_export(config)
    spec = config.get("speculators_model_type") == "dflash"
    check_mask_and_block(cfg.mask_token_id, cfg.block_size, cfg.vocab_size, where,
                         "mask_token_id" if spec else "dflash_config.mask_token_id")
    if not spec:
        top, dc = config.get("block_size"), (config.get("dflash_config") or {}).get("block_size")
        if top is not None and dc is not None and top != dc:
            raise refuse(where, "block_size", f"{top} at the top level but dflash_config.block_size {dc}",
                         "one block size")
    elif config.get("sliding_window_non_causal") is not True:
        raise refuse(where, "sliding_window_non_causal", f"{config.get('sliding_window_non_causal')!r}: vLLM makes the "
                     "block attention causal when it is false, speculators when it is absent",
                     "true (the block attention is bidirectional)")
    check_fc_reads(tensors, ids, cfg.hidden_size, "aux_hidden_state_layer_ids" if spec
                   else "dflash_config.target_layer_ids", where)
    meta = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    ref = DFlashDraft(cfg, meta, meta, dtype=torch.float32).trainable_state_dict()
    own = {next((n + k[len(sv):] for n, sv in SERVING_NAMES if k.startswith(sv)), k): v for k, v in tensors.items()}
    check_keys(own, {k: tuple(v.shape) for k, v in ref.items()}, f"export check: {where}: tensors")
    return block_layout("dflash", cfg, ids, spec, "qwen3_dflash.DFlashQwen3ForCausalLM", sample_from_anchor=False)


def block_layout(draft: str, cfg: Any, ids: list[int], spec: bool, vllm_class: str, *,
                 sample_from_anchor: bool) -> ExportLayout:
    """The :class:`~artcache.trainers.export_check.ExportLayout` of a block draft (DFlash, DSpark: a full-vocabulary
    Qwen3 backbone filling a block of ``cfg.block_size`` with ``cfg.mask_token_id``). ``vllm_class``: under
    ``vllm.model_executor.models``. ``sample_from_anchor``: the first proposal comes from the anchor slot (DSpark,
    B proposals a step) rather than after it (DFlash, B - 1); DFlash's block attention is bidirectional."""
    return ExportLayout(
        draft=draft, fmt="speculators" if spec else "hf", layer_ids=ids, hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size, vllm_method=draft,
        vllm_classes=(f"vllm.model_executor.models.{vllm_class}",),
        speculators_class=f"speculators.models.{draft}.core.{'DSpark' if draft == 'dspark' else 'DFlash'}DraftModel"
        if spec else None, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
        sample_from_anchor=sample_from_anchor, max_speculative_tokens=cfg.block_size - (0 if sample_from_anchor else 1),
        causal=None if sample_from_anchor else False)
