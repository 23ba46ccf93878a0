"""Anchor sampling for DFlash training (DFlash arXiv:2602.06036; SpecForge samples the same way)."""

from __future__ import annotations

import torch
from torch import Tensor

from artcache.errors import ConfigError

__all__ = ["eligible_anchors", "sample_anchors"]


def eligible_anchors(loss_mask: Tensor) -> Tensor:
    """Eligibility [b, T] bool: position p qualifies iff ``loss_mask[p]`` and ``loss_mask[p+1]``
    (so slot 1 of its block is supervised). The last position is never eligible."""
    if loss_mask.dim() != 2:
        raise ConfigError(f"loss_mask must be [b, T], got shape {tuple(loss_mask.shape)}")
    lm = loss_mask.bool()
    out = torch.zeros_like(lm)
    out[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return out


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` anchors per sequence, uniformly without replacement.

    Each sequence's eligible positions (:func:`eligible_anchors`) get an independent uniform float64
    key from ``generator``; the ``num_anchors`` smallest keys are chosen (a uniform random subset),
    then sorted ascending by position. Sequences with fewer eligible positions take them all and are
    padded with ``valid=False`` and anchor value 0. Deterministic given the generator state; the
    random draw happens on the generator's device (keys for all b·T positions, one call).

    Args:
        loss_mask: [b, T] bool or integer (nonzero = supervised).
        num_anchors: N >= 1.
        generator: source of randomness (its device decides where the keys are drawn).

    Returns:
        anchors [b, N] long (on loss_mask's device), valid [b, N] bool.

    Raises:
        ConfigError: ``num_anchors < 1`` or ``loss_mask`` not 2-D.
    """
    if isinstance(num_anchors, bool) or not isinstance(num_anchors, int) or num_anchors < 1:
        raise ConfigError(f"num_anchors must be an int >= 1, got {num_anchors!r}")
    elig = eligible_anchors(loss_mask)
    b, T = elig.shape
    dev = loss_mask.device
    N = num_anchors
    keys = torch.rand((b, T), generator=generator, dtype=torch.float64, device=generator.device).to(dev)
    keys = keys.masked_fill(~elig, 2.0)  # ineligible positions sort after every eligible one
    k = min(N, T)
    if k > 0:
        chosen_keys, pos = torch.topk(keys, k, dim=1, largest=False, sorted=False)
        ok = chosen_keys < 2.0
        pos = torch.where(ok, pos, torch.full_like(pos, T))  # sentinel T sorts last
        pos, _ = torch.sort(pos, dim=1)
    else:
        pos = torch.empty((b, 0), dtype=torch.long, device=dev)
    if k < N:
        pos = torch.cat((pos, torch.full((b, N - k), T, dtype=torch.long, device=dev)), dim=1)
    valid = pos < T
    anchors = torch.where(valid, pos, torch.zeros_like(pos))
    return anchors, valid
