"""Eviction: remove published artifacts outside the union of live windows that no live lease holds.

Decision order per artifact (cf. python-diskcache's culling and Bazel's re-check before delete):
retained if its fingerprint is in the retain set; else expired leases are removed first; retained
if a live lease remains; else renamed aside and unlinked (:func:`artcache.store.remove`). A lease
taken between the check and the rename is harmless: the reader either opened the file already
(POSIX keeps the bytes) or sees a miss that becomes a demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from artcache import leases as leases_mod
from artcache import store
from artcache.layout import CacheLayout


@dataclass
class EvictionResult:
    evicted: dict[str, int] = field(default_factory=dict)  # fp -> bytes
    expired_leases: list[tuple[leases_mod.LeaseInfo, str]] = field(default_factory=list)
    held_by_lease: set[str] = field(default_factory=set)
    retained: dict[str, int] = field(default_factory=dict)  # fp -> bytes after the pass


def evict_pass(layout: CacheLayout, retain: set[str], live_consumers: set[str], *,
               lease_ttl_s: float = 600.0, objects: dict[str, int] | None = None) -> EvictionResult:
    """One eviction pass over ``objects/``.

    Args:
        retain: fingerprints inside some live window (never evicted).
        live_consumers: ids of running, heart-beating consumers (their leases are live).
        lease_ttl_s: age after which another host's lease is expired.
        objects: a fresh :func:`store.list_objects` result, to avoid listing twice.
    """
    res = EvictionResult()
    objects = store.list_objects(layout) if objects is None else objects
    leases = leases_mod.scan(layout)
    for fp, size in objects.items():
        if fp in retain:
            res.retained[fp] = size
            continue
        live = []
        for lease in leases.get(fp, ()):
            reason = leases_mod.expired_reason(layout, lease, live_consumers, lease_ttl_s)
            if reason is None:
                live.append(lease)
            elif leases_mod.release(layout, lease.name):
                res.expired_leases.append((lease, reason))
        if live:
            res.held_by_lease.add(fp)
            res.retained[fp] = size
            continue
        freed = store.remove(layout, fp)
        if freed:
            res.evicted[fp] = freed
    # leases on fingerprints that are no longer published: expire the dead ones too
    for fp, infos in leases.items():
        if fp in objects:
            continue
        for lease in infos:
            reason = leases_mod.expired_reason(layout, lease, live_consumers, lease_ttl_s)
            if reason is not None and leases_mod.release(layout, lease.name):
                res.expired_leases.append((lease, reason))
    return res
