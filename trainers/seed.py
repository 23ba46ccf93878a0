"""Seeding a draft from another draft's weights (``--init-from``): one loader for every published layout.

A seed is a directory holding ``model.safetensors`` (or that file itself, or a run directory whose
``checkpoints/latest`` holds one):

- an **artcache checkpoint** (``state.json`` beside it): the draft, its draft config and the target
  identity are the ones recorded there;
- a **published draft** (``config.json`` beside it): artcache's own exports (``--format hf`` and
  ``speculators``, with ``export.json`` naming the target) and the layouts peers publish — z-lab
  ``DFlashDraftModel``, vllm-project/speculators ``dflash`` / ``eagle3``, SpecForge ``DFlashDraftModel``
  / ``LlamaForCausalLMEagle3``. Each draft's adapter reads the config of its own layouts
  (:meth:`~artcache.trainers.draft.Draft.read_published`); exactly one must recognise it.

Before a single weight is loaded, :func:`plan_seed` compares the seed's recorded config with the run's
(the same function runs in ``artcache run --dry-run`` and in the consumer): the layer ids **in order**
(never accepted when they differ: ``fc``'s columns are tied to them), the draft's sizes and options
(``seed_fields``: mask token, block size, hidden size, vocabulary, draft vocabulary, ...), the target
(weights digest, else name, else a frozen target tensor the seed carries; ``num_target_layers``), and
the layer convention. A difference is refused naming the field and both values unless an
``--init-override`` accepts it (``block_size``, ``mask_token``, ``target``). An EAGLE-3 seed keeps its own
vocab map; its coverage of the plan's supervised training tokens is measured and refused below
``--min-vocab-coverage`` unless ``--keep-vocab-map``.

Keys are mapped back **per key, only where the model lacks the key** (:func:`map_back`): the drafts'
serving renames are not injective across drafts (EAGLE-3 ``layers.0.*`` are its ``midlayer.*``, while
DFlash's ``layers.0.*`` are its own). Keys that are the target's frozen tensors (``embed_tokens.weight``,
...) must equal this run's target's and are then dropped. Strict both ways: a key left missing or
unexpected, or a shape that differs, is an error naming them. Only safetensors and JSON are read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from safetensors import safe_open
from torch import Tensor

from artcache.errors import ConfigError, ContractMismatch
from artcache.trainers import DRAFT_NAMES
from artcache.trainers.checkpoint import (
    WEIGHT_FILES,
    CheckpointState,
    find_checkpoint,
    read_state,
    verify_checkpoint,
)
from artcache.trainers.draft import draft_class

__all__ = ["SeedPlan", "SeedSource", "compare_configs", "load_seed", "map_back", "plan_seed", "read_seed",
           "seed_vocab_map"]

log = logging.getLogger("artcache.consumer")

#: The flag (or how the run sets it) named when a compared field differs.
_FIELD_FLAGS = {"block_size": "--block-size", "draft_vocab_size": "--draft-vocab", "layer_ids": "--layer-ids",
                "num_layers": "--draft-layers", "num_context_layers": "--layer-ids / --draft-layers",
                "mask_token_id": "chosen from the tokenizer and the plan"}
#: compared field -> the ``--init-override`` value that accepts a difference in it
_OVERRIDABLE = {"block_size": "block_size", "mask_token_id": "mask_token"}


@dataclass
class SeedSource:
    """A seed as found on disk (headers only; no tensor loaded).

    Attributes:
        path: the directory holding ``model.safetensors``. layout: what it is, for messages.
        draft: the draft it holds (a key of ``artcache.trainers.ADAPTERS``).
        recorded: its draft config as :meth:`Draft.config_dict` (``layer_ids`` output-of-layer, in order).
        target: the target identity it records (``name``, ``revision``, ``weights_digest``,
            ``layer_convention``, ``num_target_layers``; a key it does not record is absent).
        shapes: tensor key -> shape, from the safetensors headers (``model`` then ``extra``).
        files: tensor key -> the file holding it.
        state: the checkpoint's state (an artcache checkpoint), else None.
    """

    path: Path
    layout: str
    draft: str
    recorded: dict[str, Any]
    target: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    files: dict[str, Path]
    state: CheckpointState | None = None


@dataclass
class SeedPlan:
    """What :func:`plan_seed` decided: ``mapping`` file key -> model key, ``dropped`` the target tensors
    checked and left out, ``coverage`` of a kept vocab map (None without one), ``notes`` (accepted
    differences, said at start)."""

    source: SeedSource
    mapping: dict[str, str]
    dropped: list[str] = field(default_factory=list)
    coverage: float | None = None
    notes: list[str] = field(default_factory=list)


def _locate(path: str | Path) -> Path:
    """The directory a seed path names (see the module docstring). Raises ConfigError otherwise."""
    p = Path(path).expanduser()
    accepted = ("accepted: a model.safetensors file, a directory holding one (an artcache checkpoint or "
                "export, a published z-lab / speculators / SpecForge draft) or a run directory")
    if p.is_file():
        if p.name != "model.safetensors":
            raise ConfigError(f"--init-from {str(path)!r} is a file but not model.safetensors; {accepted}")
        return p.parent.resolve()
    if not p.is_dir():
        raise ConfigError(f"--init-from {str(path)!r} does not exist; {accepted}")
    if (p / "model.safetensors").is_file():
        return p.resolve()
    found = find_checkpoint(p)
    if found is None:
        raise ConfigError(f"--init-from {str(path)!r}: no model.safetensors there nor in its checkpoints/latest; "
                          f"{accepted}")
    return found


def _headers(directory: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, Path] = {}
    for name in ("model.safetensors", "extra.safetensors"):
        f = directory / name
        if not f.is_file():
            continue
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 - safe_open handles are not dicts
                    if key not in shapes:
                        shapes[key], files[key] = tuple(h.get_slice(key).get_shape()), f
        except (OSError, ValueError, safetensors.SafetensorError) as exc:
            raise ConfigError(f"--init-from {directory}: {name} is unreadable ({exc})") from exc
    return shapes, files


def _read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--init-from {path.parent}: {what} is unreadable or not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"--init-from {path.parent}: {what} is not a JSON object")
    return doc


def read_seed(path: str | Path, num_target_layers: int) -> SeedSource:
    """Find and describe the seed ``path`` names, reading only JSON and safetensors headers.

    Args:
        num_target_layers: L of this run's target (an EAGLE-3 export lists its three auxiliary layers;
            the fourth id it reads is ``L - 1``).

    An artcache checkpoint's ``state.json``, ``model.safetensors`` and ``extra.safetensors`` are checked
    against the digests it recorded first (:func:`~artcache.trainers.checkpoint.verify_checkpoint`: one
    streaming read of each, also in ``artcache run --dry-run``); one written before digests were is read
    with a warning that it is unverified. A published draft records none (nothing to check).

    Raises:
        ConfigError: not a seed (see :func:`_locate`), unreadable files, a checkpoint that records no
            draft, a ``config.json`` no registered draft reads (or several do), a layout option this
            artcache does not compute.
        CheckpointCorrupt: a checkpoint's file does not match its recorded digest.
    """
    d = _locate(path)
    st = None
    if (d / "state.json").is_file():  # an artcache checkpoint: its weight files checked before a header is read
        st = read_state(d)
        verify_checkpoint(d, st, WEIGHT_FILES)
    shapes, files = _headers(d)
    if st is not None:
        if st.draft not in DRAFT_NAMES:
            raise ConfigError(f"--init-from {d}: its state.json records draft {st.draft!r}; accepted: "
                              f"{', '.join(DRAFT_NAMES)}")
        target = {"name": st.target_name, "revision": None, "weights_digest": st.target_weights_digest,
                  "layer_convention": st.layer_convention}
        recorded = dict(st.draft_config or {})
        if st.view_layer_ids and "layer_ids" not in recorded:
            recorded["layer_ids"] = list(st.view_layer_ids)
        return SeedSource(d, "artcache checkpoint", st.draft, recorded, {k: v for k, v in target.items() if v},
                          shapes, files, st)
    if not (d / "config.json").is_file():
        raise ConfigError(f"--init-from {d}: model.safetensors has neither a state.json (artcache checkpoint) nor a "
                          "config.json (published draft) beside it: which draft and config it holds is unknown")
    config = _read_json(d / "config.json", "config.json")
    found = []
    for name in DRAFT_NAMES:
        rec = draft_class(name).read_published(config, num_target_layers)
        if rec is not None:
            found.append((name, rec))
    if len(found) != 1:
        what = "no registered draft reads" if not found else f"several drafts ({[n for n, _ in found]}) read"
        raise ConfigError(f"--init-from {d}: {what} its config.json (architectures {config.get('architectures')!r}, "
                          f"speculators_model_type {config.get('speculators_model_type')!r}); accepted: the layouts "
                          f"of {', '.join(DRAFT_NAMES)} (docs/export.md)")
    draft, rec = found[0]
    target = {k: rec.pop(k) for k in ("target_name", "num_target_layers") if rec.get(k) is not None}
    target = {("name" if k == "target_name" else k): v for k, v in target.items()}
    layout = rec.pop("layout", "published draft")
    prov = d / "export.json"
    if prov.is_file():  # written by artcache export: the target it was exported for
        p = _read_json(prov, "export.json")
        if p.get("exported_by") == "artcache export":
            layout = f"artcache export ({p.get('format')})"
            for k in ("name", "revision", "weights_digest"):
                if p.get(f"target_{k}"):
                    target[k] = p[f"target_{k}"]
            if p.get("layer_convention"):
                target["layer_convention"] = p["layer_convention"]
            if "name" not in target and isinstance(p.get("target"), str):
                target["name"] = Path(p["target"]).name
    return SeedSource(d, layout, draft, rec, target, shapes, files)


def _same_name(a: str, b: str) -> bool:
    """Target names agree: equal, or equal last path components (a hub id ``org/Name`` or a local
    directory against the directory's name)."""
    return a == b or Path(a.rstrip("/")).name == Path(b.rstrip("/")).name


def compare_configs(src: SeedSource, ours: dict[str, Any], fields: tuple[str, ...], overrides: list[str],
                    what: str) -> list[str]:
    """Compare the seed's recorded draft config with the run's, field by field.

    Args:
        ours: the run's draft config (:meth:`Draft.config_dict` / :meth:`Draft.configure`).
        fields: the draft's ``seed_fields``; ``layer_ids`` is always compared first, in order.

    Returns:
        the accepted differences (one note each).

    Raises:
        ConfigError: the first difference not accepted, naming the field, both values and the override
            (or that none exists).
    """
    rec = src.recorded
    mine, theirs = ours.get("layer_ids"), rec.get("layer_ids")
    if theirs is None:
        raise ConfigError(f"{what} records no layer ids, so what its fc reads cannot be checked against this run's "
                          f"{mine}; seed from a checkpoint or export that records them")
    if list(theirs) != list(mine):
        raise ConfigError(f"{what} was trained on layers {list(theirs)}, this run reads {list(mine)} (--layer-ids / "
                          "--draft-layers): its fc weights are tied to those layers in that order; not overridable")
    notes = []
    for name in fields:
        a, b = rec.get(name), ours.get(name)
        if a == b:
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b):
            continue
        how = _FIELD_FLAGS.get(name)
        flag = f" ({how})" if how else ""
        override = _OVERRIDABLE.get(name)
        if override is not None and override in overrides:
            notes.append(f"{name} differs: seed {a!r}, this run {b!r} (accepted by --init-override {override})")
            continue
        fix = f"pass --init-override {override} to train with this run's" if override else "not overridable"
        raise ConfigError(f"{what}: {name} differs: seed {a!r}, this run {b!r}{flag}; {fix}")
    return notes


def _check_target(src: SeedSource, info, contract, overrides: list[str], what: str,
                  tensor_ok: bool) -> list[str]:
    """The seed's target against this run's. Returns notes; raises ContractMismatch unless ``target`` is
    overridden (the layer convention is never overridable)."""
    t = src.target
    conv = t.get("layer_convention")
    if conv is not None and contract is not None and conv != contract.layer_convention:
        raise ContractMismatch(f"{what} was trained with layer_convention {conv!r}; this cache root has "
                               f"{contract.layer_convention!r}; not overridable")
    problem = None
    if t.get("num_target_layers") is not None and int(t["num_target_layers"]) != info.num_layers:
        problem = (f"was trained for a target of {t['num_target_layers']} layers; this run's target {info.name} "
                   f"has {info.num_layers}")
    elif t.get("weights_digest"):
        if t["weights_digest"] != info.weights_digest:
            problem = (f"was trained for target {t.get('name')!r} with weights digest {t['weights_digest']}; this "
                       f"run's target {info.name} has {info.weights_digest}")
    elif tensor_ok:
        pass  # a frozen target tensor it carries equals this run's target's
    elif t.get("name"):
        if not _same_name(str(t["name"]), info.name):
            problem = f"was trained for target {t['name']!r}; this run's target is {info.name!r}"
    else:
        problem = (f"records no target identity (weights digest, name or a target tensor), so it cannot be "
                   f"checked against this run's target {info.name} ({info.weights_digest})")
    if problem is None:
        return []
    if "target" in overrides:
        return [f"{what} {problem} (accepted by --init-override target)"]
    raise ContractMismatch(f"{what} {problem}; pass --init-override target to seed from it anyway")


def map_back(shapes: dict[str, tuple[int, ...]], own: dict[str, tuple[int, ...]],
             serving_names: tuple[tuple[str, str], ...], target_keys: dict[str, str], what: str
             ) -> tuple[dict[str, str], list[str]]:
    """Map a seed's tensor keys onto a model's, strictly.

    A key the model has is kept. Otherwise each ``(native, serving)`` rename whose serving prefix the
    key starts with is tried, and the one giving a key the model has is used (never a rename the model
    does not need). A key of ``target_keys`` that maps to nothing is a frozen target tensor (checked by
    the caller). Everything else is unexpected.

    Returns:
        (file key -> model key, the target-tensor keys).

    Raises:
        ConfigError: missing, unexpected, doubly mapped or mis-shaped keys (named, up to five of each).
    """
    mapping: dict[str, str] = {}
    target, unexpected = [], []
    for key in shapes:
        native = key if key in own else next(
            (n + key[len(s):] for n, s in serving_names if key.startswith(s) and n + key[len(s):] in own), None)
        if native is not None:
            mapping[key] = native
        elif key in target_keys:
            target.append(key)
        else:
            unexpected.append(key)
    seen: dict[str, str] = {}
    double = []
    for k, n in mapping.items():
        if n in seen:
            double.append(f"{seen[n]} and {k} -> {n}")
        seen[n] = k
    missing = sorted(set(own) - set(seen))
    bad = [f"{k} {shapes[k]} != {own[n]}" for k, n in mapping.items() if tuple(shapes[k]) != tuple(own[n])]
    if missing or unexpected or double or bad:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s) {sorted(unexpected)[:5]}")
        if double:
            parts.append(f"mapped twice {double[:5]}")
        if bad:
            parts.append(f"shape mismatches {sorted(bad)[:5]}")
        raise ConfigError(f"{what}: the weights do not fit this draft ({'; '.join(parts)})")
    return mapping, target


def _read_tensor(src: SeedSource, key: str) -> Tensor:
    try:
        with safe_open(str(src.files[key]), framework="pt") as h:
            return h.get_tensor(key)
    except (OSError, ValueError, safetensors.SafetensorError) as exc:
        raise ConfigError(f"--init-from {src.path}: cannot read {key} ({exc})") from exc


def _target_tensor(info, which: str) -> Tensor:
    from artcache.target import load_embedding_and_lm_head, load_final_norm

    if which == "final_norm":
        return load_final_norm(info)
    embed, head = load_embedding_and_lm_head(info)
    return embed if which == "embed" else head


def seed_vocab_map(src: SeedSource) -> dict[str, Tensor] | None:
    """The seed's own vocab map (``d2t``, ``t2d``: an EAGLE-3 draft keeps it), or None."""
    if {"d2t", "t2d"} <= set(src.shapes):
        return {k: _read_tensor(src, k) for k in ("d2t", "t2d")}
    return None


def plan_seed(src: SeedSource, ours: dict[str, Any], own: dict[str, tuple[int, ...]], cfg, info, contract,
              coverage_counts: Tensor | None) -> SeedPlan:
    """Every check of a seed against the run, before a weight is loaded (the consumer and the dry run).

    Args:
        ours: the run's draft config (``config_dict`` / ``configure``). own: its ``trainable_state_dict``
            shapes. cfg: the run's :class:`~artcache.trainers.consumer.ConsumerConfig` (draft,
            ``init_overrides``, ``min_vocab_coverage``, ``keep_vocab_map``), resolved.
        info: this run's target. contract: the root's capture contract (None in a dry run of a fresh root).
        coverage_counts: int64 [V], the plan's supervised training-token counts (for a kept vocab map).

    Raises:
        ConfigError: another draft, a draft-config difference, keys/shapes that do not fit, a vocab map
            covering too little of the plan. ContractMismatch: another target or layer convention.
    """
    what = f"--init-from {src.path} ({src.layout})"
    if src.draft != cfg.draft:
        raise ConfigError(f"{what} holds a {src.draft} draft, not {cfg.draft}")
    cls = draft_class(cfg.draft)
    overrides = list(cfg.init_overrides)
    notes = compare_configs(src, ours, cls.seed_fields, overrides, what)
    mapping, target_keys = map_back(src.shapes, own, cls.serving_names, cls.target_tensors, what)
    for key in target_keys:
        theirs, mine = _read_tensor(src, key), _target_tensor(info, cls.target_tensors[key])
        if tuple(theirs.shape) != tuple(mine.shape) or not torch.equal(mine.to(theirs.dtype), theirs):
            diff = "shape " + str(tuple(theirs.shape)) if tuple(theirs.shape) != tuple(mine.shape) else \
                f"max abs difference {float((mine.to(torch.float32) - theirs.to(torch.float32)).abs().max()):.3g}"
            raise ContractMismatch(f"{what} carries {key}, which is not this run's target's {cls.target_tensors[key]} "
                                   f"({diff}): it was trained for another target")
    notes += _check_target(src, info, contract, overrides, what, tensor_ok=bool(target_keys))
    plan = SeedPlan(src, mapping, target_keys, None, notes)
    vmap = seed_vocab_map(src)
    if vmap is not None and coverage_counts is not None:
        plan.coverage = cls.vocab_coverage(vmap, coverage_counts)
        if plan.coverage is not None:
            low = cfg.min_vocab_coverage if cfg.min_vocab_coverage is not None else 0.5
            figure = (f"the seed's own vocab map ({int(vmap['d2t'].numel())} tokens) covers {plan.coverage:.1%} of "
                      "this plan's supervised training tokens")
            if plan.coverage < low and not cfg.keep_vocab_map:
                raise ConfigError(f"{what}: {figure}, below --min-vocab-coverage {low}: most positions would be "
                                  "outside the draft vocabulary and train nothing; pass --keep-vocab-map to train "
                                  "anyway, or seed from a draft whose map fits this data (a map is never "
                                  "replaced under loaded weights)")
            plan.notes.append(figure + (f" (below --min-vocab-coverage {low}, kept by --keep-vocab-map)"
                                        if plan.coverage < low else ""))
    return plan


def load_seed(plan: SeedPlan) -> dict[str, Tensor]:
    """The seed's tensors under the model's keys (the target tensors left out), as :func:`plan_seed` mapped
    them. Raises ConfigError when a file cannot be read."""
    src = plan.source
    out: dict[str, Tensor] = {}
    for f in sorted(set(src.files.values())):
        try:
            tensors = safetensors.torch.load_file(f)
        except (OSError, ValueError, safetensors.SafetensorError) as exc:
            raise ConfigError(f"--init-from {src.path}: {f.name} is unreadable ({exc})") from exc
        for k, t in tensors.items():
            if src.files.get(k) == f and k in plan.mapping:
                out[plan.mapping[k]] = t
    return out
