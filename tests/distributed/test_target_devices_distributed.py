"""A target spread over the devices of a torch.distributed group on gloo (the rest of target placement:
tests/unit/test_target_devices.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from artcache import store
from artcache.layout import CacheLayout
from artcache.settings import load_settings
from tests.unit.test_target_devices import DATA


def fill(cache: Path, target: str, *extra: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *launcher, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                           target, "--data", str(DATA), "--max-samples", "10", "--max-length", "96", "--draft-layers",
                           "3", "--dtype", "float32", "--threads", "1", "--batch-samples", "4", "--fill", *extra],
                          capture_output=True, text=True, timeout=900)


def artifacts(cache: Path) -> dict[str, dict[str, torch.Tensor]]:
    layout = CacheLayout(cache)
    contract = load_settings(layout).contract
    out = {}
    for fp in store.list_objects(layout):
        art = store.read(layout, fp, contract, verify_tokens=True)
        out[fp] = {"hidden_states": art.hidden_states.clone(), "input_ids": art.input_ids.clone(),
                   "loss_mask": art.loss_mask.clone(), **{k: v.clone() for k, v in art.extras.items()}}
    return out


@pytest.mark.timeout(1200)
def test_tensor_parallel_producer_publishes_what_one_device_does(tmp_path, tiny_target):
    """Two ranks on gloo (the tiny Llama's 4 heads / 2 KV heads divide by 2) against one process: the same
    contract, the same fingerprints, captured layers within 1e-4 (fp32; the sharded matmuls add in another
    order), token ids and loss masks identical. Both launches: the producer starting its follower, and
    torchrun starting both ranks."""
    one = fill(tmp_path / "one", tiny_target.path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = fill(tmp_path / "two", tiny_target.path, "--tensor-parallel-size", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    run = fill(tmp_path / "torchrun", tiny_target.path, "--tensor-parallel-size", "2",
               launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("producer done:") == 1  # rank 1 ran forward passes only
    held = re.search(r"sharded over 2 ranks \(tensor parallel, gloo\): rank 0 holds (\d+) of its (\d+) parameters",
                     two.stderr)
    assert held, two.stderr[-3000:]
    assert int(held[1]) < int(held[2])  # the decoder's projections are split, not replicated
    contracts = [load_settings(CacheLayout(tmp_path / name)).contract for name in ("one", "two", "torchrun")]
    assert contracts[0] == contracts[1] == contracts[2]
    a = artifacts(tmp_path / "one")
    assert len(a) == 10
    worst = 0.0
    for other in ("two", "torchrun"):
        b = artifacts(tmp_path / other)
        assert sorted(a) == sorted(b)
        for fp, ta in a.items():
            tb = b[fp]
            assert sorted(ta) == sorted(tb)
            assert torch.equal(ta["input_ids"], tb["input_ids"]) and torch.equal(ta["loss_mask"], tb["loss_mask"])
            assert ta["hidden_states"].dtype == torch.float32
            assert ta["hidden_states"].shape == tb["hidden_states"].shape
            worst = max(worst, (ta["hidden_states"] - tb["hidden_states"]).abs().max().item())
    assert worst <= 1e-4, worst
    print(f"tensor parallel 2 vs one device: {len(a)} artifacts, max abs difference {worst:.3g}")


@pytest.mark.timeout(900)
def test_a_killed_follower_rank_stops_the_producer(tmp_path, tiny_target):
    """SIGKILL of rank 1 while rank 0 fills: rank 0's next broadcast fails, the producer exits 1 naming the
    tensor-parallel group (no retry loop against a group out of step), and what it published stays valid."""
    import os
    import signal
    import time

    cache, log = tmp_path / "cache", tmp_path / "producer.log"
    proc = subprocess.Popen([sys.executable, "-m", "artcache", "producer", "--cache", str(cache), "--target",
                             tiny_target.path, "--data", "synthetic", "--max-samples", "400", "--max-length", "256",
                             "--draft-layers", "3", "--dtype", "float32", "--threads", "1", "--batch-samples", "1",
                             "--fill", "--tensor-parallel-size", "2"], stderr=log.open("w"))
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not list((cache / "objects").rglob("*.safetensors")):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children  # the one follower this producer started
        os.kill(int(children[0]), signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert code == 1, err[-3000:]
    # the broken connection shows in rank 0's next collective: the batch's broadcast or a layer's all-reduce
    assert "ProducerFailed: tensor-parallel group of 2:" in err and "by peer" in err, err[-3000:]
    print(f"producer exited {code} {took:.1f} s after its follower's SIGKILL")
    layout = CacheLayout(cache)
    contract = load_settings(layout).contract
    published = store.list_objects(layout)
    assert published and all(store.verify(layout, fp, contract) is None for fp in published)
