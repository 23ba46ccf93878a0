"""Leases: a reader's right to an artifact while it reads it or a batch still references its bytes.

A lease is one empty file ``leases/<fp>~<consumer>~<host>~<pid>~<nonce>``. Acquire creates it
(O_EXCL) *before* the artifact is opened; release unlinks it. The evictor skips any fingerprint
with a live lease. A lease is *expired* (and removed by the producer) when its holder process is
gone (same host: the pid no longer exists), its consumer was fenced, or — for another host — the
file is older than ``ttl_s``. So a dead holder never blocks eviction for long.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass

from artcache.crashpoints import crash_point
from artcache.layout import CacheLayout, check_fingerprint, check_id, host_id, open_nofollow, pid_alive


@dataclass(frozen=True)
class LeaseInfo:
    name: str
    fp: str
    consumer: str
    host: str
    pid: int


def parse(name: str) -> LeaseInfo | None:
    parts = name.split("~")
    if len(parts) != 5:
        return None
    fp, consumer, host, pid, _nonce = parts
    try:
        return LeaseInfo(name, check_fingerprint(fp), consumer, host, int(pid))
    except (ValueError, TypeError):
        return None


def acquire(layout: CacheLayout, fp: str, consumer_id: str) -> str:
    """Create a lease on ``fp`` for this process; return the lease name (pass it to release)."""
    check_fingerprint(fp)
    check_id(consumer_id, "consumer id")
    name = f"{fp}~{consumer_id}~{host_id()}~{os.getpid()}~{secrets.token_hex(4)}"
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


def expired_reason(layout: CacheLayout, lease: LeaseInfo, live_consumers: set[str], ttl_s: float,
                   now: float | None = None) -> str | None:
    """Why ``lease`` is expired, or None if it is live."""
    if lease.host == host_id():
        if not pid_alive(lease.pid):
            return "holder-dead"
    else:
        try:
            age = (now or time.time()) - os.stat(layout.leases / lease.name).st_mtime
        except FileNotFoundError:
            return None
        if age > ttl_s:
            return "ttl"
    if lease.consumer not in live_consumers:
        return "consumer-fenced"
    return None
