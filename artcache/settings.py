"""``artcache.json``: the settings every process sharing a cache root must agree on."""

from __future__ import annotations

from typing import Any

import msgspec

from artcache import FORMAT_VERSION
from artcache.contract import CaptureContract
from artcache.errors import ArtcacheError, CacheRootError, ConfigError
from artcache.fsio import atomic_write
from artcache.hashing import check_record, sealed
from artcache.layout import CacheLayout
from artcache.payload import PayloadSpec


class RootSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Written once by the first producer; later producers must match it exactly.

    Attributes:
        format_version: artcache on-disk format.
        plan_id: the plan every consumer of this root walks.
        contract: the capture contract of every artifact in this root.
        target_path: where the producer found the target (consumers load its frozen embedding and
            lm_head from here and check ``contract.target_weights_digest``).
        heartbeat_timeout_s: a consumer whose heartbeat is older is fenced as ``expired``.
        lock_stripes: number of striped fingerprint lock files.
        payload: where the artifacts' tensors live: ``None`` = files in ``objects/`` (POSIX), or a remote
            store (:class:`~artcache.payload.PayloadSpec`, e.g. Mooncake) with manifests in ``objects/``.
        digests: the file's record of its own content (``{algorithm, files: {}, state}``,
            :func:`artcache.hashing.sealed`), written by :func:`init_settings` and checked by every
            :func:`load_settings` and ``fsck``; None in a root initialised before roots recorded it (read
            unverified).
    """

    format_version: int = FORMAT_VERSION
    plan_id: str
    contract: CaptureContract
    target_path: str
    heartbeat_timeout_s: float = 30.0
    lock_stripes: int = 4096
    payload: PayloadSpec | None = None
    digests: dict[str, Any] | None = None


def decode_settings(raw: bytes, path) -> tuple[RootSettings, str | None]:
    """``(settings, damage)`` of the bytes ``raw`` of ``artcache.json`` at ``path``: ``damage`` says how the
    file does not match its recorded digest (:func:`artcache.hashing.check_record`), None when it matches
    or records none (a root initialised before roots recorded it).

    Raises:
        CacheRootError: the file is not a valid RootSettings document.
    """
    try:
        settings = msgspec.json.decode(raw, type=RootSettings)
        doc = msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CacheRootError(f"{path} is invalid: {exc}") from exc
    return settings, check_record(doc)


def load_settings(layout: CacheLayout) -> RootSettings:
    """Read and validate ``artcache.json``, checked against the digest of its content it records.

    Raises:
        CacheRootError: the root is missing or uninitialised, the file is unreadable, does not match its
            recorded digest (damaged: the message says how), or was written by another format version.
    """
    layout.require()
    settings, damage = decode_settings(layout.settings.read_bytes(), layout.settings)
    if damage is not None:
        raise CacheRootError(f"{layout.settings} is damaged: {damage}; it decides the capture contract and the "
                             "plan every process uses: restore it or use a new cache root")
    if settings.format_version != FORMAT_VERSION:
        raise CacheRootError(
            f"{layout.settings} has format {settings.format_version}; this artcache reads "
            f"format {FORMAT_VERSION}: use a new cache root")
    return settings


#: the :class:`~artcache.producer.ProducerConfig` setting behind each capture-contract field (a mismatch names
#: the user's flag or config path for it, through the caller's ``name_of``), and the words for a digest's change;
#: a field no setting changes (``layer_convention``, ``format_version`` ...) is the artcache version's
CONTRACT_SETTINGS: dict[str, tuple[str, str | None]] = {
    "target_name": ("target", None), "target_revision": ("target", "another revision"),
    "target_config_hash": ("target", "another model config"), "target_weights_digest": ("target", "other weights"),
    "layer_ids": ("layer_ids", None), "dtype": ("dtype", None), "compute_dtype": ("compute_dtype", None),
    "max_length": ("max_length", None), "tokenizer_digest": ("target", "another tokenizer"),
    "template_digest": ("template_options", "another chat template"), "backend": ("backend", None)}
#: the :class:`~artcache.producer.ProducerConfig` settings a plan is built from (the fields of
#: :class:`artcache.plan.PlanSpec`; with the dataset file's contents and the target's tokenizer they make its id)
PLAN_SETTINGS: tuple[str, ...] = ("dataset", "seed", "max_length", "max_samples", "template_options", "sources",
                                  "eval")
#: a plan setting's value when plan.json predates it (or the spec leaves it out)
_PLAN_DEFAULTS: dict[str, object] = {"template_options": {}, "sources": [], "eval": None}


def check_compatible(current: RootSettings, contract: CaptureContract, plan_id: str, layout: CacheLayout, *,
                     spec=None, name_of=None) -> None:
    """Raise ConfigError naming the settings that differ if the root holds another contract or plan.

    Args:
        spec: the :class:`~artcache.plan.PlanSpec` this caller would build its plan from: the differing plan
            settings are named with the root's value and this one (read from the root's ``plan.json``); None
            names every setting that decides a plan.
        name_of: ProducerConfig setting (``max_samples``, ``layer_ids``, ``target`` ...) → the name the user
            gave it: a flag (``--max-samples``) or a config path (``data.max_samples``). Default: the setting.

    Raises:
        ConfigError: ``cache root R was initialised with another capture contract or plan (differs in:
            --max-samples 40 there, 30 here; ...)``.
    """
    if current.contract == contract and current.plan_id == plan_id:
        return
    name_of = name_of or str
    diffs: list[str] = []
    for f in CaptureContract.__struct_fields__:
        old, new = getattr(current.contract, f), getattr(contract, f)
        if old == new:
            continue
        setting, change = CONTRACT_SETTINGS.get(f, (None, None))
        if setting is None:
            diffs.append(f"the artcache version that made it ({f} {_shown(old)} there, {_shown(new)} here)")
        else:
            diffs.append(f"{name_of(setting)} ({change})" if change else
                         f"{name_of(setting)} {_shown(old)} there, {_shown(new)} here")
    if current.plan_id != plan_id:
        diffs.extend(_plan_differences(layout.plan_dir(current.plan_id) / "plan.json", spec, name_of))
    diffs = list(dict.fromkeys(diffs))  # max_length is in the contract and the plan: named once
    raise ConfigError(
        f"cache root {layout.root} was initialised with another capture contract or plan "
        f"(differs in: {'; '.join(diffs)}); use a fresh --cache directory or the original settings")


def _shown(value) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _plan_differences(plan_json, spec, name_of) -> list[str]:
    """The plan settings that differ between the root's plan (its ``plan.json`` ``spec``) and ``spec``; when
    none does (or either is unknown), the settings that decide a plan."""
    names = ", ".join(name_of(s) for s in PLAN_SETTINGS)
    try:
        there = msgspec.json.decode(plan_json.read_bytes()).get("spec") or {}
    except (OSError, msgspec.DecodeError, AttributeError):
        there = None
    if spec is None or not isinstance(there, dict):
        return [f"the plan ({names}, the dataset's contents and the target's tokenizer decide it)"]
    there, here = _plan_doc(there), _plan_doc(spec)
    mixed = bool(there.get("sources") or here.get("sources"))

    def value(doc: dict, setting: str):
        if setting == "sources" and mixed and not doc.get("sources"):  # the other side's sources vs this dataset
            return doc.get("dataset", "sharegpt")
        return doc.get(setting, _PLAN_DEFAULTS.get(setting))

    settings = [s for s in PLAN_SETTINGS if not (mixed and s == "dataset")]  # a dataset file is one source
    out = [f"{name_of(s)} {_shown(value(there, s))} there, {_shown(value(here, s))} here" for s in settings
           if value(there, s) != value(here, s)]
    return out or [f"the plan (the same {names}, but the dataset file's contents, the target's tokenizer or the "
                   "way this artcache version plans changed)"]


def _plan_doc(spec) -> dict:
    """A plan spec (a :class:`~artcache.plan.PlanSpec`, or the dict a ``plan.json`` holds) as the JSON document it
    is saved as (lists, not tuples), a dataset file given as its one source (:func:`artcache.plan.as_sources`);
    a dict that is no valid spec (another artcache version's) is returned as it is."""
    from artcache.plan import PlanSpec, as_sources  # here: the plan module imports torch

    if isinstance(spec, dict):
        try:
            spec = msgspec.convert(spec, PlanSpec)
        except (msgspec.ValidationError, ArtcacheError):
            return spec
    return msgspec.json.decode(msgspec.json.encode(as_sources(spec)))


def init_settings(layout: CacheLayout, settings: RootSettings) -> RootSettings:
    """Write ``artcache.json`` if absent; if present it must equal ``settings``.

    Call under the root lock. Raises ConfigError when the root holds another plan or contract.
    """
    if layout.settings.is_file():
        current = load_settings(layout)
        check_compatible(current, settings.contract, settings.plan_id, layout)
        return current
    doc = sealed(msgspec.json.decode(msgspec.json.encode(msgspec.structs.replace(settings, digests=None))))
    atomic_write(layout.settings, [msgspec.json.format(msgspec.json.encode(doc))], layout.tmp)
    return settings
