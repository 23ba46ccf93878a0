"""The ``artcache`` hidden-states backend for speculators' trainer without speculators installed
(:mod:`artcache.trainers.speculators_backend`): the data-row layout, the split ratio, the layer selection, the
batch check, the refused settings, and (``slow``: a published root) the data folder and the transfer's cursor
commits, checkpoint records and resume. speculators' own trainer on a live root is
tests/speculators/test_speculators_backend.py (speculators lane)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from artcache.errors import ConfigError
from artcache.trainers import speculators_backend as sb

LAYERS = [1, 3, 4, 7]  # output-of-layer ids captured: vLLM ids 2, 4, 5 and the last layer of 8


def test_row_layout_puts_position_k_at_the_samplers_kth_row():
    row_of, position_of = sb.row_layout(50, seed=7)
    assert sorted(row_of.tolist()) == list(range(50))
    assert (position_of[row_of] == np.arange(50)).all()
    # speculators' sampler takes rows in default_rng(seed).permutation order: it meets position 0, 1, 2, ...
    assert (np.random.default_rng(7).permutation(50)[:5] == row_of[:5]).all()


def test_train_ratio_splits_after_exactly_the_training_rows():
    for rows in range(2, 400):
        for train in (1, rows // 2, rows - 1):
            assert int(rows * sb.train_ratio(train, rows)) == train, (train, rows)


def test_layer_indices_maps_vllm_ids_and_appends_the_last_layer():
    assert sb.layer_indices(LAYERS, [2, 4, 5], 8) == [0, 1, 2, 3]
    assert sb.layer_indices([7, 4, 3, 1], [2, 5], 8) == [3, 1, 0]
    with pytest.raises(ConfigError, match=r"did not capture output-of-layer \[2\].*it captured \[1, 3, 4, 7\]"):
        sb.layer_indices(LAYERS, [3, 4], 8)


def test_contiguous_batches_accepts_position_ranges_and_refuses_others():
    _, position_of = sb.row_layout(6, seed=1)
    row_of = np.argsort(position_of)
    batches = [row_of[[1, 0]], row_of[[2]], row_of[[5, 3, 4]]]
    assert sb.contiguous_batches(batches, position_of) == [(0, 2), (2, 3), (3, 6)]
    with pytest.raises(ConfigError, match="batch 1 reads positions .* not the range"):
        sb.contiguous_batches([row_of[[0, 1]], row_of[[3]]], position_of)


def _args(**over) -> argparse.Namespace:
    base = dict(artcache_root="/x", num_workers=0, epochs=1, artcache_epochs=1, artcache_lookahead=4)
    return argparse.Namespace(**{**base, **over})


@pytest.mark.parametrize("over,match", [
    (dict(artcache_root=None), "needs --artcache-root"),
    (dict(num_workers=2), "--num-workers 2: .* accepted: 0"),
    (dict(epochs=3), "--epochs 3 .* accepted: 1"),
    (dict(artcache_epochs=0), "--artcache-epochs 0; accepted: 1 or more"),
    (dict(artcache_lookahead=-1), "--artcache-lookahead -1; accepted: 0 or more"),
])
def test_refused_settings_say_what_is_accepted(over, match):
    with pytest.raises(ConfigError, match=match):
        sb._check_args(_args(**over))


def test_a_world_size_above_one_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="world size 2 .* accepted: 1"):
        sb._check_args(_args())
