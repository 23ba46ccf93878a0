"""The transformers capture backend: forward hooks on the captured decoder layers only.

Layer convention: artcache stores *output-of-layer i* (the residual stream leaving decoder layer
i, Hugging Face ``output_hidden_states[i + 1]``). A forward hook on ``model.layers[i]`` sees exactly
that tensor, so no index conversion happens here; the forward pass is cut short after the deepest
captured layer (the remaining layers, the final norm and the lm_head are never run).
"""

from __future__ import annotations

import contextlib

import torch

from artcache.contract import CaptureContract
from artcache.errors import ConfigError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _StopForward(Exception):
    pass


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(f"cannot find decoder layers on {type(model).__name__}: expected .model.layers")
    return layers


def check_layer_ids(layer_ids, num_layers: int, target_name: str) -> None:
    """Raise ConfigError unless every id is a valid output-of-layer index of the target."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise ConfigError(
            f"target {target_name!r} has {num_layers} decoder layers (valid output-of-layer ids "
            f"0..{num_layers - 1}); requested layer ids {list(layer_ids)} do not fit")


class HFCaptureBackend:
    """Captures ``contract.layer_ids`` from a transformers model.

    Args:
        model: a transformers causal LM in eval mode (``load_target_model``).
        contract: the capture contract (layer ids, dtype).
        device: where the model lives; inputs are moved there.
    """

    def __init__(self, model, contract: CaptureContract, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.contract = contract
        self.device = torch.device(device)
        self.layers = decoder_layers(model)
        check_layer_ids(contract.layer_ids, len(self.layers), contract.target_name)
        self.dtype = _DTYPES[contract.dtype]
        self._captured: dict[int, torch.Tensor] = {}
        self._last = max(contract.layer_ids)
        #: per sample of the last capture: True if its hidden states were verified finite on the device
        self.last_finite: list[bool] = []
        self._hooks = [self.layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(contract.layer_ids))]

    def _hook(self, idx: int):
        def fn(_module, _inputs, output):
            hs = output[0] if isinstance(output, tuple) else output
            self._captured[idx] = hs.detach()
            if idx == self._last:
                raise _StopForward
        return fn

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _to_host(self, stacked: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor into page-locked host memory. A fresh buffer per batch (torch's
        caching host allocator recycles freed ones), since the publisher thread may still be
        writing the previous batch."""
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        torch.cuda.current_stream(stacked.device).synchronize()
        return host

    @torch.inference_mode()
    def capture(self, samples) -> list[dict[str, torch.Tensor]]:
        """Run one batched forward pass.

        Args:
            samples: plan samples with ``input_ids`` [T_i] int32 and ``loss_mask`` [T_i] uint8.

        Returns:
            Per sample, CPU tensors ``hidden_states`` [T_i, m, H] (contract dtype), ``input_ids``,
            ``loss_mask`` — ready for :func:`artcache.store.publish`. On a GPU the hidden states are
            views of one pinned host buffer per batch.
        """
        lengths = [int(s.input_ids.shape[0]) for s in samples]
        tmax = max(lengths)
        ids = torch.zeros(len(samples), tmax, dtype=torch.long)
        attn = torch.zeros(len(samples), tmax, dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, : lengths[row]] = s.input_ids.long()
            attn[row, : lengths[row]] = 1
        self._captured.clear()
        base = getattr(self.model, "model", self.model)
        with contextlib.suppress(_StopForward):
            base(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False)
        stacked = torch.stack([self._captured[i] for i in self.contract.layer_ids], dim=2)  # [b,T,m,H]
        stacked = stacked.to(self.dtype)
        self._captured.clear()
        if stacked.device.type != "cpu":
            # NaN/Inf check per sample on the device (cheap there), over the real tokens only
            bad = ~torch.isfinite(stacked)
            self.last_finite = [not bool(bad[row, : lengths[row]].any()) for row in range(len(samples))]
            stacked = self._to_host(stacked)
        else:
            self.last_finite = [False] * len(samples)  # not checked here: publish checks on the host
        out = []
        for row, s in enumerate(samples):
            out.append({
                # a prefix of one row of a contiguous [b, T, m, H] tensor is contiguous: no copy
                "hidden_states": stacked[row, : lengths[row]],
                "input_ids": s.input_ids.to(torch.int32).contiguous(),
                "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
            })
        return out
