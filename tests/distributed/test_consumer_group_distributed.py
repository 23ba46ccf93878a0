"""A consumer that is a torch.distributed group of ranks on gloo: equivalence with one rank, a killed rank, resume
(the single-process parts: tests/protocol/test_consumer_group.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch

from artcache import journal as J
from artcache import leases, registry
from artcache.layout import CacheLayout

SAMPLES = 48  # plan samples of 32 tokens; every position published before the consumers start


DRAFT_FLAGS = {
    "dflash": ["--block-size", "4", "--anchors", "4"],
    "dspark": ["--block-size", "4", "--anchors", "4", "--markov-rank", "8"],
    "eagle3": ["--ttt-steps", "2", "--draft-vocab", "512"],
}


STEPS = 10


REL = 1e-5  # loss curves and final weights: equal to float32 rounding


AMPLIFIED = 5e-4  # of a tensor's norm: AdamW's amplified rounding noise at most (assert_same_run)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from artcache.bench import consumer_speed as cs

    path = tmp_path_factory.mktemp("group") / "cache"
    cs.make_root(path, SAMPLES, torch.device("cpu"), target="random:tiny-llama", seq=32, union=list(range(8)))
    return path


def consume(root: Path, cwd: Path, cid: str, draft: str, batch: int, *extra: str, steps: int = STEPS,
            check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(root), "--id", cid, "--draft", draft,
            *DRAFT_FLAGS[draft], "--batch-size", str(batch), "--steps", str(steps), "--window", "0:16",
            "--threads", "1", "--log-every", "1", "--out", str(cwd / "runs" / cid), "--no-progress",
            "--no-tensorboard", "--group-timeout", "30", "--json", *extra]
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(root: Path, cid: str) -> list[list[tuple[int, float]]]:
    """(step, loss) of each consumer journal of ``cid`` (one list per process that wrote for it, in start order)."""
    out = []
    for path in sorted(CacheLayout(root).journal.glob(f"consumer-{cid}-*.jsonl"), key=lambda p: p.stat().st_mtime):
        out.append([(e.step, e.loss) for e in J.iter_file(path) if isinstance(e, J.Step)])
    return out


def weights(cwd: Path, cid: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(cwd / "runs" / cid / "checkpoints" / "latest" / "model.safetensors"))


def weight_diffs(cwd: Path, a: str, b: str) -> dict[str, float]:
    """Each final weight tensor's difference between runs ``a`` and ``b``, relative to its norm in ``b``."""
    wa, wb = weights(cwd, a), weights(cwd, b)
    assert wa.keys() == wb.keys()
    return {k: float((wa[k].float() - wb[k].float()).norm() / wb[k].float().norm().clamp_min(1e-30)) for k in wa}


def assert_same_run(root: Path, cwd: Path, a: str, b: str, floor: dict[str, float], steps: int = STEPS) -> None:
    """The same loss curve (relative 1e-5 at every step) and final weights: each tensor within 1e-5 of its norm,
    or within 10 × ``floor`` (its difference between two runs of the same one-process consumer that differ only in
    float reduction order: ``--threads 1`` and ``--threads 2``) where AdamW amplifies float noise beyond 1e-5 (an
    element whose gradient is near 0 gets an update of up to lr whichever way rounding tips it: DSpark's Markov
    head). That floor is itself noisy (one run measured 0 where the group then differed by 1.1e-4 of the norm in
    ``markov_w2``; --threads 1 against 2 alone moved it 9e-5), so a tensor may also differ by up to
    :data:`AMPLIFIED` of its norm; a real normalisation error is larger (the EAGLE-3 denominator clamp moved
    ``q_proj`` by 1.3e-3)."""
    (la,), (lb,) = losses(root, a), losses(root, b)
    assert [s for s, _ in la] == [s for s, _ in lb] == list(range(1, steps + 1))
    for (s, x), (_, y) in zip(la, lb, strict=True):
        if x is None or y is None:  # a batch that supervised nothing reports no loss: in both runs, or it is a bug
            assert x is None and y is None, f"step {s}: {a} loss {x!r}, {b} loss {y!r}"
            continue
        assert abs(x - y) <= REL * abs(y), f"step {s}: {a} loss {x!r}, {b} loss {y!r}"
    rel = weight_diffs(cwd, a, b)
    bad = {k: (v, floor[k]) for k, v in rel.items() if v > max(REL, 10 * floor[k], AMPLIFIED)}
    assert not bad, f"final weights of {a} and {b} differ (of the norm, then the noise floor): {bad}"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("draft", ["dflash", "eagle3", "dspark"])
def test_two_ranks_and_grad_accum_train_like_one_process_on_the_global_batch(root, tmp_path, draft):
    """2 ranks × b, 1 rank × b with --grad-accum 2 and 1 rank × 2b: the same loss curve and the same final weights
    (relative 1e-5), the group one consumer to the cache (one registration, one journal of steps). FSDP2 (2 ranks ×
    b/2 × --grad-accum 2, ``--shard full``) the same as DDP and one process, its checkpoint full tensors."""
    consume(root, tmp_path, f"{draft}-one", draft, 4)
    consume(root, tmp_path, f"{draft}-threads", draft, 4, "--threads", "2")  # argparse: the last --threads wins
    floor = weight_diffs(tmp_path, f"{draft}-threads", f"{draft}-one")
    consume(root, tmp_path, f"{draft}-accum", draft, 2, "--grad-accum", "2")
    group = consume(root, tmp_path, f"{draft}-group", draft, 2, "--nproc", "2")
    summary = json.loads(group.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["global_batch"] == 4 and summary["cursor"] == 4 * STEPS
    assert_same_run(root, tmp_path, f"{draft}-group", f"{draft}-one", floor)
    assert_same_run(root, tmp_path, f"{draft}-accum", f"{draft}-one", floor)
    sharded = consume(root, tmp_path, f"{draft}-fsdp", draft, 1, "--nproc", "2", "--grad-accum", "2", "--shard",
                      "full")
    summary = json.loads(sharded.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["shard"] == "full" and summary["global_batch"] == 4
    assert "FSDP units over 2 ranks" in sharded.stderr, sharded.stderr[-2000:]
    full, one = weights(tmp_path, f"{draft}-fsdp"), weights(tmp_path, f"{draft}-one")
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in one.items()}
    assert_same_run(root, tmp_path, f"{draft}-fsdp", f"{draft}-group", floor)
    assert_same_run(root, tmp_path, f"{draft}-fsdp", f"{draft}-one", floor)
    reg = registry.read(CacheLayout(root), f"{draft}-group")
    assert reg.state == "completed" and reg.cursor == 4 * STEPS and reg.batch_size == 4
    rank_journals = list(CacheLayout(root).journal.glob(f"reader-{draft}-group-*.jsonl"))
    assert len(rank_journals) == 1  # rank 1's reads, journaled as its own reader
    read_by_rank1 = [e.position for e in J.iter_file(rank_journals[0]) if isinstance(e, J.Request)]
    assert read_by_rank1 == [p for s in range(STEPS) for p in (4 * s + 2, 4 * s + 3)]


def _pids(log: Path, deadline: float) -> list[int]:
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "started a group of" in line:
                return [int(x) for x in line.split("(pids ")[1].rstrip(")").split(", ")]
        time.sleep(0.2)
    raise AssertionError(f"the launcher never logged its ranks: {log.read_text()[-2000:]}")


KILL_STEPS = 24


@pytest.fixture(scope="module")
def uninterrupted(root, tmp_path_factory) -> Path:
    """A 2-rank DFlash run of :data:`KILL_STEPS` steps never stopped (its run directory's parent)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    consume(root, cwd, "uninterrupted", "dflash", 2, "--nproc", "2", "--save-every", "4", steps=KILL_STEPS)
    return cwd


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_stops_its_group_and_resume_continues_exactly(root, tmp_path, uninterrupted, victim):
    """kill -9 of one rank mid-run: the group exits nonzero within 60 s naming that rank and its signal; its
    registration is not left running and no lease of it stays held; --resume continues from the recorded
    checkpoint and trains the remaining steps with the losses and final weights of an uninterrupted run; inspect
    finds no violation and no lease held."""
    steps, cid = KILL_STEPS, f"killed-{victim}"
    log = tmp_path / "killed.log"
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(root), "--id", cid, "--draft", "dflash",
            *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", str(steps), "--window", "0:16", "--threads", "1",
            "--log-every", "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard",
            "--group-timeout", "30", "--nproc", "2", "--save-every", "4"]
    with log.open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        pids = _pids(log, time.monotonic() + 300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(s >= 10 for run in losses(root, cid) for s, _ in run):
            time.sleep(0.1)
        os.kill(pids[victim], signal.SIGKILL)
        t_kill = time.monotonic()
        rc = proc.wait(timeout=120)
        stopped_s = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc != 0 and stopped_s < 60, (rc, stopped_s, text[-3000:])
    assert f"rank {victim} (pid {pids[victim]}) ended with signal SIGKILL" in text, text[-3000:]
    reg = registry.read(CacheLayout(root), cid)
    assert reg.state != "running"
    (before,) = losses(root, cid)
    assert before and before[-1][0] < steps
    consume(root, tmp_path, cid, "dflash", 2, "--nproc", "2", "--save-every", "4", "--resume", steps=steps)
    first, resumed = losses(root, cid)
    assert resumed[0][0] == reg.checkpoint_cursor // 4 + 1 and resumed[-1][0] == steps
    (reference,) = losses(root, "uninterrupted")
    ref = dict(reference)
    for s, loss in first + resumed:
        assert abs(loss - ref[s]) <= 1e-6 * abs(ref[s]), f"step {s}: {loss!r} != uninterrupted {ref[s]!r}"
    mine, theirs = weights(tmp_path, cid), weights(uninterrupted, "uninterrupted")
    assert mine.keys() == theirs.keys()
    worst = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    assert worst <= 1e-6, f"final weights differ from the uninterrupted run's by up to {worst:g}"
    out = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(root), "--json"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    acc = msgspec.json.decode(out.stdout)
    assert acc["violations"] == [], acc["violations"]
    assert acc["cache"]["leases_held"] == 0
    group = next(k for k in acc["consumers"] if k["consumer"] == cid)
    assert group["ranks"] == 2 and group["state"] == "completed" and group["cursor"] == 4 * steps
    assert not [info for infos in leases.scan(CacheLayout(root)).values() for info in infos if info.consumer == cid]


@pytest.mark.timeout(900)
def test_ranks_that_disagree_refuse_to_start(root, tmp_path):
    """Two ranks started by hand (as torchrun would) with different windows: both refuse before registering, the
    message naming the rank and the setting; nothing is registered."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    procs = []
    for rank, window in ((0, "0:16"), (1, "2:16")):
        args = [sys.executable, "-m", "artcache", "consume", "--cache", str(root), "--id", "disagree", "--draft",
                "dflash", *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", "4", "--window", window,
                "--threads", "1", "--out", str(tmp_path / "runs" / "disagree"), "--no-progress", "--group-timeout",
                "30"]
        procs.append(subprocess.Popen(args, cwd=tmp_path, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "rank 1 disagrees with rank 0 about window: [2, 16] (rank 0: [0, 16])" in outs[0][1]
    assert registry.read(CacheLayout(root), "disagree") is None


@pytest.mark.timeout(900)
def test_the_same_command_under_torchrun_is_one_consumer_with_two_ranks(root, tmp_path):
    """``torchrun --nproc-per-node 2 -m artcache consume ...`` (no --nproc): the ranks read torchrun's environment;
    rank 0 prints the summary, registers once and journals the steps; ``inspect`` shows one consumer of 2 ranks."""
    cid = "torchrun"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(_port()), "-m", "artcache", "consume", "--cache", str(root), "--id", cid, "--draft",
            "dflash", *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", "4", "--window", "0:16", "--threads",
            "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard", "--json"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (summary,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert summary["ranks"] == 2 and summary["cursor"] == 16
    reg = registry.read(CacheLayout(root), cid)
    assert reg.state == "completed" and reg.cursor == 16 and reg.batch_size == 4
    (steps,) = losses(root, cid)
    assert [s for s, _ in steps] == [1, 2, 3, 4]
    out = subprocess.run([sys.executable, "-m", "artcache", "inspect", "--cache", str(root)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert f"{cid} (2 ranks)" in out.stdout, out.stdout[-3000:]


@pytest.mark.timeout(900)
def test_resume_with_another_world_size_is_refused_in_one_line(root, tmp_path):
    consume(root, tmp_path, "sized", "dflash", 2, "--nproc", "2", steps=2)
    proc = consume(root, tmp_path, "sized", "dflash", 2, "--resume", steps=4, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "was trained by a group of 2 rank(s), this run has 1" in line, proc.stderr[-2000:]


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- context parallelism (--cp) ----------------------------------------------------------------------------

@pytest.mark.timeout(1200)
def test_cp_two_ranks_train_like_one_process(root, tmp_path):
    """--nproc 2 --cp 2 (one CP group: both ranks read the same positions, each trains the blocks anchored in its
    half of every sequence, attention over the all-gathered context) gives the one-process run's loss curve and
    final weights (relative 1e-5, or AdamW's rounding floor), one consumer to the cache whose cursor moves by one
    batch a step."""
    consume(root, tmp_path, "cp-one", "dflash", 4)
    consume(root, tmp_path, "cp-threads", "dflash", 4, "--threads", "2")
    floor = weight_diffs(tmp_path, "cp-threads", "cp-one")
    group = consume(root, tmp_path, "cp-group", "dflash", 4, "--nproc", "2", "--cp", "2")
    summary = json.loads(group.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["cp"] == 2 and summary["global_batch"] == 4
    assert summary["cursor"] == 4 * STEPS
    assert_same_run(root, tmp_path, "cp-group", "cp-one", floor)
    reg = registry.read(CacheLayout(root), "cp-group")
    assert reg.state == "completed" and reg.cursor == 4 * STEPS
    rank_journals = list(CacheLayout(root).journal.glob("reader-cp-group-*.jsonl"))
    assert len(rank_journals) == 1  # rank 1 read the same positions as rank 0, journaled as its own reader
    read_by_rank1 = [e.position for e in J.iter_file(rank_journals[0]) if isinstance(e, J.Request)]
    assert read_by_rank1 == list(range(4 * STEPS))


@pytest.mark.timeout(1500)
def test_cp_within_data_parallel_groups_trains_like_one_process(root, tmp_path):
    """--nproc 4 --cp 2 --batch-size 2: two data-parallel groups of two CP ranks, each group reading its own half
    of a global batch of 4, train the loss curve and final weights of one process with batch 4."""
    consume(root, tmp_path, "dpcp-one", "dflash", 4)
    consume(root, tmp_path, "dpcp-threads", "dflash", 4, "--threads", "2")
    floor = weight_diffs(tmp_path, "dpcp-threads", "dpcp-one")
    group = consume(root, tmp_path, "dpcp-group", "dflash", 2, "--nproc", "4", "--cp", "2")
    summary = json.loads(group.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 4 and summary["cp"] == 2 and summary["global_batch"] == 4
    assert_same_run(root, tmp_path, "dpcp-group", "dpcp-one", floor)
    reads = sorted(sorted(e.position for e in J.iter_file(p) if isinstance(e, J.Request))
                   for p in CacheLayout(root).journal.glob("reader-dpcp-group-*.jsonl"))
    first_half = [p for s in range(STEPS) for p in (4 * s, 4 * s + 1)]
    second_half = [p for s in range(STEPS) for p in (4 * s + 2, 4 * s + 3)]
    assert reads == [first_half, second_half, second_half]  # ranks 1, 2, 3 (rank 0 reads into the consumer journal)


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("draft, dpcp_steps", [("dspark", 5), ("eagle3", STEPS)])
def test_cp_trains_like_one_process_for_every_draft(root, tmp_path, draft, dpcp_steps):
    """DSpark and EAGLE-3 (DFlash: the two tests above) under --nproc 2 --cp 2 (one CP group: each rank trains its
    half of every sequence, DSpark the blocks anchored there and EAGLE-3 the TTT unroll over its positions with
    attention over the all-gathered step-0 keys; each rank's denominators count its own blocks / kept positions)
    and --nproc 4 --cp 2 --batch-size 2 (two data-parallel groups of two CP ranks) give the one-process run's loss
    curve and final weights (relative 1e-5, or AdamW's rounding floor). DSpark's data-parallel run is 5 steps:
    AdamW amplifies its float noise with every step, and once in four 10-step runs one tensor differed by 8e-4 of
    its norm while the loss curve matched at 1e-5."""
    consume(root, tmp_path, f"{draft}-cp-one", draft, 4)
    consume(root, tmp_path, f"{draft}-cp-threads", draft, 4, "--threads", "2")
    floor = weight_diffs(tmp_path, f"{draft}-cp-threads", f"{draft}-cp-one")
    group = consume(root, tmp_path, f"{draft}-cp-group", draft, 4, "--nproc", "2", "--cp", "2")
    summary = json.loads(group.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["cp"] == 2 and summary["global_batch"] == 4
    assert summary["cursor"] == 4 * STEPS
    assert_same_run(root, tmp_path, f"{draft}-cp-group", f"{draft}-cp-one", floor)
    one = f"{draft}-cp-one"
    if dpcp_steps != STEPS:
        one = f"{draft}-dpcp-one"
        consume(root, tmp_path, one, draft, 4, steps=dpcp_steps)
    group = consume(root, tmp_path, f"{draft}-dpcp-group", draft, 2, "--nproc", "4", "--cp", "2", steps=dpcp_steps)
    summary = json.loads(group.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 4 and summary["cp"] == 2 and summary["global_batch"] == 4
    assert_same_run(root, tmp_path, f"{draft}-dpcp-group", one, floor, steps=dpcp_steps)


@pytest.mark.timeout(1500)
def test_regression_a_group_stopped_by_sigterm_exits_143_with_its_summary(root, tmp_path, uninterrupted):
    """SIGTERM to ``consume --nproc 2`` stopped every rank cleanly (rank 0 checkpointed and cancelled the
    registration) but the launcher took the ranks' own exit status 130 for a failure: it exited 1 with "GroupFailed:
    rank 0 ... exit status 130" instead of 143 with the group's summary, as one process does. --resume then
    continues exactly."""
    steps, cid = KILL_STEPS, "stopped"
    log = tmp_path / "stopped.log"
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(root), "--id", cid, "--draft", "dflash",
            *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", str(steps), "--window", "0:16", "--threads", "1",
            "--log-every", "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard",
            "--group-timeout", "30", "--nproc", "2", "--save-every", "4", "--json"]
    with log.open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        _pids(log, time.monotonic() + 300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(s >= 6 for run in losses(root, cid) for s, _ in run):
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 143, (proc.returncode, text[-3000:])
    assert "GroupFailed" not in text, text[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and 0 < summary["cursor"] < 4 * steps
    assert registry.read(CacheLayout(root), cid).state == "cancelled"
    consume(root, tmp_path, cid, "dflash", 2, "--nproc", "2", "--save-every", "4", "--resume", steps=steps)
    ref = dict(losses(root, "uninterrupted")[0])
    for run in losses(root, cid):
        for s, loss in run:
            assert abs(loss - ref[s]) <= 1e-6 * abs(ref[s]), f"step {s}: {loss!r} != uninterrupted {ref[s]!r}"
    assert max(float((a - b).abs().max()) for a, b in zip(weights(tmp_path, cid).values(),
                                                           weights(uninterrupted, "uninterrupted").values(),
                                                           strict=True)) <= 1e-6


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(900)
def test_regression_ranks_stop_when_their_launcher_is_killed(root, tmp_path):
    """kill -9 of the ``consume --nproc 2`` launcher (an OOM killer, a scheduler) left both ranks training on,
    re-parented to init, the registration running and no one to report it. Each rank now gets SIGTERM when its
    launcher dies: the group stops within 60 s, its registration is not left running, and no live process holds a
    lease of it."""
    cid = "orphaned"
    log = tmp_path / "orphaned.log"
    args = [sys.executable, "-m", "artcache", "consume", "--cache", str(root), "--id", cid, "--draft", "dflash",
            *DRAFT_FLAGS["dflash"], "--batch-size", "2", "--steps", "100000", "--window", "0:16", "--threads", "1",
            "--log-every", "1", "--out", str(tmp_path / "runs" / cid), "--no-progress", "--no-tensorboard",
            "--group-timeout", "30", "--nproc", "2", "--save-every", "4"]
    with log.open("w") as err:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err, text=True)
    pids = []
    try:
        pids = _pids(log, time.monotonic() + 300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(s >= 3 for run in losses(root, cid) for s, _ in run):
            time.sleep(0.1)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), f"ranks {pids} outlived their launcher by 60 s"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    # cancelled when both ranks stop at the same step boundary; failed when one saw its peer go first (a gloo
    # collective fails): either way not left running
    assert registry.read(CacheLayout(root), cid).state in ("cancelled", "failed")
    # no live process holds a lease of it (a rank a failed collective ended may leave one under its dead pid: the
    # next producer pass or fsck reclaims it as holder-dead)
    held = [i for infos in leases.scan(CacheLayout(root)).values() for i in infos if i.consumer == cid]
    assert not [i for i in held if _alive(i.pid)], held
