"""Where an artifact's bytes live: the payload store of a cache root (the narrow seam below ``store``).

A cache root's *control plane* is always the POSIX directory (``artcache.json``, the plan, registrations,
windows, leases, journals, locks). The *payload* — each artifact's tensors — lives in one of two places,
chosen when the root is created and recorded in ``artcache.json`` (:attr:`RootSettings.payload
<artcache.settings.RootSettings>`), so every process of the root uses the same one without a flag:

==========================  ======================================================================
``posix`` (default)         ``objects/<ab>/<fp>.safetensors`` in the root: :mod:`artcache.store`'s
                            own file code, unchanged
``mooncake://HOST:PORT``    the same safetensors bytes in Mooncake Store under ``<namespace>/<fp>``,
                            plus a small manifest ``objects/<ab>/<fp>.manifest`` in the root
                            (:mod:`artcache.payload_mooncake`, docs/scale-out.md)
==========================  ======================================================================

The seam is at the level of bytes (:class:`RemotePayloads`): :mod:`artcache.store` keeps the artifact
codec and all its checks, encodes before a remote ``put`` and verifies after a remote ``get``, so a
change to the format or its checks applies to both. Each of store's public functions asks
:func:`remote_for` first; a POSIX root takes today's code path.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from artcache.errors import ConfigError

if TYPE_CHECKING:
    from artcache.layout import CacheLayout

#: ``--payload`` values naming the in-root backend
POSIX_NAMES = ("posix",)
_MOONCAKE = re.compile(r"^mooncake://(?P<host>[A-Za-z0-9_.-]{1,253}|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})$")


class PayloadSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A root's remote payload store, as recorded in ``artcache.json``.

    Attributes:
        url: ``mooncake://HOST:PORT`` (the Mooncake master's RPC address; every node must reach it).
        namespace: key prefix of this root's payloads (``artcache-<16 hex>``, random at creation), so
            roots sharing one master never share or remove each other's keys.
    """

    url: str
    namespace: str


def parse_payload_url(text: str) -> str | None:
    """``--payload`` / ``cache.payload`` → the normalised URL of a remote store, or None for ``posix``.

    Accepted: ``posix`` and ``mooncake://HOST:PORT`` (host name, IPv4 or bracketed IPv6; port 1-65535).

    Raises:
        ConfigError: naming the value and what is accepted.
    """
    value = (text or "").strip()
    if value in POSIX_NAMES:
        return None
    m = _MOONCAKE.fullmatch(value)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ConfigError(f"--payload {text!r} is not accepted: use posix (artifacts in the cache root) or "
                          "mooncake://HOST:PORT (the Mooncake master's RPC address, e.g. mooncake://127.0.0.1:50051)")
    return f"mooncake://{m['host']}:{int(m['port'])}"


def new_spec(url: str) -> PayloadSpec:
    """The spec a new root records for ``url`` (a fresh random namespace)."""
    return PayloadSpec(url=url, namespace=f"artcache-{secrets.token_hex(8)}")


def describe(spec: PayloadSpec | None) -> str:
    """``posix`` or the spec's URL (for messages)."""
    return "posix" if spec is None else spec.url


class RemotePayloads(Protocol):
    """A remote payload store of one cache root, at the level of bytes (the seam below :mod:`artcache.store`,
    which keeps the artifact codec and every check: validation, encoding, content hash, token check).

    ``fp`` is a fingerprint; sizes are bytes. Errors: ``ArtifactMissing`` (not published: a demand miss),
    ``PayloadUnavailable`` (published, not servable now: a retried miss), ``IntegrityError`` (bad manifest
    or bytes: the caller quarantines), ``PublishError`` (nothing published; ``retryable``).
    """

    def put(self, fp: str, parts: list, *, durable: bool = True) -> int:
        """Publish the artifact bytes ``parts`` (safetensors header, then data chunks); the bytes written."""
        ...

    def get(self, fp: str, *, pin: bool = False, repair: bool = True):
        """The published bytes of ``fp`` (a uint8 buffer), checked against what was published."""
        ...

    def exists(self, fp: str) -> bool: ...

    def list_objects(self) -> dict[str, int]: ...

    def remove(self, fp: str) -> int: ...

    def quarantine(self, fp: str) -> bool: ...

    def maintain(self) -> dict[str, int]:
        """Housekeeping of the producer's eviction pass; returns the artifacts found lost (fp → bytes)."""
        ...

    def close(self, drain_s: float | None = None) -> None: ...


class _RootBits(msgspec.Struct):
    """The two fields of ``artcache.json`` the dispatch needs (unknown fields ignored here; load_settings
    validates the whole file)."""

    payload: PayloadSpec | None = None
    lock_stripes: int = 4096


_lock = threading.Lock()
#: root path → (pid, artcache.json identity, backend or None)
_roots: dict[Path, tuple[int, tuple[int, int, int], object | None]] = {}


def remote_for(layout: CacheLayout):
    """The remote payload backend of ``layout``'s root, or None when its artifacts are files in the root
    (a POSIX root, or a directory without ``artcache.json``: tests that publish into a bare layout).

    One backend per root and process, reopened when ``artcache.json`` is replaced (a root removed and
    created again at the same path) and in a forked child (a Mooncake client is never shared across a
    fork). Costs one ``stat`` per call once open. Touches no store: a backend connects on first use
    (``exists``/``list_objects`` need only the root), and then raises ConfigError without the client
    library, PayloadStoreError when the store does not answer.
    """
    path = layout.root / "artcache.json"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_mtime_ns)
    pid = os.getpid()
    hit = _roots.get(layout.root)
    if hit is not None and hit[0] == pid and hit[1] == ident:
        return hit[2]
    with _lock:
        hit = _roots.get(layout.root)
        if hit is not None and hit[0] == pid and hit[1] == ident:
            return hit[2]
        try:
            bits = msgspec.json.decode(path.read_bytes(), type=_RootBits)
        except (msgspec.DecodeError, msgspec.ValidationError, FileNotFoundError):
            return None  # load_settings reports an unreadable artcache.json; the files path is harmless
        backend = None
        if bits.payload is not None:
            from artcache.payload_mooncake import MooncakePayloads

            backend = MooncakePayloads(layout, bits.payload, lock_stripes=bits.lock_stripes)
        old = _roots.get(layout.root)
        _roots[layout.root] = (pid, ident, backend)
    if old is not None and old[0] == pid and old[2] is not None:
        old[2].close(drain_s=0.0)  # a root replaced under this process: its old store is not ours to drain
    return backend


def close_all() -> None:
    """Close every remote backend this process opened (and their store clients); safe to call twice."""
    with _lock:
        mine = [v[2] for v in _roots.values() if v[0] == os.getpid() and v[2] is not None]
        _roots.clear()
    for backend in mine:
        backend.close()
    from artcache import payload_mooncake

    payload_mooncake.close_clients()


__all__ = ["POSIX_NAMES", "PayloadSpec", "RemotePayloads", "close_all", "describe", "new_spec", "parse_payload_url",
           "remote_for"]
