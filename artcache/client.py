"""The consumer's side of the protocol: lease, read, and wait on demand misses.

``acquire(position)`` takes a lease first, then reads and verifies the artifact. If it is not
published (never captured, or evicted after faster consumers moved on), the position is added to
the registration's ``demand`` list and the caller sleeps with exponential backoff (never
busy-spins) until the producer publishes it, the consumer is fenced, or ``demand_timeout_s``
passes. Every acquire is one *logical request* in the journal (``hit`` or miss with its wait).

A read failing with a transient errno (ESTALE on NFS, EBUSY, EIO: :data:`artcache.fsio.RETRYABLE_ERRNOS`)
is a miss, not a crash: the read is retried as the wait goes on, and after :data:`READ_ERRORS_BEFORE_QUARANTINE`
failures in a row the file is moved to ``quarantine/`` so the producer recaptures it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from artcache import journal as J
from artcache import leases, store
from artcache.errors import ArtifactMissing, CaptureFailed, CaptureTimeout, IntegrityError
from artcache.fingerprint import PlanFingerprints
from artcache.fsio import is_retryable
from artcache.layout import CacheLayout
from artcache.liveness import dead_reason, from_token
from artcache.plan import Plan
from artcache.registry import ConsumerHandle, Registration
from artcache.settings import RootSettings, load_settings

log = logging.getLogger("artcache.client")


def open_root(root: str | Path) -> tuple[CacheLayout, RootSettings, Plan]:
    """A cache root as a consumer reads it: its layout (the path made absolute), settings and plan.

    Raises:
        CacheRootError: no initialised root there (:func:`artcache.settings.load_settings`).
        DataError: its plan is missing or damaged (:meth:`artcache.plan.Plan.load`).
    """
    layout = CacheLayout(Path(root).expanduser().absolute())
    settings = load_settings(layout)
    return layout, settings, Plan.load(layout.plan_dir(settings.plan_id))


@dataclass
class Leased:
    """An artifact plus the lease that keeps it from eviction until :meth:`CacheClient.release`."""

    position: int
    artifact: store.Artifact
    lease: str


#: seconds between "still waiting" warnings of one demand miss
WAIT_NOTE_S = 60.0
#: consecutive transient read errors of one artifact before it is quarantined (and so recaptured)
READ_ERRORS_BEFORE_QUARANTINE = 3


class CacheClient:
    """Reads positions of the plan for one consumer.

    Args:
        layout, settings, plan: the cache root, its settings and plan.
        handle: the consumer's registration handle (demand updates go through it).
        journal: this consumer's journal.
        demand_timeout_s: raise CaptureTimeout after waiting this long for one position.
        pin: read artifacts into page-locked memory (consumers on a GPU).
    """

    def __init__(self, layout: CacheLayout, settings: RootSettings, plan, handle: ConsumerHandle,
                 journal: J.JournalWriter, demand_timeout_s: float = 600.0, pin: bool = False,
                 epoch_len: int = 0) -> None:
        self.layout = layout
        self.contract = settings.contract
        self.plan = plan
        self.fps = PlanFingerprints(self.contract, plan)
        self.order = plan.order(epoch_len)  # position -> sample (artcache.plan.EpochOrder)
        self.handle = handle
        self.journal = journal
        self.demand_timeout_s = demand_timeout_s
        self.pin = pin
        self.consumer_id = handle.consumer_id
        self._demand: set[int] = set()  # training positions
        self._held_out: set[int] = set()  # held-out sample indices
        self._demand_lock = threading.Lock()

    @classmethod
    def for_consumer(cls, layout: CacheLayout, settings: RootSettings, plan, reg: Registration,
                     journal: J.JournalWriter, demand_timeout_s: float = 600.0, *, pin: bool = False,
                     epoch_len: int = 0, handle: ConsumerHandle | None = None) -> CacheClient:
        """The client of the registered consumer ``reg`` (a :class:`~artcache.registry.Registration` of this root):
        its :class:`~artcache.registry.ConsumerHandle` (a registration write refused for space is retried for the
        root's heartbeat timeout, after which the producer fences a silent consumer anyway) and the client over it
        (``client.handle``). The one construction of a consumer's client stack: the trainer's
        (:class:`artcache.trainers.consumer.Session`) and its reader process's. ``handle``: one already taken on
        ``reg`` (a group's rank takes a :class:`~artcache.trainers.consumer.group.GroupHandle`), else a new one."""
        if handle is None:
            handle = ConsumerHandle(layout, reg, space_wait_s=settings.heartbeat_timeout_s)
        return cls(layout, settings, plan, handle, journal, demand_timeout_s, pin=pin, epoch_len=epoch_len)

    def fp_of(self, position: int) -> str:
        """The fingerprint read at training position ``position`` (its sample's)."""
        return self.fps.of_sample(self.order.sample(position))

    def _set_demand(self, key: int, on: bool, held_out: bool = False) -> None:
        with self._demand_lock:
            target = self._held_out if held_out else self._demand
            (target.add if on else target.discard)(key)
            self._write_demand(held_out)

    def _write_demand(self, held_out: bool) -> None:
        """Write the one demand list this change touched (with ``_demand_lock`` held): a consumer with a reader process
        has two clients, the trainer's (held-out evaluation) and the reader's (training positions), and neither may
        overwrite the other's list (regression: the reader's ``want`` wiped the evaluation's held-out demand)."""
        if held_out:
            self.handle.set_demand(None, sorted(self._held_out))
        else:
            self.handle.set_demand(sorted(self._demand))

    def want(self, positions: Iterable[int]) -> list[int]:
        """Announce positions this consumer will read next as demand, in one registration update.

        A consumer about to read several positions (a held-out evaluation pass) calls this first, so the
        producer captures every missing one as demand (before any prefetch) in as few batches as it can,
        instead of one batch per :meth:`acquire`. Positions already published are skipped. Each
        position's demand is withdrawn when :meth:`acquire` returns it, or by :meth:`unwant`.

        Returns the positions announced (sorted). Raises nothing beyond the registry's own errors.
        """
        return self._want(positions, held_out=False)

    def want_samples(self, samples: Iterable[int]) -> list[int]:
        """:meth:`want` for held-out sample indices (read with :meth:`acquire_sample`)."""
        return self._want(samples, held_out=True)

    def _want(self, keys: Iterable[int], held_out: bool) -> list[int]:
        fp = self.fps.of_sample if held_out else self.fp_of
        missing = sorted({k for k in keys if not store.exists(self.layout, fp(k))})
        if missing:
            with self._demand_lock:
                (self._held_out if held_out else self._demand).update(missing)
                self._write_demand(held_out)
        return missing

    def unwant(self, positions: Iterable[int], held_out: bool = False) -> None:
        """Withdraw demand announced by :meth:`want` (``held_out``: by :meth:`want_samples`) not read after all."""
        with self._demand_lock:
            target = self._held_out if held_out else self._demand
            before = len(target)
            target.difference_update(positions)
            if len(target) != before:
                self._write_demand(held_out)

    def acquire(self, position: int, stop: threading.Event | None = None) -> Leased:
        """Lease and read training position ``position`` (its sample in its epoch); wait on a demand miss.

        Raises:
            CaptureTimeout: not published within ``demand_timeout_s`` (names the fingerprint).
            ConsumerFenced: this consumer was fenced (before the read, or while waiting).
            InterruptedError: ``stop`` was set while waiting.
        """
        return self._acquire(position, self.order.sample(position), False, stop)

    def acquire_sample(self, index: int, stop: threading.Event | None = None) -> Leased:
        """Lease and read held-out plan sample ``index`` (``Leased.position`` is -1); as :meth:`acquire`."""
        return self._acquire(-1, index, True, stop)

    def _acquire(self, position: int, sample: int, held_out: bool, stop: threading.Event | None) -> Leased:
        fp = self.fps.of_sample(sample)
        key = sample if held_out else position
        lease = leases.acquire(self.layout, fp, self.consumer_id)
        self.journal.emit(J.LeaseAcquire(consumer=self.consumer_id, fp=fp, lease=lease))
        t0 = time.monotonic()
        waiting = False
        next_note = WAIT_NOTE_S
        delay = 0.002
        read_errors = 0
        space_wait = False  # the producer gave up on fp for a full disk (noted once; waited for)
        try:
            # a fenced consumer's workers cannot acquire: checked after the lease exists, so a fence
            # that lands later finds (and expires) this lease
            self.handle.check_live()
            while True:
                try:
                    art = store.read(self.layout, fp, self.contract, pin=self.pin, verify_tokens=True)
                    break
                except ArtifactMissing:
                    pass
                except IntegrityError as exc:
                    self.journal.emit(J.Quarantined(consumer=self.consumer_id, fp=fp, reason=str(exc)))
                    log.warning("quarantined %s: %s", fp, exc)
                except OSError as exc:
                    if not is_retryable(exc):
                        raise
                    read_errors += 1
                    log.warning("reading %s failed (%s, %d in a row): a miss", fp, exc.strerror or exc, read_errors)
                    if read_errors >= READ_ERRORS_BEFORE_QUARANTINE and store.quarantine(self.layout, fp):
                        reason = f"read failed {read_errors} times: {exc.strerror or exc}"
                        self.journal.emit(J.Quarantined(consumer=self.consumer_id, fp=fp, reason=reason))
                        log.warning("quarantined %s so that it is recaptured: %s", fp, reason)
                        read_errors = 0
                waited = time.monotonic() - t0
                space_wait = self._raise_if_given_up(fp, key, waited, space_wait)
                if not waiting:
                    waiting = True
                    self.journal.emit(J.DemandWait(consumer=self.consumer_id, position=position, fp=fp))
                    self._set_demand(key, True, held_out)
                if waited >= next_note:  # a silent wait reads like a hang: say what we wait for, and on whom
                    log.warning("[%s] waited %.0fs for %s %d (fingerprint %s; gives up after %.0fs): is "
                                "`artcache producer` running on %s?", self.consumer_id, waited,
                                "held-out sample" if held_out else "position", key, fp,
                                self.demand_timeout_s, self.layout.root)
                    next_note += WAIT_NOTE_S
                if waited > self.demand_timeout_s:
                    what = "held-out sample" if held_out else "position"
                    raise CaptureTimeout(
                        f"{what} {key} (fingerprint {fp}) was not published within "
                        f"{self.demand_timeout_s:.0f}s; is `artcache producer` running on {self.layout.root}?")
                if stop is not None and stop.wait(delay):
                    raise InterruptedError("stopped while waiting for a demand miss")
                if stop is None:
                    time.sleep(delay)
                delay = min(delay * 2, 0.05)
        except BaseException:
            self._release(fp, lease)
            if waiting:
                self._set_demand(key, False, held_out)
            raise
        wait_s = time.monotonic() - t0 if waiting else 0.0
        if waiting or key in (self._held_out if held_out else self._demand):  # also withdraws want()'s demand
            self._set_demand(key, False, held_out)
        self.journal.emit(J.Request(consumer=self.consumer_id, position=position, fp=fp, hit=not waiting,
                                    wait_s=wait_s, sample=sample, held_out=held_out,
                                    epoch=self.order.epoch(position) if position >= 0 else 0))
        return Leased(position, art, lease)

    def _raise_if_given_up(self, fp: str, position: int, waited: float = 0.0, noted: bool = False) -> bool:
        """Raise CaptureFailed if the producer gave up on ``fp`` (``failed/<fp>.json``). A marker whose
        producer is provably gone (same host id, pid gone) is superseded: the next producer retries the
        fingerprint, so it is not an answer. A give-up for a full disk (the marker's
        ``space``) is withdrawn by its producer once space is back: it is waited for while ``waited``
        (seconds of this acquire) is within the demand timeout, logged once (``noted``: already logged), and
        raised after that. Returns whether such a give-up is being waited for."""
        try:
            record = json.loads(self.layout.failure_path(fp).read_bytes())
        except (FileNotFoundError, ValueError):
            return False
        if not isinstance(record, dict):
            return False
        writer = from_token(str(record.get("producer", "")))
        if writer is not None and writer.comparable() and dead_reason(writer) is not None:
            return False
        space = record.get("space") is True
        if space and waited <= self.demand_timeout_s:
            if not noted:
                log.warning("[%s] the producer gave up capturing position %d (fingerprint %s) for a full disk (%s); "
                            "waiting up to %.0fs (--demand-timeout) for it to retry once space is freed on %s",
                            self.consumer_id, position, fp, record.get("error"), self.demand_timeout_s,
                            self.layout.root)
            return True
        waited_note = f"waited {waited:.0f}s (--demand-timeout) for free space, then: " if space else ""
        raise CaptureFailed(
            f"{waited_note}the producer gave up capturing position {position} (fingerprint {fp}) after "
            f"{record.get('attempts')} attempt(s): {record.get('error')}; fix that, then restart this consumer "
            "(--resume when it recorded a checkpoint): a full disk once space is freed (the running producer "
            "withdraws that give-up within seconds), any other error after you restart `artcache producer` on "
            f"{self.layout.root} (a producer keeps other give-ups for the rest of its run; a new one retries them)",
            fingerprint=fp,
            attempts=int(record.get("attempts", 0)), retryable=bool(record.get("retryable", False)))

    def _release(self, fp: str, lease: str) -> None:
        if leases.release(self.layout, lease):
            self.journal.emit(J.LeaseRelease(consumer=self.consumer_id, fp=fp, lease=lease))

    def release(self, item: Leased) -> None:
        """Release the lease of an item whose batch is no longer referenced."""
        self._release(item.artifact.fingerprint, item.lease)
