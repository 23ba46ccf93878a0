"""The DFlash block-diffusion draft (DFlash arXiv:2602.06036; architecture facts from z-lab/dflash
and SpecForge, re-implemented here).

Layout: ``fc`` (m·H -> H, no bias) over the m captured target layers, ``context_norm`` (RMSNorm)
-> context [b, T, H], shared by every layer. n non-causal Qwen3-style decoder layers whose queries
come only from block tokens and whose keys/values are ``[context ; block]`` through each layer's
own k/v projections. Final RMSNorm, then the target's **frozen** lm_head; block tokens are embedded
with the target's **frozen** embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from artcache.errors import ConfigError, DataError

from .config import DFlashConfig

__all__ = ["DFlashDraft", "RMSNorm", "build_attention_mask"]

#: Names of the frozen target tensors (buffers); never trained, never saved by trainable_state_dict().
FROZEN_BUFFERS = ("embed_weight", "lm_head_weight")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and returned in the input's dtype (Qwen3 style).

    ``y = x / sqrt(mean(x²) + eps) · weight``. Unlike ``torch.nn.RMSNorm`` it does not fall back to
    a slow path (with a warning) when autocast hands it bf16 input with fp32 weights. Parameter name
    ``weight`` matches ``torch.nn.RMSNorm`` and HF state dicts.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding (HF/Qwen "rotate half" layout). x [b, h, S, d]; positions [b, S] long."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[..., None] * inv_freq  # [b, S, d/2]
    ang = torch.cat((ang, ang), dim=-1)[:, None]  # [b, 1, S, d]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def build_attention_mask(
    anchors: Tensor, anchor_valid: Tensor, seq_len: int, block_size: int, context_valid: Tensor | None = None
) -> Tensor:
    """Boolean attention mask ``[b, 1, N·B, T + N·B]`` (True = may attend).

    Query row ``n·B + s`` (slot s of block n, anchor p = anchors[b, n]) sees context key j iff
    ``j < p`` (strictly before its anchor; DFlash arXiv:2602.06036 §3) and ``context_valid[b, j]``,
    plus all B keys of its own block (bidirectional); never another block. Rows of invalid anchors
    see only their own block (never an empty row, so softmax never runs over all ``-inf``); their
    outputs are zeroed by the model.
    """
    b, N = anchors.shape
    B = block_size
    dev = anchors.device
    p = anchors.repeat_interleave(B, dim=1)  # [b, N*B]
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < p[:, :, None]  # [b, N*B, T]
    ctx = ctx & anchor_valid.repeat_interleave(B, dim=1)[:, :, None]
    if context_valid is not None:
        ctx = ctx & context_valid.bool()[:, None, :]
    blk_id = torch.arange(N * B, device=dev) // B
    own = (blk_id[:, None] == blk_id[None, :]).expand(b, N * B, N * B)
    return torch.cat((ctx, own), dim=2)[:, None]


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd, self.theta = cfg.num_heads, cfg.num_kv_heads, hd, cfg.rope_theta
        self.q_proj = nn.Linear(H, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, q_pos: Tensor, kv_pos: Tensor, mask: Tensor) -> Tensor:
        b, S, _ = x.shape
        T = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, S, self.nh, self.hd)).transpose(1, 2)
        kv_in = torch.cat((ctx, x), dim=1)  # [context ; block]
        k = self.k_norm(self.k_proj(kv_in).view(b, T + S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, T + S, self.nkv, self.hd).transpose(1, 2)
        q = _rope(q, q_pos, self.theta)
        k = _rope(k, kv_pos, self.theta)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(o.transpose(1, 2).reshape(b, S, self.nh * self.hd))


class _MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, x: Tensor, ctx: Tensor, q_pos: Tensor, kv_pos: Tensor, mask: Tensor) -> Tensor:
        # Pre-norm on the block stream only; the context was normed once (context_norm) and is
        # shared by every layer (z-lab/dflash).
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, kv_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """DFlash draft model.

    Args:
        cfg: a validated :class:`DFlashConfig`.
        embed_weight: the target's input embedding, [V, H]. Stored as a non-persistent buffer
            (frozen, not a parameter, not in ``state_dict``/``trainable_state_dict``).
        lm_head_weight: the target's lm_head, [V, H]; same treatment. May be the same tensor as
            ``embed_weight`` for tied targets.

    Trainable: ``fc``, ``context_norm``, ``layers``, ``norm``. Linear weights start from
    N(0, 0.02²) (the Qwen3 ``initializer_range``), norms from 1.

        dtype: dtype of the trainable parameters (default float32: fp32 master weights; use autocast
            for bf16 compute). The frozen buffers keep the dtype and device they were given.

    dtype handling: the module dtype is that of ``fc.weight``. ``context_states`` and embeddings are
    cast to it; :meth:`logits` casts hidden states to the lm_head's dtype; RoPE angles are computed in
    float32. (``.to(dtype)`` on the module also casts the frozen buffers, as for any buffer.)

    Raises:
        ConfigError: weight shapes disagree with ``cfg``.
    """

    def __init__(
        self, cfg: DFlashConfig, embed_weight: Tensor, lm_head_weight: Tensor, *, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        cfg.validate()
        V, H = cfg.vocab_size, cfg.hidden_size
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (V, H):
                raise ConfigError(f"{name} has shape {tuple(w.shape)}, expected [vocab_size={V}, hidden_size={H}]")
        self.cfg = cfg
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating dtype, got {dtype}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.fc = nn.Linear(cfg.num_context_layers * H, H, bias=False)
        self.context_norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(_DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for mod in (self.fc, self.context_norm, self.layers, self.norm):
            mod.to(device=embed_weight.device, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """State dict of the trainable tensors only (never the frozen target embedding/lm_head)."""
        return {k: v for k, v in self.state_dict().items() if k not in FROZEN_BUFFERS}

    def embed(self, ids: Tensor) -> Tensor:
        """Frozen target embedding lookup, cast to the module dtype. ids long [...] -> [..., H]."""
        return F.embedding(ids, self.embed_weight).to(self.dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        """Frozen lm_head: hidden [..., H] -> logits [..., V] in the lm_head's dtype."""
        return F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)

    def forward(
        self,
        context_states: Tensor,
        input_ids: Tensor,
        anchors: Tensor,
        anchor_valid: Tensor,
        context_valid: Tensor | None = None,
    ) -> Tensor:
        """Draft hidden states for N blocks per sequence.

        Args:
            context_states: [b, T, m, H], any float dtype (cast to the module dtype): the captured
                target layers (output-of-layer convention, un-normed residual stream).
            input_ids: [b, T] long.
            anchors: [b, N] long, anchor positions p (valid ones in [0, T)).
            anchor_valid: [b, N] bool; False marks padding.
            context_valid: optional [b, T] bool; False positions (padding) are never attended.

        Returns:
            [b, N, B, H] final-normed hidden states; block n holds ``[x_p, MASK×(B-1)]`` at positions
            p … p+B-1. Rows of invalid anchors are exactly zero.

        Raises:
            ConfigError: shapes disagree with the config or with each other.
            DataError: a valid anchor lies outside [0, T).
        """
        cfg = self.cfg
        if context_states.dim() != 4:
            raise ConfigError(f"context_states must be [b, T, m, H], got shape {tuple(context_states.shape)}")
        b, T, m, H = context_states.shape
        if (m, H) != (cfg.num_context_layers, cfg.hidden_size):
            raise ConfigError(
                f"context_states has m={m}, H={H}; config expects num_context_layers={cfg.num_context_layers}, "
                f"hidden_size={cfg.hidden_size}"
            )
        if tuple(input_ids.shape) != (b, T):
            raise ConfigError(f"input_ids shape {tuple(input_ids.shape)} != (b, T) = {(b, T)}")
        if anchors.dim() != 2 or anchors.shape[0] != b or tuple(anchor_valid.shape) != tuple(anchors.shape):
            raise ConfigError(
                f"anchors {tuple(anchors.shape)} / anchor_valid {tuple(anchor_valid.shape)} must both be [b={b}, N]"
            )
        if context_valid is not None and tuple(context_valid.shape) != (b, T):
            raise ConfigError(f"context_valid shape {tuple(context_valid.shape)} != (b, T) = {(b, T)}")
        N, B = anchors.shape[1], cfg.block_size
        valid = anchor_valid.bool()
        anchors = anchors.long()
        if bool(((anchors < 0) | (anchors >= T))[valid].any()):
            raise DataError(f"a valid anchor lies outside [0, T={T})")
        anchors = torch.where(valid, anchors, torch.zeros_like(anchors))

        # Context: fc over the m captured layers, normed once, shared by all layers.
        ctx = self.context_norm(self.fc(context_states.reshape(b, T, m * H).to(self.dtype)))

        # Blocks: [x_p, MASK x (B-1)] at positions p .. p+B-1.
        block_ids = torch.full((b, N, B), cfg.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        x = self.embed(block_ids).reshape(b, N * B, H)
        q_pos = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).reshape(b, N * B)
        kv_pos = torch.cat((torch.arange(T, device=anchors.device).expand(b, T), q_pos), dim=1)
        mask = build_attention_mask(anchors, valid, T, B, context_valid)

        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, mask)
        x = self.norm(x).reshape(b, N, B, H)
        return torch.where(valid[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
