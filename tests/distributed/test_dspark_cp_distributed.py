"""DSpark context parallelism (trainers/dflash/cp.py's forward, trainers/dspark/loss.py's cp_dspark_loss) across a
torch.distributed group of real processes on gloo: the loss, its three terms' sums and every gradient equal the
one-rank step's, and each rank's attention handles about half the score elements."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from artcache.errors import ConfigError
from artcache.trainers.dflash.anchors import sample_anchors
from artcache.trainers.dspark.config import DSparkConfig
from artcache.trainers.dspark.loss import dspark_loss
from artcache.trainers.dspark.model import DSparkDraft

H, V, M, T, N, B = 32, 97, 3, 301, 24, 4  # T odd: the last rank's shard ends in padding


def _model(**kw) -> DSparkDraft:
    torch.manual_seed(0)
    base = dict(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                vocab_size=V, num_context_layers=M, mask_token_id=V - 1, block_size=B, num_anchors=N, markov_rank=8)
    base.update(kw)
    cfg = DSparkConfig(**base)
    hidden = base["hidden_size"]
    return DSparkDraft(cfg, torch.randn(V, hidden), torch.randn(V, hidden) * 0.3, torch.rand(hidden) + 0.5)


def _batch():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, T, M + 1, H, generator=g)  # the context layers, then the last layer L-1
    ids = torch.randint(0, V - 1, (2, T), generator=g)
    loss_mask = torch.rand(2, T, generator=g) > 0.3
    context_valid = torch.ones(2, T, dtype=torch.bool)
    context_valid[1, T - 40:] = False  # the second row is shorter (batch padding)
    loss_mask &= context_valid
    anchors, valid = sample_anchors(loss_mask, N, torch.Generator().manual_seed(2))
    return hidden, ids, loss_mask, context_valid, anchors, valid


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from artcache.trainers.dflash.cp import all_reduce_grads, check_unpacked, context_shard, shard_bounds
    from artcache.trainers.dspark.loss import cp_dspark_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = _model()
        hidden, ids, loss_mask, cv, anchors, valid = _batch()
        shard = context_shard(hidden[:, :, :M])
        start, end, s = shard_bounds(T, world, rank)
        assert tuple(shard.shape) == (2, s, M, H)
        assert torch.equal(shard[:, : min(end, T) - start], hidden[:, start:min(end, T), :M])
        assert not shard[:, min(end, T) - start:].any()  # zeros past the end
        with pytest.raises(ConfigError, match="does not take packed batches"):
            check_unpacked(torch.zeros(2, T, dtype=torch.long))
        share, loss, outs = cp_dspark_loss(model, shard, hidden[:, :, M], ids, loss_mask, anchors, valid,
                                           context_valid=cv)
        share.backward()
        all_reduce_grads(model)
        sums = torch.stack([outs.ce_sum, outs.l1_sum, outs.conf_sum, outs.weight_sum])
        dist.all_reduce(sums)
        if rank == 0:
            save_file({"loss": loss.reshape(1), "sums": sums,
                       **{f"grad.{k}": p.grad.contiguous() for k, p in model.named_parameters()}}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_dspark_cp_two_gloo_ranks_equal_one_rank(tmp_path):
    """Two gloo ranks, each holding half the context and the blocks anchored in it (the whole last layer), give the
    one-rank DSpark loss, its Σ w·CE, Σ w·L1, Σ w·BCE and Σ w, and every gradient (Markov and confidence heads
    included; relative <= 1e-5), with a padded row and a shard ending in padding."""
    model = _model()
    hidden, ids, loss_mask, cv, anchors, valid = _batch()
    h = model(hidden[:, :, :M], ids, anchors, valid, context_valid=cv)
    ref, out = dspark_loss(model, h, hidden[:, :, M], ids, loss_mask, anchors, valid, context_valid=cv)
    ref.backward()
    ref = float(ref.detach())
    path = str(tmp_path / "rank0.safetensors")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", path), nprocs=2, join=True)
    got = load_file(path)
    assert abs(float(got["loss"][0]) - ref) <= 1e-5 * abs(ref)
    for i, want in enumerate((out.ce_sum, out.l1_sum, out.conf_sum, out.weight_sum)):
        assert abs(float(got["sums"][i]) - float(want)) <= 1e-5 * abs(float(want)), i
    for name, p in model.named_parameters():
        g = got[f"grad.{name}"]
        scale = float(p.grad.abs().max())
        assert scale > 0, name
        assert float((g - p.grad).abs().max()) <= 1e-5 * scale, name


def _sdpa_bytes(prof) -> int:
    return sum(e.cpu_memory_usage for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")


def _long_setup():
    model = _model(hidden_size=64, head_dim=16, intermediate_size=128, block_size=16, num_anchors=128)
    g = torch.Generator().manual_seed(1)
    hidden, ids = torch.randn(1, 4096, M + 1, 64, generator=g), torch.randint(0, V - 1, (1, 4096), generator=g)
    lm = torch.ones(1, 4096, dtype=torch.bool)
    anchors, valid = sample_anchors(lm, 128, torch.Generator().manual_seed(2))
    return model, hidden, ids, lm, anchors, valid


def _rank_memory(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from artcache.trainers.dflash.cp import context_shard
    from artcache.trainers.dspark.loss import cp_dspark_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, hidden, ids, lm, anchors, valid = _long_setup()
        shard = context_shard(hidden[:, :, :M])
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _, loss, _ = cp_dspark_loss(model, shard, hidden[:, :, M], ids, lm, anchors, valid)
        save_file({"sdpa_bytes": torch.tensor([float(_sdpa_bytes(prof))]), "loss": loss.reshape(1)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_dspark_cp_per_rank_attention_memory_about_half(tmp_path):
    """Measured (torch.profiler, bytes allocated inside scaled_dot_product_attention over the forward): at 4,096
    tokens and 128 anchors of block 16, each of 2 ranks allocates at most 0.6 of what one rank does, and the
    loss is the one-rank loss."""
    from torch.profiler import ProfilerActivity, profile

    model, hidden, ids, lm, anchors, valid = _long_setup()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        h = model(hidden[:, :, :M], ids, anchors, valid)
    one = _sdpa_bytes(prof)
    ref, _ = dspark_loss(model, h, hidden[:, :, M], ids, lm, anchors, valid)
    assert one > 0
    out = str(tmp_path / "mem")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_memory, args=(2, f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, join=True)
    for rank in (0, 1):
        got = load_file(f"{out}.{rank}")
        assert float(got["sdpa_bytes"][0]) <= 0.6 * one, (rank, float(got["sdpa_bytes"][0]), one)
        assert abs(float(got["loss"][0]) - float(ref.detach())) <= 1e-5 * abs(float(ref.detach()))
