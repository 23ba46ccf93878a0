"""Leases: a reader's right to an artifact while it reads it or a batch still references its bytes.

A lease is one empty file ``leases/<fp>~<consumer>~<holder>~<nonce>`` where ``<holder>`` is the holding
process's identity token (:mod:`artcache.liveness`). Acquire creates it (O_EXCL) *before* the artifact is
opened; release unlinks it. The evictor skips any fingerprint with a live lease. A lease is *expired*
(and removed by the producer or ``fsck``) when (:func:`expired_reason`):

- its holder is provably gone: same host id, and its pid no longer exists (or was reused) —
  ``holder-dead``;
- its consumer is not live (fenced, finished, or dead by the registration's liveness rule) —
  ``consumer-fenced``;
- its holder's pid cannot be checked from here (another host or pid namespace) and it is not the live
  registration's own process: then it is expired once this reader has seen it for ``ttl_s`` on its own
  monotonic clock (``ttl``; a reader that watches nothing, like a one-shot ``fsck``, never expires it so).

So a dead holder never blocks eviction for long, and no reader's clock is compared with another's.

Migration rule: a lease named before identity tokens existed (``<fp>~<consumer>~<hostname>~<pid>~<nonce>``)
is read with ``holder=None``: its pid is never checked; it expires with its consumer, or by ``ttl``.
"""

from __future__ import annotations

import os
import secrets
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from artcache.crashpoints import crash_point
from artcache.layout import CacheLayout, check_fingerprint, check_id, open_nofollow
from artcache.liveness import HeartbeatWatch, ProcessIdentity, dead_reason, from_token, this_process


@dataclass(frozen=True)
class LeaseInfo:
    """A parsed lease name. ``holder``: the holder's identity (None for a legacy name); ``host`` and ``pid``:
    its host id and pid (a legacy name's host name and pid)."""

    name: str
    fp: str
    consumer: str
    host: str
    pid: int
    holder: ProcessIdentity | None = None


def parse(name: str) -> LeaseInfo | None:
    parts = name.split("~")
    try:
        if len(parts) == 4:
            fp, consumer, token, _nonce = parts
            holder = from_token(token)
            if holder is None:
                return None
            return LeaseInfo(name, check_fingerprint(fp), consumer, holder.host, holder.pid, holder)
        if len(parts) == 5:  # legacy: <fp>~<consumer>~<hostname>~<pid>~<nonce>
            fp, consumer, host, pid, _nonce = parts
            return LeaseInfo(name, check_fingerprint(fp), consumer, host, int(pid))
    except (ValueError, TypeError):
        return None
    return None


def lease_name(fp: str, consumer_id: str, holder: ProcessIdentity) -> str:
    """A fresh lease name for ``holder`` (unique: a random nonce)."""
    return f"{check_fingerprint(fp)}~{check_id(consumer_id, 'consumer id')}~{holder.token()}~{secrets.token_hex(4)}"


def acquire(layout: CacheLayout, fp: str, consumer_id: str) -> str:
    """Create a lease on ``fp`` for this process; return the lease name (pass it to release)."""
    name = lease_name(fp, consumer_id, this_process())
    fd = open_nofollow(layout.leases / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    crash_point("lease.after-create")
    return name


def release(layout: CacheLayout, name: str) -> bool:
    """Remove a lease; False if it was already gone (expired by the producer)."""
    if parse(name) is None:
        raise ValueError(f"not a lease name: {name!r}")
    try:
        os.unlink(layout.leases / name)
        return True
    except FileNotFoundError:
        return False


def scan(layout: CacheLayout) -> dict[str, list[LeaseInfo]]:
    """Map fingerprint → leases held on it (one directory listing)."""
    out: dict[str, list[LeaseInfo]] = defaultdict(list)
    try:
        names = os.listdir(layout.leases)
    except FileNotFoundError:
        return out
    for name in names:
        info = parse(name)
        if info is not None:
            out[info.fp].append(info)
    return out


def expired_reason(lease: LeaseInfo, live_consumers: Mapping[str, ProcessIdentity | None] | set[str],
                   ttl_s: float, watch: HeartbeatWatch | None = None) -> str | None:
    """Why ``lease`` is expired (``holder-dead``, ``consumer-fenced``, ``ttl``), or None if it may be live.

    Args:
        live_consumers: the live consumers' ids, mapped to their registrations' identities (a plain set of
            ids: identities unknown).
        ttl_s: how long a reader must have seen a lease whose holder it cannot check (and which is not the
            live registration's own process) before it is expired.
        watch: the reader's memory of when it first saw each lease (None: a one-shot reader, never ``ttl``).
    """
    if lease.holder is not None and lease.holder.comparable() and dead_reason(lease.holder) is not None:
        return "holder-dead"
    if lease.consumer not in live_consumers:
        return "consumer-fenced"
    registered = live_consumers.get(lease.consumer) if isinstance(live_consumers, Mapping) else None
    if lease.holder is not None and (lease.holder.comparable() or lease.holder.same_process(registered)):
        return None  # a live local process, or the live registration's own process on its host
    if watch is not None and watch.observe(lease.name, ttl_s).silent_s > ttl_s:
        return "ttl"
    return None
