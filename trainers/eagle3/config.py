"""EAGLE-3 draft configuration and the target layers it captures.

Sizes follow the target config; the draft-specific settings (three captured layers, a pruned draft
vocabulary, the training-time-test unroll and its 0.8 loss decay) follow EAGLE-3 arXiv:2503.01840 and
SpecForge's EAGLE-3 recipe (EAGLE-3 arXiv:2503.01840; re-implemented here).

Layer ids are in the **output-of-layer** convention (docs/export.md, "Layer ids: the one conversion"): id ``i`` is
the un-normed residual stream leaving decoder layer ``i`` (0-based). Convert to vLLM's
``eagle_aux_hidden_state_layer_ids`` (input-of-layer) with
:func:`artcache.layer_ids.output_of_layer_to_vllm_id` (``+1``).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from artcache.errors import ConfigError
from artcache.trainers.dflash.config import read_target_shape, resolve_intermediate

__all__ = ["EAGLE3_NUM_AUX", "Eagle3Config"]

#: Number of captured (auxiliary) target layers concatenated into ``fc`` (3H -> H).
EAGLE3_NUM_AUX = 3


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    return value


class Eagle3Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape and training settings of an EAGLE-3 draft (one Llama-style decoder layer).

    Fields (units):
        hidden_size: H, the target's hidden size (the draft works at the same width).
        num_heads / num_kv_heads / head_dim: GQA geometry of the draft layer (num_heads % num_kv_heads
            == 0; head_dim even, for RoPE). q/k/v read width 2H (``[embed ; hidden]``).
        intermediate_size: SwiGLU width.
        vocab_size: V, the target vocabulary (rows of the frozen embedding / target lm_head).
        draft_vocab_size: V_d <= V, rows of the trainable draft lm_head (typically 32000; V_d == V
            means no pruning and an identity vocab map).
        ttt_steps: training-time-test unroll length (default 7, SpecForge; speculators uses 3).
        loss_decay: step i's loss weight is ``loss_decay ** i`` (default 0.8).
        rope_theta: RoPE base; :meth:`from_target` copies the target's.
        rms_norm_eps: epsilon of every RMSNorm, the target's final norm included.
        logit_chunk: rows per chunk for the target logits ([rows, V]) and the draft soft-CE
            ([rows, V_d]); bounds the transient memory of the loss.

    Construction validates (:meth:`validate`) and raises :class:`ConfigError`.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    ttt_steps: int = 7
    loss_decay: float = 0.8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    logit_chunk: int = 1024

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raise :class:`ConfigError` naming the offending value."""
        positive = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                    "draft_vocab_size", "ttt_steps", "logit_chunk")
        for name in positive:
            v = _check_int(name, getattr(self, name))
            if v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size} must be <= vocab_size={self.vocab_size} "
                              "(from_target clamps it)")
        for name in ("loss_decay", "rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")

    def step_weights(self) -> list[float]:
        """Per-step loss weights ``[loss_decay ** i for i in range(ttt_steps)]``."""
        return [float(self.loss_decay) ** i for i in range(self.ttt_steps)]

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        draft_vocab_size: int = 32000,
        ttt_steps: int = 7,
        *,
        loss_decay: float = 0.8,
        intermediate_size: int | None = None,
        logit_chunk: int = 1024,
    ) -> Eagle3Config:
        """Build a config whose sizes come from a transformers config of the target.

        Read from the target (or its ``get_text_config()``): hidden_size, num_attention_heads,
        num_key_value_heads (default: num_attention_heads), head_dim (default: hidden_size //
        num_attention_heads), intermediate_size, vocab_size, rms_norm_eps (default 1e-6), and rope_theta
        from ``rope_theta`` (transformers 4.x) or ``rope_parameters["rope_theta"]`` (5.x), 10000.0 when
        neither is present. RoPE scaling variants are not copied (plain RoPE). ``draft_vocab_size`` is
        clamped to the target vocab: asking for V_d >= V gives V_d = V (identity vocab map).

        Raises:
            ConfigError: a required field missing on the target config, or any resulting value invalid.
        """
        t = read_target_shape(target_hf_config)
        vocab = t.vocab_size
        _check_int("draft_vocab_size", draft_vocab_size)
        return cls(
            hidden_size=t.hidden_size,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            intermediate_size=resolve_intermediate(t, intermediate_size),
            vocab_size=vocab,
            draft_vocab_size=min(draft_vocab_size, vocab),
            ttt_steps=ttt_steps,
            loss_decay=loss_decay,
            rope_theta=t.rope_theta,
            rms_norm_eps=t.rms_norm_eps,
            logit_chunk=logit_chunk,
        )
