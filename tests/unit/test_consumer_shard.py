"""A consumer group that shards its draft with FSDP2 (``artcache consume --nproc N --shard full``).

FSDP2 against DDP and one process, for each draft, is a case of
:func:`test_consumer_group.test_two_ranks_and_grad_accum_train_like_one_process_on_the_global_batch` (its runs
serve both). Here, in the ``distributed`` lane on the tiny random root of :mod:`test_consumer_group`: a sharded
run stopped at step k, or whose rank 1 is killed, and continued with ``--resume`` has the losses (held-out
figures) and final weights of an uninterrupted one. The config tests (no marker) are in the default lane.
"""

from __future__ import annotations

import pytest

from artcache.app import config as C
from artcache.errors import ConfigError
from artcache.trainers.consumer import ConsumerConfig

# ---- the settings (default lane) ---------------------------------------------------------------------------


def test_shard_full_needs_a_group(tmp_path, monkeypatch):
    """``--shard full`` in one process is refused in one line (there is nothing to shard over); under torchrun
    (``WORLD_SIZE`` 2, no ``--nproc``) the group is torchrun's and it is accepted."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"^--shard full shards the draft over the ranks of a group and this "
                                          r"consumer has one: pass --nproc N \(N >= 2\)"):
        ConsumerConfig(cache=str(tmp_path), shard="full").validate()
    ConsumerConfig(cache=str(tmp_path), shard="full", nproc=2, lookahead=16).validate()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ConsumerConfig(cache=str(tmp_path), shard="full").validate()
    with pytest.raises(ConfigError, match=r"^--cp 2 and --shard full exclude each other"):
        ConsumerConfig(cache=str(tmp_path), shard="full", nproc=2, cp=2, lookahead=16).validate()


def test_run_config_shard_is_typed():
    """``experiments.X.consumer.shard`` takes ``none`` or ``full``; another value is refused in one line naming
    it and the accepted ones."""
    cfg = C.convert({"experiments": [{"name": "a", "draft": "dflash", "window": "0:16",
                                      "consumer": {"shard": "full", "nproc": 2}}]})
    assert C.consumer_config(cfg, "a").shard == "full"
    cfg = C.convert({"experiments": [{"name": "a", "draft": "dflash", "consumer": {"shard": "half"}}]})
    with pytest.raises(ConfigError) as info:
        C.consumer_config(cfg, "a")
    message = str(info.value)
    assert "\n" not in message and "consumer.shard: Invalid enum value 'half'" in message
    assert "accepted: one of full, none" in message, message


# ---- the distributed lane: real processes on gloo ----------------------------------------------------------
