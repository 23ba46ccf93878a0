"""trainers/consumer/restore.py: what ``--resume`` says when the checkpoint the registry records is not found."""

from __future__ import annotations

import os
import types

import pytest

from artcache import registry
from artcache.errors import ConfigError
from artcache.layout import CacheLayout
from artcache.trainers.consumer.restore import resume_state


def _recorded(tmp_path, cursor=8):
    layout = CacheLayout(tmp_path / "cache")
    layout.create()
    reg = registry.register(layout, registry.Registration(consumer_id="b", draft="dflash", pid=os.getpid()))
    h = registry.ConsumerHandle(layout, reg)
    h.commit_cursor(cursor)
    h.record_checkpoint(cursor)
    return layout


@pytest.mark.parametrize("damage", ["torn state.json", "no state.json"])
def test_regression_a_damaged_recorded_checkpoint_is_named_not_reported_missing(tmp_path, damage):
    """Regression: with the recorded checkpoint's state.json torn (or gone), --resume said the run directory
    "holds no checkpoint; pass the --out directory of that run" — the right directory, wrongly accused."""
    layout = _recorded(tmp_path)
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step-00000004"
    ck.mkdir(parents=True)
    (ck / "model.safetensors").write_bytes(b"")
    if damage == "torn state.json":
        (ck / "state.json").write_text('{"step": 4, "cur')
    with pytest.raises(ConfigError) as info:
        resume_state(types.SimpleNamespace(consumer_id="b"), layout, "plan", "contract", run)
    msg = str(info.value)
    assert "step-00000004 (" in msg and "cannot be resumed" in msg and "pass the --out" not in msg
    assert ("no state.json" in msg) == (damage == "no state.json")


def test_an_empty_run_directory_still_says_pass_the_out_directory(tmp_path):
    layout = _recorded(tmp_path)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds no checkpoint; pass the --out directory of that run"):
        resume_state(types.SimpleNamespace(consumer_id="b"), layout, "plan", "contract", tmp_path / "run")


def _run_cfg(tmp_path, **kw):
    from artcache.trainers.consumer import ConsumerConfig

    base = dict(cache=str(tmp_path), consumer_id="r", draft="dflash", batch_size=2, steps=3, lookbehind=0,
                lookahead=16, threads=1, out_dir=str(tmp_path / "r"), progress=False, tensorboard=False,
                checkpoints=False, block_size=4, num_anchors=4, draft_layers=3)
    base.update(kw)
    return ConsumerConfig(**base)


def test_regression_a_complete_run_says_whether_it_can_be_extended(tmp_path):
    """A resume of a run already at its ``--steps`` said "raise --steps to extend the run"; with min_lr_frac 0 and
    no ``--lr-total-steps`` at start the horizon is that step, so a raised --steps was refused next (past the
    horizon) and ``--lr-total-steps`` as differing from the checkpoint: a dead end. The message now says the run
    cannot be extended and what to do instead, or up to which step it can."""
    from artcache.trainers.consumer.config import run_settings
    from artcache.trainers.consumer.restore import check_run_settings

    done = _run_cfg(tmp_path, steps=3)
    st = types.SimpleNamespace(run=run_settings(done), schedule=None, step=3)
    with pytest.raises(ConfigError, match="cannot be extended: start a new run from its weights with --init-from"):
        check_run_settings(done, st, tmp_path)
    with pytest.raises(ConfigError, match="use --steps <= 3, or start a new run from its weights with --init-from"):
        check_run_settings(_run_cfg(tmp_path, steps=5), st, tmp_path)
    roomy = _run_cfg(tmp_path, steps=3, lr_total_steps=10)
    st = types.SimpleNamespace(run=run_settings(roomy), schedule=None, step=3)
    with pytest.raises(ConfigError, match=r"raise --steps to extend the run \(up to 10, its --lr-total-steps"):
        check_run_settings(_run_cfg(tmp_path, steps=3), st, tmp_path)
    check_run_settings(_run_cfg(tmp_path, steps=10), st, tmp_path)  # extending within the horizon is fine
