"""FP8 captures on a CUDA device: the device collator dequantises as collate does (the rest: tests/unit/test_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from artcache import store
from tests.unit import test_fp8 as fast_part
from tests.unit.test_fp8 import C8, _leased, capture, fp_of

layout = fast_part.layout  # a fixture of tests/unit/test_fp8.py


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_collator_dequantises_fp8_as_collate_does(layout):
    """The CUDA consumer's reader-thread collator (main's DeviceCollator) gives an fp8 root's batch
    dequantised into bf16 on the device, equal to the CPU collate's fp32 values rounded to bf16."""
    from artcache.trainers.consumer.reader import DeviceCollator, collate

    items = []
    for i, (t, seed) in enumerate(((12, 0), (7, 1))):
        _, ts = capture(t=t, seed=seed)
        fp = fp_of(ts)
        store.publish(layout, fp, C8, ts)
        items.append(_leased(store.read(layout, fp, C8, pin=True), i))
    for layers in (None, slice(0, 1), torch.tensor([1, 1, 0])):
        ref = collate(items, torch.device("cpu"), layers)
        got = DeviceCollator(torch.device("cuda"), layers)(items).wait()
        assert got.hidden.device.type == "cuda" and got.hidden.dtype == torch.bfloat16
        assert torch.equal(got.hidden.cpu(), ref.hidden.to(torch.bfloat16))
        for name in ("input_ids", "loss_mask", "valid"):
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name)), name
