"""How a producer takes its next batch when another producer on the root holds capture flocks
(``target.replicas``): the queue's order stays (demand first), the fingerprints held elsewhere at its last attempt
are left to their holder, and when nothing else is left it probes those again (a holder that died released them)."""

from __future__ import annotations

from types import SimpleNamespace

from artcache.producer import Producer
from artcache.scheduler import SchedulerLimits, Want


def want(i: int, demand: bool) -> Want:
    return Want(fp=f"{i:064x}", sample=i, priority=(0 if demand else 1, float(i)), consumers={"c"},
                positions={i})


class Decision:
    def __init__(self, wants: list[Want]) -> None:
        self.wants = wants

    def head(self, k: int) -> list[Want]:
        return self.wants[:k]


def head_of(queue: list[Want], held: set[str], batch: int = 2) -> list[int]:
    me = SimpleNamespace(cfg=SimpleNamespace(limits=SchedulerLimits(max_batch_samples=batch)), _held_elsewhere=held)
    return [w.sample for w in Producer._queue_head(me, Decision(queue))]


def test_next_batch_skips_what_another_producer_captures_keeping_demand_first():
    queue = [want(0, True), want(1, True), want(2, True), want(3, False), want(4, False)]
    assert head_of(queue, set()) == [0, 1]
    # the other producer holds demand 0 and 1: the next demand (2) comes before any lookahead
    assert head_of(queue, {queue[0].fp, queue[1].fp}) == [2, 3]
    assert head_of(queue, {queue[1].fp}) == [0, 2]


def test_held_fingerprints_are_probed_again_when_nothing_else_is_queued():
    queue = [want(0, True), want(1, False)]
    assert head_of(queue, {w.fp for w in queue}) == [0, 1]
