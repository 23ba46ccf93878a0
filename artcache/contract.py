"""The capture contract: everything that decides the bytes of an artifact.

Any field that can change an artifact's bytes is part of the contract, and the contract is part of
every fingerprint (see :mod:`artcache.fingerprint`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from artcache import FORMAT_VERSION
from artcache.hashing import canonical_json, strong_digest

#: The layer-id convention artcache stores: the residual stream leaving decoder layer i,
#: i.e. Hugging Face ``output_hidden_states[i + 1]`` (SpecForge, z-lab DFlash, DeepSpec).
OUTPUT_OF_LAYER = "output-of-layer"

#: stored dtypes of ``hidden_states``. ``float8_e4m3fn`` is the row-scaled fp8 scheme of :mod:`artcache.fp8`
#: (codes plus a ``hidden_scales`` fp32 tensor, one scale per token row per layer; docs/format.md)
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
#: what ``--dtype`` / ``target.dtype`` accept besides ``DTYPES`` (an alias is stored as its full name)
DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def stored_dtype(name: str) -> str:
    """The contract dtype for ``name`` (an entry of ``DTYPES`` or ``DTYPE_ALIASES``).

    Raises:
        ValueError: naming the value and what is accepted.
    """
    full = DTYPE_ALIASES.get(name, name)
    if full not in DTYPES:
        raise ValueError(f"dtype {name!r} not accepted: use {', '.join(DTYPES)} or {', '.join(DTYPE_ALIASES)}")
    return full


def stored_bytes_per_token(dtype: str, layers: int, hidden: int) -> int:
    """Data bytes one token takes in an artifact of ``dtype``: ``layers × hidden`` hidden-state values,
    plus one fp32 scale per layer for fp8, plus 5 (int32 token id, uint8 loss mask). The header (under
    4 KiB) comes on top, once per artifact."""
    full = stored_dtype(dtype)
    return layers * hidden * _ITEMSIZE[full] + (4 * layers if full == "float8_e4m3fn" else 0) + 5

#: Capture backends (``artcache producer --backend``): ``hf`` runs the target in transformers with
#: forward hooks, ``vllm`` in a vLLM engine with ``extract_hidden_states`` (artcache.backends.vllm). Both
#: store the ``output-of-layer`` convention; vLLM's ids are converted at its boundary.
BACKENDS = ("hf", "vllm")


class CaptureContract(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a capture produces.

    Attributes:
        target_name, target_revision, target_config_hash, target_weights_digest: target identity.
        layer_ids: captured layers, in artifact order, in the ``layer_convention`` convention.
        dtype: dtype of ``hidden_states`` in the artifact (one of ``DTYPES``); ``float8_e4m3fn`` means the
            row-scaled fp8 scheme (:mod:`artcache.fp8`), whose artifacts also hold ``hidden_scales``.
        compute_dtype: dtype the target ran in (the stored bits depend on it).
        include_last_hidden: whether ``last_hidden`` (post final norm) is stored.
        include_target_argmax: whether ``target_argmax`` ids are stored.
        max_length: samples are truncated to this many tokens by the plan.
        tokenizer_digest, template_digest: tokenizer and chat template identity.
        loss_mask_policy: how the plan's loss mask was derived.
        backend: capture backend, one of ``BACKENDS``; backends may differ in the last bits (other kernels,
            another accumulation order), so it is part of every fingerprint and an ``hf`` artifact is
            never served for a ``vllm`` contract or the reverse.
        format_version: artcache on-disk format.
    """

    target_name: str
    target_revision: str
    target_config_hash: str
    target_weights_digest: str
    layer_ids: tuple[int, ...]
    layer_convention: Literal["output-of-layer"] = OUTPUT_OF_LAYER
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = "bfloat16"
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    include_last_hidden: bool = False
    include_target_argmax: bool = False
    max_length: int
    tokenizer_digest: str
    template_digest: str
    loss_mask_policy: str = "assistant-content+eot"
    backend: Literal["hf", "vllm"] = "hf"
    format_version: int = FORMAT_VERSION

    def canonical(self) -> bytes:
        """Canonical JSON bytes (sorted keys, no whitespace)."""
        return canonical_json(self)

    @property
    def contract_id(self) -> str:
        """Hex digest identifying this contract."""
        return strong_digest(self.canonical())
