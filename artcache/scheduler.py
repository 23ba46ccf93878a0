"""The producer's scheduler: demand misses first, then lookahead prefetch by distance from cursor.

Pure logic (no I/O) so it can be tested directly. Each pass takes the live registrations and the
set of published fingerprints and returns the next capture batch under three limits: queue length
(how many wanted fingerprints are considered at all), capture batch size in samples, and capture
batch size in padded tokens. Requests for the same fingerprint from several consumers collapse into
one entry (one capture serves them all). The producer captures one batch at a time (one in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from artcache.errors import ConfigError
from artcache.registry import Registration


class SchedulerLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Backpressure limits.

    Attributes:
        max_queue: at most this many distinct wanted fingerprints are queued per pass.
        max_batch_samples: samples per forward pass.
        max_batch_tokens: padded tokens (samples × longest length) per forward pass.
    """

    max_queue: int = 1024
    max_batch_samples: int = 8
    max_batch_tokens: int = 8192

    def validate(self, max_length: int) -> None:
        for name in ("max_queue", "max_batch_samples", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_tokens < max_length:
            raise ConfigError(
                f"max_batch_tokens={self.max_batch_tokens} is smaller than the plan's max length "
                f"{max_length}: a full-length sample could never be captured; raise it to >= {max_length}")


def check_deadlock(limits: SchedulerLimits, batch_size: int, lookahead: int, max_length: int) -> None:
    """Start-up check: refuse settings under which a consumer could wait forever.

    A consumer reads ``batch_size`` consecutive positions from its cursor before it steps, but the
    producer only captures (and the reader only acquires) positions up to ``cursor + lookahead``:
    with ``lookahead < batch_size`` the batch's last position may never be captured, so the cursor
    never moves. A sample longer than ``max_batch_tokens`` could never be captured either
    (:meth:`SchedulerLimits.validate`).

    Raises:
        ConfigError: naming the setting and the fix.
    """
    limits.validate(max_length)
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    if lookahead < 0:
        raise ConfigError(f"lookahead must be >= 0, got {lookahead}")
    if lookahead < batch_size:
        raise ConfigError(
            f"lookahead {lookahead} is smaller than the batch size {batch_size}: positions of a batch past "
            f"cursor + lookahead are never captured, so the consumer could wait forever; raise the lookahead "
            f"to >= {batch_size} (--window LOOKBEHIND:{batch_size} or larger) or lower the batch size to "
            f"<= {lookahead}")


@dataclass
class Want:
    """One fingerprint somebody wants. ``priority`` sorts: (0 = demand / 1 = prefetch, distance)."""

    fp: str
    position: int
    priority: tuple[int, int]
    consumers: set[str] = field(default_factory=set)
    positions: set[int] = field(default_factory=set)

    @property
    def demand(self) -> bool:
        return self.priority[0] == 0


def wanted(regs: Iterable[Registration], fp_of: Callable[[int], str], published: set[str],
           max_queue: int) -> list[Want]:
    """Unpublished fingerprints inside live windows, demand first, then by distance from cursor.

    Only positions in ``[cursor, min(cursor + lookahead, end - 1)]`` and pinned positions (a
    consumer's held-out evaluation split, :meth:`Registration.pinned_range`) are ever wanted: the
    lookbehind is retained if present but never (re)captured, and nothing past a consumer's
    announced end is prefetched. Priorities: demand ``(0, distance)``, window prefetch
    ``(1, distance from cursor)``, pinned prefetch ``(2, offset in the pinned range)`` — pinned
    positions never delay a window; a consumer blocked on one turns it into demand.
    """
    by_fp: dict[str, Want] = {}
    regs = list(regs)
    # demand misses: positions a consumer is blocked on (still inside its window)
    for reg in regs:
        lo, hi = reg.readable()
        pinned = reg.pinned_range()
        for p in reg.demand:
            if lo <= p <= hi:
                _add(by_fp, fp_of(p), p, (0, p - reg.cursor), reg.consumer_id, published)
            elif p in pinned:
                _add(by_fp, fp_of(p), p, (0, p - pinned.start), reg.consumer_id, published)
    # prefetch, interleaved across consumers by distance from each cursor
    spans = [(reg, *reg.readable()) for reg in regs]
    for dist in range(max((hi - lo for _, lo, hi in spans), default=-1) + 1):
        if len(by_fp) >= max_queue:
            break
        for reg, lo, hi in spans:
            if lo + dist <= hi:
                _add(by_fp, fp_of(lo + dist), lo + dist, (1, dist), reg.consumer_id, published)
    # pinned ranges last (held-out evaluation positions: needed only every --eval-interval steps)
    for reg in regs:
        for i, p in enumerate(reg.pinned_range()):
            if len(by_fp) >= max_queue:
                break
            _add(by_fp, fp_of(p), p, (2, i), reg.consumer_id, published)
    out = sorted(by_fp.values(), key=lambda w: w.priority)
    return out[:max_queue]


def _add(by_fp: dict[str, Want], fp: str, p: int, prio: tuple[int, int], consumer: str,
         published: set[str]) -> None:
    if fp in published:
        return
    w = by_fp.get(fp)
    if w is None:
        by_fp[fp] = w = Want(fp, p, prio)
    elif prio < w.priority:
        w.priority, w.position = prio, p
    w.consumers.add(consumer)
    w.positions.add(p)


def next_batch(queue: list[Want], length_of: Callable[[int], int], limits: SchedulerLimits) -> list[Want]:
    """Take wants in priority order while the batch fits ``max_batch_samples`` and padded tokens.

    The first want is always taken (a single sample never exceeds max_batch_tokens, which
    :meth:`SchedulerLimits.validate` guarantees).
    """
    batch: list[Want] = []
    longest = 0
    for w in queue:
        n = length_of(w.position)
        new_longest = max(longest, n)
        if batch and (len(batch) + 1 > limits.max_batch_samples
                      or new_longest * (len(batch) + 1) > limits.max_batch_tokens):
            break
        batch.append(w)
        longest = new_longest
    return batch


def window_positions(regs: Iterable[Registration]) -> set[int]:
    """The retain set as positions: the union of live windows and pinned ranges."""
    out: set[int] = set()
    for reg in regs:
        out |= reg.retained_positions()
    return out


def window_bound(regs: Iterable[Registration]) -> int:
    """Upper bound on retained artifacts: Σ (window size + pinned positions) of the live consumers."""
    return sum(r.retain_bound() for r in regs)
