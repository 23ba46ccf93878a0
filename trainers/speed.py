"""How a draft trains fast on a GPU: the options every draft's adapter reads (:class:`SpeedOptions`).

On a CPU nothing changes (the reference arithmetic; tests pin the losses within float32 rounding). On CUDA the
training step is **sync-free**: nothing in it reads device memory back to the host (no ``.item()``,
``.tolist()``, ``nonzero`` or ``bool(tensor)``), so the host enqueues step k+1 while the GPU runs step
k; metric sums stay on the device (:class:`~artcache.trainers.draft.PendingSums`) and the consumer
reads them every ``--log-every`` steps. The lm_head loss runs in bf16 chunks
(:mod:`artcache.trainers.lm_head_ce`), and ``--compile on`` wraps the draft's forward (and the loss's
per-chunk softmax body) in ``torch.compile`` (``graphs``: with CUDA graphs, ``mode="reduce-overhead"``);
``auto`` is ``on`` on CUDA for a run of at least :data:`AUTO_COMPILE_MIN_STEPS` steps and ``off`` otherwise
(every CPU run, and short CUDA runs, which the ~20 s compile would not repay).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from artcache.errors import ConfigError
from artcache.trainers import COMPILE_MODES, LOSS_IMPLS
from artcache.trainers.lm_head_ce import liger_available

__all__ = ["AUTO_COMPILE_MIN_STEPS", "SpeedOptions", "to_device"]

#: ``--compile auto`` compiles on CUDA from this many planned steps on. Measured on one H200 (2026-12-01,
#: bench/results/2026-12-01-h200-consumer-speed.json, SmolLM2 shapes, batch 8 x 1024): DFlash B16 32.8 ->
#: 60.1 steps/s and EAGLE-3 (7 TTT) 23.9 -> 31.1 steps/s with ``--compile on``, after a 19-22 s compile.
#: EAGLE-3 saves 1/23.9 - 1/31.1 = 9.7 ms a step, so the compile is repaid after ~2,000 steps.
AUTO_COMPILE_MIN_STEPS = 2000


@dataclass(frozen=True)
class SpeedOptions:
    """Resolved speed options of one draft (``--compile``, ``--loss-impl``, and the device).

    Attributes:
        sync_free: the training step reads nothing back to the host (CUDA).
        ce_impl: the lm_head loss implementation (:data:`artcache.trainers.lm_head_ce.CE_IMPLS`).
        compile: ``off``, ``on`` (``torch.compile``) or ``graphs`` (``torch.compile`` with CUDA graphs).
        attn: the block attention of DFlash / DSpark, ``sdpa`` or ``flex``
            (:attr:`~artcache.trainers.dflash.DFlashDraft.attn_impl`). The consumer always uses ``sdpa``:
            FlexAttention measured slower on an H200 (docs/training.md, "GPU speed"); ``bench.consumer_speed``'s
            ``+flex`` variants set it.
    """

    sync_free: bool = False
    ce_impl: str = "reference"
    compile: str = "off"
    attn: str = "sdpa"

    @classmethod
    def for_device(cls, cfg, device: torch.device) -> SpeedOptions:
        """From a consumer config's ``loss_impl`` / ``compile`` on ``device`` (``auto`` resolved there).

        Raises:
            ConfigError: ``liger`` off CUDA or without the package; ``on`` or ``graphs`` off CUDA (the host step
                is never compiled: ``on`` was a silent no-op there); unknown values.
        """
        cuda = device.type == "cuda"
        impl = getattr(cfg, "loss_impl", "auto")
        mode = getattr(cfg, "compile", "auto")
        if impl not in LOSS_IMPLS:
            raise ConfigError(f"--loss-impl {impl!r} is not accepted: one of {', '.join(LOSS_IMPLS)}")
        if mode not in COMPILE_MODES:
            raise ConfigError(f"--compile {mode!r} is not accepted: one of {', '.join(COMPILE_MODES)}")
        if impl == "auto":
            impl = "chunked" if cuda else "reference"
        if impl == "liger" and not (cuda and liger_available()):
            raise ConfigError("--loss-impl liger needs a CUDA device and the liger-kernel package "
                              "(pip install 'artcache[liger]'); use --loss-impl chunked")
        if mode == "auto":
            mode = "on" if cuda and getattr(cfg, "steps", 0) >= AUTO_COMPILE_MIN_STEPS else "off"
        if mode == "graphs" and not cuda:
            raise ConfigError("--compile graphs needs a CUDA device (CUDA graphs); use --compile off or auto")
        if mode == "on" and not cuda:
            raise ConfigError(f"--compile on compiles the CUDA step only: on {device.type} the consumer runs the "
                              "host step, which is not compiled; use --compile off or auto")
        return cls(sync_free=cuda, ce_impl=impl, compile=mode)

    def compiled(self, module: torch.nn.Module):
        """``module`` itself (``off``), or its ``torch.compile``-d callable (shapes: automatic dynamic,
        so a second sequence length recompiles once into a length-generic graph)."""
        if self.compile == "off":
            return module
        return _compile(module, "reduce-overhead" if self.compile == "graphs" else "default")

    def step_begin(self) -> None:
        """Mark a new training step for CUDA graphs (their outputs of the previous step may be reused)."""
        if self.compile == "graphs":
            torch.compiler.cudagraph_mark_step_begin()


@functools.lru_cache(maxsize=8)
def _compile(module: torch.nn.Module, mode: str):
    return torch.compile(module, mode=mode)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; a CPU tensor bound for CUDA goes through pinned memory without blocking
    (a pageable copy would wait for the GPU to drain the stream: a synchronisation in disguise)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
