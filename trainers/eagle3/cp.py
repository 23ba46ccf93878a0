"""Context parallelism for the EAGLE-3 training step: the sequence split across the ranks of a
``torch.distributed`` group (the layout of :mod:`artcache.trainers.dflash.cp`, whose :func:`shard_bounds`,
:func:`context_shard` and key/value all-gather it uses).

Over ``R`` ranks for a batch of length ``T`` (padded to ``R·S``, ``S = ceil(T / R)``), rank ``r`` holds:

- **Queries**: positions ``[start, end)`` of :func:`~artcache.trainers.dflash.cp.shard_bounds` for every TTT
  step: the captured auxiliary layers of those positions only (``aux_shard`` [b, S, 3, H], the large input: ``1/R``
  of it per rank), their ``fc``, midlayer and MLP. ``input_ids`` [b, T] is small and held in full: step i at t
  reads the token ``t + 1 + i``, which may lie past the shard.
- **Exchange**: EAGLE-3 has one decoder layer. Its step-0 keys/values (k/v projections of the rank's positions,
  RoPE at the global positions) are **all-gathered** once per forward, so step i's query at t sees the step-0
  keys of positions ``<= t`` of the whole sequence; the keys of steps ``1..i`` that it sees are its own position's
  (the diagonal of :func:`~artcache.trainers.eagle3.model.build_ttt_mask`), computed on this rank. The backward of
  the gather all-reduces the key/value gradients and hands each rank its shard's.
- **Labels**: step i at t is scored against the target's distribution at ``t + 1 + i``: the target logits of
  the window ``[start, min(T, end + steps))`` of the whole last layer ``[b, T, H]`` (a rank reads ``steps``
  positions past its shard).
- **Loss**: each rank's per-step sums over its own positions divided by the global per-step denominators (kept
  positions, all-reduced or given), so the ranks' losses add up to the one-rank :func:`eagle3_loss`; the
  gradients summed over the ranks (:func:`~artcache.trainers.dflash.cp.all_reduce_grads`) are its gradient.

Per rank the attention's queries are ``S`` of the ``T`` positions (score rows ``S × (up to T + steps·S)`` per
step); rank ``r``'s queries see the keys of ``[0, end)``, so the last rank's work is the largest (causal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from artcache.errors import ConfigError, DataError
from artcache.trainers.dflash.cp import _GatherSeq, shard_bounds

from .config import EAGLE3_NUM_AUX
from .loss import Eagle3Stats, kept_steps, supervision_masks, target_soft_labels
from .model import Eagle3Draft, _TTTChunks, default_attn_chunk

__all__ = ["cp_eagle3_loss", "cp_forward", "cp_kept_counts"]


def _check_int(name: str, value, default: int) -> int:
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1 or None, got {value!r}")
    return value


def cp_forward(model: Eagle3Draft, aux_shard: Tensor, input_ids: Tensor, valid: Tensor | None = None, *,
               steps: int | None = None, validate: bool = True, attn_chunk: int | None = None,
               group=None) -> list[Tensor]:
    """:meth:`Eagle3Draft.forward` for this rank's positions, the sequence split across the group.

    Args:
        aux_shard: [b, S, 3, H]: this rank's positions ``[start, end)`` of
            :func:`~artcache.trainers.dflash.cp.shard_bounds` (:func:`~artcache.trainers.dflash.cp.context_shard`;
            zeros past the sequence's end).
        input_ids: [b, T] long, the whole sequence. valid: optional [b, T] bool (False: padding).
        steps, validate: as :meth:`Eagle3Draft.forward`'s.
        attn_chunk: query positions per chunk of the attention (at most ``S``); None:
            :func:`~artcache.trainers.eagle3.model.default_attn_chunk` of ``T``. A chunk ``[a, e)`` of the shard
            attends to the gathered step-0 keys ``[0, start + e)`` under
            :func:`~artcache.trainers.eagle3.model.ttt_chunk_mask` at the global positions.
        group: the CP group (default: the world).

    Returns:
        ``steps`` tensors [b, S, H] in the module dtype: each step's pre-norm output at positions ``[start, end)``
        (those past ``T``: padding, finite, never supervised), equal to :meth:`Eagle3Draft.forward`'s there.

    Raises:
        ConfigError: the shard is not [b, ceil(T / world), 3, H], bad ``steps`` / ``attn_chunk``.
        DataError: a valid id lies outside ``[0, V)`` (``validate``).
    """
    cfg = model.cfg
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, T = input_ids.shape
    start, end, S = shard_bounds(T, world, rank)
    if aux_shard.dim() != 4 or tuple(aux_shard.shape) != (b, S, EAGLE3_NUM_AUX, cfg.hidden_size):
        raise ConfigError(f"aux_shard has shape {tuple(aux_shard.shape)}; accepted [b={b}, S={S}, "
                          f"{EAGLE3_NUM_AUX}, H={cfg.hidden_size}] (S = ceil(T={T} / world size {world}))")
    steps = _check_int("steps", steps, cfg.ttt_steps)
    dev = aux_shard.device
    chunk = min(_check_int("attn_chunk", attn_chunk, default_attn_chunk(T, dev)), S)
    Tp = world * S
    vfull = torch.zeros(b, Tp, dtype=torch.bool, device=dev)
    vfull[:, :T] = True if valid is None else valid.to(dev).bool()
    ids = input_ids.to(dev).long()
    key_valid = None
    if valid is not None:
        ids = torch.where(vfull[:, :T], ids, torch.zeros_like(ids))
        # a right-padded (prefix) validity needs no key mask: the causal part never reaches padding (nor the
        # positions past T, which only the last shard holds)
        key_valid = vfull if validate and bool((vfull[:, 1:T] & ~vfull[:, :T - 1]).any()) else None
    if validate and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        raise DataError(f"input_ids hold ids in [{int(ids.min())}, {int(ids.max())}], "
                        f"outside [0, vocab_size={cfg.vocab_size})")
    ext = torch.zeros(b, Tp + steps + 1, dtype=torch.long, device=dev)  # pad id 0 past the end (ttt_input_ids)
    ext[:, :T] = ids
    local = vfull[:, start:end]
    aux = torch.where(local[:, :, None, None], aux_shard, torch.zeros((), dtype=aux_shard.dtype, device=dev))
    mask = _TTTChunks(chunk, key_valid, None, offset=start, gather=lambda x: _GatherSeq.apply(x, group))
    h = model.fc(aux.reshape(b, S, EAGLE3_NUM_AUX * cfg.hidden_size).to(model.dtype))
    pos = torch.arange(start, end, device=dev)[None]
    cache: list[tuple[Tensor, Tensor]] = []
    outs: list[Tensor] = []
    for i in range(steps):
        h = model.midlayer(model.embed(ext[:, start + 1 + i:end + 1 + i]), h, pos + i, cache, mask)
        outs.append(h)
    return outs


def _window(model: Eagle3Draft, last_hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, valid: Tensor,
            steps: int, chunk_rows: int, normed: bool, group) -> tuple[list[Tensor], Tensor, Tensor]:
    """This rank's supervision masks ([b, S] per step), and the target's labels over the window ``[start, start +
    S + steps)`` (``probs`` [b, S + steps, V_d], ``arg`` [b, S + steps]; zero / -1 past ``T``)."""
    cfg = model.cfg
    b, T = input_ids.shape
    if tuple(last_hidden.shape) != (b, T, cfg.hidden_size):
        raise ConfigError(f"last_hidden shape {tuple(last_hidden.shape)} != {(b, T, cfg.hidden_size)}")
    for name, t in (("loss_mask", loss_mask), ("valid", valid)):
        if tuple(t.shape) != (b, T):
            raise ConfigError(f"{name} shape {tuple(t.shape)} != (b, T) = {(b, T)}")
    start, end, S = shard_bounds(T, dist.get_world_size(group), dist.get_rank(group))
    dev = last_hidden.device
    vb = valid.to(dev).bool()
    L = S + steps
    wend = min(T, start + L)
    acc_dtype = torch.promote_types(model.dtype, torch.float32)
    probs = torch.zeros(b, L, cfg.draft_vocab_size, dtype=acc_dtype, device=dev)
    arg = torch.full((b, L), -1, dtype=torch.long, device=dev)
    if start < T:
        lh = last_hidden[:, start:wend]
        lh = torch.where(vb[:, start:wend, None], lh, torch.zeros((), dtype=lh.dtype, device=dev))
        probs[:, :wend - start], arg[:, :wend - start] = target_soft_labels(model, lh, vb[:, start:wend], chunk_rows,
                                                                            normed=normed)
    sup = []
    for m in supervision_masks(loss_mask.to(dev), vb, steps):
        part = torch.zeros(b, S, dtype=torch.bool, device=dev)
        if start < T:
            part[:, :min(end, T) - start] = m[:, start:min(end, T)]
        sup.append(part)
    return sup, probs, arg


def _kept(sup: list[Tensor], arg: Tensor) -> Tensor:
    """float64 [steps]: step i's kept positions (supervised, the target argmax at t + 1 + i in the draft vocab)."""
    S = sup[0].shape[1]
    return torch.stack([(m & (arg[:, 1 + i:1 + i + S] >= 0)).sum() for i, m in enumerate(sup)]).double()


@torch.no_grad()
def cp_kept_counts(model: Eagle3Draft, last_hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, valid: Tensor, *,
                   steps: int | None = None, chunk_rows: int | None = None, last_hidden_normed: bool = False,
                   group=None) -> Tensor:
    """float64 [steps]: the kept positions of each TTT step among this rank's positions (no forward, no
    exchange; their sum over the group is the one-rank :class:`Eagle3Stats` ``kept``). Args as
    :func:`cp_eagle3_loss`'s."""
    steps = _check_int("steps", steps, model.cfg.ttt_steps)
    chunk_rows = _check_int("chunk_rows", chunk_rows, model.cfg.logit_chunk)
    sup, _, arg = _window(model, last_hidden, input_ids, loss_mask, valid, steps, chunk_rows, last_hidden_normed,
                          group)
    return _kept(sup, arg)


def cp_eagle3_loss(model: Eagle3Draft, aux_shard: Tensor, last_hidden: Tensor, input_ids: Tensor, loss_mask: Tensor,
                   valid: Tensor, *, steps: int | None = None, chunk_rows: int | None = None,
                   last_hidden_normed: bool = False, denominators: Tensor | None = None,
                   attn_chunk: int | None = None, group=None) -> tuple[Tensor, Tensor, Eagle3Stats]:
    """This rank's share of the EAGLE-3 loss under context parallelism: ``(share, loss, stats)``.

    ``share`` (backward this one) = ``Σ_i loss_decay**i · (this rank's soft-CE sum of step i) / den_i``; with
    ``denominators`` None, ``den_i`` is the group's kept positions of step i (an all-reduce of
    :func:`cp_kept_counts`), so the shares add up to :func:`~artcache.trainers.eagle3.loss.eagle3_loss` of one rank
    holding everything, and their gradients (each rank's through its own computation, summed:
    :func:`~artcache.trainers.dflash.cp.all_reduce_grads`) to its gradient. ``loss`` is the shares' sum (detached,
    the same on every rank); ``stats`` this rank's positions' :class:`Eagle3Stats` (they add up over the ranks).

    Args:
        aux_shard: [b, S, 3, H] this rank's positions (:func:`~artcache.trainers.dflash.cp.context_shard`).
        last_hidden: [b, T, H] the whole sequence's output-of-layer ``L - 1`` (before the final norm, unless
            ``last_hidden_normed``); rank r reads its window ``[start, min(T, end + steps))``.
        input_ids, loss_mask, valid: [b, T]. steps, chunk_rows, attn_chunk: as :func:`eagle3_loss`'s.
        denominators: [steps] float64, the per-step denominators to divide by (a consumer's global batch), or None.
        group: the CP group (default: the world).

    Raises:
        ConfigError: shapes disagree, bad ``steps`` / ``chunk_rows`` / ``attn_chunk``.
        DataError: a valid id outside ``[0, V)``.
    """
    steps = _check_int("steps", steps, model.cfg.ttt_steps)
    chunk_rows = _check_int("chunk_rows", chunk_rows, model.cfg.logit_chunk)
    sup, probs, arg = _window(model, last_hidden, input_ids, loss_mask, valid, steps, chunk_rows, last_hidden_normed,
                              group)
    if denominators is None:
        denominators = _kept(sup, arg)
        dist.all_reduce(denominators, group=group)
    hiddens = cp_forward(model, aux_shard, input_ids, valid, steps=steps, attn_chunk=attn_chunk, group=group)
    share, stats = kept_steps(model, hiddens, sup, probs, arg, chunk_rows, denominators)
    loss = share.detach().clone()
    dist.all_reduce(loss, group=group)
    return share, loss, stats
