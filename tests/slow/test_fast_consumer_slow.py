"""The fast consumer on a real run (minutes; the rest: tests/unit/test_fast_consumer.py)."""

from __future__ import annotations

import math

import pytest

from artcache.trainers.speed import SpeedOptions
from tests.unit import test_fast_consumer as fast_part
from tests.unit.test_fast_consumer import M, _batch, _dspark, _rel

_one_thread = fast_part._one_thread  # a fixture of tests/unit/test_fast_consumer.py


def test_compiled_dspark_step_runs_and_matches_eager():
    """``--compile on`` for DSpark (the forward and the chunked loss body ``torch.compile``-d) runs on the CPU
    and gives the eager sync-free step's loss and gradients."""
    batch = _batch(3, 24, M, 10)
    results = []
    for compile_mode in ("off", "on"):
        draft = _dspark(speed=SpeedOptions(sync_free=True, ce_impl="chunked", compile=compile_mode))
        loss, sums = draft.loss(batch)
        loss.backward()
        grads = [p.grad.clone() for p in draft.model.parameters() if p.requires_grad]
        results.append((float(loss), grads, sums.resolve()))
    (l0, g0, s0), (l1, g1, s1) = results
    assert math.isfinite(l1) and l1 == pytest.approx(l0, rel=1e-4)
    assert max(_rel(a, b) for a, b in zip(g1, g0, strict=True)) < 1e-3
    assert s1.den == s0.den
