"""A target placed on a CUDA device (the rest of target placement: tests/unit/test_target_devices.py)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_target_devices import placed_equals_one_device


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_placed_over_two_gpus_is_captured_as_on_one(tiny_target, fake_plan):
    """Layers 0-2 on cuda:0, 3-5 on cuda:1: hooks read each layer where it lives, captures gathered on cuda:0
    and copied to the host equal the one-GPU model's (fp32)."""
    placed_equals_one_device(tiny_target, fake_plan, ["cuda:0", "cuda:1"])
