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
