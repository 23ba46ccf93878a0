"""The DFlash block-diffusion draft (DFlash arXiv:2602.06036; architecture facts from z-lab/dflash
and SpecForge, re-implemented here).

Layout: ``fc`` (m·H -> H, no bias) over the m captured target layers, ``context_norm`` (RMSNorm)
-> context [b, T, H], shared by every layer. n non-causal Qwen3-style decoder layers whose queries
come only from block tokens and whose keys/values are ``[context ; block]`` through each layer's
own k/v projections. Final RMSNorm, then the target's **frozen** lm_head; block tokens are embedded
with the target's **frozen** embedding.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from artcache.errors import ConfigError, DataError

from .config import DFlashConfig

__all__ = ["ATTN_IMPLS", "DFlashDraft", "DocumentSegments", "RMSNorm", "build_attention_mask", "dflash_mask_mod"]

#: Attention implementations of :class:`DFlashDraft` (all compute the same function; see ``attn_impl``).
ATTN_IMPLS = ("sdpa", "flex", "dense")

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
    anchors: Tensor, anchor_valid: Tensor, seq_len: int, block_size: int, context_valid: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> Tensor:
    """Boolean attention mask ``[b, 1, N·B, T + N·B]`` (True = may attend).

    Query row ``n·B + s`` (slot s of block n, anchor p = anchors[b, n]) sees context key j iff
    ``j < p`` (strictly before its anchor; DFlash arXiv:2602.06036 §3) and ``context_valid[b, j]``,
    plus all B keys of its own block (bidirectional); never another block. Rows of invalid anchors
    see only their own block (never an empty row, so softmax never runs over all ``-inf``); their
    outputs are zeroed by the model. ``doc_ids`` [b, T] long (a packed batch,
    :mod:`artcache.trainers.packing`): context key j is visible only if ``doc_ids[b, j] == doc_ids[b, p]``
    (attention block-diagonal per document).
    """
    b, N = anchors.shape
    B = block_size
    dev = anchors.device
    p = anchors.repeat_interleave(B, dim=1)  # [b, N*B]
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < p[:, :, None]  # [b, N*B, T]
    ctx = ctx & anchor_valid.repeat_interleave(B, dim=1)[:, :, None]
    if context_valid is not None:
        ctx = ctx & context_valid.bool()[:, None, :]
    if doc_ids is not None:
        anchor_doc = doc_ids.gather(1, anchors.clamp(0, seq_len - 1)).repeat_interleave(B, dim=1)  # [b, N*B]
        ctx = ctx & (doc_ids[:, None, :] == anchor_doc[:, :, None])
    blk_id = torch.arange(N * B, device=dev) // B
    own = (blk_id[:, None] == blk_id[None, :]).expand(b, N * B, N * B)
    return torch.cat((ctx, own), dim=2)[:, None]


def dflash_mask_mod(
    anchors: Tensor, anchor_valid: Tensor, seq_len: int, block_size: int, context_valid: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The DFlash mask of :func:`build_attention_mask` as a FlexAttention ``mask_mod``.

    Returns ``mask_mod(b, h, q_idx, kv_idx) -> bool``: key ``kv_idx < T`` is context position
    ``kv_idx``, visible iff it is before the query's anchor, the anchor is valid and (if given)
    ``context_valid[b, kv_idx]``; key ``kv_idx >= T`` is block token ``kv_idx - T``, visible iff it
    belongs to the query's own block. Indices are clamped before every gather, because FlexAttention
    may evaluate the mask on padded (out-of-range) indices. Evaluated on the full index grid it equals
    :func:`build_attention_mask` element for element (tests pin this).

    Args:
        anchors: [b, N] long. anchor_valid: [b, N] bool. seq_len: T. block_size: B.
        context_valid: optional [b, T] bool. doc_ids: optional [b, T] long (a packed batch: context keys of
            the anchor's own document only).
    """
    T, B = seq_len, block_size
    N = anchors.shape[1]
    anchors = anchors.long()
    valid = anchor_valid.bool()
    cv = context_valid.bool() if context_valid is not None else None
    docs = doc_ids.long() if doc_ids is not None else None

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        n = (q_idx // B).clamp(0, max(N - 1, 0))
        is_ctx = kv_idx < T
        ctx_ok = (kv_idx < anchors[b, n]) & valid[b, n]
        if cv is not None:
            ctx_ok = ctx_ok & cv[b, kv_idx.clamp(0, max(T - 1, 0))]
        if docs is not None:
            last = max(T - 1, 0)
            ctx_ok = ctx_ok & (docs[b, kv_idx.clamp(0, last)] == docs[b, anchors[b, n].clamp(0, last)])
        own = torch.div(kv_idx - T, B, rounding_mode="floor") == n
        return torch.where(is_ctx, ctx_ok, own)

    return mask_mod


_COMPILED_FLEX: Any = None


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, gqa: bool) -> Tensor:
    """FlexAttention: compiled (fused kernel) on CUDA; eager on CPU, where torch runs an unfused
    reference that materialises the scores (its "call without torch.compile" warning is silenced)
    and, in torch 2.13, has no backward."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if q.device.type == "cuda":
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        return _COMPILED_FLEX(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    except NotImplementedError as exc:  # e.g. "FlexAttention does not support backward on CPU"
        raise ConfigError(
            f"attn_impl='flex' cannot run here ({exc}); use attn_impl='sdpa' (the default) for CPU training"
        ) from exc


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, gqa: bool) -> Tensor:
    """Explicit softmax(q kᵀ / √d + mask) v, the reference the other paths are tested against.
    q [b, h, S, d]; k, v [b, h_kv, K, d]; mask [b, 1, S, K] bool or None. Softmax in float32 (or
    float64 for float64 inputs)."""
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.to(acc)).to(q.dtype)


class DocumentSegments:
    """Per-document attention of a packed batch on a CPU (``attn_impl="sdpa"``): only the valid blocks are computed,
    all rows' blocks flattened into one sequence of query slots, and each document's blocks attend, in one
    ``scaled_dot_product_attention`` per document, to the keys of that document's context and of their own blocks.
    A packed row then costs what its documents cost unpacked: neither a row-wide mask (quadratic in the documents
    per row: every block scored against every other document's keys and blocks) nor the anchor slots a row leaves
    unused (rows of one batch hold different numbers of anchors).

    ``rows``, ``slots``: long [Nv], the (row, anchor slot) of each valid block, row-major (the flattened order).
    ``parts``: ``(row, q0, q1, c0, c1, mask)``: flattened query slots ``q0 .. q1 - 1`` (one document's blocks;
    anchors are sorted, so they are contiguous), the row's context positions ``c0 .. c1 - 1`` of that document,
    and the :func:`build_attention_mask` of those blocks over ``[context ; blocks]`` ([1, 1, q1-q0, c1-c0 + q1-q0]).
    """

    def __init__(self, rows: Tensor, slots: Tensor, parts: list[tuple[int, int, int, int, int, Tensor]]) -> None:
        self.rows, self.slots, self.parts = rows, slots, parts

    @classmethod
    def build(cls, anchors: Tensor, valid: Tensor, doc_ids: Tensor, block_size: int) -> DocumentSegments:
        """From anchors [b, N] (sorted per row), their validity [b, N] and ``doc_ids`` [b, T] (read on the host)."""
        B = block_size
        anchors, valid, doc_ids = anchors.cpu(), valid.cpu(), doc_ids.cpu()
        rows, slots = valid.nonzero(as_tuple=True)
        parts, base = [], 0
        for r in range(anchors.shape[0]):
            a = anchors[r][valid[r]]
            if not a.numel():
                continue
            docs = doc_ids[r, a]
            cut = [0] + (torch.nonzero(docs[1:] != docs[:-1]).squeeze(1) + 1).tolist() + [a.numel()]
            for i0, i1 in zip(cut[:-1], cut[1:], strict=True):
                where = torch.nonzero(doc_ids[r] == docs[i0]).squeeze(1)
                c0, c1 = int(where[0]), int(where[-1]) + 1
                seg = (a[i0:i1] - c0)[None]
                mask = build_attention_mask(seg, torch.ones_like(seg, dtype=torch.bool), c1 - c0, B)
                parts.append((r, (base + i0) * B, (base + i1) * B, c0, c1, mask))
            base += a.numel()
        return cls(rows, slots, parts)

    def gather(self, blocks: Tensor) -> Tensor:
        """[b, N, B, ...] -> the valid blocks flattened, [1, Nv·B, ...]."""
        picked = blocks[self.rows.to(blocks.device), self.slots.to(blocks.device)]
        return picked.reshape(1, -1, *blocks.shape[3:])

    def scatter(self, flat: Tensor, b: int, N: int, B: int) -> Tensor:
        """[1, Nv·B, H] -> [b, N, B, H], zeros at invalid anchors."""
        H = flat.shape[-1]
        out = flat.new_zeros(b, N, B, H)
        return out.index_put((self.rows.to(flat.device), self.slots.to(flat.device)), flat.reshape(-1, B, H))

    def attend(self, q: Tensor, kc: Tensor, vc: Tensor, kb: Tensor, vb: Tensor, gqa: bool) -> Tensor:
        """q [1, h, S, d] (flattened blocks); kc, vc [b, h_kv, T, d] (each row's context); kb, vb [1, h_kv, S, d]
        (the blocks' own keys) -> [1, h, S, d]."""
        out = q.new_zeros(q.shape)
        for r, q0, q1, c0, c1, mask in self.parts:
            kk = torch.cat((kc[r:r + 1, :, c0:c1], kb[:, :, q0:q1]), dim=2)
            vv = torch.cat((vc[r:r + 1, :, c0:c1], vb[:, :, q0:q1]), dim=2)
            out[:, :, q0:q1] = F.scaled_dot_product_attention(q[:, :, q0:q1], kk, vv, attn_mask=mask.to(q.device),
                                                               enable_gqa=gqa)
        return out


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

    def forward(self, x: Tensor, ctx: Tensor, q_pos: Tensor, kv_pos: Tensor, mask: Any,
                impl: str = "sdpa") -> Tensor:
        """mask: [b, 1, S, T+S] bool for "sdpa"/"dense", a FlexAttention BlockMask for "flex", or
        None (every query sees every key: the inference-style single block)."""
        b, S, _ = x.shape
        T = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, S, self.nh, self.hd)).transpose(1, 2)
        if isinstance(mask, DocumentSegments):  # x: the flattened valid blocks [1, S]; ctx: every row [b', T]
            bc = ctx.shape[0]
            kc = self.k_norm(self.k_proj(ctx).view(bc, T, self.nkv, self.hd)).transpose(1, 2)
            vc = self.v_proj(ctx).view(bc, T, self.nkv, self.hd).transpose(1, 2)
            kb = self.k_norm(self.k_proj(x).view(b, S, self.nkv, self.hd)).transpose(1, 2)
            vb = self.v_proj(x).view(b, S, self.nkv, self.hd).transpose(1, 2)
            o = mask.attend(_rope(q, q_pos, self.theta), _rope(kc, kv_pos, self.theta), vc,
                            _rope(kb, q_pos, self.theta), vb, self.nh != self.nkv)
            return self.o_proj(o.transpose(1, 2).reshape(b, S, self.nh * self.hd))
        kv_in = torch.cat((ctx, x), dim=1)  # [context ; block]
        k = self.k_norm(self.k_proj(kv_in).view(b, T + S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, T + S, self.nkv, self.hd).transpose(1, 2)
        q = _rope(q, q_pos, self.theta)
        k = _rope(k, kv_pos, self.theta)
        gqa = self.nh != self.nkv
        if impl == "flex":
            o = _flex(q, k, v, mask, gqa)
        elif impl == "dense":
            o = _dense_attention(q, k, v, mask, gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
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

    def forward(self, x: Tensor, ctx: Tensor, q_pos: Tensor, kv_pos: Tensor, mask: Any,
                impl: str = "sdpa") -> Tensor:
        # Pre-norm on the block stream only; the context was normed once (context_norm) and is
        # shared by every layer (z-lab/dflash).
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, kv_pos, mask, impl)
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
        attn_impl: how attention is computed (an attribute; may be changed after construction):

            - ``"sdpa"`` (default): ``F.scaled_dot_product_attention`` with the dense boolean mask of
              :func:`build_attention_mask` ([b, 1, N·B, T + N·B]). Trains on CPU and GPU.
            - ``"flex"``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from
              :func:`dflash_mask_mod` (block-sparse: fully masked 128×128 tiles are skipped). Compiled
              on CUDA (torch's kernel needs ``head_dim >= 16``). On CPU torch 2.13 runs it eagerly,
              unfused and **forward only** (no backward: training raises :class:`ConfigError`); use
              it there for evaluation and tests.
            - ``"dense"``: an explicit softmax(q kᵀ/√d + mask) v reference.

            All three agree to float rounding (tests pin sdpa = flex = dense).

    dtype handling: the module dtype is that of ``fc.weight``. ``context_states`` and embeddings are
    cast to it; :meth:`logits` casts hidden states to the lm_head's dtype; RoPE angles are computed in
    float32. (``.to(dtype)`` on the module also casts the frozen buffers, as for any buffer.)

    Raises:
        ConfigError: weight shapes disagree with ``cfg``, or ``attn_impl`` is not one of
            :data:`ATTN_IMPLS`.
    """

    def __init__(
        self, cfg: DFlashConfig, embed_weight: Tensor, lm_head_weight: Tensor, *, dtype: torch.dtype = torch.float32,
        attn_impl: str = "sdpa",
    ) -> None:
        super().__init__()
        cfg.validate()
        if attn_impl not in ATTN_IMPLS:
            raise ConfigError(f"attn_impl={attn_impl!r} is not accepted: one of {', '.join(ATTN_IMPLS)}")
        self.attn_impl = attn_impl
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
        check_anchors: bool = True,
        doc_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Draft hidden states for N blocks per sequence.

        Args:
            context_states: [b, T, m, H], any float dtype (cast to the module dtype): the captured
                target layers (output-of-layer convention, un-normed residual stream).
            input_ids: [b, T] long.
            anchors: [b, N] long, anchor positions p (valid ones in [0, T)).
            anchor_valid: [b, N] bool; False marks padding.
            context_valid: optional [b, T] bool; False positions (padding) are never attended.
            check_anchors: raise DataError for a valid anchor outside [0, T) (reads one bool back to
                the host: a device synchronisation on a GPU). False when the caller drew the anchors
                itself (:func:`~artcache.trainers.dflash.anchors.sample_anchors` never draws such an anchor).
            doc_ids: a packed batch (:mod:`artcache.trainers.packing`): [b, T] long, each position's
                document (-1 padding); a block sees context of its anchor's document only.
            position_ids: [b, T] long, RoPE positions of the context (restarting per document in a packed
                batch); block slot k of anchor p sits at ``position_ids[p] + k``. None: ``arange(T)``.

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
        if check_anchors and bool(((anchors < 0) | (anchors >= T))[valid].any()):
            raise DataError(f"a valid anchor lies outside [0, T={T})")
        anchors = torch.where(valid, anchors, torch.zeros_like(anchors))

        # Context: fc over the m captured layers, normed once, shared by all layers.
        ctx = self.context_norm(self.fc(context_states.reshape(b, T, m * H).to(self.dtype)))

        # Blocks: [x_p, MASK x (B-1)] at positions p .. p+B-1.
        block_ids = torch.full((b, N, B), cfg.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        x = self.embed(block_ids).reshape(b, N * B, H)
        if position_ids is None:
            ctx_pos = torch.arange(T, device=anchors.device).expand(b, T)
            start = anchors
        else:
            ctx_pos = position_ids.to(anchors.device).long()
            start = ctx_pos.gather(1, anchors)
        q_pos = (start[:, :, None] + torch.arange(B, device=anchors.device)).reshape(b, N * B)
        kv_pos = torch.cat((ctx_pos, q_pos), dim=1)
        docs = None if doc_ids is None else doc_ids.to(anchors.device).long()
        impl = self.attn_impl
        if impl == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            mask = create_block_mask(dflash_mask_mod(anchors, valid, T, B, context_valid, docs), b, None, N * B,
                                     T + N * B, device=x.device)
        elif docs is not None and impl == "sdpa" and x.device.type == "cpu" and bool(valid.any()):
            # per document, valid blocks only: no quadratic waste, no unused anchor slots
            seg = DocumentSegments.build(anchors, valid, docs, B)
            x = seg.gather(x.reshape(b, N, B, H))
            q_pos = seg.gather(q_pos.reshape(b, N, B, 1))[..., 0]
            for layer in self.layers:
                x = layer(x, ctx, q_pos, ctx_pos, seg, impl)
            return seg.scatter(self.norm(x), b, N, B)
        else:
            mask = build_attention_mask(anchors, valid, T, B, context_valid, docs)

        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, mask, impl)
        x = self.norm(x).reshape(b, N, B, H)
        return torch.where(valid[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))

    def infer_block(self, context_states: Tensor, anchor_ids: Tensor) -> Tensor:
        """Inference-style forward: one block per sequence, as a serving engine drafts it.

        The engine has verified tokens up to position p (``anchor_ids`` = x_p, the token the target
        just produced) and holds the target's captured states for positions 0 … p-1. The block
        ``[x_p, MASK × (B-1)]`` sits at positions p … p+B-1 and attends, without any mask, to all p
        context positions and to its own B tokens (z-lab/dflash ``dflash_generate``; vLLM
        ``qwen3_dflash.py`` keeps the context K/V in its cache). No anchors, no padding, no other
        blocks: :meth:`forward` must give the same result for an anchor at p (tests pin this).

        Args:
            context_states: [b, p, m, H] captured layers (output-of-layer convention) for positions
                0 … p-1; p may be 0.
            anchor_ids: [b] long, x_p.

        Returns:
            [b, B, H] final-normed hidden states (slot k predicts x_{p+k}; slot 0 is the anchor).

        Raises:
            ConfigError: shapes disagree with the config.
        """
        cfg = self.cfg
        if context_states.dim() != 4 or tuple(context_states.shape[2:]) != (cfg.num_context_layers, cfg.hidden_size):
            raise ConfigError(
                f"context_states must be [b, p, m={cfg.num_context_layers}, H={cfg.hidden_size}], "
                f"got shape {tuple(context_states.shape)}")
        b, p, m, H = context_states.shape
        if tuple(anchor_ids.shape) != (b,):
            raise ConfigError(f"anchor_ids shape {tuple(anchor_ids.shape)} != (b,) = {(b,)}")
        B = cfg.block_size
        dev = anchor_ids.device
        ctx = self.context_norm(self.fc(context_states.reshape(b, p, m * H).to(self.dtype)))
        block_ids = torch.full((b, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = anchor_ids.long()
        x = self.embed(block_ids)
        q_pos = (p + torch.arange(B, device=dev)).expand(b, B)
        kv_pos = torch.cat((torch.arange(p, device=dev).expand(b, p), q_pos), dim=1)
        for layer in self.layers:
            x = layer(x, ctx, q_pos, kv_pos, None, self.attn_impl)
        return self.norm(x)

    @torch.no_grad()
    def propose(self, context_states: Tensor, anchor_ids: Tensor) -> Tensor:
        """Greedy draft tokens for slots 1 … B-1 of :meth:`infer_block`'s block: [b, B-1] long."""
        return self.logits(self.infer_block(context_states, anchor_ids)[:, 1:]).argmax(dim=-1)
