"""The producer's scheduler: the capture queue's entries, the batch limits and the start-up checks.

Pure logic (no I/O) so it can be tested directly. The queue itself — demand misses first, then the
live lookaheads in order of need, inside the disk budget — comes from
:func:`artcache.eviction.decide`, the one retention policy; :func:`next_batch` takes one capture
batch from it under three limits: queue length (how many wanted fingerprints are considered at all),
capture batch size in samples, and capture batch size in padded tokens. Requests for the same
fingerprint from several consumers collapse into one entry (one capture serves them all). The
producer captures one batch at a time (one in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from artcache.errors import ConfigError
from artcache.ranges import Count, NonNegative, check_ranges, check_value, range_message
from artcache.registry import Registration


class SchedulerLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Backpressure limits.

    Attributes:
        max_queue: at most this many distinct wanted fingerprints are queued per pass.
        max_batch_samples: samples per forward pass.
        max_batch_tokens: padded tokens per forward pass: samples × the longest length, or × ``prefill_chunk``
            when the longest is longer (a chunked prefill runs one chunk per pass).
        prefill_chunk: tokens per row in one forward pass (0: the whole sample in one pass). A longer sample
            is prefilled in chunks of this many tokens through the target's KV cache
            (:class:`artcache.backends.hf.HFCaptureBackend`), so a sample longer than ``max_batch_tokens``
            can be captured. The captured values equal a one-pass prefill's to the compute dtype's rounding;
            neither the fingerprint nor the contract depends on it.
    """

    max_queue: Count = 1024
    max_batch_samples: Count = 8
    max_batch_tokens: Count = 8192
    prefill_chunk: NonNegative = 0

    def pass_tokens(self, length: int) -> int:
        """Tokens one row of ``length`` tokens puts into one forward pass: ``min(length, prefill_chunk)``
        (``length`` when chunking is off)."""
        return min(length, self.prefill_chunk) if self.prefill_chunk else length

    def validate(self, max_length: int, name_of: Callable[[str], str] = str) -> None:
        """The ranges declared on the fields, then ``max_batch_tokens >= min(max_length, prefill_chunk)`` (one
        forward pass of a full-length sample must fit a batch). ``name_of`` names a field the caller's way
        (:func:`artcache.ranges.check_ranges`): the producer's flag (``--batch-tokens``), a run config's
        ``capture.batch_tokens``; default: the field.

        Raises:
            ConfigError: ``<name> <value> is invalid: accepted <what>``.
        """
        check_ranges(self, name_of)
        need = self.pass_tokens(max_length)
        chunk_name = name_of("prefill_chunk") or "prefill_chunk"
        if self.max_batch_tokens < need:
            what = (f"an integer >= {need}, the plan's max length (a full-length sample could never be captured; "
                    f"or set {chunk_name} <= {self.max_batch_tokens} to prefill it in chunks)"
                    if need == max_length else
                    f"an integer >= {need}, {chunk_name} (one chunk of a long sample could never be "
                    "captured)")
            raise ConfigError(range_message(name_of("max_batch_tokens"), self.max_batch_tokens, what))


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
    check_value(batch_size, Count, "batch size")
    check_value(lookahead, NonNegative, "lookahead")
    if lookahead < batch_size:
        raise ConfigError(
            f"lookahead {lookahead} is smaller than the batch size {batch_size}: positions of a batch past "
            f"cursor + lookahead are never captured, so the consumer could wait forever; raise the lookahead "
            f"to >= {batch_size} or lower the batch size to <= {lookahead}")


@dataclass
class Want:
    """One fingerprint somebody wants captured.

    Attributes:
        fp: its fingerprint. sample: the plan sample index it captures.
        priority: sort key ``(class, need)``: class 0 = demand, 1 = window prefetch, 2 = pinned
            (held-out) prefetch, 3 = ``--fill``; need = seconds until a consumer reads it
            (:func:`artcache.eviction.decide`).
        consumers: ids of the consumers that asked for it. positions: the run positions they read it at
            (held-out reads have none).
    """

    fp: str
    sample: int
    priority: tuple[int, float]
    consumers: set[str] = field(default_factory=set)
    positions: set[int] = field(default_factory=set)

    @property
    def demand(self) -> bool:
        return self.priority[0] == 0


def next_batch(queue: list[Want], length_of: Callable[[int], int], limits: SchedulerLimits) -> list[Want]:
    """Take wants in priority order while the batch fits ``max_batch_samples`` and padded tokens per forward
    pass (:meth:`SchedulerLimits.pass_tokens` of the batch's longest sample, times its samples).

    ``length_of(sample)``: tokens of a plan sample.

    The first want is always taken (a single sample never exceeds max_batch_tokens, which
    :meth:`SchedulerLimits.validate` guarantees).
    """
    batch: list[Want] = []
    longest = 0
    for w in queue:
        n = limits.pass_tokens(length_of(w.sample))
        new_longest = max(longest, n)
        if batch and (len(batch) + 1 > limits.max_batch_samples
                      or new_longest * (len(batch) + 1) > limits.max_batch_tokens):
            break
        batch.append(w)
        longest = new_longest
    return batch


def window_bound(regs: Iterable[Registration], plan_samples: int | None) -> int:
    """Upper bound on the artifacts the windows-only rule retains: Σ (lookbehind + lookahead + 1 + pinned held-out
    positions) of the live consumers, at most ``plan_samples`` (a root holds one artifact per sample of its
    plan however many windows cover it). :func:`bound_of` over :meth:`Registration.retain_bound`."""
    return bound_of((r.retain_bound() for r in regs), plan_samples)


def bound_of(windows: Iterable[int], plan_samples: int | None) -> int:
    """The window bound of consumers retaining ``windows`` artifacts each (lookbehind + lookahead + 1 + pinned):
    their sum, at most ``plan_samples`` (None: the plan's length is not known, the sum alone). The one rule behind
    the producer's ``retained`` events, ``artcache inspect``'s and ``artcache run``'s window bound."""
    total = sum(windows)
    return total if plan_samples is None else min(total, plan_samples)
