"""The speculators backend over a published root (the rest: tests/unit/test_speculators_backend_unit.py)."""

from __future__ import annotations

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
from tests.unit.test_speculators_backend_unit import LAYERS

SAMPLES, HELD, SEQ = 24, 4, 16


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A published root: random tiny Llama target, synthetic 16-token plan, layers 1, 3, 4, 7."""
    from artcache.bench import consumer_speed as cs

    path = tmp_path_factory.mktemp("spec-unit") / "root"
    cs.make_root(path, SAMPLES, torch.device("cpu"), target="random:tiny-llama", seq=SEQ, union=LAYERS)
    return path


# a published root (about 10 s)
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


# a published root (about 10 s)
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


# a published root (about 10 s)
def test_a_second_epoch_of_speculators_is_refused(tmp_path, root):
    t, row_of = _transfer(root, tmp_path / "ckpt", cid="spec2")
    t.start(0)
    try:
        t.get_cached(int(row_of[4]))
        with pytest.raises(ConfigError, match="a second epoch; accepted: --epochs 1"):
            t.get_cached(int(row_of[0]))
    finally:
        t.close()
