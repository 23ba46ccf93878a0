"""Checkpoints without pickle: safetensors for tensors, JSON for everything else, atomic per directory.

Layout of ``<run_dir>/checkpoints/step-<N>/``::

    model.safetensors       trainable draft weights (never the frozen target embedding/lm_head)
    optimizer.safetensors   optimizer state tensors, keys ``<param index>.<state name>``
    state.json              step, committed cursor, draft config, optimizer param groups,
                            scheduler state, RNG states (as lists of ints), artcache ids

The directory is written under a unique temp name beside it and renamed into place, so a crash
leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch

from artcache.fsio import fsync_dir
from artcache.layout import unique_suffix


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"{idx}.{name}"] = t.detach().cpu().contiguous()
    return tensors, sd["param_groups"]


def save_checkpoint(run_dir: Path, *, step: int, cursor: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler, extra: dict) -> Path:
    """Write ``run_dir/checkpoints/step-<step>`` atomically and return its path.

    Args:
        model: must provide ``trainable_state_dict()``.
        extra: JSON-serialisable metadata (draft config, plan and contract ids, consumer id).
    """
    final = run_dir / "checkpoints" / f"step-{step:08d}"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{unique_suffix()}"
    tmp.mkdir()
    try:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.trainable_state_dict().items()}
        safetensors.torch.save_file(weights, tmp / "model.safetensors")
        opt_tensors, groups = _optimizer_tensors(optimizer)
        safetensors.torch.save_file(opt_tensors, tmp / "optimizer.safetensors")
        state = {
            "step": step, "cursor": cursor, "param_groups": groups,
            "scheduler": {k: v for k, v in scheduler.state_dict().items() if not callable(v)
                          and k != "lr_lambdas"} if scheduler is not None else None,
            "torch_rng": torch.get_rng_state().tolist(), **extra,
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
        for name in ("model.safetensors", "optimizer.safetensors", "state.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest = final.parent / "latest"
    tmp_link = final.parent / f".latest-{unique_suffix()}"
    os.symlink(final.name, tmp_link)
    os.replace(tmp_link, latest)
    return final


def load_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Trainable weights of a checkpoint (safetensors only; nothing is unpickled)."""
    path = Path(checkpoint) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"no model.safetensors in checkpoint {checkpoint}")
    return safetensors.torch.load_file(path)


def load_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "state.json").read_text())
