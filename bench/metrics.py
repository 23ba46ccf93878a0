"""Figures of one scenario, computed from its journals only.

The *common post-warm-up interval* runs from the moment the last consumer finished its warm-up
steps to the moment the first consumer finished its measured steps (speculators RFC method);
aggregate throughput and producer utilisation are taken over it alone.
"""

from __future__ import annotations

from statistics import median

from artcache import journal as J
from artcache.report import loss_ends


def interval(steps_by_consumer: dict[str, list[J.Step]], warmup: int) -> tuple[float, float]:
    """(start, end) of the common post-warm-up interval, seconds since epoch. end <= start if none."""
    starts, ends = [], []
    for steps in steps_by_consumer.values():
        by_step = {s.step: s.t for s in steps}
        starts.append(by_step.get(warmup, steps[0].t if steps else 0.0) if warmup else
                      min((s.t - s.step_s for s in steps), default=0.0))
        ends.append(max((s.t for s in steps), default=0.0))
    return (max(starts), min(ends)) if starts else (0.0, 0.0)


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def rate_spread(steps: list[J.Step], chunks: int = 4) -> float | None:
    """How much a consumer's step rate varied within its measured steps: the steps (sorted, consecutive) cut into
    ``chunks`` runs of equal length, each run's steps/s (steps over the time from the previous run's last step
    end to its own), and half their range over their median (``0.05``: the rate stayed within about ±5 %). None
    with fewer than ``2 * chunks + 1`` steps (too few to tell)."""
    if len(steps) < 2 * chunks + 1:
        return None
    n = (len(steps) - 1) // chunks
    rates = []
    for k in range(chunks):
        a, b = steps[k * n], steps[(k + 1) * n]
        rates.append(n / (b.t - a.t) if b.t > a.t else float("inf"))
    mid = median(rates)
    return (max(rates) - min(rates)) / 2 / mid if 0 < mid < float("inf") else None


def scenario_figures(events: list, warmup: int) -> dict:
    """Per-consumer rates, aggregate steady throughput, producer utilisation, over the interval."""
    steps: dict[str, list[J.Step]] = {}
    for ev in events:
        if isinstance(ev, J.Step):
            steps.setdefault(ev.consumer, []).append(ev)
    t0, t1 = interval(steps, warmup)
    length = max(0.0, t1 - t0)
    consumers = {}
    for cid, ss in sorted(steps.items()):
        ss.sort(key=lambda s: s.step)
        measured = [s for s in ss if s.step > warmup]
        span = (measured[-1].t - ss[warmup - 1].t) if warmup and len(ss) > warmup and measured else \
            (ss[-1].t - ss[0].t + ss[0].step_s if ss else 0.0)
        in_interval = sum(1 for s in ss if t0 < s.t <= t1)
        wait = sum(s.wait_s for s in measured)
        busy = sum(s.step_s for s in measured)
        first_loss, final_loss, _ = loss_ends([s.loss for s in ss if s.loss is not None])
        consumers[cid] = {
            "steps": len(ss), "measured_steps": len(measured),
            "steps_per_s": len(measured) / span if span > 0 else 0.0,
            "rate_spread": rate_spread(measured),
            "steps_in_interval": in_interval,
            "wait_s": wait, "fetch_fraction": wait / busy if busy > 0 else 0.0,
            "first_loss": first_loss, "final_loss": final_loss,  # None for a consumer that logged no loss
            "tau": (sum(s.tau_sum for s in ss[-10:]) / max(1, sum(s.blocks for s in ss[-10:]))),
            "tau_includes_bonus": True,
            "progress": [[s.t, s.step] for s in ss],
        }
    aggregate = sum(c["steps_in_interval"] for c in consumers.values()) / length if length > 0 else 0.0
    busy_in = sum(overlap(ev.start, ev.end, t0, t1) for ev in events if isinstance(ev, J.CaptureBatch))
    busy_all = sum(ev.end - ev.start for ev in events if isinstance(ev, J.CaptureBatch))
    return {
        "interval": [t0, t1], "interval_s": length,
        "aggregate_steps_per_s": aggregate,
        "median_consumer_steps_per_s": median(c["steps_per_s"] for c in consumers.values()) if consumers else 0.0,
        "producer_busy_s": busy_all,
        "producer_busy_in_interval_s": busy_in,
        "producer_utilization": busy_in / length if length > 0 else 0.0,
        "consumers": consumers,
    }
