"""The EAGLE-3 draft vocabulary: which target token ids the pruned draft lm_head covers.

Recipe (EAGLE-3 arXiv:2503.01840 / SpecForge ``generate_vocab_mapping``):
count the loss-masked training tokens, keep the V_d most frequent (padded with the smallest unused ids
when fewer than V_d distinct ids were seen), sort ascending. Two tensors describe the map, in the
layout vLLM and speculators load:

- ``d2t`` int64 [V_d]: ``target_id = draft_id + d2t[draft_id]`` (an offset, not the id itself);
- ``t2d`` bool [V]: True for the target ids the draft vocabulary contains.

A draft trained with one map must keep it: replacing the map under loaded weights silently misaligns
the draft lm_head rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from artcache.errors import ConfigError, DataError

__all__ = ["build_vocab_map", "count_plan_tokens", "draft_ids_to_target", "vocab_coverage", "vocab_map_from_used"]


def count_plan_tokens(plan: Any, vocab_size: int | None = None) -> Tensor:
    """Occurrences of each target token id among a plan's **loss-masked** positions.

    Reads the plan's flat ``input_ids`` (int32 [total]) and ``loss_mask`` (uint8 [total]) directly
    (:class:`artcache.plan.Plan`; one ``bincount``, no per-sample loop). These are the tokens the draft
    is trained to predict (the EAGLE-3 loss supervises a predicted token iff its loss-mask bit is set,
    see :func:`artcache.trainers.eagle3.loss.eagle3_loss`).

    Args:
        plan: an :class:`artcache.plan.Plan` (anything with flat ``input_ids`` / ``loss_mask`` tensors
            of equal shape; ``provenance["target_vocab_size"]`` supplies the default vocab size).
        vocab_size: V; default ``plan.provenance["target_vocab_size"]``.

    Returns:
        int64 [V] counts (on CPU).

    Raises:
        ConfigError: no vocab size available, or it is not an int >= 1.
        DataError: mismatched tensors, or an id outside ``[0, V)``.
    """
    if vocab_size is None:
        vocab_size = (getattr(plan, "provenance", None) or {}).get("target_vocab_size")
        if vocab_size is None:
            raise ConfigError("count_plan_tokens: the plan's provenance has no target_vocab_size; pass vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    ids, mask = plan.input_ids, plan.loss_mask
    if ids.shape != mask.shape or ids.dim() != 1:
        raise DataError(f"plan input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} must be equal 1-D")
    picked = ids[mask.bool()].long()
    if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= vocab_size):
        raise DataError(f"plan holds token ids in [{int(picked.min())}, {int(picked.max())}], "
                        f"outside the target vocab [0, {vocab_size})")
    return torch.bincount(picked.cpu(), minlength=vocab_size)


def vocab_map_from_used(used: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """``(d2t, t2d)`` from the ascending target ids ``used`` [V_d] the draft vocabulary covers.

    Raises:
        DataError: ``used`` not strictly increasing or outside ``[0, vocab_size)``.
    """
    used = used.long()
    if used.dim() != 1 or used.numel() == 0:
        raise DataError(f"used ids must be a non-empty 1-D tensor, got shape {tuple(used.shape)}")
    if bool((used[1:] <= used[:-1]).any()) or int(used[0]) < 0 or int(used[-1]) >= vocab_size:
        raise DataError(f"used ids must be strictly increasing within [0, {vocab_size})")
    d2t = used - torch.arange(used.numel(), dtype=torch.long, device=used.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=used.device)
    t2d[used] = True
    return d2t, t2d


def build_vocab_map(token_counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """Deterministic draft vocabulary from token counts.

    The V_d ids with the largest counts are kept, ties broken by the smaller id; when fewer than V_d
    ids have a nonzero count, the remainder is filled with the smallest unseen ids (a stable sort by
    descending count does both). The kept ids are sorted ascending: ``used[i] = i + d2t[i]``.
    ``draft_vocab_size >= V`` gives the identity map (``d2t`` zeros [V], ``t2d`` all True).

    Args:
        token_counts: integer [V] counts (e.g. :func:`count_plan_tokens`); V is the target vocab.
        draft_vocab_size: V_d >= 1.

    Returns:
        ``(d2t int64 [min(V_d, V)], t2d bool [V])`` on ``token_counts``'s device.

    Raises:
        ConfigError: ``draft_vocab_size`` not an int >= 1.
        DataError: ``token_counts`` not a 1-D integer tensor of non-negative counts.
    """
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int) or draft_vocab_size < 1:
        raise ConfigError(f"draft_vocab_size must be an int >= 1, got {draft_vocab_size!r}")
    if token_counts.dim() != 1 or token_counts.numel() == 0:
        raise DataError(f"token_counts must be a non-empty 1-D tensor [V], got shape {tuple(token_counts.shape)}")
    if token_counts.dtype.is_floating_point or token_counts.dtype == torch.bool or token_counts.is_complex():
        raise DataError(f"token_counts must hold integer counts, got dtype {token_counts.dtype}")
    if bool((token_counts < 0).any()):
        raise DataError("token_counts holds negative counts")
    V = token_counts.numel()
    dev = token_counts.device
    if draft_vocab_size >= V:
        return torch.zeros(V, dtype=torch.long, device=dev), torch.ones(V, dtype=torch.bool, device=dev)
    order = torch.sort(token_counts.long(), descending=True, stable=True).indices  # ties: smaller id first
    used = torch.sort(order[:draft_vocab_size]).values
    return vocab_map_from_used(used, V)


def draft_ids_to_target(draft_ids: Tensor, d2t: Tensor) -> Tensor:
    """Map draft-vocabulary ids to target ids: ``draft_ids + d2t[draft_ids]`` (vLLM's convention)."""
    return draft_ids + d2t[draft_ids]


def vocab_coverage(t2d: Tensor, token_counts: Tensor) -> float | None:
    """Share of token occurrences a draft vocabulary covers: ``Σ counts[t2d] / Σ counts``.

    Args:
        t2d: bool [V], True for the target ids in the draft vocabulary. token_counts: integer [V]
            (e.g. :func:`count_plan_tokens` of the training samples).

    Returns:
        a float in [0, 1]; None when ``token_counts`` sums to 0 (nothing supervised: no figure).

    Raises:
        DataError: the two tensors are not [V] of the same V.
    """
    if t2d.dim() != 1 or token_counts.shape != t2d.shape:
        raise DataError(f"t2d {tuple(t2d.shape)} and token_counts {tuple(token_counts.shape)} must both be [V]")
    total = int(token_counts.sum())
    if total == 0:
        return None
    return int(token_counts[t2d.bool()].sum()) / total
