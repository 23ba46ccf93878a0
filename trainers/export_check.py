"""``artcache export --check``: refuse an exported draft directory that a serving engine would load without
error and then serve at acceptance length tau ~ 1 (the +1 bonus token alone), before anyone serves it.

What it checks, in order (each refusal is one :class:`~artcache.errors.ConfigError` line naming the
``config.json`` key, tensor or file and what is accepted):

0. **Files and fields** (always, first): ``config.json`` and ``model.safetensors`` each read (the one that does
   not is named), ``config.json``'s draft and layer-id fields decoded strictly (:func:`export_fields`), and each
   layer-id key compared with the trained ids ``export.json`` records (its digest record verified first).
1. **Static** (always; no engine needed): the directory's ``config.json`` and ``model.safetensors`` read as
   the draft's layout (:meth:`artcache.trainers.draft.Draft.export_layout`: the draft's keys, shapes, layer
   ids, block size, MASK id, norm placement, ``sample_from_anchor``, vocabulary map), plus what every layout
   shares: no ``quantization_config`` / ``compression_config`` (artcache's exports are unquantized; vLLM
   quantizes a draft that carries one, or that it treats as part of a quantized target), ``torch_dtype`` =
   the tensors' dtype, the speculators ``speculators_config`` (algorithm = ``speculators_model_type``, a
   default proposal method that exists, ``speculative_tokens`` in ``[1, K_max]``, a verifier name), the
   provenance ``export.json`` (draft, format and layer ids it recorded) and the target (hidden size, vocabulary,
   layer range of the aux ids, the verifier's architectures).
2. **vLLM** (when ``import vllm`` works in this interpreter): the export resolved by vLLM's own config and
   registry code in a child process (:mod:`artcache.trainers.export_engines`): the speculative method, the
   class vLLM instantiates, the aux layer ids the target captures, the draft's quantization, its norm
   placement, causal flag, MASK id, ``sample_from_anchor``, draft vocabulary and target width must be what
   the static reading says the draft was trained with.
3. **speculators** (``--format speculators`` exports, when ``import speculators`` works): the config class
   its registry picks, the model class ``SpeculatorModel.from_pretrained`` instantiates, and its defaults
   filled in (``norm_before_residual``, aux ids, MASK id, block size, ``sample_from_anchor``, causal masking).
4. **SGLang** (EAGLE-3 ``--format hf`` exports; static, no SGLang import): the layout SGLang's
   ``LlamaForCausalLMEagle3`` reads (``python/sglang/srt/models/llama_eagle3.py``, ``models/llama.py``,
   ``model_executor/model_runner.py``, ``speculative/eagle_worker.py``, read for facts): the architecture
   name, ``eagle_config.eagle_aux_hidden_state_layer_ids`` in **output-of-layer** ids (SGLang's target adds 1
   itself; absent, it captures its default layers), one decoder layer, ``draft_vocab_size`` with the draft's
   own ``lm_head`` and a ``d2t`` map, ``tie_word_embeddings`` false, no ``fc`` bias, the un-normed residual
   (SGLang has no ``norm_before_residual`` option), and every tensor under a name its ``load_weights`` keeps
   (it drops unknown names silently). Other drafts and formats: SGLang is not checked, and the report says so.

An engine that is not installed is skipped with one line saying which checks did not run; the static checks
run regardless.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.hashing import check_file, check_record

__all__ = ["ENGINES", "CheckReport", "ExportFields", "ExportLayout", "check_export", "check_fc_reads", "export_fields",
           "read_export", "refuse"]

#: The engines the check resolves an export through (``vllm`` and ``speculators`` when installed; ``sglang``
#: statically).
ENGINES = ("vllm", "speculators", "sglang")
_ENGINE_SCRIPT = Path(__file__).with_name("export_engines.py")
_RESULT_PREFIX = "EXPORT_ENGINE_RESULT "
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: SGLang's ``LlamaForCausalLMEagle3`` (its EAGLE-3 draft class, registered under this architecture name).
SGLANG_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
#: The tensor names SGLang's ``LlamaForCausalLMEagle3.load_weights`` places (``d2t`` becomes its hot-token map;
#: ``t2d`` and ``embed_tokens`` are read and replaced or skipped; anything else is dropped without a word).
SGLANG_EAGLE3_TENSORS = frozenset({
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))})


def refuse(where: str, key: str, problem: str, accepted: str) -> ConfigError:
    """The one-line refusal: ``export check: <where>: <key>: <problem>; accepted: <accepted>``."""
    return ConfigError(f"export check: {where}: {key}: {problem}; accepted: {accepted}")


def check_fc_reads(tensors: dict[str, Tensor], ids: list[int], hidden_size: int, ids_key: str, where: str) -> None:
    """``fc.weight`` ([hidden_size, n x hidden_size]: ``fc`` reads n concatenated target states) must read as many
    target layers as ``config.json`` lists ids (``ids``, under key ``ids_key``). Absent or not 2-D: left to the
    key and shape check.

    Raises:
        ConfigError: the width implies another count (both counts named), or is no multiple of ``hidden_size``.
    """
    fc = tensors.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] == len(ids) * hidden_size:
        return
    width = int(fc.shape[1])
    reads = (f"reads {width // hidden_size} target layers ({width} = {width // hidden_size} x hidden_size "
             f"{hidden_size})" if width % hidden_size == 0 else f"has input width {width}, no multiple of "
             f"hidden_size {hidden_size}")
    raise refuse(where, "fc.weight", f"{list(fc.shape)} {reads} but config.json {ids_key} lists {len(ids)} target "
                 f"layers {ids}", "one id per target layer fc reads (its input width / hidden_size), here an "
                 f"fc.weight of input width {len(ids) * hidden_size} for these ids")


@dataclass
class ExportLayout:
    """What the static reading of an export says a serving engine must resolve (built by each draft's
    :meth:`~artcache.trainers.draft.Draft.export_layout`).

    ``layer_ids``: the captured target layers, **output-of-layer**, in ``fc``'s input order (``aux_ids``: the
    same as vLLM / speculators input-of-layer ids, + 1). ``max_speculative_tokens``: the largest proposal length
    the draft was trained for (DFlash ``B - 1``, DSpark ``B``; None: any). ``vllm_classes``: the vLLM class
    names (``module.Class``) its registry must resolve; ``speculators_class`` likewise (None: not a speculators
    layout). ``norm_before_residual`` / ``causal``: the convention trained (None: not applicable)."""

    draft: str
    fmt: str
    layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    vllm_method: str
    vllm_classes: tuple[str, ...]
    speculators_class: str | None = None
    block_size: int | None = None
    mask_token_id: int | None = None
    sample_from_anchor: bool = False
    max_speculative_tokens: int | None = None
    norm_before_residual: bool | None = None
    causal: bool | None = None

    @property
    def aux_ids(self) -> list[int]:
        return [i + 1 for i in self.layer_ids]

    @property
    def target_hidden_size(self) -> int:
        """The width of the target states ``fc`` reads: every artcache draft reads states of its own width."""
        return self.hidden_size


@dataclass
class CheckReport:
    """What :func:`check_export` found: the ``directory``, its ``layout``, one line per check that ran
    (``checked``) and one per engine check that did not (``skipped``, saying why)."""

    directory: Path
    layout: ExportLayout
    checked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"checked: {c}" for c in self.checked] + [f"skipped: {s}" for s in self.skipped]

    def summary(self) -> dict:
        return {"path": str(self.directory), "draft": self.layout.draft, "format": self.layout.fmt,
                "checked": self.checked, "skipped": self.skipped}


def read_export(directory: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(``config.json`` as a dict, ``model.safetensors``'s tensors) of an exported draft directory.

    Raises:
        ConfigError: a file is missing or unreadable (the one that failed named), or ``config.json`` is no
            JSON object.
    """
    d = Path(directory)
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"exported draft {d}: unreadable config.json ({_one_line(exc)}); accepted: a JSON "
                          "object") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"exported draft {d}: config.json is a {type(config).__name__}; accepted: a JSON object")
    try:
        return config, safetensors.torch.load_file(d / "model.safetensors")
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"exported draft {d}: unreadable model.safetensors ({_one_line(exc)}); accepted: a "
                          "complete safetensors file") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


class _EagleConfig(msgspec.Struct):
    eagle_aux_hidden_state_layer_ids: list[int] | None = None


class _DFlashConfig(msgspec.Struct):
    target_layer_ids: list[int] | None = None


class ExportFields(msgspec.Struct):
    """The ``config.json`` fields that say which draft an export is and which target layers it reads, decoded
    strictly (:func:`export_fields`): ints are ints (not bools, not floats), lists are lists. Other keys of the
    file are read by each draft's loader.

    Layer ids: ``eagle_aux_hidden_state_layer_ids`` and ``aux_hidden_state_layer_ids`` (top level) are
    **input-of-layer** (vLLM's convention, in ``[1, L]``); ``eagle_config.eagle_aux_hidden_state_layer_ids``,
    ``dflash_config.target_layer_ids`` and ``target_layer_ids`` are **output-of-layer** (in ``[0, L)``), L the
    target's layer count. None: absent."""

    architectures: list[str] | None = None
    speculators_model_type: str | None = None
    num_target_layers: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    aux_hidden_state_layer_ids: list[int] | None = None
    target_layer_ids: list[int] | None = None
    eagle_config: _EagleConfig | None = None
    dflash_config: _DFlashConfig | None = None

    def layer_id_fields(self) -> dict[str, tuple[list[int], bool]]:
        """Every layer-id key present: {dotted key: (ids, input_of_layer)}."""
        nested = {"eagle_config.eagle_aux_hidden_state_layer_ids": (
                      self.eagle_config.eagle_aux_hidden_state_layer_ids if self.eagle_config else None, False),
                  "dflash_config.target_layer_ids": (
                      self.dflash_config.target_layer_ids if self.dflash_config else None, False)}
        out = {"eagle_aux_hidden_state_layer_ids": (self.eagle_aux_hidden_state_layer_ids, True),
               "aux_hidden_state_layer_ids": (self.aux_hidden_state_layer_ids, True),
               "target_layer_ids": (self.target_layer_ids, False), **nested}
        return {k: v for k, v in out.items() if v[0] is not None}


_INPUT_OF_LAYER = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")
#: Who reads each layer-id key of an export, and how.
_ID_READERS = {
    "eagle_aux_hidden_state_layer_ids": "vLLM reads this key first, as input-of-layer ids",
    "aux_hidden_state_layer_ids": "vLLM and speculators read this key as input-of-layer ids",
    "eagle_config.eagle_aux_hidden_state_layer_ids": "SGLang reads only this key, as output-of-layer ids (its "
                                                     "target adds 1 itself)",
    "dflash_config.target_layer_ids": "the engines read this key as output-of-layer ids",
    "target_layer_ids": "the engines read this key as output-of-layer ids"}


def _accepted(key: str) -> str:
    if key.endswith("layer_ids"):
        if key in _INPUT_OF_LAYER:
            return "a list of integers in [1, num_target_layers] (input-of-layer ids of the target's layers)"
        return "a list of integers in [0, num_target_layers) (output-of-layer ids of the target's layers)"
    if key == "architectures":
        return 'a list of class names, such as ["DFlashDraftModel"]'
    if key in ("eagle_config", "dflash_config"):
        return "an object"
    if key == "num_target_layers":
        return "an integer, the target's layer count"
    return "a string"


def export_fields(config: dict) -> ExportFields:
    """``config.json``'s draft and layer-id fields (:class:`ExportFields`), decoded strictly, no layer-id list
    empty or below its key's lowest id. The one reader of these fields for the export check and every draft's
    loader; whether the ids lie below the target's layer count is checked where that count is known.

    Raises:
        ConfigError: one line naming ``config.json``, the key, its value and what is accepted.
    """
    try:
        fields = msgspec.convert(config, ExportFields, strict=True)
    except msgspec.ValidationError as exc:
        m = re.search(r"at `\$\.([A-Za-z_][\w.]*)", str(exc))
        key = m.group(1) if m else "?"
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        raise ConfigError(f"config.json: {key}: {json.dumps(value)} ({str(exc).split(' - at ')[0]}); accepted: "
                          f"{_accepted(key)}") from exc
    for key, (ids, input_of_layer) in fields.layer_id_fields().items():
        if not ids or min(ids) < (1 if input_of_layer else 0):
            raise ConfigError(f"config.json: {key}: {json.dumps(ids)} " + ("is empty" if not ids else
                              "names a layer below the target's first") + f"; accepted: {_accepted(key)}")
    return fields


# ------------------------------------------------------------------------------------------ static

def _draft_of(config: dict, num_target_layers: int, where: str) -> str:
    """The draft whose published layout ``config`` is (each draft's ``read_published``).

    Raises:
        ConfigError: none of them (``architectures`` / ``speculators_model_type`` named), or the layout
            refuses an option (its own one line).
    """
    from artcache.trainers import DRAFT_NAMES
    from artcache.trainers.draft import draft_class

    for name in DRAFT_NAMES:
        if draft_class(name).read_published(config, num_target_layers) is not None:
            return name
    raise refuse(where, "architectures", f"{config.get('architectures')!r} (speculators_model_type "
                 f"{config.get('speculators_model_type')!r}) is no draft layout artcache exports, so no engine "
                 "would instantiate the trained draft", "DFlashDraftModel, LlamaForCausalLMEagle3, Qwen3DSparkModel "
                 "or speculators_model_type dflash / eagle3 / dspark")


def _check_quantization(config: dict, tensors: dict[str, Tensor], where: str) -> None:
    """artcache's exports are unquantized: a ``quantization_config`` (copied from a quantized target, say) makes
    vLLM build quantized layers for floating weights."""
    layer = config.get("transformer_layer_config") or {}
    for scope, d in (("", config), ("transformer_layer_config.", layer)):
        for key in ("quantization_config", "compression_config"):
            if d.get(key) is not None:
                kinds = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
                raise refuse(where, scope + key, f"{json.dumps(d[key])[:120]} while the tensors are {kinds} "
                             "(vLLM would quantize or mis-read the draft's weights)",
                             "no quantization_config: artcache's exports are unquantized")


def _check_width(config: dict, layout: ExportLayout, where: str) -> None:
    width = config.get("target_hidden_size", layout.hidden_size)
    if width != layout.hidden_size:
        raise refuse(where, "target_hidden_size", f"{width} for a draft of hidden_size {layout.hidden_size}",
                     f"{layout.hidden_size} (artcache's drafts read target states of their own width)")


def _check_dtype(config: dict, tensors: dict[str, Tensor], where: str) -> None:
    name = config.get("torch_dtype") or (config.get("transformer_layer_config") or {}).get("torch_dtype")
    if name is None:
        return
    want = _DTYPE_NAMES.get(name)
    got = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()})
    if want is None or got != [name]:
        raise refuse(where, "torch_dtype", f"{name!r} but the floating tensors are {got}",
                     f"the one dtype the tensors hold, one of {', '.join(_DTYPE_NAMES)}")


def _check_speculators_config(config: dict, layout: ExportLayout, where: str) -> int:
    """The speculators wrapper: returns the default proposal's ``speculative_tokens``."""
    sc = config.get("speculators_config")
    if not isinstance(sc, dict):
        raise refuse(where, "speculators_config", f"{sc!r}", "an object (algorithm, proposal_methods, "
                     "default_proposal_method, verifier)")
    if sc.get("algorithm") != config.get("speculators_model_type"):
        raise refuse(where, "speculators_config.algorithm", f"{sc.get('algorithm')!r} is not "
                     f"speculators_model_type {config.get('speculators_model_type')!r}", "the same algorithm")
    methods = sc.get("proposal_methods")
    default = sc.get("default_proposal_method")
    chosen = [m for m in methods or [] if isinstance(m, dict) and m.get("proposal_type") == default]
    if not chosen:
        raise refuse(where, "speculators_config.default_proposal_method", f"{default!r} names none of "
                     f"proposal_methods {methods!r}", "the proposal_type of one entry of proposal_methods")
    k = chosen[0].get("speculative_tokens")
    hi = layout.max_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (hi is not None and k > hi):
        raise refuse(where, "speculators_config.proposal_methods[].speculative_tokens", f"{k!r}",
                     f"an int in [1, {hi if hi is not None else 'any'}] (a {layout.draft} draft of block size "
                     f"{layout.block_size} drafts at most that many tokens per step)")
    verifier = sc.get("verifier") or {}
    if not isinstance(verifier.get("name_or_path"), str) or not verifier["name_or_path"]:
        raise refuse(where, "speculators_config.verifier.name_or_path", f"{verifier.get('name_or_path')!r}",
                     "the target's name")
    return k


def _read_provenance(directory: Path, where: str) -> dict:
    """``export.json`` as a dict (absent for drafts artcache did not write: ``{}``), its ``digests`` record
    verified whole (:func:`artcache.hashing.check_record`) before the check trusts the trained ids it records.

    Raises:
        ConfigError: unreadable, not a JSON object, a damaged or mismatching ``digests`` record, or a
            ``layer_ids_output_of_layer`` that is no list of ints.
    """
    p = directory / "export.json"
    if not p.is_file():
        return {}
    try:
        prov = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise refuse(where, "export.json", f"unreadable ({_one_line(exc)})", "the JSON artcache export writes") from exc
    if not isinstance(prov, dict):
        raise refuse(where, "export.json", f"a {type(prov).__name__}", "the JSON object artcache export writes")
    damaged = check_record(prov)  # before anything trusts its trained ids
    if damaged is not None:
        raise refuse(where, "export.json digests", damaged, "the export.json artcache export wrote (export again)")
    ids = prov.get("layer_ids_output_of_layer")
    if ids is not None and (not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                                              for i in ids)):
        raise refuse(where, "export.json layer_ids_output_of_layer", json.dumps(ids),
                     "the list of integers artcache export writes (export again)")
    return prov


def _check_trained_ids(fields: ExportFields, prov: dict, where: str) -> None:
    """Every layer-id key of ``config.json`` against the ids the draft was trained on (``export.json``
    ``layer_ids_output_of_layer``): an output-of-layer key must hold them, an input-of-layer key them + 1
    (:class:`ExportFields`). Each key is compared with the training record, never with another key, so the
    refusal names the key that was changed and gives the value that serves the trained draft.

    Raises:
        ConfigError: the first key that differs (its value, the trained ids and the accepted value named).
    """
    trained = prov.get("layer_ids_output_of_layer")
    if trained is None:
        return
    for key, (ids, input_of_layer) in fields.layer_id_fields().items():
        want = [i + 1 for i in trained] if input_of_layer else list(trained)
        if ids != want:
            raise refuse(where, f"config.json {key}", f"{ids} but the draft was trained on layer ids {trained} "
                         f"(output-of-layer, export.json): {_ID_READERS[key]}, so fc would read other target layers",
                         f"{want} ({'input-of-layer = trained + 1' if input_of_layer else 'output-of-layer'})")


def _check_provenance(prov: dict, layout: ExportLayout, where: str) -> dict:
    """``export.json``'s draft, format and layer ids (read and verified by :func:`_read_provenance`) must be the
    layout's. Returns it."""
    if not prov:
        return prov
    for key, want in (("draft", layout.draft), ("format", layout.fmt)):
        if prov.get(key) not in (None, want):
            raise refuse(where, f"export.json {key}", f"{prov.get(key)!r} but config.json is a {want!r} export",
                         "the config.json of the export that wrote it")
    ids = prov.get("layer_ids_output_of_layer")
    if ids is not None and list(ids) != layout.layer_ids:
        raise refuse(where, "layer ids", f"config.json reads output-of-layer ids {layout.layer_ids} (aux ids "
                     f"{layout.aux_ids}) but the draft was trained on {list(ids)} (export.json)",
                     f"aux ids {[i + 1 for i in ids]} (input-of-layer = trained output-of-layer + 1)")
    return prov


def _check_weights(directory: Path, tensors: dict[str, Tensor], prov: dict, where: str) -> str:
    """The weights themselves: every floating tensor finite (a NaN or inf weight loads without error and
    proposes garbage), and ``model.safetensors`` the bytes whose digest ``export.json`` records
    (:func:`artcache.hashing.check_file`). Returns the ``checked`` line.

    Raises:
        ConfigError: the first non-finite tensor (named, with its count of NaN and inf), or a
            ``model.safetensors`` whose size or digest differs from the record (the file named).
    """
    for key in sorted(tensors):
        t = tensors[key]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise refuse(where, f"model.safetensors {key}", f"{nan} NaN and {inf} inf of {t.numel()} values "
                         "(the engine loads it and proposes garbage)", "finite weights (export a checkpoint "
                         "that trained without diverging)")
    n = sum(t.is_floating_point() for t in tensors.values())
    if not prov.get("digests"):
        return f"weights: {n} floating tensors finite; no digest recorded (no export.json, or one written " \
               "before exports recorded digests): model.safetensors unverified"
    try:
        damaged = check_file(prov, "model.safetensors", directory / "model.safetensors")
    except OSError as exc:
        raise refuse(where, "model.safetensors", f"unreadable ({exc})", "a readable file") from exc
    if damaged is not None:
        damaged = damaged.removeprefix("model.safetensors ")  # the refusal names the file once, as its key
        raise refuse(where, "model.safetensors", f"{damaged} (export.json digests): the weights changed after "
                     "the export wrote them", "the model.safetensors artcache export wrote (export again)")
    return f"weights: {n} floating tensors finite; model.safetensors matches the digest export.json records"


def _check_num_target_layers(config: dict, layout: ExportLayout, tc: Any, where: str) -> None:
    """A recorded ``num_target_layers`` (L; DFlash and DSpark ``--format hf``) must be an int above every layer
    id (output-of-layer ids lie in ``[0, L)``; DSpark also reads layer ``L - 1``), and the target's layer count
    when the target is at hand.

    Raises:
        ConfigError: naming the recorded L and the ids or target count it disagrees with.
    """
    L = config.get("num_target_layers")
    if L is None:
        return
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise refuse(where, "num_target_layers", f"{L!r}", "the target's layer count, an int >= 1")
    if layout.layer_ids and max(layout.layer_ids) >= L:
        raise refuse(where, "num_target_layers", f"{L} but the layer ids {layout.layer_ids} (output-of-layer) read "
                     f"layer {max(layout.layer_ids)}, which a {L}-layer target does not have",
                     f"an int above {max(layout.layer_ids)}: the target's layer count")
    n = getattr(tc.get_text_config() if hasattr(tc, "get_text_config") else tc, "num_hidden_layers", None)
    if isinstance(n, int) and n != L:
        raise refuse(where, "num_target_layers", f"{L} but the target has {n} layers (num_hidden_layers)", f"{n}")


def _check_target(config: dict, layout: ExportLayout, tc: Any, where: str) -> None:
    tc = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    L = getattr(tc, "num_hidden_layers", None)
    for key, ours, theirs in (("target_hidden_size", layout.target_hidden_size, getattr(tc, "hidden_size", None)),
                              ("vocab_size", layout.vocab_size, getattr(tc, "vocab_size", None))):
        if theirs is not None and ours != theirs:
            raise refuse(where, key, f"{ours} but the target has {theirs}", f"the target's {theirs}")
    if isinstance(L, int) and any(not 0 <= i < L for i in layout.layer_ids):
        raise refuse(where, "aux layer ids", f"{layout.aux_ids} (input-of-layer) reach outside the target's {L} "
                     "layers", f"ids in [1, {L}]")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
    archs = list(getattr(tc, "architectures", None) or [])
    if verifier and archs and list(verifier) != archs:
        raise refuse(where, "speculators_config.verifier.architectures", f"{verifier} but the target is {archs}",
                     f"{archs}")


# ------------------------------------------------------------------------------------------ SGLang

def _check_sglang(config: dict, tensors: dict[str, Tensor], layout: ExportLayout, where: str) -> str:
    """SGLang's EAGLE-3 loader, statically (module docstring). Returns the ``checked`` line."""
    if config.get("architectures") != [SGLANG_EAGLE3_ARCHITECTURE]:
        raise refuse(where, "architectures", f"{config.get('architectures')!r}: SGLang registers its EAGLE-3 draft "
                     "class under one name", f"[{SGLANG_EAGLE3_ARCHITECTURE!r}]")
    ec = config.get("eagle_config")
    sg = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    if sg is None or list(sg) != layout.layer_ids:
        raise refuse(where, "eagle_config.eagle_aux_hidden_state_layer_ids", f"{sg!r}: SGLang reads only this key "
                     "and adds 1 itself (absent, it captures its default layers)",
                     f"the output-of-layer ids {layout.layer_ids}")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise refuse(where, "num_hidden_layers", f"{config.get('num_hidden_layers')!r}", "1")
    if config.get("tie_word_embeddings"):
        raise refuse(where, "tie_word_embeddings", "true: SGLang then uses the target's embedding as lm_head",
                     "false (the draft's own lm_head over draft_vocab_size)")
    if config.get("draft_vocab_size") != layout.draft_vocab_size:
        raise refuse(where, "draft_vocab_size", f"{config.get('draft_vocab_size')!r}: absent, SGLang loads the "
                     "target's full lm_head", f"{layout.draft_vocab_size}")
    if config.get("bias"):
        raise refuse(where, "bias", "true: SGLang gives fc a bias the draft never trained", "false or absent")
    if config.get("norm_before_residual"):
        raise refuse(where, "norm_before_residual", "true: SGLang always keeps the un-normed residual", "false")
    dropped = sorted(set(tensors) - SGLANG_EAGLE3_TENSORS - {"embed_tokens.weight"})
    missing = sorted(SGLANG_EAGLE3_TENSORS - set(tensors))
    if dropped or missing:
        raise refuse(where, "tensors", f"SGLang's load_weights would drop {dropped} and leave {missing} unset",
                     f"exactly {sorted(SGLANG_EAGLE3_TENSORS)}")
    return (f"sglang (static, LlamaForCausalLMEagle3): eagle_config aux ids {layout.layer_ids} (output-of-layer), "
            f"draft vocab {layout.draft_vocab_size} with d2t, {len(tensors)} tensors all loaded")


# ------------------------------------------------------------------------------------------ engines

def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _engine(engine: str, args: list[str], where: str, timeout_s: float) -> dict:
    """Run :mod:`artcache.trainers.export_engines` for ``engine`` under this interpreter; its result dict.

    Raises:
        ConfigError: the child printed no result (its last stderr line quoted) or ran past ``timeout_s``.
    """
    try:
        proc = subprocess.run([sys.executable, str(_ENGINE_SCRIPT), engine, *args], capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired as exc:
        raise refuse(where, engine, f"resolving the export took longer than {timeout_s:.0f} s, so it is unchecked",
                     f"an export {engine} resolves in time (or export with --no-check)") from exc
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_PREFIX):
            return json.loads(line[len(_RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise refuse(where, engine, f"could not resolve the export (exit {proc.returncode}: {tail[:300]})",
                 f"an export {engine} reads")


def _expect(where: str, engine: str, key: str, got: Any, want: Any, why: str) -> None:
    if got != want:
        raise refuse(where, key, f"{engine} resolves {got!r} but the draft was trained with {want!r} ({why})",
                     f"{want!r}")


def _check_vllm(directory: Path, layout: ExportLayout, tc: Any, k: int | None, where: str,
                timeout_s: float) -> str:
    """vLLM's resolution of the export (module docstring). Returns the ``checked`` line."""
    with tempfile.TemporaryDirectory(prefix="artcache-check-target-") as tmp:
        tc.to_json_file(str(Path(tmp) / "config.json"))
        # the method is given, as docs/export.md serves every format: without it vLLM guesses it from the draft
        # directory's name (a name without "eagle3" / "dflash" / "dspark" runs the draft as a plain draft model)
        args = ["--draft", str(directory), "--target", tmp, "--k", str(k or layout.max_speculative_tokens or 1),
                "--method", layout.vllm_method]
        got = _engine("vllm", args, where, timeout_s)
    if "error" in got:
        raise refuse(where, "vllm", f"vLLM refuses the export: {got['error']}", "an export vLLM loads")
    cfg = got.get("config") or {}
    _expect(where, "vLLM", "speculative method", got.get("method"), layout.vllm_method, "the draft's algorithm")
    if got.get("class") not in layout.vllm_classes:
        raise refuse(where, "architectures", f"vLLM resolves {got.get('architectures')} to {got.get('class')}, "
                     f"another class than the one trained", f"architectures vLLM maps to {layout.vllm_classes}")
    _expect(where, "vLLM", "eagle_aux_hidden_state_layer_ids", got.get("aux_layer_ids"), layout.aux_ids,
            "the layers the target captures for the draft, input-of-layer")
    _expect(where, "vLLM", "quantization_config", got.get("quantization"), None,
            "artcache's drafts are unquantized; vLLM took the quantization of the target or of the config")
    if layout.norm_before_residual is not None:
        _expect(where, "vLLM", "norm_before_residual", bool(cfg.get("norm_before_residual")),
                layout.norm_before_residual, "where the hidden norm sits relative to the residual")
    dflash = got.get("dflash_config") or {}
    if layout.causal is not None:
        causal = bool(cfg["is_causal"] if cfg.get("is_causal") is not None else dflash.get("causal"))
        _expect(where, "vLLM", "dflash_config.causal / is_causal", causal, layout.causal,
                "the block attention the draft was trained with")
    anchor = bool(cfg.get("sample_from_anchor") or dflash.get("sample_from_anchor"))
    _expect(where, "vLLM", "sample_from_anchor", anchor, layout.sample_from_anchor,
            "which slot the first proposal comes from")
    if layout.mask_token_id is not None:
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        _expect(where, "vLLM", "mask_token_id", mask, layout.mask_token_id, "the MASK id the blocks were trained with")
    for key, want in (("draft_vocab_size", layout.draft_vocab_size), ("target_hidden_size", layout.target_hidden_size)):
        if cfg.get(key) is not None:
            _expect(where, "vLLM", key, cfg.get(key), want, "the draft's sizes")
    K, hi = got.get("num_speculative_tokens"), layout.max_speculative_tokens
    if hi is not None and isinstance(K, int) and hi < K:
        raise refuse(where, "num_speculative_tokens", f"vLLM resolves {K}, more than the {hi} the draft's block of "
                     f"{layout.block_size} proposes", f"at most {hi}")
    note = "; runner refused on this machine: " + got["runner_refusal"][0][:120] if got.get("runner_refusal") else ""
    return (f"vllm: method {got.get('method')}, {got.get('class')}, aux layers {tuple(got.get('aux_layer_ids'))}, "
            f"quantization None, {K} speculative tokens{note}")


def _check_speculators(directory: Path, layout: ExportLayout, where: str, timeout_s: float) -> str:
    got = _engine("speculators", ["--draft", str(directory)], where, timeout_s)
    if "error" in got:
        raise refuse(where, "speculators", f"speculators refuses the export: {got['error']}",
                     "an export speculators loads")
    cfg = got.get("config") or {}
    if got.get("class") != layout.speculators_class:
        raise refuse(where, "speculators_model_type", f"speculators resolves {got.get('class')}", f"a config that "
                     f"resolves to {layout.speculators_class}")
    _expect(where, "speculators", "aux_hidden_state_layer_ids", got.get("aux_layer_ids"), layout.aux_ids,
            "input-of-layer ids of the trained layers")
    if layout.norm_before_residual is not None:
        for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            _expect(where, "speculators", key, bool(cfg.get(key)), False, "artcache's EAGLE-3 normalises only the "
                    "embedding and the hidden state, and keeps the un-normed residual")
    if layout.causal is not None:
        _expect(where, "speculators", "sliding_window_non_causal", bool(cfg.get("sliding_window_non_causal")),
                not layout.causal, "the block attention the draft was trained with")
    if layout.mask_token_id is not None:
        _expect(where, "speculators", "mask_token_id", cfg.get("mask_token_id"), layout.mask_token_id, "MASK id")
        _expect(where, "speculators", "block_size", cfg.get("block_size"), layout.block_size, "block size")
        _expect(where, "speculators", "sample_from_anchor", bool(cfg.get("sample_from_anchor")),
                layout.sample_from_anchor, "which slot the first proposal comes from")
    _expect(where, "speculators", "draft_vocab_size", cfg.get("draft_vocab_size"), layout.draft_vocab_size, "vocab")
    return (f"speculators: {got.get('config_class')} -> {got.get('class')}, aux layers {got.get('aux_layer_ids')}, "
            f"{got.get('speculative_tokens')} speculative tokens")


# ------------------------------------------------------------------------------------------ driver

def _target_config(target: Any, recorded: str | None, where: str) -> Any:
    """The target's transformers config: ``target`` (a config object, a name or a directory), else the name
    ``export.json`` records when it resolves here; None when neither is at hand."""
    from transformers import AutoConfig

    from artcache.target import resolve_target

    if target is not None and not isinstance(target, (str, os.PathLike)):
        return target
    name = target if target is not None else recorded
    if not name:
        return None
    try:
        p = Path(name).expanduser()
        path = p if (p / "config.json").is_file() else resolve_target(str(name)).path
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        if target is None:
            return None  # the recorded target is not on this machine: target checks are skipped (reported)
        raise ConfigError(f"--target {str(target)!r}: cannot read its config ({exc})") from exc


def check_export(directory: str | Path, target: Any = None, *, engines: tuple[str, ...] = ENGINES,
                 timeout_s: float = 600.0, name: str | None = None) -> CheckReport:
    """Check an exported draft directory (module docstring) and report what was checked and skipped.

    Args:
        directory: holds ``config.json`` and ``model.safetensors`` (``export.json`` when artcache wrote it).
        target: the target it is served with: a transformers config, a name or a directory; default the
            ``target_name`` its ``export.json`` records (when it resolves here). The target checks and the
            vLLM resolution need it; without one they are skipped and reported.
        engines: which of :data:`ENGINES` to try (a static check always runs).
        timeout_s: per engine child process.
        name: how messages name the export (default: ``directory``; an export being written is checked in its
            temporary directory and named by its ``--out``).

    Raises:
        ConfigError: the first silent-collapse case found, in one line naming the key (see :func:`refuse`).
    """
    d = Path(directory)
    where = name or str(d)
    try:
        config, tensors = read_export(d)
    except ConfigError as exc:
        raise ConfigError(f"export check: {exc}") from exc
    prov = _read_provenance(d, where)
    recorded = prov.get("target_name") or prov.get("target")
    tc = _target_config(target, None, where) if target is not None else _target_config(None, recorded, where)
    n = getattr(tc.get_text_config() if hasattr(tc, "get_text_config") else tc, "num_hidden_layers", None)
    from artcache.trainers.draft import draft_class

    try:
        fields = export_fields(config)  # ids outside the target's layers: _check_target names the target's count
        _check_trained_ids(fields, prov, where)
        L = n if isinstance(n, int) and n > 0 else fields.num_target_layers or 0
        kind = _draft_of(config, L if L > 0 else 1_000_000, where)
        layout = draft_class(kind).export_layout(config, tensors, where)
    except ConfigError as exc:
        msg = str(exc)
        raise exc if msg.startswith("export check:") else ConfigError(f"export check: {where}: {msg}") from exc
    _check_quantization(config, tensors, where)
    _check_width(config, layout, where)
    _check_dtype(config, tensors, where)
    k = _check_speculators_config(config, layout, where) if layout.fmt == "speculators" else None
    _check_provenance(prov, layout, where)
    report = CheckReport(d, layout)
    if tc is not None:
        _check_target(config, layout, tc, where)
    _check_num_target_layers(config, layout, tc, where)
    report.checked.append(f"static: {layout.draft} {layout.fmt}, layer ids {layout.layer_ids} (output-of-layer; "
                          f"aux {layout.aux_ids}), unquantized, {len(tensors)} tensors"
                          + ("" if tc is not None else " (no target at hand: target sizes not checked)"))
    _engine_checks(report, config, tensors, tc, k, engines, where, timeout_s)
    report.checked.append(_check_weights(d, tensors, prov, where))
    return report


def _engine_checks(report: CheckReport, config: dict, tensors: dict[str, Tensor], tc: Any, k: int | None,
                   engines: tuple[str, ...], where: str, timeout_s: float) -> None:
    layout, d = report.layout, report.directory
    if "vllm" in engines:
        if not _installed("vllm"):
            report.skipped.append("vllm: not installed in this Python (pip install -e '.[vllm]'): the class, aux "
                                  "layers, quantization and norm placement vLLM resolves were not checked")
        elif tc is None:
            report.skipped.append("vllm: no target config at hand (pass --target): vLLM's resolution not checked")
        else:
            report.checked.append(_check_vllm(d, layout, tc, k, where, timeout_s))
    if "speculators" in engines:
        if layout.fmt != "speculators":
            report.skipped.append("speculators: an hf-format export (speculators' loader reads --format speculators)")
        elif not _installed("speculators"):
            report.skipped.append("speculators: not installed in this Python (pip install speculators): its config "
                                  "class, model class and defaults were not checked")
        else:
            report.checked.append(_check_speculators(d, layout, where, timeout_s))
    if "sglang" in engines:
        if layout.draft == "eagle3" and layout.fmt == "hf":
            report.checked.append(_check_sglang(config, tensors, layout, where))
        else:
            report.skipped.append(f"sglang: only EAGLE-3 --format hf is checked against SGLang's loader (this is "
                                  f"{layout.draft} {layout.fmt})")
