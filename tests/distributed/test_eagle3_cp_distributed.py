"""EAGLE-3 context parallelism (trainers/eagle3/cp.py) across a torch.distributed group of real processes on gloo:
the loss, the per-step stats and every gradient equal the one-rank step's, and each rank's attention allocates
about half of one rank's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from artcache.errors import ConfigError
from artcache.trainers.eagle3 import Eagle3Config, Eagle3Draft, build_vocab_map
from artcache.trainers.eagle3.loss import eagle3_loss

V, VD, H = 40, 16, 32

# (name, T, padded rows, holes, attn_chunk, given denominators): T odd, so the last rank's shard ends past T
CASES = [("padded", 21, True, False, None, False), ("holes", 21, False, True, None, False),
         ("chunks", 23, True, False, 4, False), ("given_den", 21, True, False, 3, True),
         ("short", 3, False, False, None, False)]


def _model() -> Eagle3Draft:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=V,
                       draft_vocab_size=VD, ttt_steps=3)
    emb = torch.randn(V, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64) * 0.3
    counts = torch.zeros(V, dtype=torch.long)
    counts[torch.arange(0, V, 2)] = 5  # half the target ids in the draft vocab: some positions dropped
    d2t, t2d = build_vocab_map(counts, VD)
    return Eagle3Draft(cfg, emb, 1 + 0.1 * torch.randn(H, dtype=torch.float64), head, d2t, t2d, dtype=torch.float64)


def _batch(T: int, padded: bool, holes: bool):
    g = torch.Generator().manual_seed(T)
    aux = torch.randn(2, T, 3, H, generator=g, dtype=torch.float64)
    last = torch.randn(2, T, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (2, T), generator=g)
    lm = torch.rand(2, T, generator=g) < 0.8
    valid = torch.ones(2, T, dtype=torch.bool)
    if padded:
        valid[1, T - 7:] = False  # the second row is shorter (batch padding), ending in rank 1's shard
        aux[1, T - 7:] = float("nan")  # garbage at padding stays out
    if holes:
        valid[0, 4] = valid[1, 13] = False  # not a right-padded prefix: the key mask is used
    return aux, last, ids, lm & valid, valid


def _one_rank(T, padded, holes, chunk):
    model = _model()
    aux, last, ids, lm, valid = _batch(T, padded, holes)
    loss, stats = eagle3_loss(model, aux, last, ids, lm, valid, attn_chunk=chunk)
    loss.backward()
    return model, loss.detach(), stats


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from artcache.trainers.dflash.cp import all_reduce_grads, context_shard
    from artcache.trainers.eagle3.cp import cp_eagle3_loss, cp_forward, cp_kept_counts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        got = {}
        for name, T, padded, holes, chunk, given in CASES:
            model = _model()
            aux, last, ids, lm, valid = _batch(T, padded, holes)
            den = None
            if given:  # as the consumer passes them: each rank counts its own positions, summed over the world
                den = cp_kept_counts(model, last, ids, lm, valid)
                dist.all_reduce(den)
                den = den / world
            share, loss, stats = cp_eagle3_loss(model, context_shard(aux), last, ids, lm, valid, denominators=den,
                                                attn_chunk=chunk)
            share.backward()
            all_reduce_grads(model)
            if given:
                for p in model.parameters():
                    p.grad /= world
                loss = loss / world
            vec = stats.to_tensor()
            dist.all_reduce(vec)
            got.update({f"{name}.loss": loss.reshape(1), f"{name}.stats": vec,
                        **{f"{name}.grad.{k}": p.grad.contiguous() for k, p in model.named_parameters()}})
        with pytest.raises(ConfigError, match="aux_shard has shape"):
            cp_forward(_model(), torch.zeros(2, 5, 3, H, dtype=torch.float64), torch.zeros(2, 21, dtype=torch.long))
        if rank == 0:
            save_file(got, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_eagle3_cp_two_gloo_ranks_equal_one_rank(tmp_path):
    """Two gloo ranks, each holding half the positions' auxiliary layers (the whole last layer and ids), give the
    one-rank EAGLE-3 loss, its per-step sums (soft-CE, kept, correct, supervised) and every gradient (relative
    <= 1e-5, float64): a padded row, a shard ending past T, validity with holes (the key mask), the attention in
    chunks inside a shard, T = 3 over 2 ranks (rank 1 keeps no position, so its lm_head gets no gradient:
    all_reduce_grads still joins every all-reduce, with zeros), and the consumer's given per-step denominators."""
    refs = {name: _one_rank(T, padded, holes, chunk) for name, T, padded, holes, chunk, _ in CASES}
    path = str(tmp_path / "rank0.safetensors")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", path), nprocs=2, join=True)
    got = load_file(path)
    for name, (model, loss, stats) in refs.items():
        assert abs(float(got[f"{name}.loss"][0]) - float(loss)) <= 1e-5 * abs(float(loss)), name
        want = stats.to_tensor()
        assert int(stats.kept.sum()) > 0, name
        assert name == "short" or int((stats.total - stats.kept).sum()) > 0, name  # some positions dropped
        assert torch.allclose(got[f"{name}.stats"], want, rtol=1e-5, atol=0), (name, got[f"{name}.stats"], want)
        for k, p in model.named_parameters():
            g = got[f"{name}.grad.{k}"]
            scale = float(p.grad.abs().max())
            assert scale > 0, (name, k)
            assert float((g - p.grad).abs().max()) <= 1e-5 * scale, (name, k)


def _sdpa_bytes(prof) -> int:
    return sum(e.cpu_memory_usage for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")


def _long_setup():
    """4,096 positions (chunked attention: 1,024-position chunks on a CPU, two per rank), 3 TTT steps, float32."""
    torch.manual_seed(0)
    h, v, vd = 64, 256, 128
    cfg = Eagle3Config(hidden_size=h, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=v,
                       draft_vocab_size=vd, ttt_steps=3)
    d2t, t2d = build_vocab_map(torch.ones(v, dtype=torch.long), vd)
    model = Eagle3Draft(cfg, torch.randn(v, h), torch.ones(h), torch.randn(v, h) * 0.3, d2t, t2d)
    g = torch.Generator().manual_seed(1)
    T = 4096
    ones = torch.ones(1, T, dtype=torch.bool)
    return (model, torch.randn(1, T, 3, h, generator=g), torch.randn(1, T, h, generator=g),
            torch.randint(0, v, (1, T), generator=g), ones, ones)


def _rank_memory(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from artcache.trainers.dflash.cp import context_shard
    from artcache.trainers.eagle3.cp import cp_eagle3_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, aux, last, ids, lm, valid = _long_setup()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _, loss, _ = cp_eagle3_loss(model, context_shard(aux), last, ids, lm, valid)
        save_file({"sdpa_bytes": torch.tensor([float(_sdpa_bytes(prof))]), "loss": loss.reshape(1)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_eagle3_cp_per_rank_attention_memory_about_half(tmp_path):
    """Measured (torch.profiler, bytes allocated inside scaled_dot_product_attention over the forward): at 4,096
    tokens and 3 TTT steps, each of 2 ranks allocates at most 0.6 of what one rank does, and the loss is the
    one-rank loss (relative 1e-5, float32)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    model, aux, last, ids, lm, valid = _long_setup()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ref, _ = eagle3_loss(model, aux, last, ids, lm, valid)
    one = _sdpa_bytes(prof)
    assert one > 0
    out = str(tmp_path / "mem")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_memory, args=(2, f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, join=True)
    for rank in (0, 1):
        got = load_file(f"{out}.{rank}")
        assert float(got["sdpa_bytes"][0]) <= 0.6 * one, (rank, float(got["sdpa_bytes"][0]), one)
        assert abs(float(got["loss"][0]) - float(ref.detach())) <= 1e-5 * abs(float(ref.detach()))


def _rank_missing_grad(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from artcache.trainers.dflash.cp import all_reduce_grads

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(3, 2))
        for p in model.parameters():
            p.data.fill_(1.0)
        x = torch.full((1, 3), float(rank + 1))
        loss = model[0](x).sum() + (model[1](x).sum() if rank == 0 else 0.0)  # rank 1: no gradient for model[1]
        loss.backward()
        all_reduce_grads(model)
        if rank == 0:
            save_file({k: p.grad for k, p in model.named_parameters()}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_regression_all_reduce_grads_joins_with_a_missing_gradient(tmp_path):
    """Bug: ``all_reduce_grads`` skipped a parameter without a gradient, so a rank whose context-parallel share did
    not reach it (an EAGLE-3 shard that kept no position: no lm_head gradient) joined one all-reduce fewer than its
    peers and gloo aborted on a collective mismatch. A missing gradient now counts as zeros: the sum is the peers'."""
    out = str(tmp_path / "grads.safetensors")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_missing_grad, args=(2, f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, join=True)
    got = load_file(out)
    assert torch.equal(got["0.weight"], torch.full((2, 3), 3.0))  # x = 1 on rank 0, 2 on rank 1
    assert torch.equal(got["0.bias"], torch.full((2,), 2.0))
    assert torch.equal(got["1.weight"], torch.full((2, 3), 1.0))  # rank 0's alone
    assert torch.equal(got["1.bias"], torch.full((2,), 1.0))
