"""Where an artifact's bytes live: the payload backend of a cache root (the narrow seam below ``store``).

A cache root's *control plane* is always the POSIX directory (``artcache.json``, the plan, registrations,
windows, leases, journals, locks). The *payload* — each artifact's tensors — lives in one of two places,
chosen when the root is created and recorded in ``artcache.json`` (:attr:`RootSettings.payload
<artcache.settings.RootSettings>`), so every process of the root uses the same one without a flag:

==========================  ======================================================================
``posix`` (default)         ``objects/<ab>/<fp>.safetensors`` in the root (:mod:`artcache.store`)
``mooncake://HOST:PORT``    the same safetensors bytes in Mooncake Store under ``<namespace>/<fp>``,
                            plus a small manifest ``objects/<ab>/<fp>.manifest`` in the root
                            (:mod:`artcache.payload_mooncake`, docs/scale-out.md)
==========================  ======================================================================

:mod:`artcache.store`'s public functions (``publish``, ``exists``, ``read``, ``verify``, ``quarantine``,
``remove``, ``list_objects``, ``maintain``) keep their signatures: each asks :func:`remote_for` first and
hands the call to the root's remote backend when it has one; a POSIX root takes today's code path
unchanged. :class:`PayloadBackend` is that interface; :class:`PosixPayloads` is the POSIX
implementation as an object (the same functions), for code that wants the seam explicitly (tests, bench).
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

if TYPE_CHECKING:  # typing only: store imports this module
    import torch

    from artcache.contract import CaptureContract
    from artcache.layout import CacheLayout
    from artcache.store import Artifact

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


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of a ``mooncake://HOST:PORT`` URL (brackets of an IPv6 host removed)."""
    m = _MOONCAKE.fullmatch(url)
    if m is None:
        raise ConfigError(f"not a mooncake://HOST:PORT URL: {url!r}")
    return m["host"].strip("[]"), int(m["port"])


def new_spec(url: str) -> PayloadSpec:
    """The spec a new root records for ``url`` (a fresh random namespace)."""
    return PayloadSpec(url=url, namespace=f"artcache-{secrets.token_hex(8)}")


def describe(spec: PayloadSpec | None) -> str:
    """``posix`` or the spec's URL (for messages)."""
    return "posix" if spec is None else spec.url


class PayloadBackend(Protocol):
    """What a payload backend does for one cache root (the functions of :mod:`artcache.store`, bound).

    Sizes are bytes; ``fp`` is a fingerprint (40 lower-case hex digits); tensors as in
    :func:`artcache.store.publish`. Errors: ``ArtifactMissing`` (not published: a demand miss),
    ``IntegrityError`` (failed a check; quarantined), ``PublishError`` (nothing published; ``retryable``).
    """

    def publish(self, fp: str, contract: CaptureContract, tensors: dict[str, torch.Tensor], *,
                durable: bool = True, values_checked: bool = False, verify_tokens: bool = False) -> int: ...

    def exists(self, fp: str) -> bool: ...

    def read(self, fp: str, contract: CaptureContract, *, pin: bool = False,
             verify_tokens: bool = False) -> Artifact: ...

    def verify(self, fp: str, contract: CaptureContract, *, verify_tokens: bool = True) -> str | None: ...

    def quarantine(self, fp: str) -> bool: ...

    def remove(self, fp: str) -> int: ...

    def list_objects(self) -> dict[str, int]: ...

    def maintain(self) -> dict[str, int]:
        """Housekeeping of the producer's eviction pass; returns the artifacts found lost (fp → bytes)."""
        ...


class PosixPayloads:
    """The POSIX backend as an object: :mod:`artcache.store`'s functions on one layout (today's behaviour)."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout

    def publish(self, fp, contract, tensors, *, durable=True, values_checked=False, verify_tokens=False) -> int:
        from artcache import store

        return store.publish(self.layout, fp, contract, tensors, durable=durable, values_checked=values_checked,
                             verify_tokens=verify_tokens)

    def exists(self, fp: str) -> bool:
        from artcache import store

        return store.exists(self.layout, fp)

    def read(self, fp, contract, *, pin=False, verify_tokens=False):
        from artcache import store

        return store.read(self.layout, fp, contract, pin=pin, verify_tokens=verify_tokens)

    def verify(self, fp, contract, *, verify_tokens=True):
        from artcache import store

        return store.verify(self.layout, fp, contract, verify_tokens=verify_tokens)

    def quarantine(self, fp: str) -> bool:
        from artcache import store

        return store.quarantine(self.layout, fp)

    def remove(self, fp: str) -> int:
        from artcache import store

        return store.remove(self.layout, fp)

    def list_objects(self) -> dict[str, int]:
        from artcache import store

        return store.list_objects(self.layout)

    def maintain(self) -> dict[str, int]:
        return {}


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
    fork). Costs one ``stat`` per call once open.

    Raises:
        ConfigError: ``artcache.json`` names a payload store this install cannot use (e.g. Mooncake
            without the ``mooncake-transfer-engine-non-cuda`` package).
        PayloadStoreError: the store is unreachable.
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


def open_backend(layout: CacheLayout) -> PayloadBackend:
    """The root's backend as an object: its remote backend, or :class:`PosixPayloads`."""
    return remote_for(layout) or PosixPayloads(layout)


def close_all() -> None:
    """Close every remote backend this process opened (and their store clients); safe to call twice."""
    with _lock:
        mine = [v[2] for v in _roots.values() if v[0] == os.getpid() and v[2] is not None]
        _roots.clear()
    for backend in mine:
        backend.close()
    from artcache import payload_mooncake

    payload_mooncake.close_clients()


__all__ = ["POSIX_NAMES", "PayloadBackend", "PayloadSpec", "PosixPayloads", "close_all", "describe", "host_port",
           "new_spec", "open_backend", "parse_payload_url", "remote_for"]
