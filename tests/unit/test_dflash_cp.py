"""DFlash context parallelism (trainers/dflash/cp.py) over 2 gloo ranks: the loss and every gradient equal the
one-rank step's, and each rank's attention handles about half the score elements."""

from __future__ import annotations

import pytest
import torch

from artcache.errors import ConfigError
from artcache.trainers.dflash.cp import cp_attention_elements, local_anchors, shard_bounds


def test_shard_bounds_and_local_anchors():
    assert [shard_bounds(301, 2, r) for r in (0, 1)] == [(0, 151, 151), (151, 302, 151)]
    with pytest.raises(ConfigError, match="rank 2 of world size 2 is invalid"):
        shard_bounds(10, 2, 2)
    anchors = torch.tensor([[3, 9, 12, 0], [1, 2, 0, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    a, v = local_anchors(anchors, valid, 5, 20)
    assert a.tolist() == [[9, 12], [0, 0]] and v.tolist() == [[True, True], [False, False]]


def test_cp_attention_elements_halve_per_rank():
    """Per rank, one layer's attention operands at 2 ranks are about half of one rank's (32,768 tokens, 512 anchors
    of block 16, the tiny target's 4 heads / 2 KV heads)."""
    one = cp_attention_elements(512, 16, 32768, 4, 2, world=1)
    two = cp_attention_elements(512, 16, 32768, 4, 2, world=2)
    assert 0.45 <= two / one <= 0.55
