"""artcache's vLLM KV connector: hands captured hidden-state rows back in memory.

vLLM's ``extract_hidden_states`` speculative method writes the aux hidden states of every token
into the KV cache of one cache-only attention layer (``[blocks, m, block_size, H]`` on CPU); a KV
connector copies them out once the request has finished. vLLM's own hidden-states connector then
writes a safetensors file in place behind a ``.lock`` file from a thread pool and copies through a
CUDA stream into pinned memory (which fails on CPU). This subclass keeps its scheduler/worker
plumbing (block bookkeeping, delayed block freeing, KV cache group lookup) and replaces the output
path:

* no files and no lock files: the worker copies each finished request's rows out of the KV cache
  (``[T, m, H]`` in the model dtype, plus ``token_ids`` [T] int64) into a process-wide mailbox keyed
  by the ``artcache_key`` the request carried in ``kv_transfer_params``;
* the rows are reported "finished sending" as soon as the copy is done, so vLLM frees the blocks;
* publication (temp file, fsync, rename, content hash) stays in artcache's publisher.

The mailbox only works when the engine core and its single worker live in the requesting process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker): :class:`artcache.backends.vllm.VLLMCaptureBackend`
sets that up and checks it. Load it with ``kv_connector="ArtcacheHiddenStatesConnector"``,
``kv_connector_module_path="artcache.backends.vllm_connector"``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: ``kv_transfer_params`` key naming the mailbox slot of a request's capture.
KEY_PARAM = "artcache_key"

_mailbox: dict[str, dict[str, torch.Tensor] | BaseException] = {}
_mailbox_lock = threading.Lock()


def take(key: str) -> dict[str, torch.Tensor] | BaseException | None:
    """Remove and return the capture delivered under ``key`` (None if it has not arrived).

    Returns ``{"hidden_states": [T, m, H] model dtype, "token_ids": [T] int64}`` (CPU tensors owned by
    the caller), or the exception the worker raised while copying it out.
    """
    with _mailbox_lock:
        return _mailbox.pop(key, None)


def discard(keys) -> None:
    """Drop captures nobody will take (a failed batch), so the mailbox does not grow."""
    with _mailbox_lock:
        for key in keys:
            _mailbox.pop(key, None)


def _deliver(key: str, value: dict[str, torch.Tensor] | BaseException) -> None:
    with _mailbox_lock:
        _mailbox[key] = value


@dataclass
class _Pending:
    req_id: str
    key: str
    token_ids: torch.Tensor  # [T] int64, the tokens whose states are in the KV cache
    block_ids: list[int]


@dataclass
class ArtcacheConnectorMetadata(KVConnectorMetadata):
    pending: list[_Pending] = field(default_factory=list)


class ArtcacheHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only connector: finished requests' hidden states go to :func:`take`, not to files."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._artcache_pending: dict[str, _Pending] = {}  # scheduler side: finished, not yet sent
        self._extracted: set[str] = set()  # worker side: copied out, not yet reported
        self._finished: set[str] = set()  # worker side: reported finished by the scheduler

    # -- scheduler side ----------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ArtcacheConnectorMetadata(pending=list(self._artcache_pending.values()))
        self._artcache_pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Queue the request's rows for copying; True keeps its blocks until they are copied."""
        params = request.kv_transfer_params or {}
        key = params.get(KEY_PARAM)
        if key is None or not block_ids:
            return False, None  # not an artcache capture request, or never scheduled
        # the prompt's tokens (artcache requests max_tokens=1; the sampled token is never fed back, so it
        # has no state); the requester compares them with what it asked for
        token_ids = torch.tensor(list(request.prompt_token_ids or ()), dtype=torch.long)
        self._artcache_pending[request.request_id] = _Pending(request.request_id, str(key), token_ids,
                                                              list(block_ids))
        return True, {KEY_PARAM: key}

    # -- worker side -------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        pass  # nothing is written, so no lock files are pre-created

    def _copy_out(self, pending: _Pending) -> None:
        try:
            if self._kv_cache is None:
                raise RuntimeError("the hidden-states KV cache was never registered")
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten().to(self._kv_cache.device)
            n = int(pending.token_ids.shape[0])
            if n > slots.numel():
                raise RuntimeError(f"request holds {slots.numel()} cache slots for {n} tokens")
            rows = extract_from_kv_cache(self._kv_cache, slots, n)  # [T, m, H], a fresh tensor
            _deliver(pending.key, {"hidden_states": rows.to("cpu"), "token_ids": pending.token_ids.clone()})
        except Exception as exc:  # reported to the requester, which rejects the capture
            _deliver(pending.key, exc)
        self._extracted.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy out this step's finished requests; report them done so vLLM frees their blocks."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ArtcacheConnectorMetadata):
                for pending in meta.pending:
                    if self._is_tp_rank_zero:
                        self._copy_out(pending)
                    else:
                        self._extracted.add(pending.req_id)
        self._finished.update(finished_req_ids)
        done = self._finished & self._extracted
        self._finished -= done
        self._extracted -= done
        return done or None, None


__all__ = ["KEY_PARAM", "ArtcacheHiddenStatesConnector", "discard", "take"]
