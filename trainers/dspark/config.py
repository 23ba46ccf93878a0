"""DSpark draft configuration.

DSpark (arXiv:2607.05147) is the DFlash backbone with "sample from anchor", a Markov head and a
confidence head. The shape fields come from :class:`~artcache.trainers.dflash.DFlashConfig` (this
config *is* one, so the DFlash backbone modules build from it); the DSpark fields and their defaults
follow DeepSpec's ``config/dspark/dspark_qwen3_8b.py`` (block 7, 512 anchors, Markov rank 256 vanilla,
loss decay 4.0, CE 0.1, L1 0.9, confidence 1.0, confidence head on ``[h ; W1[prev]]``) and its
``deepspec/modeling/dspark/qwen3/config.py``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from artcache.errors import ConfigError
from artcache.trainers.dflash.config import DFlashConfig, read_target_shape, resolve_intermediate

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MARKOV_RANK", "MARKOV_HEAD_TYPES", "DSparkConfig", "default_anchors"]

#: DSpark's block size B (every one of the B slots predicts; DeepSpec's Qwen3-8B recipe).
DEFAULT_BLOCK_SIZE = 7
#: Rank r of the Markov head (W1: V x r, W2: r -> V).
DEFAULT_MARKOV_RANK = 256
#: ``vanilla``: bias = W2(W1[prev]) (what vLLM 0.32's Qwen3DSparkModel serves); ``gated``: bias =
#: W2(sigmoid(G[h; W1[prev]]) * W1[prev]) (DeepSpec's GatedMarkovHead; trains and exports as hf only).
MARKOV_HEAD_TYPES = ("vanilla", "gated")


def default_anchors(device: str) -> int:
    """Anchors per sequence when ``--anchors`` is not given: 512 on a GPU (DeepSpec), 64 on a CPU."""
    return 512 if str(device).startswith("cuda") else 64


class DSparkConfig(DFlashConfig, frozen=True, forbid_unknown_fields=True):
    """A DSpark draft: the DFlash fields (see :class:`DFlashConfig`) with DSpark's defaults, plus:

    Fields:
        block_size: B slots per block, default 7. Slot k = 0 … B-1 of the block anchored at p holds
            ``x_p`` (k = 0) or MASK and predicts ``x_{p+k+1}`` ("sample from anchor": every slot
            predicts, so a block proposes B tokens).
        gamma: loss decay; slot k weighs ``exp(-k / gamma)`` (0-based k), default 4.0 (every DeepSpec
            config; the paper reuses its block-length symbol). Never None for DSpark.
        logit_chunk: rows per [rows, V] chunk in the loss (draft and target softmaxes), default 1024.
        markov_rank: r; 0 disables the Markov head (and ``confidence_head_with_markov``).
        markov_head_type: one of :data:`MARKOV_HEAD_TYPES`.
        enable_confidence_head: train the confidence head (sigmoid(linear) = c_k, the conditional
            probability that slot k is accepted given every earlier slot was).
        confidence_head_with_markov: its input is ``[h_k ; W1[prev_k]]`` (H + r); else ``h_k`` (H).
        ce_weight, l1_weight, confidence_weight: the objective's weights (0.1, 0.9, 1.0).

    Raises:
        ConfigError: any field invalid (named, with what is accepted).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    gamma: float | None = 4.0
    logit_chunk: int = 1024
    markov_rank: int = DEFAULT_MARKOV_RANK
    markov_head_type: Literal["vanilla", "gated"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.gamma is None:
            raise ConfigError("DSpark gamma (loss decay) must be a finite number > 0, got None")
        r = self.markov_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"--markov-rank {r!r} is invalid: accepted an int >= 0 (0 disables the Markov head)")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type {self.markov_head_type!r} is not accepted: one of "
                              f"{', '.join(MARKOV_HEAD_TYPES)}")
        if self.confidence_head_with_markov and self.enable_confidence_head and r == 0:
            raise ConfigError("confidence_head_with_markov needs the Markov head (markov_rank > 0); pass "
                              "--markov-rank N or turn confidence_head_with_markov off")
        for name in ("ce_weight", "l1_weight", "confidence_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.confidence_weight > 0 and not self.enable_confidence_head:
            raise ConfigError("confidence_weight > 0 needs enable_confidence_head")

    @property
    def confidence_input_size(self) -> int:
        """Width of the confidence head's input: H + r with the Markov embedding, else H."""
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @classmethod
    def from_target(  # type: ignore[override]
        cls,
        target_hf_config: Any,
        num_layers: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_anchors: int = 512,
        mask_token_id: int | None = None,
        *,
        num_context_layers: int | None = None,
        markov_rank: int = DEFAULT_MARKOV_RANK,
        markov_head_type: str = "vanilla",
        intermediate_size: int | None = None,
        **fields: Any,
    ) -> DSparkConfig:
        """A config whose sizes come from the target's transformers config (as
        :meth:`DFlashConfig.from_target`); ``num_context_layers`` defaults to ``num_layers`` (the
        DFlash formula's one context layer per draft layer). Other DSpark fields pass through
        ``fields``.

        Raises:
            ConfigError: no ``mask_token_id``, a field the target config lacks, or any value invalid.
        """
        if mask_token_id is None:
            raise ConfigError("mask_token_id is required: choose an id that never occurs in data (Qwen3: 151669)")
        t = read_target_shape(target_hf_config)
        return cls(
            hidden_size=t.hidden_size, num_layers=num_layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim, intermediate_size=resolve_intermediate(t, intermediate_size),
            vocab_size=t.vocab_size,
            num_context_layers=num_layers if num_context_layers is None else num_context_layers,
            mask_token_id=mask_token_id, block_size=block_size, num_anchors=num_anchors, rope_theta=t.rope_theta,
            rms_norm_eps=t.rms_norm_eps, markov_rank=markov_rank, markov_head_type=markov_head_type, **fields)
