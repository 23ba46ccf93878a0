"""DFlash on a CUDA device (the rest of DFlash's tests: tests/unit/test_dflash.py)."""

from __future__ import annotations

import pytest
import torch

from artcache.trainers.dflash import (
    dflash_loss,
    sample_anchors,
)
from tests.unit.test_dflash import tiny_batch, tiny_model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_matches_sdpa_on_cuda_with_backward():
    """On CUDA the flex path is compiled (fused, block-sparse) and trains: loss, gradients and
    outputs agree with SDPA on a padded batch with invalid anchors."""
    dev = torch.device("cuda")
    results = {}
    for impl in ("sdpa", "flex"):
        model = tiny_model(dtype=torch.float32, head_dim=16).to(dev)  # compiled flex needs head_dim >= 16
        model.attn_impl = impl
        ctx, ids = tiny_batch(b=2, T=40, dtype=torch.float32)
        ctx, ids = ctx.to(dev), ids.to(dev)
        cv = torch.ones(2, 40, dtype=torch.bool, device=dev)
        cv[1, 30:] = False
        lm = cv.clone()
        a, v = sample_anchors(lm.cpu(), 7, torch.Generator().manual_seed(0))
        a, v = a.to(dev), v.to(dev)
        v[0, -1] = False  # a padded block
        out = model(ctx, ids, a, v, context_valid=cv)
        loss, _ = dflash_loss(model, out, ids, lm, a, v, context_valid=cv)
        loss.backward()
        results[impl] = (out.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (o1, l1, g1), (o2, l2, g2) = results["sdpa"], results["flex"]
    assert torch.isfinite(o2).all() and (o2[0, -1] == 0).all()
    torch.testing.assert_close(o2, o1, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(l2, l1, rtol=2e-4, atol=2e-4)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=2e-3, atol=2e-4)
