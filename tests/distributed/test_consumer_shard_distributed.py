"""FSDP2 consumer groups (`--shard full`) on gloo: resume and a killed rank continue exactly (the single-process
parts: tests/unit/test_consumer_shard.py)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_consumer_group_distributed import consume, losses, root, weights  # noqa: F401


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
        if loss is None or ref[s] is None:  # a batch that supervised nothing reports no loss, in both runs
            assert loss is None and ref[s] is None, f"step {s}: {loss!r} != uninterrupted {ref[s]!r}"
            continue
        assert abs(loss - ref[s]) <= 1e-6 * abs(ref[s]), f"step {s}: {loss!r} != uninterrupted {ref[s]!r}"
    ev_whole = json.loads(whole.stdout.strip().splitlines()[-1])["eval"]
    ev_parts = json.loads(last.stdout.strip().splitlines()[-1])["eval"]
    assert ev_parts["step"] == ev_whole["step"] == 6
    # an evaluation that kept no position (no target argmax in the draft vocabulary) reports no loss, in both runs
    assert ("loss" in ev_parts) == ("loss" in ev_whole), (ev_parts, ev_whole)
    if "loss" in ev_whole:
        assert abs(ev_parts["loss"] - ev_whole["loss"]) <= 1e-6 * abs(ev_whole["loss"]), (ev_parts, ev_whole)
    mine, theirs = weights(tmp_path, "parts"), weights(tmp_path, "whole")
    assert mine.keys() == theirs.keys()
    worst = max(float((mine[k].double() - theirs[k].double()).abs().max()) for k in mine)
    assert worst <= 1e-6, f"final weights differ from the uninterrupted run's by up to {worst:g}"


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

    from artcache import leases, registry
    from artcache.layout import CacheLayout
    from tests.distributed.test_consumer_group_distributed import DRAFT_FLAGS, _pids

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
