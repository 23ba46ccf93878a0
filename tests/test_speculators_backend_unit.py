"""The ``artcache`` hidden-states backend for speculators' trainer without speculators installed
(:mod:`artcache.trainers.speculators_backend`): the data-row layout, the split ratio, the layer selection, the
batch check, the refused settings, and (``slow``: a published root) the data folder and the transfer's cursor
commits, checkpoint records and resume. speculators' own trainer on a live root is
tests/test_speculators_backend.py (speculators lane)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from artcache import journal as J
from artcache import leases, registry
from artcache.errors import ConfigError
from artcache.fingerprint import PlanFingerprints
from artcache.layout import CacheLayout
from artcache.store import read
from artcache.trainers import speculators_backend as sb

LAYERS = [1, 3, 4, 7]  # output-of-layer ids captured: vLLM ids 2, 4, 5 and the last layer of 8
SAMPLES, HELD, SEQ = 24, 4, 16


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


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A published root: random tiny Llama target, synthetic 16-token plan, layers 1, 3, 4, 7."""
    from artcache.bench import consumer_speed as cs

    path = tmp_path_factory.mktemp("spec-unit") / "root"
    cs.make_root(path, SAMPLES, torch.device("cpu"), target="random:tiny-llama", seq=SEQ, union=LAYERS)
    return path


@pytest.mark.slow  # a published root (about 10 s)
def test_write_data_dir_lays_out_the_plan_and_refuses_a_foreign_folder(tmp_path, root):
    from datasets import load_from_disk

    from artcache.client import open_root

    _, _, plan = open_root(root)
    order = plan.order(SAMPLES - HELD)
    out = tmp_path / "data"
    sb.write_data_dir(out, plan, order, SAMPLES - HELD, (SAMPLES - HELD, SAMPLES), 3, {"seed": 3})
    data = load_from_disk(str(out))
    row_of, _ = sb.row_layout(SAMPLES - HELD, 3)
    for k in range(SAMPLES - HELD):
        assert data[int(row_of[k])]["input_ids"].tolist() == plan.sample(k).input_ids.tolist()
    assert data[SAMPLES - HELD]["input_ids"].tolist() == plan.sample(SAMPLES - HELD).input_ids.tolist()
    assert data[0]["loss_mask"].dtype == torch.int64 and data[0]["seq_len"] == SEQ
    sb.write_data_dir(out, plan, order, SAMPLES - HELD, (SAMPLES - HELD, SAMPLES), 3, {"seed": 3})  # its own: replaced
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match="exists and was not written by the artcache backend"):
        sb.write_data_dir(tmp_path / "mine", plan, order, 4, (SAMPLES - HELD, SAMPLES), 3, {})


def _transfer(root: Path, save: Path, cid: str = "spec") -> tuple[sb.ArtcacheTransfer, np.ndarray]:
    train = SAMPLES - HELD
    _, position_of = sb.row_layout(train, 5)
    spans = [(a, min(a + 3, train)) for a in range(0, train, 3)]  # batches of 3 positions
    t = sb.ArtcacheTransfer(root, cid, layers=[0, 1, 2, 3], spans=spans, position_of=position_of,
                            heldout=(train, SAMPLES), end=spans[4][1], lookahead=4, demand_timeout_s=5,
                            save_path=save, draft="speculators-eagle3")
    return t, np.argsort(position_of)


@pytest.mark.slow  # a published root (about 10 s)
def test_cursor_commits_follow_the_batches_and_resume_starts_after_the_checkpoint(tmp_path, root):
    layout = CacheLayout(root)
    save = tmp_path / "ckpt"
    t, row_of = _transfer(root, save)
    t.start(0)
    reg = registry.read(layout, "spec")
    assert (reg.cursor, reg.end, reg.pinned, reg.epoch_len, reg.checkpoint_cursor) == (0, 15, (20, 24), 20, -1)
    for p in range(15):
        sample = t.get_cached(int(row_of[p]))
        art = read(layout, PlanFingerprints(t.settings.contract, t.plan).of_sample(p), t.settings.contract)
        assert sample["hidden_states"].dtype == torch.bfloat16 and sample["token_ids"].dtype == torch.int64
        assert torch.equal(sample["hidden_states"], art.hidden_states) and sample["token_ids"].tolist() == \
            art.input_ids.tolist()
        # the first read of batch k commits a_k: the steps of batches 0 .. k-1 are done
        assert registry.read(layout, "spec").cursor == p // 3 * 3
        if p == 7:  # speculators checkpointed after step 2 (global_step 2): recorded at the next commit
            (save / "0").mkdir(parents=True)
            (save / "0" / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 2,
                                                                         "global_step": 2}))
    assert registry.read(layout, "spec").checkpoint_cursor == 6
    held = t.get_cached(np.int64(20))  # validation (speculators' sampler passes numpy ints): training is done
    assert held["token_ids"].tolist() == t.plan.sample(20).input_ids.tolist()
    assert registry.read(layout, "spec").cursor == 15
    t.close()
    assert registry.read(layout, "spec").state == registry.COMPLETED
    events = [e for path in layout.journal.glob("consumer-spec-*.jsonl") for e in J.iter_file(path)]
    assert [e.cursor for e in events if isinstance(e, J.ConsumerEnd)] == [15]
    assert not leases.scan(layout), "every lease released"

    t2, _ = _transfer(root, save)
    t2.start(2)  # speculators resumed from global_step 2: positions 0 .. 5 are not read again
    assert (registry.read(layout, "spec").cursor, registry.read(layout, "spec").checkpoint_cursor) == (6, 6)
    t2.close()
    assert registry.read(layout, "spec").state == "cancelled"


@pytest.mark.slow  # a published root (about 10 s)
def test_a_second_epoch_of_speculators_is_refused(tmp_path, root):
    t, row_of = _transfer(root, tmp_path / "ckpt", cid="spec2")
    t.start(0)
    try:
        t.get_cached(int(row_of[4]))
        with pytest.raises(ConfigError, match="a second epoch; accepted: --epochs 1"):
            t.get_cached(int(row_of[0]))
    finally:
        t.close()
