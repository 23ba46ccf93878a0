"""Scenario definitions: which consumers run beside the one producer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConsumerSpec:
    """One bench consumer. ``anchors``: DFlash anchors per sequence (None: the bench's ``--anchors``);
    ``ttt_steps``: EAGLE-3 training-time-test steps; ``start_s``: seconds after the first consumer started
    that this one starts; ``fast``: the consumer whose rate is compared with its rate alone (``solo``)."""

    consumer_id: str
    draft: str
    block_size: int
    anchors: int | None = None
    ttt_steps: int = 7
    draft_vocab: int | None = None  # EAGLE-3 pruned vocabulary (None: the consumer's default)
    start_s: float = 0.0
    fast: bool = False


@dataclass(frozen=True)
class Scenario:
    """``modes``: the modes run by default (empty: artcache with the baselines of
    :func:`artcache.bench.run.parse_modes`); ``window``, ``steps``, ``max_length``: this scenario's defaults
    for the bench's ``--window`` / ``--steps`` / ``--max-length`` (per device: ``{"cpu": n, "cuda": n}``);
    ``in_all``: run by ``--scenario all``."""

    name: str
    consumers: tuple[ConsumerSpec, ...]
    modes: tuple[str, ...] = ()
    window: str | None = None
    steps: dict[str, int] | None = None
    max_length: dict[str, int] | None = None
    in_all: bool = True


#: heterogeneous consumers: speeds differ by >= 1.5x (a DFlash B4 with few anchors; a DFlash B16 with
#: more; an EAGLE-3 unrolling 7 TTT steps), started at different times (the slowest first, the fastest last, so
#: it passes the others and leads them by most of the run); small windows, so that under the windows-only
#: rule what the slower ones read again was evicted. CPU sizes (measured on the 2-core machine, tiny random
#: target, 128 tokens: about 0.27 / 0.78 / 0.9 s per step under load); on CUDA the bench's anchors apply
HETERO = Scenario(
    "hetero",
    (ConsumerSpec("eagle3-ttt7", "eagle3", 16, ttt_steps=7, draft_vocab=8192, start_s=0.0),
     ConsumerSpec("dflash-b16", "dflash", 16, anchors=8, start_s=10.0),
     ConsumerSpec("dflash-b4", "dflash", 4, anchors=4, start_s=20.0, fast=True)),
    modes=("artcache", "windows", "tight", "solo"), window="2:8", steps={"cpu": 200, "cuda": 1500},
    max_length={"cpu": 128, "cuda": 2048}, in_all=False)

SCENARIOS = {
    "1p1c": Scenario("1p1c", (ConsumerSpec("dflash-b16", "dflash", 16),)),
    "1p3c": Scenario("1p3c", tuple(ConsumerSpec(f"dflash-b{b}", "dflash", b) for b in (4, 8, 16))),
    "hetero": HETERO,
}


def resolve(name: str) -> list[Scenario]:
    """``all`` → every scenario marked ``in_all`` (1p1c, 1p3c), in order; otherwise the named one (KeyError
    names accepted ones)."""
    if name == "all":
        return [s for s in SCENARIOS.values() if s.in_all]
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; accepted: {', '.join([*SCENARIOS, 'all'])}")
    return [SCENARIOS[name]]
