"""The transformers capture backend: forward hooks on the captured decoder layers only.

Layer convention: artcache stores *output-of-layer i* (the residual stream leaving decoder layer
i, Hugging Face ``output_hidden_states[i + 1]``). A forward hook on ``model.layers[i]`` sees exactly
that tensor, so no index conversion happens here; the forward pass is cut short after the deepest
captured layer (the remaining layers, the final norm and the lm_head are never run).

On a GPU, :meth:`HFCaptureBackend.capture` returns as soon as the work is queued: the NaN/Inf check runs
on the device in one pass (per-sample flags, no host sync), an fp8 contract is quantised there
(half the bytes to copy), and the device-to-host copy into pinned memory runs on a side stream, so it
overlaps the next batch's prefill instead of holding the compute stream. The returned
:class:`CapturedBatch` says when its host tensors are complete (:meth:`CapturedBatch.ready`).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from artcache.contract import CaptureContract
from artcache.errors import ConfigError, ProducerFailed
from artcache.fp8 import SCALES, stored_hidden
from artcache.layer_ids import check_layer_ids

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn}


class _StopForward(Exception):
    pass


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError(f"cannot find decoder layers on {type(model).__name__}: expected .model.layers")
    return layers


class CapturedBatch(list):
    """The per-sample tensors of one capture (a list of dicts, as :func:`artcache.store.publish` takes them)
    whose host copies may still be in flight.

    :meth:`ready` blocks until they are complete and returns, per sample, whether its hidden states were
    verified free of NaN/Inf on the device (False = not checked: publish checks on the host). Touch
    the tensors only after it returned. A batch captured on the CPU is ready at once.
    """

    def __init__(self, items, finite=None, event=None) -> None:
        super().__init__(items)
        self._finite = finite  # list[bool], or a pinned bool tensor filled by the copy stream
        self._event = event

    def ready(self) -> list[bool]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if isinstance(self._finite, torch.Tensor):
            self._finite = [bool(x) for x in self._finite.tolist()]
        return list(self._finite) if self._finite is not None else [False] * len(self)


class HFCaptureBackend:
    """Captures ``contract.layer_ids`` from a transformers model.

    Placement is not part of the capture: a model placed over several devices (``load_target_model(...,
    devices=...)``: decoder layers split in contiguous blocks) is read by hooks on each layer where it
    lives, and the captured layers are gathered onto ``device`` before they are stacked; a model sharded by
    a tensor-parallel plan (``group``) has replicated layer outputs, read on rank 0.

    Args:
        model: a transformers causal LM in eval mode (``load_target_model``).
        contract: the capture contract (layer ids, dtype).
        device: where the inputs go and the captured layers are gathered (the first device of a placement).
        group: a :class:`artcache.backends.tensor_parallel.TensorParallelGroup` this process is rank 0 of:
            each batch is announced to the follower ranks before the forward pass, which they run with it.
        prefill_chunk: tokens per row in one forward pass (0: the whole batch in one pass). A batch longer
            than this is prefilled in chunks through a ``transformers.DynamicCache``: chunk ``c`` runs
            positions ``[c·C, (c+1)·C)`` attending to the cached keys/values of the earlier chunks, and the
            captured layers of the chunks are concatenated along the token axis. Attention stays causal, so
            the values equal a one-pass prefill's up to the compute dtype's rounding (the kernels sum in
            another order). Only the layers up to the deepest captured one run, so only their keys/values
            are cached: ``2 × layers run × T × kv heads × head dim`` elements of the compute dtype per row.
            Not with ``group`` (its followers run one pass).
    """

    def __init__(self, model, contract: CaptureContract, device: str | torch.device = "cpu", group=None,
                 prefill_chunk: int = 0) -> None:
        if prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk {prefill_chunk} is invalid: accepted 0 (off) or a positive integer")
        if prefill_chunk and group is not None:
            raise ConfigError(f"prefill_chunk {prefill_chunk} is invalid with a tensor-parallel target: accepted 0 "
                              "there")
        self.prefill_chunk = int(prefill_chunk)
        self.model = model
        self.group = group
        self.contract = contract
        self.device = torch.device(device)
        self.layers = decoder_layers(model)
        check_layer_ids(contract.layer_ids, len(self.layers), f"contract layer_ids {list(contract.layer_ids)}",
                        target=contract.target_name)
        self.dtype = _DTYPES[contract.dtype]
        self._captured: dict[int, torch.Tensor | list[torch.Tensor]] = {}
        self._last = max(contract.layer_ids)
        self._last_batch: CapturedBatch | None = None
        self._copy_stream = None  # created on the first GPU capture
        self._hooks = [self.layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(contract.layer_ids))]

    def _hook(self, idx: int):
        def fn(_module, _inputs, output):
            hs = output[0] if isinstance(output, tuple) else output
            if hasattr(hs, "full_tensor"):  # a DTensor output of a sharded layer (every rank gathers it)
                hs = hs.full_tensor()
            got = self._captured.get(idx)
            if isinstance(got, list):  # a chunked prefill: one piece per chunk
                got.append(hs.detach())
            else:
                self._captured[idx] = hs.detach()
            if idx == self._last:
                raise _StopForward
        return fn

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.group is not None:
            self.group.close()
            self.group = None

    def forward(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Run the decoder up to the deepest captured layer on ``ids`` and ``attn`` ([b, T] int64, on any
        device) and return the captured layers stacked in contract order, ``[b, T, m, H]`` in the compute
        dtype on ``device``. Each layer's output is read where that layer lives and moved to ``device``. A batch
        longer than ``prefill_chunk`` runs in chunks (:meth:`_prefill_chunks`)."""
        self._captured.clear()
        base = getattr(self.model, "model", self.model)
        if self.prefill_chunk and ids.shape[1] > self.prefill_chunk:
            self._prefill_chunks(base, ids.to(self.device), attn.to(self.device))
        else:
            with contextlib.suppress(_StopForward):
                base(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False)
        try:
            return torch.stack([self._captured[i].to(self.device) for i in self.contract.layer_ids], dim=2)
        finally:
            self._captured.clear()

    def _prefill_chunks(self, base, ids: torch.Tensor, attn: torch.Tensor) -> None:
        """Prefill ``ids`` [b, T] (right-padded; ``attn`` [b, T] 1 on real tokens) in chunks of
        ``prefill_chunk`` through one DynamicCache; leaves each captured layer's [b, T, H] in ``_captured``.

        Each chunk passes the attention mask of every position so far (``attn[:, :end]``) and its
        ``cache_position`` (``start .. end-1``; position ids follow from it), so a chunk's queries see the
        cached keys of earlier chunks causally, as in one pass. Padding sits at the end of a row, after its
        real tokens, so no real token ever attends to it.
        """
        from transformers import DynamicCache

        cache = DynamicCache()
        # transformers 5 names the argument ``cache``; 4.x ``past_key_values`` (5 still takes it, deprecated)
        name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        wanted = sorted(set(self.contract.layer_ids))
        for i in wanted:
            self._captured[i] = []
        t = ids.shape[1]
        for start in range(0, t, self.prefill_chunk):
            end = min(t, start + self.prefill_chunk)
            with contextlib.suppress(_StopForward):
                base(input_ids=ids[:, start:end], attention_mask=attn[:, :end], use_cache=True,
                     **{name: cache}, cache_position=torch.arange(start, end, device=ids.device))
            if cache.get_seq_length() != end:  # a model that ignored the cache would see each chunk alone
                raise ConfigError(f"{type(base).__name__} did not fill its KV cache in a chunked prefill "
                                  f"({cache.get_seq_length()} of {end} positions); accepted: --prefill-chunk 0")
        for i in wanted:
            pieces = self._captured[i]
            self._captured[i] = torch.cat(pieces, dim=1)
            pieces.clear()  # the pieces go now, not with the list
        del cache

    @property
    def last_finite(self) -> list[bool]:
        """Per sample of the last capture: True if its hidden states were verified finite on the device
        (waits for that capture's host copies). New code uses the returned batch's ``ready()``."""
        return self._last_batch.ready() if self._last_batch is not None else []

    def _to_host(self, tensors: dict[str, torch.Tensor], row_ok: torch.Tensor):
        """Queue the copies of device tensors into fresh page-locked host buffers on the side copy stream.

        Returns ``(host tensors, host row flags, event)``; the host tensors are complete once ``event``
        has completed. The copy stream waits for the compute stream's work so far (the capture), and each
        device tensor is marked used by the copy stream so the caching allocator does not hand its memory
        to the next batch before the copy is done. The host buffers come from torch's caching host
        allocator, which recycles a buffer only after the copies recorded on it completed (the publisher
        may still be writing the previous batch: each batch gets its own)."""
        dev = row_ok.device
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(dev)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        host = {}
        with torch.cuda.stream(stream):
            for name, t in {**tensors, "_row_ok": row_ok}.items():
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(stream)
                host[name] = h
            event = torch.cuda.Event()
            event.record(stream)
        flags = host.pop("_row_ok")
        return host, flags, event

    @torch.inference_mode()
    def capture(self, samples) -> CapturedBatch:
        """Run one batched forward pass (in chunks of ``prefill_chunk`` tokens when the batch is longer).

        Args:
            samples: plan samples with ``input_ids`` [T_i] int32 and ``loss_mask`` [T_i] uint8.

        Returns:
            Per sample, CPU tensors ``hidden_states`` [T_i, m, H] (contract dtype; for fp8 the e4m3fn codes
            plus ``hidden_scales`` [T_i, m] float32, :mod:`artcache.fp8`), ``input_ids``, ``loss_mask``,
            ready for :func:`artcache.store.publish` once ``ready()`` returned (at once on a CPU). On a GPU
            the tensors are views of one pinned host buffer per batch and tensor name.
        """
        lengths = [int(s.input_ids.shape[0]) for s in samples]
        tmax = max(lengths)
        ids = torch.zeros(len(samples), tmax, dtype=torch.long)
        attn = torch.zeros(len(samples), tmax, dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, : lengths[row]] = s.input_ids.long()
            attn[row, : lengths[row]] = 1
        attn_dev = attn.to(self.device)
        if self.group is None:
            stacked = self.forward(ids, attn_dev)  # [b,T,m,H]
        else:  # the followers run this forward with rank 0; one that fails leaves the group out of step
            self.group.announce(ids, attn)
            try:
                stacked = self.forward(ids, attn_dev)
            except Exception as exc:  # noqa: BLE001 - any failure ends the group
                raise ProducerFailed(f"tensor-parallel group of {self.group.size}: the forward pass failed on rank 0 "
                                     f"({type(exc).__name__}: {exc}); a follower rank is gone or out of step, the "
                                     "producer stops") from exc
        stored = stored_hidden(stacked, self.dtype)  # fp8: quantised here, on the device
        del stacked
        if self.device.type != "cpu":
            # NaN/Inf check of what is stored, per sample, over the real tokens only: one pass, no host sync
            # (the flags travel with the copies). fp8: a NaN/Inf anywhere in a row makes its scale NaN/Inf,
            # so the [b, T, m] scales are checked instead of the codes
            check = stored.get(SCALES, stored["hidden_states"])
            bad = (~torch.isfinite(check)).flatten(2).any(dim=-1)  # [b, T]
            row_ok = ~(bad & attn_dev.bool()).any(dim=1)
            host, batch_finite, batch_event = self._to_host(stored, row_ok)
        else:
            host = stored
            batch_finite, batch_event = [False] * len(samples), None  # not checked here: publish checks
        out = []
        for row, s in enumerate(samples):
            out.append({
                # a prefix of one row of a contiguous [b, T, ...] tensor is contiguous: no copy
                **{name: t[row, : lengths[row]] for name, t in host.items()},
                "input_ids": s.input_ids.to(torch.int32).contiguous(),
                "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
            })
        self._last_batch = CapturedBatch(out, batch_finite, batch_event)
        return self._last_batch
