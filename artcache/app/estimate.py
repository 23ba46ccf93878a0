"""A capacity estimate before a run (``artcache run --dry-run``): per experiment and for the whole root, the disk
peak under the chosen retention, the captures per consumed position and the time to finish, from the retention
simulator (:mod:`artcache.bench.sim`, which runs the real :func:`artcache.eviction.decide` and scheduler over the
experiments' real :class:`~artcache.plan.EpochOrder` orders; tests/properties/test_retention_sim.py validates it).

Inputs:

- **rates**: the producer's capture rate (samples per second of busy time) and each experiment's step rate
  (optimizer steps per second of compute). Stated (``--capture-rate``, ``--step-rate``) wins; otherwise measured
  from the cache root's journal when a run has used it before (``capture_batch`` events: samples over busy
  seconds; ``step`` events of the experiment's consumer id: 1 / mean ``step_s``); otherwise assumed (every
  experiment 1 step/s, the producer twice the fastest experiment's positions/s), and the times are then in those
  units only, which the text says.
- **the run**: each experiment's positions, batch size, window and held-out split (:class:`RunPlan`), the
  plan's length, the capture batching limits, and the producer's retention rule and budget from
  ``cache.disk_budget`` / ``cache.retention`` (:func:`artcache.eviction.retention_rule`; ``auto``: 90 % of the
  free space beyond the reserve where the root will be, as :func:`artcache.producer.default_budget` derives it).

Model: every artifact is counted at the run's bound per artifact (``bytes_per_artifact_max``: ``max_length``
tokens), so the disk figures are upper bounds; a capture of ``n`` samples takes ``n / capture_rate`` seconds;
evaluations, checkpoints and start-up are not modelled. The held-out split (pinned by every evaluating
experiment, captured once) is added to the disk peak and the captures. "Per experiment" is that experiment
alone on a fresh root; "root" is every experiment together, sharing one capture per position.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import msgspec

from artcache.errors import ConfigError

#: the simulator's work grows with the positions (4 s for 3 consumers x 8,000 positions on one CPU core; the dry run
#: simulates the root and each experiment alone); above this many, summed over the experiments, the dry run skips
#: the estimate and says so (bench/sim.py runs any size)
MAX_SIM_POSITIONS = 50_000


class Rates(msgspec.Struct, kw_only=True):
    """Rates the estimate runs at, and where each came from (``stated``, ``measured``, ``assumed``).
    capture: samples per second of producer busy time. steps: experiment name → optimizer steps per second."""

    capture: float
    capture_source: str
    steps: dict[str, float]
    step_sources: dict[str, str]


class PartEstimate(msgspec.Struct, kw_only=True):
    """One simulated run: ``disk_peak_bytes`` (retained artifacts at their peak plus the held-out split, at the
    bound per artifact), ``captures`` (the held-out split included), ``positions`` consumed (distinct (epoch,
    sample) pairs), ``captures_per_position`` (training captures / positions), ``finish_s`` (seconds to the last
    step), ``wait_s`` (seconds the experiments waited for data, summed)."""

    name: str
    disk_peak_bytes: int
    disk_peak_artifacts: int
    captures: int
    positions: int
    captures_per_position: float
    finish_s: float
    wait_s: float


class CapacityEstimate(msgspec.Struct, kw_only=True):
    retention: str
    budget_bytes: float
    budget_source: str
    artifact_bytes: int
    plan_samples: int
    heldout_samples: int
    rates: Rates
    root: PartEstimate
    experiments: list[PartEstimate]


def parse_step_rates(items, names=None) -> dict[str, float]:
    """``["NAME=STEPS_PER_S", "STEPS_PER_S"]`` → ``{name or "*": rate}``. ConfigError naming a bad item, or (with
    ``names``, the run's experiment names) a NAME no experiment has."""
    out: dict[str, float] = {}
    for item in items or ():
        name, sep, text = item.rpartition("=")
        try:
            rate = float(text)
        except ValueError:
            rate = math.nan
        if not math.isfinite(rate) or rate <= 0:
            raise ConfigError(f"--step-rate {item!r} is invalid: accepted NAME=STEPS_PER_S or STEPS_PER_S, a number "
                              "> 0 (optimizer steps per second)")
        if sep and names is not None and name not in names:
            raise ConfigError(f"--step-rate {item!r}: no experiment is named {name!r}; accepted names: "
                              f"{', '.join(names) or '(none)'} (or STEPS_PER_S alone, for every experiment)")
        out[name if sep else "*"] = rate
    return out


def check_capture_rate(capture_rate: float | None) -> None:
    """ConfigError unless ``capture_rate`` (``--capture-rate``, samples per second) is None or a number > 0."""
    if capture_rate is not None and not (math.isfinite(capture_rate) and capture_rate > 0):
        raise ConfigError(f"--capture-rate {capture_rate!r} is invalid: accepted a number > 0 (samples per "
                          "second the producer captures)")


def measured_rates(cache_root: str | Path) -> tuple[float | None, dict[str, float]]:
    """(capture samples per busy second, consumer id → steps per second) from a root's journal; None / absent
    where the journal has no such events (or there is no root)."""
    from artcache import journal as J

    jdir = Path(cache_root) / "journal"
    if not jdir.is_dir():
        return None, {}
    events = J.read_events(jdir).events
    samples = busy = 0.0
    step_s: dict[str, list[float]] = {}
    for ev in events:
        if isinstance(ev, J.CaptureBatch) and ev.end > ev.start:
            samples += ev.samples
            busy += ev.end - ev.start
        elif isinstance(ev, J.Step) and ev.step_s > 0:
            step_s.setdefault(ev.consumer, []).append(ev.step_s)
    capture = samples / busy if busy > 0 and samples > 0 else None
    return capture, {k: len(v) / sum(v) for k, v in step_s.items()}


def resolve_rates(plan, capture_rate: float | None, step_rates: dict[str, float]) -> Rates:
    """The rates of :func:`estimate`: stated, else measured from ``plan.cache_root``'s journal, else assumed."""
    measured_capture, measured_steps = measured_rates(plan.cache_root)
    steps, sources = {}, {}
    for x in plan.experiments:
        for value, source in ((step_rates.get(x.name), "stated"), (step_rates.get("*"), "stated"),
                              (measured_steps.get(x.name), "measured"), (1.0, "assumed")):
            if value is not None:
                steps[x.name], sources[x.name] = float(value), source
                break
    check_capture_rate(capture_rate)
    if capture_rate is not None:
        capture, capture_source = float(capture_rate), "stated"
    elif measured_capture is not None:
        capture, capture_source = measured_capture, "measured"
    else:
        fastest = max((steps[x.name] * (x.global_batch or x.batch_size) for x in plan.experiments), default=1.0)
        capture, capture_source = 2.0 * fastest, "assumed"
    return Rates(capture=capture, capture_source=capture_source, steps=steps, step_sources=sources)


def _budget(cfg, plan) -> tuple[str, float, str]:
    """(retention rule, budget bytes, where the budget comes from): the producer's rule
    (:func:`artcache.eviction.retention_rule`); ``auto`` is 90 % of the free space beyond the reserve where the
    root will be, as the producer derives it at start; no budget (the ``windows`` rule) is inf."""
    from artcache.eviction import retention_rule

    rule = retention_rule(cfg.cache.disk_budget, cfg.cache.retention)
    if isinstance(cfg.cache.disk_budget, int) and cfg.cache.disk_budget:
        return rule, float(cfg.cache.disk_budget), "cache.disk_budget"
    if not cfg.cache.disk_budget:
        return rule, math.inf, "no cache.disk_budget: live windows only"
    from artcache.fsio import space_reserve
    from artcache.producer import BUDGET_FREE_FRACTION

    where = next(p for p in [Path(plan.cache_root), *Path(plan.cache_root).parents] if p.exists())
    usage = shutil.disk_usage(where)
    free = max(0, usage.free - space_reserve(usage.total))
    return rule, float(int(BUDGET_FREE_FRACTION * free)), (f"auto: {BUDGET_FREE_FRACTION:.0%} of the "
                                                           f"{usage.free / 2**30:.2f} GiB free on {where}")


def sim_inputs(plan, cfg, rates: Rates, plan_samples: int, budget_bytes: float,
               policy: str) -> tuple[list, Any, int]:
    """(:class:`~artcache.bench.sim.ConsumerSpec` per experiment, the :class:`~artcache.bench.sim.ProducerSpec`,
    positions): the simulator's view of the run (see the module docstring's model)."""
    from artcache.bench.sim import ConsumerSpec, ProducerSpec
    from artcache.scheduler import SchedulerLimits

    consumers = []
    for x in plan.experiments:
        if not x.positions:
            continue
        lb, la = (int(v) for v in x.window.split(":"))
        held = int(x.consumer.get("eval_samples", 0) or 0)
        # an optimizer step consumes the global batch (every rank's slice of it, every micro-batch)
        consumers.append(ConsumerSpec(x.name, step_s=1.0 / rates.steps[x.name],
                                      batch_size=x.global_batch or x.batch_size,
                                      lookbehind=lb, lookahead=la, end=x.positions,
                                      epoch_len=plan_samples - held if held else None))
    limits = SchedulerLimits(max_queue=cfg.capture.max_queue, max_batch_samples=cfg.capture.batch_samples,
                             max_batch_tokens=cfg.capture.batch_tokens)
    producer = ProducerSpec(fixed_s=0.0, per_sample_s=1.0 / rates.capture, limits=limits,
                            sample_tokens=cfg.data.max_length, max_length=cfg.data.max_length,
                            artifact_bytes=plan.bytes_per_artifact_max, budget_bytes=budget_bytes, policy=policy)
    return consumers, producer, max((c.end for c in consumers), default=0)


def _part(name: str, consumers, producer, positions: int, plan_samples: int, heldout: int) -> PartEstimate:
    from artcache.bench.sim import simulate

    res = simulate(consumers, producer, positions, plan_samples)
    peak = res.max_retained + heldout
    return PartEstimate(name=name, disk_peak_bytes=peak * producer.artifact_bytes, disk_peak_artifacts=peak,
                        captures=res.captures + heldout, positions=res.positions,
                        captures_per_position=res.captures_per_position,
                        finish_s=max((r.finish_s or 0.0) for r in res.consumers.values()),
                        wait_s=sum(r.wait_s for r in res.consumers.values()))


def skipped(plan) -> str | None:
    """Why the dry run gives no estimate for ``plan`` (None: it gives one)."""
    total = sum(x.positions for x in plan.experiments)
    if not total:
        return "no experiment has positions left to train"
    if total > MAX_SIM_POSITIONS:
        return (f"{total:,} positions to simulate exceed the dry run's {MAX_SIM_POSITIONS:,}; the simulator "
                "itself (python -m artcache.bench.sim --consumer ...) runs any size")
    return None


def estimate(plan, cfg, plan_samples: int, *, capture_rate: float | None = None,
             step_rates: dict[str, float] | None = None) -> CapacityEstimate | None:
    """The capacity estimate of a planned run (module docstring); None when :func:`skipped` gives a reason.

    Args:
        plan: the :class:`~artcache.app.experiments.RunPlan`. cfg: its resolved run config. plan_samples: the
            plan's length (samples). capture_rate: stated samples per second. step_rates: stated steps per second
            per experiment name (``"*"``: every experiment).

    Raises:
        ConfigError: a stated rate <= 0.
    """
    rates = resolve_rates(plan, capture_rate, step_rates or {})
    policy, budget, budget_source = _budget(cfg, plan)
    consumers, producer, positions = sim_inputs(plan, cfg, rates, plan_samples, budget, policy)
    if skipped(plan) is not None:
        return None
    held_of = {x.name: int(x.consumer.get("eval_samples", 0) or 0) for x in plan.experiments}
    heldout = max((held_of[c.name] for c in consumers), default=0)
    root = _part("root", consumers, producer, positions, plan_samples, heldout)
    parts = [_part(c.name, [c], producer, c.end, plan_samples, held_of[c.name]) for c in consumers]
    return CapacityEstimate(retention=policy, budget_bytes=budget, budget_source=budget_source,
                            artifact_bytes=plan.bytes_per_artifact_max, plan_samples=plan_samples,
                            heldout_samples=heldout, rates=rates, root=root, experiments=parts)


def plan_length(plan, cfg) -> int:
    """The plan's length in samples: the root's published plan, else the plan built in memory exactly as the
    producer will build it (:func:`artcache.app.config.producer_config`; nothing is written)."""
    from artcache.app.config import producer_config
    from artcache.app.experiments import _load_or_build_plan
    from artcache.layout import CacheLayout
    from artcache.plan import PlanSpec
    from artcache.target import load_tokenizer, resolve_target

    p = producer_config(cfg)
    spec = PlanSpec(dataset=p.dataset, sources=tuple(p.sources), eval=p.eval, seed=p.seed, max_length=p.max_length,
                    max_samples=p.max_samples, template_options=dict(p.template_options))
    info = resolve_target(cfg.target.name)
    return len(_load_or_build_plan(CacheLayout(Path(plan.cache_root)), plan.plan_id, spec, load_tokenizer(info), info))


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def format_estimate(est: CapacityEstimate) -> str:
    """The estimate's lines of the dry-run text."""
    from artcache.report import format_bytes, table

    r = est.rates
    assumed = r.capture_source == "assumed" or "assumed" in r.step_sources.values()
    budget = "none" if math.isinf(est.budget_bytes) else format_bytes(int(est.budget_bytes))
    rates = ", ".join(f"{n} {v:.3g} steps/s ({r.step_sources[n]})" for n, v in r.steps.items())
    lines = [
        f"estimate (retention simulator, bench/sim.py): retention {est.retention}, budget {budget} "
        f"({est.budget_source}), {format_bytes(est.artifact_bytes)} per artifact at most; capture "
        f"{r.capture:.3g} samples/s ({r.capture_source}); {rates}",
        table(["estimate", "disk peak", "artifacts", "captures", "positions", "captures/position", "finish",
               "waiting"],
              [[p.name + (" (alone)" if p.name != "root" else " (all)"), format_bytes(p.disk_peak_bytes),
                p.disk_peak_artifacts, p.captures, p.positions, f"{p.captures_per_position:.3f}",
                _seconds(p.finish_s), _seconds(p.wait_s)] for p in [est.root, *est.experiments]]),
    ]
    if est.heldout_samples:
        lines.append(f"  the held-out split ({est.heldout_samples} samples, pinned) is in the disk peak and captures")
    if assumed:
        lines.append("  rates assumed (no measured or stated rate): the times are in those units only; give "
                     "--capture-rate SAMPLES_PER_S and --step-rate [NAME=]STEPS_PER_S")
    return "\n".join(lines)


__all__ = ["MAX_SIM_POSITIONS", "CapacityEstimate", "PartEstimate", "Rates", "check_capture_rate", "estimate",
           "format_estimate", "measured_rates", "parse_step_rates", "plan_length", "resolve_rates", "sim_inputs",
           "skipped"]
