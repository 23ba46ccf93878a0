"""A consumer group that shards its draft with FSDP2 (``artcache consume --nproc N --shard full``).

FSDP2 against DDP and one process, for each draft, is a case of
:func:`test_consumer_group.test_two_ranks_and_grad_accum_train_like_one_process_on_the_global_batch` (its runs
serve both). Here, in the ``distributed`` lane on the tiny random root of :mod:`test_consumer_group`: a sharded
run stopped at step k, or whose rank 1 is killed, and continued with ``--resume`` has the losses (held-out
figures) and final weights of an uninterrupted one. The config tests (no marker) are in the default lane.
"""

from __future__ import annotations

import json

import pytest
from test_consumer_group import consume, losses, root, weights  # noqa: F401

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
    assert "\n" not in message and "consumer setting shard: Invalid enum value 'half'" in message
    assert "accepted: one of full, none" in message, message


# ---- the distributed lane: real processes on gloo ----------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.timeout(1500)
def test_fsdp_resume_continues_exactly(root, tmp_path):  # noqa: F811
    """A sharded EAGLE-3 run stopped after step 2, resumed sharded to step 4, under DDP to step 5 and sharded again
    to step 6 has the losses, the held-out figures and the final weights of an uninterrupted sharded run (the
    checkpoint format is the same under both modes); resuming it with another world size is refused in one line
    naming both sizes."""
    run = ("--lr-total-steps", "6", "--save-every", "3", "--eval-samples", "4", "--eval-interval", "3")
    sharded = ("--nproc", "2", "--shard", "full", *run)
    whole = consume(root, tmp_path, "whole", "eagle3", 2, *sharded, steps=6)
    consume(root, tmp_path, "parts", "eagle3", 2, *sharded, steps=2)
    refused = consume(root, tmp_path, "parts", "eagle3", 2, *run, "--resume", steps=6, check=False)
    assert refused.returncode == 2
    assert "was trained by a group of 2 rank(s), this run has 1" in refused.stderr.strip().splitlines()[-1]
    consume(root, tmp_path, "parts", "eagle3", 2, *sharded, "--resume", steps=4)
    consume(root, tmp_path, "parts", "eagle3", 2, "--nproc", "2", *run, "--resume", steps=5)
    last = consume(root, tmp_path, "parts", "eagle3", 2, *sharded, "--resume", steps=6)
    legs = losses(root, "parts")
    (reference,) = losses(root, "whole")
    assert [[s for s, _ in leg] for leg in legs] == [[1, 2], [3, 4], [5], [6]]
    ref = dict(reference)
    for s, loss in (x for leg in legs for x in leg):
        assert abs(loss - ref[s]) <= 1e-6 * abs(ref[s]), f"step {s}: {loss!r} != uninterrupted {ref[s]!r}"
    ev_whole = json.loads(whole.stdout.strip().splitlines()[-1])["eval"]
    ev_parts = json.loads(last.stdout.strip().splitlines()[-1])["eval"]
    assert ev_parts["step"] == ev_whole["step"] == 6
    assert abs(ev_parts["loss"] - ev_whole["loss"]) <= 1e-6 * abs(ev_whole["loss"]), (ev_parts, ev_whole)
    mine, theirs = weights(tmp_path, "parts"), weights(tmp_path, "whole")
    assert mine.keys() == theirs.keys()
    worst = max(float((mine[k].double() - theirs[k].double()).abs().max()) for k in mine)
    assert worst <= 1e-6, f"final weights differ from the uninterrupted run's by up to {worst:g}"


@pytest.mark.distributed
@pytest.mark.timeout(1500)
def test_fsdp_rank_killed_then_resume_continues_exactly(root, tmp_path):  # noqa: F811
    """kill -9 of rank 1 of a sharded DFlash group of 24 steps after step 6 (checkpoints every 4): the group exits
    nonzero naming rank 1 and SIGKILL, writes no final checkpoint (the dead rank's shards cannot be gathered), and
    ``--resume`` from the recorded checkpoint trains to step 24 with the losses and final weights of an
    uninterrupted sharded run; no lease stays held."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_consumer_group import DRAFT_FLAGS, _pids

    from artcache import leases, registry
    from artcache.layout import CacheLayout

    steps, flags = 24, ("--nproc", "2", "--shard", "full", "--save-every", "4")
    consume(root, tmp_path, "fsdp-whole", "dflash", 2, *flags, steps=steps)
    cid, log = "fsdp-killed", tmp_path / "killed.log"
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(root), "--id", cid, "--draft", "dflash",
            *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", str(steps), "--window", "0:16", "--threads", "1",
            "--log-every", "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard",
            "--group-timeout", "30", *flags]
    with log.open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        pids = _pids(log, time.monotonic() + 300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(s >= 6 for run in losses(root, cid) for s, _ in run):
            time.sleep(0.1)
        os.kill(pids[1], signal.SIGKILL)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc != 0 and f"rank 1 (pid {pids[1]}) ended with signal SIGKILL" in text, text[-3000:]
    reg = registry.read(CacheLayout(root), cid)
    assert reg.state != "running" and reg.checkpoint_cursor > 0 and reg.checkpoint_cursor % 16 == 0
    (before,) = losses(root, cid)
    assert before[-1][0] < steps
    consume(root, tmp_path, cid, "dflash", 2, *flags, "--resume", steps=steps)
    first, resumed = losses(root, cid)
    assert resumed[0][0] == reg.checkpoint_cursor // 4 + 1 and resumed[-1][0] == steps
    ref = dict(*losses(root, "fsdp-whole"))
    for s, loss in first + resumed:
        assert abs(loss - ref[s]) <= 1e-6 * abs(ref[s]), f"step {s}: {loss!r} != uninterrupted {ref[s]!r}"
    mine, theirs = weights(tmp_path, cid), weights(tmp_path, "fsdp-whole")
    worst = max(float((mine[k].double() - theirs[k].double()).abs().max()) for k in mine)
    assert mine.keys() == theirs.keys() and worst <= 1e-6, worst
    assert not [info for infos in leases.scan(CacheLayout(root)).values() for info in infos if info.consumer == cid]
