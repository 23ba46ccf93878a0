"""DFlash draft configuration.

Sizes follow the target (Qwen3-style) config; the draft-specific settings (block size, anchors,
gamma, mask token) follow DFlash arXiv:2602.06036 and its reference code (z-lab/dflash, SpecForge).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import msgspec

from artcache.errors import ConfigError

__all__ = ["DFlashConfig", "default_gamma"]

#: Reference decay constants: gamma per block size (DFlash paper / SpecForge recipes).
_GAMMA_REFERENCE: tuple[tuple[int, float], ...] = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """Loss-decay constant γ for a block size ``B`` (weight of slot k is ``exp(-(k-1)/γ)``).

    ``B = 16 -> 7``, ``B = 10 -> 5``, ``B = 8 -> 4`` are the published reference values (DFlash
    arXiv:2602.06036; SpecForge's DFlash training script recommends the same three pairs for its
    ``--loss-decay-gamma``). Other ``B`` (artcache's choice,
    not from a reference): **piecewise-linear interpolation** through the points (8, 4), (10, 5),
    (16, 7), extrapolated along the nearest end segment (slope 1/2 below 8, slope 1/3 above 16),
    floored at 1.0. So B=2 -> 1.0, B=4 -> 2.0,
    B=12 -> 5.667, B=32 -> 12.333. The exact reference values are reproduced.

    Raises:
        ConfigError: ``block_size < 2``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ConfigError(f"block_size must be an int >= 2, got {block_size!r}")
    pts = _GAMMA_REFERENCE
    if block_size <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif block_size >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(len(pts) - 1) if pts[i][0] <= block_size <= pts[i + 1][0])
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    return max(1.0, y0 + (y1 - y0) * (block_size - x0) / (x1 - x0))


class DFlashConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape and training settings of a DFlash draft.

    Fields (units):
        hidden_size: model width H (= the target's hidden size; the frozen embedding/lm_head are [V, H]).
        num_layers: draft decoder layers n.
        num_heads / num_kv_heads / head_dim: GQA attention geometry (num_heads % num_kv_heads == 0;
            head_dim even, for RoPE).
        intermediate_size: SwiGLU width.
        vocab_size: V, rows of the target embedding and lm_head.
        num_context_layers: m, captured target layers concatenated into ``fc`` (m·H -> H).
        block_size: B tokens per block (anchor + B-1 MASK tokens), default 16.
        num_anchors: N blocks sampled per sequence, default 512.
        gamma: loss-decay constant; ``None`` -> :func:`default_gamma` (see :attr:`resolved_gamma`).
        mask_token_id: the MASK id; must be a row of the target embedding that never occurs in data
            (Qwen3: 151669). Chosen deliberately, never a fallback to pad/eos.
        rope_theta: RoPE base; default 10000.0 but :meth:`from_target` copies the target's.
        rms_norm_eps: RMSNorm epsilon.
        logit_chunk: rows per lm_head chunk in the loss (bounds rows × V memory).

    Construction validates (:meth:`validate`) and raises :class:`ConfigError`.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_context_layers: int
    mask_token_id: int
    block_size: int = 16
    num_anchors: int = 512
    gamma: float | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    logit_chunk: int = 2048

    def __post_init__(self) -> None:
        self.validate()

    @property
    def resolved_gamma(self) -> float:
        """``gamma`` if set, else :func:`default_gamma` of ``block_size``."""
        return float(self.gamma) if self.gamma is not None else default_gamma(self.block_size)

    def validate(self) -> None:
        """Check every field; raise :class:`ConfigError` naming the offending value."""
        positive = (
            "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
            "vocab_size", "num_context_layers", "num_anchors", "logit_chunk",
        )
        for name in (*positive, "block_size", "mask_token_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an int, got {v!r}")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (anchor + at least one MASK), got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} must be in [0, vocab_size={self.vocab_size})")
        if self.gamma is not None and not (
            isinstance(self.gamma, (int, float)) and not isinstance(self.gamma, bool)
            and math.isfinite(self.gamma) and self.gamma > 0
        ):
            raise ConfigError(f"gamma must be a finite number > 0 or None, got {self.gamma!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        num_layers: int,
        block_size: int = 16,
        num_anchors: int = 512,
        mask_token_id: int | None = None,
        *,
        num_context_layers: int | None = None,
        gamma: float | None = None,
        intermediate_size: int | None = None,
        logit_chunk: int = 2048,
    ) -> DFlashConfig:
        """Build a config whose sizes come from a transformers config of the target.

        Read from the target (or its ``get_text_config()`` for multimodal configs): hidden_size,
        num_attention_heads, num_key_value_heads (default: num_attention_heads), head_dim (default:
        hidden_size // num_attention_heads), intermediate_size, vocab_size, rms_norm_eps (default
        1e-6), and rope_theta from ``rope_theta`` (transformers 4.x) or ``rope_parameters["rope_theta"]``
        (5.x); 10000.0 when the target has neither. RoPE scaling variants are not copied: the draft
        uses plain RoPE. ``num_context_layers`` defaults to ``num_layers`` (one captured layer per
        draft layer, :func:`~artcache.layer_ids.dflash_layer_ids`).

        Raises:
            ConfigError: ``mask_token_id`` missing, a required field missing on the target config,
                or any resulting value invalid.
        """
        if mask_token_id is None:
            raise ConfigError("mask_token_id is required: choose an id that never occurs in data (Qwen3: 151669)")
        t = read_target_shape(target_hf_config)
        return cls(
            hidden_size=t.hidden_size,
            num_layers=num_layers,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            intermediate_size=resolve_intermediate(t, intermediate_size),
            vocab_size=t.vocab_size,
            num_context_layers=num_layers if num_context_layers is None else num_context_layers,
            mask_token_id=mask_token_id,
            block_size=block_size,
            num_anchors=num_anchors,
            gamma=gamma,
            rope_theta=t.rope_theta,
            rms_norm_eps=t.rms_norm_eps,
            logit_chunk=logit_chunk,
        )


class TargetShape(NamedTuple):
    """The target sizes a draft copies (from a transformers config)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float


def read_target_shape(target_hf_config: Any) -> TargetShape:
    """Read a transformers config (or its ``get_text_config()``): hidden_size, num_attention_heads,
    num_key_value_heads (default: heads), head_dim (default: hidden // heads), intermediate_size (None when
    absent), vocab_size, rms_norm_eps (default 1e-6), rope_theta from ``rope_theta`` (transformers 4.x) or
    ``rope_parameters["rope_theta"]`` (5.x), 10000.0 when neither is present.

    Raises:
        ConfigError: hidden_size, num_attention_heads or vocab_size missing.
    """
    cfg = target_hf_config.get_text_config() if hasattr(target_hf_config, "get_text_config") else target_hf_config

    def need(name: str) -> Any:
        v = getattr(cfg, name, None)
        if v is None:
            raise ConfigError(f"target config has no {name!r}")
        return v

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None)
        if isinstance(params, dict):
            theta = params.get("rope_theta")
    eps = getattr(cfg, "rms_norm_eps", None)
    inter = getattr(cfg, "intermediate_size", None)
    return TargetShape(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
        intermediate_size=int(inter) if inter is not None else None, vocab_size=int(need("vocab_size")),
        rope_theta=float(theta) if theta is not None else 10000.0,
        rms_norm_eps=float(eps) if eps is not None else 1e-6)


def resolve_intermediate(t: TargetShape, given: int | None) -> int:
    """``given`` if set, else the target's intermediate_size. Raises ConfigError when neither exists."""
    if given is not None:
        return int(given)
    if t.intermediate_size is None:
        raise ConfigError("target config has no 'intermediate_size'")
    return t.intermediate_size
