"""DFlash context parallelism across a torch.distributed group of real processes on gloo (the single-process parts:
tests/unit/test_dflash_cp.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from artcache.trainers.dflash.anchors import sample_anchors
from artcache.trainers.dflash.config import DFlashConfig
from artcache.trainers.dflash.cp import shard_bounds
from artcache.trainers.dflash.loss import dflash_loss
from artcache.trainers.dflash.model import DFlashDraft

H, V, M, T, N, B = 32, 97, 3, 301, 24, 4  # T odd: the last rank's shard ends in padding


def _model() -> DFlashDraft:
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       vocab_size=V, num_context_layers=M, mask_token_id=V - 1, block_size=B, num_anchors=N)
    return DFlashDraft(cfg, torch.randn(V, H), torch.randn(V, H) * 0.3, dtype=torch.float32)


def _batch():
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(2, T, M, H, generator=g)
    ids = torch.randint(0, V - 1, (2, T), generator=g)
    loss_mask = torch.rand(2, T, generator=g) > 0.3
    context_valid = torch.ones(2, T, dtype=torch.bool)
    context_valid[1, T - 40:] = False  # the second row is shorter (batch padding)
    loss_mask &= context_valid
    anchors, valid = sample_anchors(loss_mask, N, torch.Generator().manual_seed(2))
    return ctx, ids, loss_mask, context_valid, anchors, valid


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from artcache.trainers.dflash.cp import all_reduce_grads, cp_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = _model()
        ctx, ids, loss_mask, cv, anchors, valid = _batch()
        start, end, s = shard_bounds(T, world, rank)
        shard = torch.zeros(2, s, M, H)
        shard[:, : max(0, min(end, T) - start)] = ctx[:, start:min(end, T)]
        share, loss, stats = cp_loss(model, shard, ids, loss_mask, anchors, valid, context_valid=cv)
        share.backward()
        all_reduce_grads(model)
        if rank == 0:
            save_file({"loss": loss.reshape(1), "weight_sum": stats.weight_sum.reshape(1).float(),
                       **{f"grad.{k}": p.grad.contiguous() for k, p in model.named_parameters()}}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_cp_two_gloo_ranks_equal_one_rank(tmp_path):
    """Two gloo ranks, each holding half the context and the blocks anchored in it, give the one-rank loss and
    gradients (relative <= 1e-5), with a padded row and a shard ending in padding."""
    model = _model()
    ctx, ids, loss_mask, cv, anchors, valid = _batch()
    hidden = model(ctx, ids, anchors, valid, context_valid=cv)
    ref, ref_stats = dflash_loss(model, hidden, ids, loss_mask, anchors, valid, context_valid=cv)
    ref.backward()
    ref = float(ref.detach())
    out = str(tmp_path / "rank0.safetensors")
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, init, out), nprocs=2, join=True)
    got = load_file(out)
    assert abs(float(got["loss"][0]) - ref) <= 1e-5 * abs(ref)
    assert abs(float(got["weight_sum"][0]) - float(ref_stats.weight_sum)) <= 1e-5 * float(ref_stats.weight_sum)
    for name, p in model.named_parameters():
        g = got[f"grad.{name}"]
        scale = float(p.grad.abs().max())
        assert scale > 0, name
        assert float((g - p.grad).abs().max()) <= 1e-5 * scale, name


def _sdpa_bytes(prof) -> int:
    return sum(e.cpu_memory_usage for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")


def _long_setup():
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=V, num_context_layers=M, mask_token_id=V - 1, block_size=16, num_anchors=128)
    model = DFlashDraft(cfg, torch.randn(V, 64), torch.randn(V, 64) * 0.3)
    g = torch.Generator().manual_seed(1)
    ctx, ids = torch.randn(1, 4096, M, 64, generator=g), torch.randint(0, V - 1, (1, 4096), generator=g)
    lm = torch.ones(1, 4096, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 128, torch.Generator().manual_seed(2))
    return model, ctx, ids, lm, anchors, valid


def _rank_memory(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from artcache.trainers.dflash.cp import cp_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, ctx, ids, lm, anchors, valid = _long_setup()
        start, end, _ = shard_bounds(4096, world, rank)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _, loss, _ = cp_loss(model, ctx[:, start:end].contiguous(), ids, lm, anchors, valid)
        save_file({"sdpa_bytes": torch.tensor([float(_sdpa_bytes(prof))]), "loss": loss.reshape(1)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_cp_per_rank_attention_memory_about_half(tmp_path):
    """Measured (torch.profiler, bytes allocated inside scaled_dot_product_attention over the forward): at 4,096
    tokens and 128 anchors of block 16, each of 2 ranks allocates at most 0.6 of what one rank does, and the
    loss is the one-rank loss."""
    from torch.profiler import ProfilerActivity, profile

    model, ctx, ids, lm, anchors, valid = _long_setup()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ref, _ = dflash_loss(model, model(ctx, ids, anchors, valid), ids, lm, anchors, valid)
    one = _sdpa_bytes(prof)
    assert one > 0
    out = str(tmp_path / "mem")
    mp.spawn(_rank_memory, args=(2, f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, join=True)
    for rank in (0, 1):
        got = load_file(f"{out}.{rank}")
        assert float(got["sdpa_bytes"][0]) <= 0.6 * one, (rank, float(got["sdpa_bytes"][0]), one)
        assert abs(float(got["loss"][0]) - float(ref.detach())) <= 1e-5 * abs(float(ref.detach()))
