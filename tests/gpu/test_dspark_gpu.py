"""DSpark on a CUDA device: the Qwen3-8B vocabulary at 512 anchors fits (the rest of DSpark's tests:
tests/unit/test_dspark.py)."""

from __future__ import annotations

import pytest
import torch

from artcache.trainers.dflash import sample_anchors
from artcache.trainers.dspark import (
    DSparkConfig,
    DSparkDraft,
    dspark_loss,
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen3_8b_vocab_at_512_anchors_fits_on_cuda():
    """The objective at Qwen3-8B's vocabulary (151,936) and width with 512 anchors × B 7 of a 3,072-token
    sequence (1 draft layer, random weights, bf16 autocast): forward + backward run, and the peak memory of the
    loss and the backward above the forward stays under 6 GiB, where an unchunked loss holds about five
    [3584, 151936] fp32 tensors (2.2 GB each: draft logits, softmax, target logits and softmax, gradient).
    Prints the peak (the figure the GPU recipe reports)."""
    dev = torch.device("cuda")
    Vq, Hq, T = 151936, 4096, 3072
    cfg = DSparkConfig(hidden_size=Hq, num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=12288, vocab_size=Vq, num_context_layers=5, mask_token_id=151669,
                       num_anchors=512)
    torch.manual_seed(0)
    emb = torch.randn(Vq, Hq, device=dev, dtype=torch.bfloat16) * 0.02
    m = DSparkDraft(cfg, emb, emb, torch.ones(Hq, device=dev))
    ctx = torch.randn(1, T, 5, Hq, device=dev, dtype=torch.bfloat16)
    last = torch.randn(1, T, Hq, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, 150000, (1, T), device=dev)
    lm = torch.ones(1, T, dtype=torch.bool, device=dev)
    a, v = sample_anchors(lm.cpu(), 512, torch.Generator().manual_seed(0))
    a, v = a.to(dev), v.to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = m(ctx, ids, a, v)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, out = dspark_loss(m, hidden, last, ids, lm, a, v)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    print(f"\nDSpark loss at V {Vq}, 512 anchors x B 7: peak {peak / 2**30:.2f} GiB above the forward; "
          f"loss {float(loss):.3f}, rows {int(out.supervised.sum())}")
    assert torch.isfinite(loss) and int(out.supervised.sum()) > 3000
    assert peak < 6 * 2**30
