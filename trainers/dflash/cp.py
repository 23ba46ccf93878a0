"""Context parallelism for the DFlash and DSpark training steps: the sequence split across the ranks of a
``torch.distributed`` group (EAGLE-3's, on the same layout: :mod:`artcache.trainers.eagle3.cp`).

DSpark's backbone is :class:`DFlashDraft` itself, so :func:`cp_forward` serves both; the DSpark loss on a rank's
blocks is :func:`artcache.trainers.dspark.loss.cp_dspark_loss` (its Markov and confidence heads work on each
block's own slots, and its target states are read at the blocks' positions of the whole ``[b, T, H]`` last layer).

Layout over ``R`` ranks for a batch of length ``T`` (padded to ``R·S``, ``S = ceil(T / R)``):

- **Context**: rank ``r`` holds the captured layers of positions ``[r·S, (r+1)·S)`` only
  (``context_states`` [b, S, m, H], the large tensor: ``1/R`` of it per rank). ``fc`` and
  ``context_norm`` are per position, so each rank computes its shard of the context alone.
- **Anchors**: drawn on every rank from the same generator over the whole sequence (``input_ids`` and
  ``loss_mask``, [b, T], are small and held in full), exactly as one rank draws them; rank ``r`` keeps
  the blocks whose anchor lies in its shard. Their queries, block keys/values and MLPs are computed
  there only.
- **Exchange**: in every layer each rank projects its context shard to keys/values (k/v projection,
  k RMSNorm, RoPE at the global positions) and the shards are **all-gathered**, so each rank's block
  queries see the keys/values of the whole context ([b, kv heads, R·S, d] per layer, the small
  tensor: ``kv heads · d`` values per position against the scores' ``heads · T`` per query row). A
  block query still sees only context positions before its anchor (:func:`build_attention_mask` at
  global positions). Backward of the gather sums the key/value gradients of every rank and hands each
  rank its shard's (an all-reduce), so each rank's parameter gradients are those of the sum of the
  ranks' losses through its own computation; :func:`all_reduce_grads` sums them.
- **Loss**: each rank's decay-weighted cross-entropy sum over its blocks is divided by the global sum
  of weights (an all-reduce of the per-rank sums), so the ranks' losses add up to the one-rank loss
  (DSpark: each of its three terms' weighted sums, over the same global ``Σ w``).

Per rank the attention scores are ``[b, heads, N_r·B, R·S + N_r·B]`` for its ``N_r ≈ N/R`` blocks:
about ``1/R`` of one rank's ``N·B × (T + N·B)``, plus the gathered context keys/values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from artcache.errors import ConfigError

from .loss import LossStats, dflash_loss
from .model import DFlashDraft, _rope, build_attention_mask

__all__ = ["all_reduce_grads", "check_unpacked", "context_shard", "cp_attention_elements", "cp_forward", "cp_loss",
           "local_anchors", "shard_bounds"]


def shard_bounds(seq_len: int, world: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, S)``: rank ``rank``'s context positions ``[start, end)`` of a sequence of ``seq_len``
    padded to ``world · S`` (``S = ceil(seq_len / world)``; ``end`` may pass ``seq_len``: padding).

    Raises:
        ConfigError: ``world < 1`` or ``rank`` outside ``[0, world)``.
    """
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} of world size {world} is invalid: accepted 0 <= rank < world size, world >= 1")
    s = -(-seq_len // world)
    return rank * s, (rank + 1) * s, s


def check_unpacked(doc_ids: Tensor | None) -> None:
    """Refuse a packed batch (``doc_ids`` given, :mod:`artcache.trainers.packing`): the split context has no
    per-document attention.

    Raises:
        ConfigError: ``doc_ids`` is not None.
    """
    if doc_ids is not None:
        raise ConfigError("context parallelism (--cp) does not take packed batches; leave --pack-tokens at 0")


def context_shard(context: Tensor, group=None) -> Tensor:
    """This rank's shard of a whole sequence's context: ``context`` [b, T, ...] -> [b, S, ...] holding positions
    ``[start, end)`` of :func:`shard_bounds` (``S = ceil(T / world)``), zeros past ``T`` (a new tensor, the
    input's dtype and device). ``group``: the CP group (default: the world)."""
    b, T = context.shape[:2]
    start, end, S = shard_bounds(T, dist.get_world_size(group), dist.get_rank(group))
    shard = context.new_zeros((b, S) + tuple(context.shape[2:]))
    if start < T:
        shard[:, : min(end, T) - start] = context[:, start:min(end, T)]
    return shard


def local_anchors(anchors: Tensor, valid: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    """The blocks whose anchor lies in ``[start, end)``, packed to the front: ``(anchors [b, N_r] long,
    valid [b, N_r] bool)`` with ``N_r`` the most any row keeps (at least 1), ascending per row like the input.

    Args:
        anchors: [b, N] long, ascending among the valid ones. valid: [b, N] bool.
    """
    keep = valid.bool() & (anchors >= start) & (anchors < end)
    n = max(1, int(keep.sum(dim=1).max()))
    idx = torch.arange(anchors.shape[1], device=anchors.device).expand_as(anchors)
    order = torch.where(keep, idx, idx + anchors.shape[1]).argsort(dim=1)[:, :n]  # kept first, in order
    got = anchors.gather(1, order)
    ok = keep.gather(1, order)
    return torch.where(ok, got, torch.zeros_like(got)), ok


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 ([b, heads, S, d] shards -> [b, heads, R·S, d]); backward all-reduces the
    gradient (SUM) and returns this rank's slice. Gloo and NCCL alike (no reduce-scatter needed)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        s = grad.shape[2] // ctx.world
        return grad[:, :, ctx.rank * s:(ctx.rank + 1) * s], None


def cp_forward(model: DFlashDraft, context_shard: Tensor, input_ids: Tensor, anchors: Tensor, valid: Tensor,
               context_valid: Tensor | None = None, group=None) -> tuple[Tensor, Tensor, Tensor]:
    """:meth:`DFlashDraft.forward` for this rank's blocks, the context split across the group.

    Args:
        context_shard: [b, S, m, H]: this rank's positions ``[start, end)`` of :func:`shard_bounds` (zeros
            past the sequence's end).
        input_ids: [b, T] long, the whole sequence. anchors, valid: [b, N], the whole draw (every rank the
            same). context_valid: optional [b, T] bool. group: the CP group (default: the world).

    Returns:
        ``(hidden [b, N_r, B, H], anchors [b, N_r], valid [b, N_r])``: this rank's blocks
        (:func:`local_anchors`), rows of invalid blocks zero, as :meth:`DFlashDraft.forward` returns them
        for those anchors.

    Raises:
        ConfigError: the shard's length is not ``ceil(T / world)``, or shapes disagree with the config.
    """
    cfg = model.cfg
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, T = input_ids.shape
    start, end, S = shard_bounds(T, world, rank)
    if context_shard.dim() != 4 or tuple(context_shard.shape[:2]) != (b, S) or \
            tuple(context_shard.shape[2:]) != (cfg.num_context_layers, cfg.hidden_size):
        raise ConfigError(f"context_shard has shape {tuple(context_shard.shape)}; accepted [b={b}, S={S}, "
                          f"m={cfg.num_context_layers}, H={cfg.hidden_size}] (S = ceil(T={T} / world size {world}))")
    B, H, m = cfg.block_size, cfg.hidden_size, cfg.num_context_layers
    dev = input_ids.device
    la, lv = local_anchors(anchors.long(), valid.bool(), start, end)
    Tp = world * S
    cv = torch.zeros(b, Tp, dtype=torch.bool, device=dev)
    cv[:, :T] = True if context_valid is None else context_valid.bool()

    ctx = model.context_norm(model.fc(context_shard.reshape(b, S, m * H).to(model.dtype)))
    ctx_pos = torch.arange(start, end, device=dev).expand(b, S)
    n = la.shape[1]
    block_ids = torch.full((b, n, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, la)
    x = model.embed(block_ids).reshape(b, n * B, H)
    q_pos = (la[:, :, None] + torch.arange(B, device=dev)).reshape(b, n * B)
    mask = build_attention_mask(la, lv, Tp, B, cv)  # [b, 1, n·B, Tp + n·B]
    for layer in model.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = _rope(att.q_norm(att.q_proj(h).view(b, n * B, att.nh, att.hd)).transpose(1, 2), q_pos, att.theta)
        kc = _rope(att.k_norm(att.k_proj(ctx).view(b, S, att.nkv, att.hd)).transpose(1, 2), ctx_pos, att.theta)
        vc = att.v_proj(ctx).view(b, S, att.nkv, att.hd).transpose(1, 2)
        kb = _rope(att.k_norm(att.k_proj(h).view(b, n * B, att.nkv, att.hd)).transpose(1, 2), q_pos, att.theta)
        vb = att.v_proj(h).view(b, n * B, att.nkv, att.hd).transpose(1, 2)
        k = torch.cat((_GatherSeq.apply(kc, group), kb), dim=2)
        v = torch.cat((_GatherSeq.apply(vc, group), vb), dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=att.nh != att.nkv)
        x = x + att.o_proj(o.transpose(1, 2).reshape(b, n * B, att.nh * att.hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.norm(x).reshape(b, n, B, H)
    return torch.where(lv[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=dev)), la, lv


def cp_loss(model: DFlashDraft, context_shard: Tensor, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor,
            valid: Tensor, context_valid: Tensor | None = None, group=None, **loss_kwargs) -> tuple[Tensor, Tensor,
                                                                                                   LossStats]:
    """This rank's share of the DFlash loss: ``(share, loss, stats)``.

    ``share`` (backward this one) = this rank's Σ w·CE over its blocks / the group's Σ w, so the shares add
    up to :func:`dflash_loss` of one rank holding everything; ``loss`` is that sum (detached, the same on every
    rank); ``stats`` the group's summed :class:`LossStats`. ``loss_kwargs`` go to :func:`dflash_loss`.
    """
    hidden, la, lv = cp_forward(model, context_shard, input_ids, anchors, valid, context_valid, group)
    local, stats = dflash_loss(model, hidden, input_ids, loss_mask, la, lv, context_valid=context_valid,
                               **loss_kwargs)
    vec = stats.to_tensor()
    dist.all_reduce(vec, group=group)
    total = LossStats.from_tensor(vec)
    denom = total.weight_sum.to(local.dtype).clamp_min(torch.finfo(local.dtype).tiny)
    share = local * (stats.weight_sum.to(local.dtype) / denom)
    loss = share.detach().clone()
    dist.all_reduce(loss, group=group)
    return share, loss, total


def all_reduce_grads(model: torch.nn.Module, group=None) -> None:
    """Sum every trainable parameter's gradient over the group (after each rank's backward of its
    :func:`cp_loss` share): the gradient of the one-rank loss. A missing gradient counts as zeros (a rank whose
    share did not reach a parameter, e.g. an EAGLE-3 shard that kept no position, still joins every all-reduce)."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)


def cp_attention_elements(num_blocks: int, block_size: int, seq_len: int, heads: int, kv_heads: int,
                          world: int = 1) -> int:
    """Elements of one layer's attention operands on one rank (one sequence): the score matrix
    ``heads × N_r·B × (R·S + N_r·B)`` plus the keys/values ``2 × kv_heads × (R·S + N_r·B)`` per head dim 1,
    with ``N_r = ceil(N / R)`` (an even split of the anchors) and ``S = ceil(T / R)``."""
    nr = -(-num_blocks // world)
    keys = world * -(-seq_len // world) + nr * block_size
    return heads * nr * block_size * keys + 2 * kv_heads * keys
