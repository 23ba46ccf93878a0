"""A target split over the ranks of a torch.distributed group by transformers' own tensor-parallel plan
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``): ``artcache producer
--tensor-parallel-size N``.

Rank 0 is the producer: it schedules, captures and publishes as a one-device producer does. Ranks 1..N-1
are followers: they hold their shard of every decoder layer and run each forward pass with rank 0, nothing
else (no cache root access). Each capture, rank 0 broadcasts a header (command, batch rows, padded length)
and the padded ``input_ids`` and ``attention_mask``; every rank runs the same forward with the same capture
hooks, so every rank stops after the same deepest captured layer and the collectives inside the layers
match. Layer outputs of a tensor-parallel layer are replicated on every rank (the row-parallel projections
end in an all-reduce), so rank 0's hooks read the whole residual stream; nothing is gathered.

Launch: without torchrun the producer process becomes rank 0 and starts the followers itself
(``python -m artcache.backends.tensor_parallel``, rendezvous on 127.0.0.1); under ``torchrun
--nproc-per-node N -m artcache producer ... --tensor-parallel-size N`` every process runs the producer
command and ranks > 0 turn into followers. The group uses gloo on the CPU and NCCL on CUDA (rank r on
``cuda:<local rank>``).

Faults: a follower that dies breaks rank 0's next collective; a forward that fails on rank 0 leaves the
group out of step. Both end the producer (:class:`artcache.errors.ProducerFailed`, exit 1), never a retry,
and the followers exit when rank 0 closes the group or its connection drops.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import time

import msgspec
import torch

from artcache.contract import CaptureContract
from artcache.errors import ConfigError, ProducerFailed
from artcache.shutdown import follow_parent

log = logging.getLogger(__name__)

#: how long a collective may wait. Followers wait in a broadcast for rank 0's next batch while the producer idles
#: (no consumer, a full window), so this is long; a dead peer is noticed at once by the broken connection.
GROUP_TIMEOUT_S = 7 * 24 * 3600.0
#: seconds rank 0 waits for the followers to exit after it closed the group, before it kills them
FOLLOWER_EXIT_S = 30.0

_FORWARD, _STOP = 1, 0


def launched_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun (``RANK`` and ``WORLD_SIZE``
    set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of one rank: the CPU for ``cpu``, else ``cuda:<local rank>``."""
    return torch.device("cpu") if torch.device(device).type == "cpu" else torch.device("cuda", local_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """The group as rank 0 (or a follower) sees it: the process group, and the broadcast of each batch.

    Args:
        size: the world size N (>= 2). device: ``cpu`` or ``cuda``; rank r runs on :func:`rank_device`.
    """

    def __init__(self, size: int, device: str) -> None:
        self.size = size
        self.followers: list[subprocess.Popen] = []
        launched = launched_rank()
        if launched is not None:  # torchrun started every rank
            self.rank, world, local = launched
            if world != size:
                raise ConfigError(f"--tensor-parallel-size {size} under a launcher of WORLD_SIZE {world}: give the "
                                  f"same size to both (torchrun --nproc-per-node {size})")
            init = "env://"
        else:
            self.rank, local = 0, 0
            port = _free_port()
            init = f"tcp://127.0.0.1:{port}"
            self._start_followers(port, device)
        self.device = rank_device(device, local)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        os.environ.setdefault("LOCAL_RANK", str(local))  # transformers' tensor-parallel set-up reads it
        torch.distributed.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo", init_method=init, rank=self.rank, world_size=size,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))

    def _start_followers(self, port: int, device: str) -> None:
        from artcache.launch import role_env

        for r in range(1, self.size):
            env = role_env({"RANK": str(r), "WORLD_SIZE": str(self.size), "LOCAL_RANK": str(r),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "ARTCACHE_TP_DEVICE": device})
            argv = [sys.executable, "-m", "artcache.backends.tensor_parallel"]
            self.followers.append(subprocess.Popen(argv, env=env))

    # ---- the load spec: what every rank loads, decided by rank 0 -------------------------------------------

    def share_spec(self, spec: dict | None) -> dict:
        """Rank 0 gives ``spec`` (JSON-able: target path, contract, threads); every rank returns it."""
        data = json.dumps(spec).encode() if self.rank == 0 else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(n, 0)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if self.rank == 0
               else torch.empty(int(n.item()), dtype=torch.uint8, device=self.device))
        torch.distributed.broadcast(buf, 0)
        return json.loads(bytes(buf.cpu().tolist()).decode())

    # ---- each batch --------------------------------------------------------------------------------------

    def announce(self, ids: torch.Tensor, attn: torch.Tensor) -> None:
        """Rank 0: send one batch's ``input_ids`` and ``attention_mask`` (both [b, T] int64) to the followers."""
        try:
            header = torch.tensor([_FORWARD, *ids.shape], dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(header, 0)
            torch.distributed.broadcast(ids.to(self.device), 0)
            torch.distributed.broadcast(attn.to(self.device), 0)
        except Exception as exc:  # noqa: BLE001 - a follower gone: the group is over
            raise ProducerFailed(f"tensor-parallel group of {self.size}: a follower rank is gone ({exc}); the "
                                 "producer stops") from None

    def receive(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A follower: the next batch from rank 0, or None when rank 0 closes the group."""
        header = torch.empty(3, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(header, 0)
        cmd, b, t = (int(x) for x in header.tolist())
        if cmd == _STOP:
            return None
        ids = torch.empty(b, t, dtype=torch.int64, device=self.device)
        attn = torch.empty(b, t, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(ids, 0)
        torch.distributed.broadcast(attn, 0)
        return ids, attn

    def close(self) -> None:
        """Rank 0: tell the followers to stop, end the group, and reap the followers it started."""
        if self.rank == 0 and torch.distributed.is_initialized():
            try:
                torch.distributed.broadcast(torch.tensor([_STOP, 0, 0], dtype=torch.int64, device=self.device), 0)
            except Exception as exc:  # noqa: BLE001 - a follower already gone: nothing to tell it
                log.warning("tensor-parallel group: could not tell the followers to stop (%s)", exc)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        deadline = time.monotonic() + FOLLOWER_EXIT_S
        for proc in self.followers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.followers = []


def load_tensor_parallel(path: str, dtype: torch.dtype, group: TensorParallelGroup):
    """The target at ``path`` (an HF directory) sharded over ``group`` by its model's own tensor-parallel plan
    (``base_model_tp_plan``), in ``dtype``, eval mode, no gradients. Raises ConfigError when the model has no
    plan or its heads do not divide by the group size (transformers' own message)."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(tp_size=group.size, tp_plan="auto"))
    except (ValueError, NotImplementedError, AssertionError) as exc:
        raise ConfigError(f"--tensor-parallel-size {group.size}: the target {path!r} cannot be split so "
                          f"({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})") from None
    model.eval()
    model.requires_grad_(False)
    return model


def follow(device: str) -> None:
    """A follower rank: join the group, load the shard rank 0 names, run every forward rank 0 announces
    until it closes the group."""
    from artcache.backends.hf import HFCaptureBackend
    from artcache.target import quiet_transformers

    quiet_transformers()
    group = TensorParallelGroup(int(os.environ["WORLD_SIZE"]), device)
    try:
        spec = group.share_spec(None)
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        contract = msgspec.json.decode(spec["contract"].encode(), type=CaptureContract)
        model = load_tensor_parallel(spec["path"], getattr(torch, contract.compute_dtype), group)
        backend = HFCaptureBackend(model, contract, device=group.device)
        while (batch := group.receive()) is not None:
            backend.forward(*batch)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":  # a follower started by rank 0 (TensorParallelGroup._start_followers)
    # a terminal's Ctrl-C reaches the whole process group: rank 0 finishes its batch and then closes the group,
    # which the followers must still be in to run that batch; a follower dies with rank 0 (PR_SET_PDEATHSIG)
    follow_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-follower %(levelname)s %(message)s")
    follow(os.environ.get("ARTCACHE_TP_DEVICE", "cpu"))
