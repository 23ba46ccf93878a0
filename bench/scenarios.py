"""Scenario definitions: which consumers run beside the one producer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConsumerSpec:
    consumer_id: str
    draft: str
    block_size: int


@dataclass(frozen=True)
class Scenario:
    name: str
    consumers: tuple[ConsumerSpec, ...]


SCENARIOS = {
    "1p1c": Scenario("1p1c", (ConsumerSpec("dflash-b16", "dflash", 16),)),
    "1p3c": Scenario("1p3c", tuple(ConsumerSpec(f"dflash-b{b}", "dflash", b) for b in (4, 8, 16))),
}


def resolve(name: str) -> list[Scenario]:
    """``all`` → every scenario in order; otherwise the named one (KeyError names accepted ones)."""
    if name == "all":
        return list(SCENARIOS.values())
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; accepted: {', '.join([*SCENARIOS, 'all'])}")
    return [SCENARIOS[name]]
