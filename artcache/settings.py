"""``artcache.json``: the settings every process sharing a cache root must agree on."""

from __future__ import annotations

import msgspec

from artcache import FORMAT_VERSION
from artcache.contract import CaptureContract
from artcache.errors import CacheRootError, ConfigError
from artcache.fsio import atomic_write
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
    """

    format_version: int = FORMAT_VERSION
    plan_id: str
    contract: CaptureContract
    target_path: str
    heartbeat_timeout_s: float = 30.0
    lock_stripes: int = 4096
    payload: PayloadSpec | None = None


def load_settings(layout: CacheLayout) -> RootSettings:
    """Read and validate ``artcache.json``.

    Raises:
        CacheRootError: the root is missing or uninitialised, the file is unreadable, or it was
            written by another format version.
    """
    layout.require()
    try:
        settings = msgspec.json.decode(layout.settings.read_bytes(), type=RootSettings)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CacheRootError(f"{layout.settings} is invalid: {exc}") from exc
    if settings.format_version != FORMAT_VERSION:
        raise CacheRootError(
            f"{layout.settings} has format {settings.format_version}; this artcache reads "
            f"format {FORMAT_VERSION}: use a new cache root")
    return settings


def check_compatible(current: RootSettings, contract: CaptureContract, plan_id: str, layout: CacheLayout) -> None:
    """Raise ConfigError naming the differing fields if the root holds another contract or plan."""
    if current.contract == contract and current.plan_id == plan_id:
        return
    diff = [f for f in CaptureContract.__struct_fields__ if getattr(current.contract, f) != getattr(contract, f)]
    if current.plan_id != plan_id:
        diff.append("plan_id")
    raise ConfigError(
        f"cache root {layout.root} was initialised with another capture contract or plan "
        f"(differs in: {', '.join(diff)}); use a fresh --cache directory or the original settings")


def init_settings(layout: CacheLayout, settings: RootSettings) -> RootSettings:
    """Write ``artcache.json`` if absent; if present it must equal ``settings``.

    Call under the root lock. Raises ConfigError when the root holds another plan or contract.
    """
    if layout.settings.is_file():
        current = load_settings(layout)
        check_compatible(current, settings.contract, settings.plan_id, layout)
        return current
    atomic_write(layout.settings, [msgspec.json.format(msgspec.json.encode(settings))], layout.tmp)
    return settings
