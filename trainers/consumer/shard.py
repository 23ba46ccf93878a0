"""Fully sharded data parallelism for a consumer group (``--shard full``): PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``) for a draft whose weights, gradients and AdamW state do not fit one
device together.

Each decoder layer of the draft (every module of a ``layers`` ``nn.ModuleList``) is one FSDP unit, resharded after
its forward; the root (the draft itself: its ``fc``, norms, heads) is the last unit and stays gathered from its
forward to the end of its backward. Every rank then holds ``1 / world`` of each trainable parameter (dim 0,
``torch.chunk`` layout), of its gradient and of its AdamW state; a unit's parameters are all-gathered for its forward
and backward, gradients are reduce-scattered and averaged over the ranks as DDP averages them (so
:meth:`~.session.Session._accumulate` normalises both the same way). Frozen tensors (the target's embedding,
lm_head, norm) are buffers and are not sharded. The device mesh is one dimension over the group's default process
group: gloo on a CPU, nccl on CUDA.

Checkpoints stay in the one-process format (:mod:`artcache.trainers.checkpoint`): every rank takes part in
gathering the full weights and the full optimizer state (:func:`gather_weights`, :func:`gather_optimizer`: one
all-gather per tensor, each copied to the host at once), and rank 0 writes them as it writes any checkpoint
(``model.safetensors`` holds full, unsharded weights; export reads them unchanged). On ``--resume`` every rank
reads the full checkpoint, loads the weights before sharding and cuts the optimizer state to its own shard
(:func:`shard_optimizer_state`, no communication), so a checkpoint of a DDP group, of a sharded group or of one
process resumes under either mode.

Rank 0's held-out evaluation runs on the unsharded draft: every rank gathers every unit first (:func:`gathered`,
which also turns off the reshard after forward, so rank 0's forwards need no collective while the others wait).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["gather_optimizer", "gather_weights", "gathered", "local_params", "shard_draft", "shard_optimizer_state"]


def shard_draft(model: nn.Module, device: torch.device, world: int) -> list[nn.Module]:
    """Shard ``model`` in place over a one-dimensional device mesh of ``world`` ranks on ``device``'s type
    (``init_process_group`` ran): each module of a ``layers`` ModuleList is a unit (``reshard_after_forward``
    True), then the root (False). Call after the weights were loaded and before the optimizer is built (its
    parameters become ``DTensor`` shards). Returns the units, layers first, the root last."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    units: list[nn.Module] = []
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            for layer in module:
                if any(p.requires_grad for p in layer.parameters()):
                    units.append(fully_shard(layer, mesh=mesh, reshard_after_forward=True))
    units.append(fully_shard(model, mesh=mesh, reshard_after_forward=False))
    return units


def _full(t: Tensor) -> Tensor:
    """``t`` whole on the host: a ``DTensor`` all-gathered (a collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def gather_weights(weights: dict[str, Tensor], keep: bool) -> dict[str, Tensor]:
    """``trainable_state_dict()`` of a sharded draft (``DTensor`` shards) as full host tensors, in its order. A
    collective: every rank calls it; only a rank with ``keep`` (rank 0) holds the result (the others drop each
    tensor once gathered and get an empty dict)."""
    out = {}
    for k, v in weights.items():
        t = _full(v)
        if keep:
            out[k] = t
    return out


def gather_optimizer(optimizer: torch.optim.Optimizer, keep: bool) -> dict:
    """``optimizer.state_dict()`` with every state tensor full and on the host (what
    :func:`~artcache.trainers.checkpoint.optimizer_tensors` writes; the same keys as a one-process run's). A
    collective: every rank calls it; only a rank with ``keep`` holds the tensors."""
    sd = optimizer.state_dict()
    state: dict = {}
    for idx, st in sorted(sd["state"].items()):
        for name, v in st.items():
            t = _full(v) if isinstance(v, Tensor) else v
            if keep:
                state.setdefault(idx, {})[name] = t
    return {"state": state, "param_groups": sd["param_groups"]}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's full optimizer tensors (``state.<param index>.<name>``) with each state of a sharded
    parameter cut to this rank's shard, laid out as the parameter (``distribute_tensor`` from the local copy: every
    rank read the same checkpoint, nothing is sent). Other tensors (``step``, a one-process parameter's) unchanged.
    A key :func:`~artcache.trainers.checkpoint.restore_optimizer` would refuse is passed on for it to refuse."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    for key, t in tensors.items():
        parts = key.split(".", 2)
        p = params[int(parts[1])] if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < len(params) else None
        if isinstance(p, DTensor) and t.dim() > 0 and tuple(t.shape) == tuple(p.shape):
            t = distribute_tensor(t.to(device=p.device_mesh.device_type), p.device_mesh, p.placements,
                                  src_data_rank=None)
        out[key] = t
    return out


def local_params(model: nn.Module) -> list[Tensor]:
    """The trainable parameters of ``model`` registered as plain tensors now (a gathered unit's; not a unit's
    ``DTensor`` shards)."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]


@contextmanager
def gathered(units: list[nn.Module]) -> Iterator[None]:
    """Every unit's parameters all-gathered and kept so (no reshard after a forward) inside the block, resharded
    after it: a rank may run forwards alone (rank 0's evaluation) while the others wait. A collective on entry:
    every rank enters it. Nothing inside may call ``state_dict()`` (FSDP2 reshards the unit for it)."""
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for i, unit in enumerate(units):
            unit.set_reshard_after_forward(i < len(units) - 1, recurse=False)
            unit.reshard()
