"""Anchor sampling for DFlash training (DFlash arXiv:2602.06036; SpecForge samples the same way)."""

from __future__ import annotations

import torch
from torch import Tensor

from artcache.errors import ConfigError

__all__ = ["eligible_anchors", "position_seed", "sample_anchors"]


def eligible_anchors(loss_mask: Tensor) -> Tensor:
    """Eligibility [b, T] bool: position p qualifies iff ``loss_mask[p]`` and ``loss_mask[p+1]``
    (so slot 1 of its block is supervised). The last position is never eligible."""
    if loss_mask.dim() != 2:
        raise ConfigError(f"loss_mask must be [b, T], got shape {tuple(loss_mask.shape)}")
    lm = loss_mask.bool()
    out = torch.zeros_like(lm)
    out[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return out


def position_seed(seed: int, position: int) -> int:
    """The seed of run position ``position``'s own anchor draw in a run seeded ``seed``: SplitMix64's finaliser
    (Steele et al., "Fast splittable pseudorandom number generators", OOPSLA 2014) of ``seed × 2**32 + position``,
    as a non-negative int63 (``torch.Generator.manual_seed`` takes it). Two positions, or two seeds, give
    unrelated streams."""
    z = ((seed & 0xFFFFFFFF) << 32 | (position & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15 & (1 << 64) - 1
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & (1 << 64) - 1
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & (1 << 64) - 1
    return (z ^ (z >> 31)) & (1 << 63) - 1


def _position_keys(elig: Tensor, positions: tuple[int, ...], seed: int) -> Tensor:
    """Keys [b, T] float64 on the host: row i's first ``n_i`` keys (``n_i`` = one past its last eligible position)
    from run position ``positions[i]``'s own generator (:func:`position_seed`), the rest 2.0 (never chosen). A
    row's keys depend on its sample and position only, not on the batch it was collated into (its padding) or
    on which rank of a group read it."""
    b, T = elig.shape
    keys = torch.full((b, T), 2.0, dtype=torch.float64)
    last = torch.where(elig.any(1), T - elig.flip(1).int().argmax(1), torch.zeros(b, dtype=torch.long))
    for i, (p, n) in enumerate(zip(positions, last.tolist(), strict=True)):
        if n:
            keys[i, :n] = torch.rand(n, generator=torch.Generator().manual_seed(position_seed(seed, p)),
                                     dtype=torch.float64)
    return keys


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator,
                   positions: tuple[int, ...] | None = None, seed: int | None = None) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` anchors per sequence, uniformly without replacement.

    Each sequence's eligible positions (:func:`eligible_anchors`) get an independent uniform float64
    key from ``generator``; the ``num_anchors`` smallest keys are chosen (a uniform random subset),
    then sorted ascending by position. Sequences with fewer eligible positions take them all and are
    padded with ``valid=False`` and anchor value 0. Deterministic given the generator state; the
    random draw happens on the generator's device (keys for all b·T positions, one call).

    With ``positions`` (the rows' run positions, all >= 0) and ``seed``, each row's keys come from its own
    position's generator instead (:func:`position_seed`; ``generator`` is not drawn from): the anchors of a
    sample at a position are the same whichever batch, micro-batch or rank of a group reads it, so a group of
    N ranks × b rows trains on exactly the anchors one process × N·b rows draws.

    Args:
        loss_mask: [b, T] bool or integer (nonzero = supervised).
        num_anchors: N >= 1.
        generator: source of randomness (its device decides where the keys are drawn).
        positions, seed: per-position draws (above); both or neither.

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
    if positions is not None and seed is not None and len(positions) == b and min(positions, default=0) >= 0:
        keys = _position_keys(elig.cpu(), tuple(positions), int(seed)).to(dev)
    else:
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
