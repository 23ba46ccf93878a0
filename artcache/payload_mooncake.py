"""Mooncake Store as a cache root's payload backend: tensors in Mooncake, the control plane on POSIX.

The root's directory keeps everything but the tensors: plan, contract, registrations, windows, leases,
journals, locks, and one small **manifest** per published artifact, ``objects/<ab>/<fp>.manifest``
(:class:`Manifest`: shapes, dtypes, payload size, payload hash, the store epoch). The **payload** is the
artifact's safetensors encoding (exactly the bytes a POSIX root would hold in ``<fp>.safetensors``), one
Mooncake object under the key ``<namespace>/<fp>``, put with ``ReplicateConfig(with_hard_pin=True)``:
Mooncake never evicts it (its LRU is off for these keys; a full store refuses puts, which is
back-pressure). artcache's windows and leases alone decide its lifetime.

Protocols (docs/scale-out.md has the why):

* **Publish** (:meth:`MooncakePayloads.publish`): create the intent marker ``<fp>.pending``; ``upsert`` the
  payload from a registered staging buffer (``upsert``, not ``put``: a writer killed mid-put leaves a key
  that is unreadable for 30 s, and ``put`` on an existing key keeps the old value; ``upsert`` takes it
  over); then write the manifest by temp file + fsync + rename (:func:`artcache.fsio.atomic_write`); then
  remove the marker. A reader sees no manifest, or a manifest whose payload is complete.
* **Read**: manifest → ``get_into`` a fresh buffer of the manifest's size → accept only if the bytes hash
  to the manifest's ``payload_hash`` and pass every check of :func:`artcache.store.read` (content hash,
  fingerprint, contract, shapes, token ids). A key Mooncake no longer has (master restart, holder gone)
  makes the manifest a ``.pending`` marker and the read a miss (the producer recaptures); a transient
  failure (master unreachable, replica not ready, transfer failed) is :class:`PayloadUnavailable`, a miss
  that is retried.
* **Evict** (:meth:`MooncakePayloads.remove`): rename the manifest to ``<fp>.pending`` (readers now miss),
  then remove the key. "Not found" is success; a key under Mooncake's read lease (``-706``, 10 s after the
  last read by default) or half put (``-703``) stays marked and is removed by a later
  :meth:`~MooncakePayloads.maintain` pass: waited out, never an error. A payload is removed only while its
  fingerprint's capture lock is free and no manifest names it, so a recapture racing an eviction keeps
  its new payload.
* **Master restart**: the producer keeps a hard-pinned sentinel ``<namespace>/epoch`` and stamps every
  manifest with it. A master restart forgets every key (the holders keep their memory but the master
  their metadata); :meth:`~MooncakePayloads.maintain` notices the sentinel gone, starts a new epoch and
  turns every manifest of the old one into a miss (returned as lost: the producer journals them as
  evictions and recaptures on demand). Readers find the same per key without waiting for it.

Bytes live in the memory of the process that mounted a Mooncake segment: ``artcache payload-holder``
(:func:`run_holder`) mounts one and does nothing else, so producers and consumers (segment size 0) can
exit or be killed without losing a payload. Mooncake return codes are those of its ``types.h``
(``ErrorCode``); the ones handled are named below.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import msgspec

from artcache import FORMAT_VERSION
from artcache.crashpoints import crash_point
from artcache.errors import (
    ArtifactMissing,
    ConfigError,
    IntegrityError,
    PayloadStoreError,
    PayloadUnavailable,
    PublishError,
)
from artcache.fsio import atomic_write
from artcache.hashing import digest_bytes
from artcache.layout import CacheLayout, check_fingerprint, check_real_dir, make_dir, open_nofollow, unique_suffix
from artcache.locking import Timeout, cache_lock

log = logging.getLogger("artcache.payload")

# Mooncake ErrorCode values (mooncake-store/include/types.h) that artcache handles by name
NO_AVAILABLE_HANDLE = -200  #: no segment has room (hard-pinned objects fill it): back-pressure
INVALID_PARAMS = -600  #: e.g. a buffer smaller than the object
ILLEGAL_CLIENT = -601  #: the master dropped this client (no heartbeat within its --client_ttl); it re-registers
REPLICA_IS_NOT_READY = -703  #: a put is in progress, or its writer died mid-put (30 s)
OBJECT_NOT_FOUND = -704  #: no such key
OBJECT_HAS_LEASE = -706  #: a read lease (default 10 s after a read) blocks the remove
LEASE_EXPIRED = -707  #: the read lease ran out before the transfer completed
TRANSFER_FAIL = -800  #: the holder of the bytes went away mid-transfer
RPC_FAIL = -900  #: the master does not answer (after ~4 s)
RPC_TIMEOUT = -901

_NAMES = {NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (the store is full)", INVALID_PARAMS: "INVALID_PARAMS",
          ILLEGAL_CLIENT: "ILLEGAL_CLIENT (the master dropped this client)",
          REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY", OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
          OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", LEASE_EXPIRED: "LEASE_EXPIRED", TRANSFER_FAIL: "TRANSFER_FAIL",
          RPC_FAIL: "RPC_FAIL (master unreachable)", RPC_TIMEOUT: "RPC_TIMEOUT"}
#: put results after which the same put can succeed later (space freed, master back, writer's key taken over)
TRANSIENT_PUT = frozenset({NO_AVAILABLE_HANDLE, ILLEGAL_CLIENT, REPLICA_IS_NOT_READY, TRANSFER_FAIL, RPC_FAIL,
                           RPC_TIMEOUT})
#: get results after which a later get of the same published key can succeed
TRANSIENT_GET = frozenset({ILLEGAL_CLIENT, REPLICA_IS_NOT_READY, LEASE_EXPIRED, TRANSFER_FAIL, RPC_FAIL,
                           RPC_TIMEOUT})
#: remove results that leave the key for a later pass (waited out, not an error)
DEFERRED_REMOVE = frozenset({OBJECT_HAS_LEASE, ILLEGAL_CLIENT, REPLICA_IS_NOT_READY, RPC_FAIL, RPC_TIMEOUT})

#: seconds a publish retries a transient put (a full store while evictions wait out read leases, a
#: master restart) before raising PublishError
PUT_WAIT_S = 30.0
#: seconds between the producer's checks of the epoch sentinel
EPOCH_CHECK_S = 2.0
#: seconds between attempts to remove one deferred key
PENDING_RETRY_S = 0.5
#: seconds a closing backend waits for removals deferred by read leases (Mooncake's default lease is 10 s)
DRAIN_S = 15.0
#: the client's own transfer buffer (artcache reads and writes through registered buffers of its own)
LOCAL_BUFFER_BYTES = 16 << 20
#: largest payload a manifest may name (a guard against a corrupt manifest, not a limit in practice)
MAX_PAYLOAD_BYTES = 1 << 40
MANIFEST_SUFFIX = ".manifest"
PENDING_SUFFIX = ".pending"
_FP_NAME = re.compile(r"[0-9a-f]{16,128}")


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of a ``mooncake://HOST:PORT`` URL (validated by :func:`artcache.payload.parse_payload_url`;
    brackets of an IPv6 host removed)."""
    host, _, port = url.removeprefix("mooncake://").rpartition(":")
    return host.strip("[]"), int(port)


def _header(first: memoryview, fp: str) -> dict:
    """The JSON header of a safetensors encoding whose first part is ``first`` (8-byte LE length + JSON)."""
    if first.nbytes < 8:
        raise IntegrityError(f"artifact {fp}: its encoding is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", first[:8])
    if first.nbytes < 8 + n:
        raise IntegrityError(f"artifact {fp}: its first part does not hold the whole safetensors header")
    try:
        header = json.loads(bytes(first[8:8 + n]))
    except ValueError as exc:
        raise IntegrityError(f"artifact {fp}: unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise IntegrityError(f"artifact {fp}: the safetensors header is not an object")
    return header


def code_name(rc: int) -> str:
    """``-704`` → ``'-704 OBJECT_NOT_FOUND'`` (the Mooncake ErrorCode name where artcache knows it)."""
    return f"{rc} {_NAMES.get(rc, 'see Mooncake ErrorCode')}"


# ---- sizes ----------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "--size") -> int:
    """``"4GiB"`` / ``"512M"`` / ``"1048576"`` → bytes (K, M, G, T are powers of 1024 with or without ``i``).
    ``what``: the flag or key named in the error.

    Raises:
        ConfigError: naming ``what``, the value and what is accepted.
    """
    m = _SIZE.fullmatch(str(text))
    if m is None or float(m[1]) <= 0:
        raise ConfigError(f"{what} {text!r} is not accepted: a positive number of bytes, optionally with K, M, G or T "
                          "(powers of 1024), e.g. 4GiB or 512M")
    return int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper() or " "))


# ---- the client -----------------------------------------------------------------------------------------

def local_address(host: str, port: int) -> str:
    """The address of this host that other Mooncake clients reach it by: ``ARTCACHE_MOONCAKE_LOCAL_HOST``
    when set, 127.0.0.1 for a master on loopback, else the source address of the route to the master (a UDP
    ``connect`` sends nothing)."""
    env = os.environ.get("ARTCACHE_MOONCAKE_LOCAL_HOST")
    if env:
        return env
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _probe(host: str, port: int, timeout_s: float = 3.0) -> None:
    """Fail fast when nothing listens at the master's address (Mooncake's own setup retries for ~90 s)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise PayloadStoreError(f"no Mooncake master answers at {host}:{port} ({exc.strerror or exc}); start "
                                f"`mooncake_master --rpc_address={host} --rpc_port={port}` and an `artcache "
                                "payload-holder` first (docs/scale-out.md)") from None


def _import_store():
    """``mooncake.store`` (its native library logs INFO lines to stderr at client setup; GLOG_* variables do
    not silence them)."""
    try:
        import mooncake.store as ms
    except ImportError as exc:
        raise ConfigError("this cache root keeps its payloads in Mooncake, which needs `python3 -m pip install "
                          "mooncake-transfer-engine-non-cuda` (and `apt-get install libibverbs1`): "
                          f"{exc}") from None
    return ms


class MooncakeClient:
    """One ``MooncakeDistributedStore`` connected over TCP to one master (``P2PHANDSHAKE``: no metadata server).

    Args:
        url: ``mooncake://HOST:PORT``.
        segment_bytes: memory this process mounts for the store (0 for producers and consumers: their exit
            loses nothing; a payload holder mounts the segment).
        local_buffer_bytes: the client's own transfer buffer (small objects: the epoch sentinel).

    Raises:
        PayloadStoreError: the master does not answer, or setup failed.
        ConfigError: the ``mooncake`` package is not installed.
    """

    def __init__(self, url: str, *, segment_bytes: int = 0, local_buffer_bytes: int = LOCAL_BUFFER_BYTES) -> None:
        self.url = url
        host, port = host_port(url)
        _probe(host, port)
        local = local_address(host, port)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local)  # else Mooncake's data path binds eth0
        ms = _import_store()
        self._store = ms.MooncakeDistributedStore()
        rc = self._store.setup(local, "P2PHANDSHAKE", int(segment_bytes), int(local_buffer_bytes), "tcp", "",
                               f"{host}:{port}")
        if rc != 0:
            raise PayloadStoreError(f"Mooncake client setup against {host}:{port} failed with {code_name(rc)}")
        self.hard_pin = ms.ReplicateConfig()
        self.hard_pin.with_hard_pin = True
        self.pid = os.getpid()
        self._tls = threading.local()
        self._poisoned: list = []  # buffers a failed transfer may still write into: never freed early
        self._closed = False

    # staging buffers (one per thread, registered once, grown when needed)
    def staging(self, nbytes: int):
        """A registered uint8 tensor of at least ``nbytes`` bytes, private to this thread."""
        import torch

        buf = getattr(self._tls, "buf", None)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._store.unregister_buffer(buf.data_ptr())
            buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
            rc = self._store.register_buffer(buf.data_ptr(), buf.numel())
            if rc != 0:
                raise PublishError(f"registering a {buf.numel()} B staging buffer with Mooncake failed "
                                   f"({code_name(rc)})", retryable=False)
            self._tls.buf = buf
        return buf

    def upsert_from(self, key: str, buf, nbytes: int) -> int:
        return self._store.upsert_from(key, buf.data_ptr(), nbytes, self.hard_pin)

    def get_into(self, key: str, buf) -> int:
        """Read ``key`` into the uint8 tensor ``buf`` (exactly its size); the bytes read or a negative code."""
        n = buf.numel()
        rc = self._store.register_buffer(buf.data_ptr(), n)
        if rc != 0:
            return rc
        got = self._store.get_into(key, buf.data_ptr(), n)
        if got == TRANSFER_FAIL:  # the transfer may still land in buf after the call returns: keep buf alive
            self._poisoned = [*self._poisoned[-15:], buf]
        else:
            self._store.unregister_buffer(buf.data_ptr())
        return got

    def get_size(self, key: str) -> int:
        return self._store.get_size(key)

    def get_small(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def put_small(self, key: str, value: bytes) -> int:
        """``put`` (not upsert): on an existing key it keeps the old value, so racing writers agree."""
        return self._store.put(key, value, self.hard_pin)

    def remove(self, key: str) -> int:
        return self._store.remove(key)

    def close(self) -> None:
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._store.close()


_clients_lock = threading.Lock()
_clients: dict[tuple[int, str], MooncakeClient] = {}


def client_for(url: str) -> MooncakeClient:
    """This process's client of ``url`` (segment size 0), created on first use; never one inherited over a fork."""
    key = (os.getpid(), url)
    with _clients_lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = MooncakeClient(url)
        return c


def close_clients() -> None:
    with _clients_lock:
        mine = [c for (pid, _), c in _clients.items() if pid == os.getpid()]
        _clients.clear()
    for c in mine:
        c.close()


# ---- manifests ------------------------------------------------------------------------------------------

class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dtype: str  # safetensors dtype name: BF16, F16, F32, I32, U8, ...
    shape: list[int]


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``objects/<ab>/<fp>.manifest``: one published artifact whose payload is in Mooncake.

    Attributes:
        artcache_format: :data:`artcache.FORMAT_VERSION`. fingerprint, contract_id: as in the payload.
        key: the Mooncake key (``<namespace>/<fp>``). nbytes: payload size in bytes.
        payload_hash: xxh3-128 (32 hex) of all ``nbytes`` payload bytes; a reader accepts nothing else.
        content_hash: the payload's own safetensors ``content_hash`` (of its data section).
        tensors: name → dtype and shape of every tensor in the payload.
        epoch: the store epoch (sentinel value) the payload was put in.
    """

    artcache_format: int
    fingerprint: str
    contract_id: str
    key: str
    nbytes: int
    payload_hash: str
    content_hash: str
    tensors: dict[str, TensorSpec]
    epoch: str


class MooncakePayloads:
    """The payload backend of one cache root whose ``artcache.json`` records ``payload = mooncake://...``.

    Opened by :func:`artcache.payload.remote_for` (one per root and process); the Mooncake client is
    opened on first use of the store, so ``exists``/``list_objects`` (``artcache inspect``) need only the
    POSIX root.
    """

    def __init__(self, layout: CacheLayout, spec, *, lock_stripes: int = 4096) -> None:
        """``spec``: the root's :class:`artcache.payload.PayloadSpec` (its ``url`` and ``namespace``)."""
        self.layout = layout
        self.spec = spec
        self.lock_stripes = lock_stripes
        self.epoch: str | None = None
        self._next_epoch_check = 0.0
        self._pending: dict[str, float] = {}  # fp → monotonic time of the next removal attempt
        self._sizes: dict[str, tuple[int, int, int, str]] = {}  # fp → (inode, mtime_ns, nbytes, epoch)
        self._unreachable_logged = False
        self._state = threading.Lock()

    # -- names ------------------------------------------------------------------------------------
    @property
    def client(self) -> MooncakeClient:
        return client_for(self.spec.url)

    def key(self, fp: str) -> str:
        return f"{self.spec.namespace}/{check_fingerprint(fp)}"

    @property
    def sentinel(self) -> str:
        return f"{self.spec.namespace}/epoch"

    def manifest_path(self, fp: str) -> Path:
        return self.layout.objects / fp[:2] / f"{check_fingerprint(fp)}{MANIFEST_SUFFIX}"

    def pending_path(self, fp: str) -> Path:
        return self.layout.objects / fp[:2] / f"{check_fingerprint(fp)}{PENDING_SUFFIX}"

    # -- put ------------------------------------------------------------------------------------
    def put(self, fp: str, parts, *, durable: bool = True) -> int:
        """Publish ``fp``'s artifact bytes (``parts``: the safetensors header, then the data chunks, as
        :func:`artcache.store.publish` encodes them): intent marker, hard-pinned ``upsert`` of the payload,
        then the manifest by temp file + fsync + rename. Returns the payload size in bytes.

        Raises:
            PublishError: nothing published (the marker stays and a later :meth:`maintain` removes any
                half-put key); ``retryable`` for transient store states. A put the store keeps refusing
                for :data:`PUT_WAIT_S` names the Mooncake code (``-200``: the holders are full).
        """
        views = [memoryview(p).cast("B") for p in parts]
        nbytes = sum(v.nbytes for v in views)
        header = _header(views[0], fp)
        try:
            shard = self.layout.objects / fp[:2]
            make_dir(shard, exist_ok=True)  # 0700, or 2770 in a group-shared root
            check_real_dir(shard)
        except FileNotFoundError as exc:
            raise PublishError(f"writing {fp} failed: {exc}", fingerprint=fp, errno_=exc.errno) from exc
        client = self._client_or_publish_error(fp)
        if self.epoch is None:  # adopt the store's epoch (withdrawing stale manifests is maintain()'s job)
            self.epoch = self._epoch_now()
            if self.epoch is None:
                raise PublishError(f"publishing {fp}: the Mooncake store {self.spec.url} does not answer",
                                   fingerprint=fp, retryable=True)
        buf = client.staging(nbytes)
        view = buf.numpy()
        off = 0
        for v in views:
            view[off:off + v.nbytes] = v
            off += v.nbytes
        meta = header.get("__metadata__") or {}
        manifest = Manifest(
            artcache_format=FORMAT_VERSION, fingerprint=fp, contract_id=str(meta.get("contract_id", "")),
            key=self.key(fp), nbytes=nbytes, payload_hash=digest_bytes(memoryview(view)[:nbytes]),
            content_hash=str(meta.get("content_hash", "")),
            tensors={k: TensorSpec(v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"},
            epoch=self.epoch)
        # the intent marker first: a writer killed after the put leaves a marker, and the next maintain pass
        # removes the orphaned payload (unless a manifest names it by then)
        self._touch(self.pending_path(fp), fp)
        try:
            self._put(client, fp, buf, nbytes)
            crash_point("publish.after-payload")
            atomic_write(self.manifest_path(fp), [msgspec.json.encode(manifest)], self.layout.tmp, durable=durable,
                         fingerprint=fp)
        except BaseException:
            self._defer(fp)  # the marker stays; a later maintain() removes whatever the put left
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pending_path(fp))
        return nbytes

    def _client_or_publish_error(self, fp: str) -> MooncakeClient:
        try:
            return self.client
        except PayloadStoreError as exc:
            raise PublishError(f"publishing {fp}: {exc}", fingerprint=fp, retryable=True) from exc

    def _touch(self, path: Path, fp: str) -> None:
        try:
            os.close(open_nofollow(path, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as exc:
            raise PublishError(f"writing the intent marker of {fp} failed: {exc.strerror or exc}", fingerprint=fp,
                               errno_=exc.errno) from exc

    def _put(self, client: MooncakeClient, fp: str, buf, nbytes: int) -> None:
        deadline = time.monotonic() + PUT_WAIT_S
        delay = 0.05
        while True:
            rc = client.upsert_from(self.key(fp), buf, nbytes)
            if rc == 0:
                return
            if rc not in TRANSIENT_PUT or time.monotonic() >= deadline:
                hint = (": the payload holders' segments are smaller than the live windows need (start a larger "
                        "`artcache payload-holder --size`, or smaller windows)" if rc == NO_AVAILABLE_HANDLE else "")
                raise PublishError(f"Mooncake put of {fp} ({nbytes} B) failed with {code_name(rc)}"
                                   f"{' for ' + str(int(PUT_WAIT_S)) + ' s' if rc in TRANSIENT_PUT else ''}{hint}",
                                   fingerprint=fp, retryable=rc in TRANSIENT_PUT)
            if rc == NO_AVAILABLE_HANDLE:  # room may come from removals waiting out a read lease
                self._retry_pending(time.monotonic(), force=True)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- get --------------------------------------------------------------------------------------
    def exists(self, fp: str) -> bool:
        return self.manifest_path(fp).is_file()

    def _load_manifest(self, fp: str) -> Manifest:
        """The manifest of ``fp``. ArtifactMissing if absent; IntegrityError if it is not a valid manifest of fp."""
        path = self.manifest_path(fp)
        try:
            check_real_dir(path.parent)
            fd = open_nofollow(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ArtifactMissing(f"artifact {fp} is not published") from exc
        try:
            raw = os.read(fd, 1 << 20)
        finally:
            os.close(fd)
        try:
            m = msgspec.json.decode(raw, type=Manifest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise IntegrityError(f"manifest of {fp} is unreadable: {exc}") from exc
        if m.fingerprint != fp or m.key != self.key(fp):
            raise IntegrityError(f"manifest of {fp} names fingerprint {m.fingerprint!r} / key {m.key!r}")
        if m.artcache_format != FORMAT_VERSION:
            raise IntegrityError(f"manifest of {fp} has format {m.artcache_format}, expected {FORMAT_VERSION}")
        if not 8 < m.nbytes <= MAX_PAYLOAD_BYTES:
            raise IntegrityError(f"manifest of {fp} names an impossible payload size {m.nbytes}")
        return m

    def get(self, fp: str, *, pin: bool = False, repair: bool = True):
        """The payload bytes of ``fp`` (a uint8 numpy array over a fresh buffer, page-locked when ``pin``),
        accepted only if they hash to the manifest's ``payload_hash``. The caller checks the artifact itself
        (:func:`artcache.store.read`: content hash, fingerprint, contract, shapes, token ids).

        Raises:
            ArtifactMissing: no manifest; or (``repair``) Mooncake no longer has the key: the manifest is
                withdrawn first, so the producer recaptures it.
            PayloadUnavailable: published, but the store cannot serve it now (retry).
            IntegrityError: the manifest is unreadable, the bytes do not match it, or (not ``repair``) the
                store lost the payload. The caller quarantines.
        """
        import torch

        m = self._load_manifest(fp)
        buf = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=pin)
        try:
            got = self.client.get_into(m.key, buf)
        except PayloadStoreError as exc:
            raise PayloadUnavailable(f"payload of {fp}: {exc}") from exc
        if got == OBJECT_NOT_FOUND:
            if not repair:
                raise IntegrityError(f"artifact {fp}: Mooncake no longer holds its payload (key {m.key})")
            self._withdraw(fp, m)
            raise ArtifactMissing(f"artifact {fp}: Mooncake no longer holds its payload (master restarted or its "
                                  "holder stopped); withdrawn, it is recaptured on demand")
        if got < 0 and got != INVALID_PARAMS:
            raise PayloadUnavailable(f"artifact {fp}: Mooncake get failed with {code_name(got)}; retrying")
        if got != m.nbytes:
            raise IntegrityError(f"payload of {fp} has {got} B, its manifest says {m.nbytes}")
        data = buf.numpy()
        if digest_bytes(memoryview(data)) != m.payload_hash:
            raise IntegrityError(f"payload of {fp} does not match its manifest's payload hash")
        return data

    # -- removal ----------------------------------------------------------------------------------
    def _withdraw(self, fp: str, m: Manifest | None = None) -> int:
        """Rename the manifest to the ``.pending`` marker (readers now miss) and try to remove the key;
        the bytes the manifest named (0 if it was already gone)."""
        path = self.manifest_path(fp)
        if m is None:
            try:
                m = self._load_manifest(fp)
            except ArtifactMissing:
                return 0
            except IntegrityError:
                m = None
        try:
            os.replace(path, self.pending_path(fp))
        except FileNotFoundError:
            return 0
        crash_point("evict.after-rename")
        self._drop_payload(fp)
        if m is not None:
            return m.nbytes
        return self._sizes.get(fp, (0, 0, 0, ""))[2]  # an unreadable manifest: the size last listed

    def remove(self, fp: str) -> int:
        """Evict one artifact: withdraw its manifest, then remove its key (now, or in a later
        :meth:`maintain` pass while a read lease lasts). Returns the payload bytes freed (0 if gone)."""
        return self._withdraw(fp)

    def quarantine(self, fp: str) -> bool:
        """Move a bad manifest to ``quarantine/`` and mark its key for removal; False if it was already gone."""
        try:
            os.replace(self.manifest_path(fp), self.layout.quarantine / f"{fp}.{unique_suffix()}{MANIFEST_SUFFIX}")
        except FileNotFoundError:
            return False
        with contextlib.suppress(OSError):
            os.close(open_nofollow(self.pending_path(fp), os.O_WRONLY | os.O_CREAT, 0o644))
        self._drop_payload(fp)
        return True

    def _drop_payload(self, fp: str) -> bool:
        """Remove ``fp``'s key if nothing publishes it: its capture lock is free and no manifest names it.
        True when settled (removed, already gone, or owned by a new manifest; the marker is unlinked)."""
        lock = cache_lock(self.layout.fingerprint_lock(fp, self.lock_stripes), timeout=0, thread_local=False)
        try:
            lock.acquire()
        except Timeout:  # a producer is capturing (or publishing) a fingerprint of this stripe: later
            return self._defer(fp)
        try:
            if not self.manifest_path(fp).is_file():
                try:
                    rc = self.client.remove(self.key(fp))
                except PayloadStoreError:
                    return self._defer(fp)
                if rc in DEFERRED_REMOVE:
                    return self._defer(fp)
                if rc not in (0, OBJECT_NOT_FOUND):
                    log.warning("removing Mooncake key %s failed with %s; retrying later", self.key(fp), code_name(rc))
                    return self._defer(fp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pending_path(fp))
            with self._state:
                self._pending.pop(fp, None)
            return True
        finally:
            lock.release()

    def _defer(self, fp: str) -> bool:
        with self._state:
            self._pending[fp] = time.monotonic() + PENDING_RETRY_S
        return False

    def _retry_pending(self, now: float, force: bool = False) -> None:
        with self._state:
            due = [fp for fp, t in self._pending.items() if force or t <= now]
        for fp in due:
            self._drop_payload(fp)

    # -- listing and housekeeping -----------------------------------------------------------------
    def list_objects(self) -> dict[str, int]:
        """fp → payload bytes of every manifest (one walk of ``objects/``; manifests are read once each).
        ``.pending`` markers seen on the way are queued for removal by the next :meth:`maintain`."""
        out: dict[str, int] = {}
        seen_pending: list[str] = []
        try:
            shards = list(os.scandir(self.layout.objects))
        except FileNotFoundError:
            return out
        sizes = {}
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(shard.path):
                name = entry.name
                for suffix in (MANIFEST_SUFFIX, PENDING_SUFFIX):
                    if name.endswith(suffix):
                        fp = name[: -len(suffix)]
                        break
                else:
                    continue
                if not _FP_NAME.fullmatch(fp) or shard.name != fp[:2] or not entry.is_file(follow_symlinks=False):
                    continue
                if suffix == PENDING_SUFFIX:
                    seen_pending.append(fp)
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                hit = self._sizes.get(fp)
                if hit is None or hit[:2] != (st.st_ino, st.st_mtime_ns):
                    try:
                        m = self._load_manifest(fp)
                    except (ArtifactMissing, IntegrityError):
                        continue  # gone meanwhile; a bad one is quarantined by its next reader (or fsck)
                    hit = (st.st_ino, st.st_mtime_ns, m.nbytes, m.epoch)
                sizes[fp] = hit
                out[fp] = hit[2]
        self._sizes = sizes
        now = time.monotonic()
        with self._state:
            for fp in seen_pending:
                self._pending.setdefault(fp, now)
        return out

    def maintain(self) -> dict[str, int]:
        """The producer's housekeeping, once per eviction pass: every :data:`EPOCH_CHECK_S`, check the
        epoch sentinel (a master restart makes every manifest of the old epoch a miss: returned, fp →
        bytes, for the producer to journal as evictions); remove the keys of ``.pending`` markers that are
        due (deferred removals, orphans of killed writers)."""
        lost: dict[str, int] = {}
        now = time.monotonic()
        if now >= self._next_epoch_check:
            self._next_epoch_check = now + EPOCH_CHECK_S
            lost = self._check_epoch()
        # deferred removals, and the .pending markers the last list_objects() saw (evict_pass lists objects/
        # every pass, so markers left by killed processes are queued there)
        self._retry_pending(now)
        return lost

    def _epoch_now(self) -> str | None:
        """The store's epoch: the sentinel's value, put fresh when the store has none (a new store, or one that
        forgot every key). None when the store does not answer. Racing processes agree: ``put`` on an existing
        key keeps its value, and a sentinel being put (``-703``) is waited for."""
        deadline = time.monotonic() + 5.0
        try:
            client = self.client
            while True:
                n = client.get_size(self.sentinel)
                if n > 0:
                    value = client.get_small(self.sentinel).decode(errors="replace")
                    if value:
                        return value
                elif n == OBJECT_NOT_FOUND:
                    rc = client.put_small(self.sentinel, secrets.token_hex(8).encode())
                    if rc == 0:
                        continue  # read back what won (ours, or a racing process's)
                elif n not in (REPLICA_IS_NOT_READY, ILLEGAL_CLIENT):  # neither being put nor re-registering
                    self._note_unreachable(code_name(n))
                    return None
                if time.monotonic() > deadline:
                    self._note_unreachable(f"the epoch sentinel stayed unreadable ({code_name(n)})")
                    return None
                time.sleep(0.02)
        except PayloadStoreError as exc:
            self._note_unreachable(str(exc))
            return None

    def _note_unreachable(self, why: str) -> None:
        if not self._unreachable_logged:
            log.warning("Mooncake store %s of %s does not answer (%s); payload reads and puts wait for it",
                        self.spec.url, self.layout.root, why)
            self._unreachable_logged = True

    def _check_epoch(self) -> dict[str, int]:
        """Compare the store's epoch with this process's; on a change (or at this process's first check) every
        manifest of another epoch is withdrawn: the store forgot its payload (a master restart). Returns them."""
        current = self._epoch_now()
        if current is None:
            return {}
        self._unreachable_logged = False
        if current == self.epoch:
            return {}
        previous, self.epoch = self.epoch, current
        lost = {}
        for fp in self.list_objects():
            hit = self._sizes.get(fp)
            if hit is not None and hit[3] != current:
                nbytes = self._withdraw(fp)
                if nbytes:
                    lost[fp] = nbytes
        if lost:
            log.warning("Mooncake store %s forgot this root's payloads (epoch %s -> %s: its master restarted, or the "
                        "holder of the epoch sentinel stopped); %d published artifact(s) withdrawn, recaptured on "
                        "demand", self.spec.url, previous or "(this process's first check)", current, len(lost))
        return lost

    def close(self, drain_s: float | None = None) -> None:
        """Finish this process's deferred removals, waiting out read leases for at most ``drain_s``
        (default :data:`DRAIN_S`), so a producer that exits leaves no payload it evicted behind. What is
        still deferred then keeps its ``.pending`` marker: the next producer's :meth:`maintain` removes it.
        (The client is per process: :func:`close_clients`.)"""
        deadline = time.monotonic() + (DRAIN_S if drain_s is None else drain_s)
        while self._pending and time.monotonic() < deadline:
            self._retry_pending(time.monotonic(), force=True)
            if self._pending:
                time.sleep(PENDING_RETRY_S)


# ---- the holder -----------------------------------------------------------------------------------------

def run_holder(url: str, size_bytes: int, stop: threading.Event, ready=None) -> None:
    """Mount ``size_bytes`` of this process's memory as a Mooncake segment and hold it until ``stop`` is set.

    Every payload put by artcache processes lands in some holder's segment (they mount none), so a
    producer or consumer can exit or be killed without losing one. Stopping the holder loses every
    payload in its segment: readers then miss, and the producer recaptures on demand.

    Raises:
        PayloadStoreError: the master does not answer or refused the segment.
    """
    client = MooncakeClient(url, segment_bytes=size_bytes)
    try:
        if ready is not None:
            ready(client)
        while not stop.wait(1.0):
            pass
    finally:
        client.close()


__all__ = ["Manifest", "MooncakeClient", "MooncakePayloads", "TensorSpec", "client_for", "close_clients", "code_name",
           "local_address", "parse_size", "run_holder"]
