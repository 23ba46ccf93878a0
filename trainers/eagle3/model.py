"""The EAGLE-3 draft (EAGLE-3 arXiv:2503.01840; architecture facts from SpecForge ``llama3_eagle`` and
vLLM ``llama_eagle3.py``, re-implemented here) and its training-time-test (TTT) unroll.

Layout (parameter names are those of the vLLM/speculators EAGLE-3 Llama checkpoints, see
:mod:`artcache.trainers.eagle3.export`):

- ``fc`` (3H -> H, no bias) over the three captured target layers, concatenated in capture order;
- ``midlayer``: one Llama decoder layer whose q/k/v read ``[input_layernorm(embed(token)) ;
  hidden_norm(h)]`` (width 2H) while its residual stream is ``h`` (un-normed); GQA, RoPE, no q/k
  norm, no biases, SwiGLU MLP behind ``post_attention_layernorm``;
- ``norm`` (final RMSNorm) and a trainable ``lm_head`` (H -> V_d) over the pruned draft vocabulary;
- frozen target tensors, kept as non-persistent buffers (never trained, never in ``state_dict``): the
  input embedding, the target's final-norm weight and lm_head (used only to make the soft labels);
- persistent buffers ``d2t`` int64 [V_d] and ``t2d`` bool [V] (the vocab map travels with the weights).

The midlayer's **pre-norm** output is the hidden state fed to the next TTT step (vLLM's
``hidden_prenorm``); ``lm_head(norm(.))`` of it gives the draft logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from artcache.errors import ConfigError, DataError
from artcache.trainers.dflash.model import _MLP, RMSNorm, _rope

from .config import EAGLE3_NUM_AUX, Eagle3Config

__all__ = ["FROZEN_BUFFERS", "TTT_ATTN_CHUNK", "TTT_DENSE_MAX_LEN", "Eagle3Draft", "build_ttt_mask",
           "default_attn_chunk", "ttt_chunk_mask", "ttt_input_ids"]

#: Names of the frozen target tensors (non-persistent buffers); never trained, never exported.
FROZEN_BUFFERS = ("embed_weight", "target_norm_weight", "target_lm_head_weight")


def build_ttt_mask(seq_len: int, steps: int, key_valid: Tensor | None = None,
                   device: torch.device | str | None = None, doc_ids: Tensor | None = None) -> Tensor:
    """Boolean TTT attention mask ``[b or 1, 1, T, steps·T]`` (True = may attend).

    Keys are laid out step by step: key column ``k·T + j`` is the key that step k computed at position
    j. A query of step i at position t sees the step-0 keys at positions ``j <= t`` (causal) and the
    key of every step ``k <= i`` at its own position ``t`` (the diagonal of each step's block); step i
    uses the first ``(i + 1)·T`` columns. This is the mask of EAGLE-3's training-time test ("causal over step-0 keys
    plus the same position's keys from earlier steps") and of speculators' ``create_combined_mask_mod``
    / ``extend_mask_for_draft_tokens``. (SpecForge's manual-attention path additionally hides the
    step-0 keys ``t-i+1 .. t`` at step i; artcache follows the definition above.)

    ``key_valid`` [b, T] bool, if given, hides step-0 keys at invalid positions (padding); the
    diagonal stays visible, so no row is ever empty (a softmax over only ``-inf`` would be NaN).
    Without ``key_valid`` the mask is broadcast over the batch ([1, 1, T, steps·T]). Built on
    ``key_valid``'s device, else on ``device``. Size: T²·steps bytes (66 MB for T=3072, 7 steps).

    ``doc_ids`` [b, T] long (a packed batch, :mod:`artcache.trainers.packing`): the step-0 keys are further
    limited to the query's own document (block-diagonal causal attention); [b, 1, T, steps·T].

    Raises:
        ConfigError: ``seq_len < 1`` or ``steps < 1``, or ``key_valid`` not [b, seq_len].
    """
    if seq_len < 1 or steps < 1:
        raise ConfigError(f"seq_len and steps must be >= 1, got {seq_len}, {steps}")
    dev = key_valid.device if key_valid is not None else device
    t = torch.arange(seq_len, device=dev)[:, None]  # [T, 1]
    col = torch.arange(steps * seq_len, device=dev)
    kpos, kstep = col % seq_len, col // seq_len  # [S]
    causal0 = (kstep == 0)[None, :] & (kpos[None, :] <= t)  # [T, S]
    diag = kpos[None, :] == t
    if doc_ids is not None:
        dev = doc_ids.device
        docs = doc_ids.long()
        same = docs[:, :, None] == docs[:, kpos.to(dev)][:, None, :]  # [b, T, S]
        causal0 = causal0.to(dev)[None] & same
        if key_valid is not None:
            causal0 = causal0 & key_valid.to(dev).bool()[:, kpos.to(dev)][:, None, :]
        return (causal0 | diag.to(dev)[None])[:, None]
    if key_valid is None:
        return (causal0 | diag)[None, None]
    if key_valid.dim() != 2 or key_valid.shape[1] != seq_len:
        raise ConfigError(f"key_valid must be [b, {seq_len}], got shape {tuple(key_valid.shape)}")
    causal0 = causal0[None] & key_valid.bool()[:, kpos][:, None, :]  # [b, T, S]
    return (causal0 | diag[None])[:, None]


#: Up to this many positions the TTT attention uses the dense :func:`build_ttt_mask` (one SDPA call per step) on
#: an accelerator; above it, query chunks. On a CPU the chunks are used above :data:`TTT_ATTN_CHUNK` positions:
#: there they measured faster and smaller already at 2,048 and 4,096 positions (docs/training.md, "Long contexts").
TTT_DENSE_MAX_LEN = 4096
#: Query positions per chunk of the chunked TTT attention (:func:`ttt_chunk_mask`) when chosen automatically.
TTT_ATTN_CHUNK = 1024


def ttt_chunk_mask(start: int, end: int, step: int, key_valid: Tensor | None = None,
                   doc_ids: Tensor | None = None, device: torch.device | str | None = None) -> Tensor:
    """The rows ``[start, end)`` of TTT step ``step``'s mask, over only the keys those rows can see.

    Keys: the step-0 keys of positions ``[0, end)``, then for each step ``k = 1 .. step`` the keys of positions
    ``[start, end)`` (only the diagonal of those blocks is ever visible). Returns bool
    ``[b or 1, 1, C, end + step·C]`` with ``C = end - start``: the columns of :func:`build_ttt_mask`'s rows
    ``[start, end)`` that are not all False, in the same order, element for element (same ``key_valid`` /
    ``doc_ids`` semantics, [b, T] each). Size ``C·(end + step·C)`` booleans per row, never ``T·steps·T``.

    Raises:
        ConfigError: ``not 0 <= start < end`` or ``step < 0``.
    """
    if not 0 <= start < end or step < 0:
        raise ConfigError(f"need 0 <= start < end and step >= 0, got start={start}, end={end}, step={step}")
    for ref in (doc_ids, key_valid):
        if ref is not None:
            device = ref.device
    C = end - start
    t = torch.arange(start, end, device=device)[:, None]  # [C, 1]
    j = torch.arange(end, device=device)[None, :]  # [1, end]
    causal0 = (j <= t)[None]  # [1, C, end]
    if doc_ids is not None:
        docs = doc_ids.long()
        causal0 = causal0 & (docs[:, start:end, None] == docs[:, None, :end])
    if key_valid is not None:
        causal0 = causal0 & key_valid.bool()[:, None, :end]
    first = causal0 | (j == t)[None]
    if step == 0:
        return first[:, None]
    diag = torch.eye(C, dtype=torch.bool, device=device).repeat(1, step)  # [C, step·C]
    return torch.cat([first, diag[None].expand(first.shape[0], C, step * C)], dim=2)[:, None]


def default_attn_chunk(seq_len: int, device: torch.device | str) -> int:
    """The TTT attention's query chunk chosen for ``seq_len`` positions on ``device``: ``seq_len`` (the dense
    mask) up to :data:`TTT_DENSE_MAX_LEN` positions on an accelerator and up to :data:`TTT_ATTN_CHUNK` on a CPU,
    else :data:`TTT_ATTN_CHUNK`."""
    dense_max = TTT_ATTN_CHUNK if torch.device(device).type == "cpu" else TTT_DENSE_MAX_LEN
    return TTT_ATTN_CHUNK if dense_max < seq_len else seq_len


class _TTTChunks:
    """The chunked TTT attention's plan: queries in chunks of ``chunk`` positions, masks built per chunk.

    ``offset``: the global position of the first query (context parallelism: a rank's shard starts there; the
    masks are built at global positions, ``key_valid`` / ``doc_ids`` cover the global positions). ``gather``: a
    callable that turns the step-0 keys/values of the queries' positions [b, kv heads, T, d] into those of every
    position from 0 ([b, kv heads, >= offset + T, d]; :mod:`artcache.trainers.eagle3.cp`), applied once per
    forward; None: the step-0 keys are the queries' own (``offset`` 0)."""

    def __init__(self, chunk: int, key_valid: Tensor | None, doc_ids: Tensor | None, offset: int = 0,
                 gather=None) -> None:
        self.chunk, self.key_valid, self.doc_ids = chunk, key_valid, doc_ids
        self.offset, self.gather = offset, gather
        self._first: tuple[Tensor, Tensor] | None = None

    def attend(self, q: Tensor, cache: list[tuple[Tensor, Tensor]], gqa: bool) -> Tensor:
        """SDPA of q [b, h, T, d] over the step-0 keys and the diagonal keys of the later steps in ``cache``,
        chunk by chunk; under autograd each chunk is checkpointed (its mask and gathered keys are rebuilt in
        backward, so none of them outlives its chunk). Returns [b, h, T, d]."""
        T = q.shape[2]
        if self.gather is not None:
            if self._first is None:  # step 0: its keys/values of every position, once per forward
                self._first = (self.gather(cache[0][0]), self.gather(cache[0][1]))
            cache = [self._first, *cache[1:]]
        flat = [x for kv in cache for x in kv]
        outs = []
        for a in range(0, T, self.chunk):
            e = min(a + self.chunk, T)
            if torch.is_grad_enabled():
                # nothing random inside: no RNG state to stash per chunk
                outs.append(checkpoint(self._chunk, a, e, gqa, q[:, :, a:e], *flat, use_reentrant=False,
                                       preserve_rng_state=False))
            else:
                outs.append(self._chunk(a, e, gqa, q[:, :, a:e], *flat))
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def _chunk(self, a: int, e: int, gqa: bool, q: Tensor, *flat: Tensor) -> Tensor:
        ks, vs = flat[0::2], flat[1::2]
        step, o = len(ks) - 1, self.offset
        keys = torch.cat([ks[0][:, :, :o + e], *(k[:, :, a:e] for k in ks[1:])], dim=2)
        vals = torch.cat([vs[0][:, :, :o + e], *(v[:, :, a:e] for v in vs[1:])], dim=2)
        mask = ttt_chunk_mask(o + a, o + e, step, self.key_valid, self.doc_ids, device=q.device)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=gqa)


def ttt_input_ids(input_ids: Tensor, step: int, pad_id: int = 0, doc_ids: Tensor | None = None) -> Tensor:
    """Token ids fed at TTT step ``step``: position t gets ``input_ids[t + 1 + step]`` (the shift left
    by one of EAGLE-3 plus one more per step); the last ``step + 1`` positions get ``pad_id``, and so does
    t when ``doc_ids`` [b, T] (a packed batch) puts ``t + 1 + step`` in another document than t (a shift never
    reads the next document's tokens: what an unpacked row of the document alone reads past its end).

    input_ids [b, T] long -> [b, T] long.
    """
    b, T = input_ids.shape
    out = torch.full_like(input_ids, pad_id)
    n = T - 1 - step
    if n > 0:
        out[:, :n] = input_ids[:, 1 + step:]
        if doc_ids is not None:
            other = doc_ids[:, :n] != doc_ids[:, 1 + step:]
            out[:, :n] = out[:, :n].masked_fill(other, pad_id)
    return out


class _Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read width 2H; K/V of earlier TTT steps come from ``cache``.

    SDPA gets the boolean TTT mask and ``enable_gqa``; measured on an H200 (torch 2.11, T=3072, 7
    steps, 32/8 heads, head_dim 128, bf16, fwd+bwd) this stays on a memory-efficient backend: 0.65 GiB
    extra, versus 0.90 GiB with K/V heads repeated by hand (no [heads, T, 7T] score matrix).
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd, self.theta = cfg.num_heads, cfg.num_kv_heads, hd, cfg.rope_theta
        self.q_proj = nn.Linear(2 * H, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=False)

    def forward(self, x: Tensor, positions: Tensor, cache: list[tuple[Tensor, Tensor]],
                mask: Tensor | _TTTChunks) -> Tensor:
        b, T, _ = x.shape
        q = _rope(self.q_proj(x).view(b, T, self.nh, self.hd).transpose(1, 2), positions, self.theta)
        k = _rope(self.k_proj(x).view(b, T, self.nkv, self.hd).transpose(1, 2), positions, self.theta)
        v = self.v_proj(x).view(b, T, self.nkv, self.hd).transpose(1, 2)
        cache.append((k, v))
        if isinstance(mask, _TTTChunks):
            o = mask.attend(q, cache, self.nh != self.nkv)
            return self.o_proj(o.transpose(1, 2).reshape(b, T, self.nh * self.hd))
        keys = torch.cat([c[0] for c in cache], dim=2) if len(cache) > 1 else k
        vals = torch.cat([c[1] for c in cache], dim=2) if len(cache) > 1 else v
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=self.nh != self.nkv)
        return self.o_proj(o.transpose(1, 2).reshape(b, T, self.nh * self.hd))


class _Eagle3Layer(nn.Module):
    """The EAGLE-3 midlayer (vLLM ``norm_before_residual=False``: the residual is the un-normed h)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps=eps)  # applied to the token embedding
        self.hidden_norm = RMSNorm(H, eps=eps)  # applied to the hidden state
        self.self_attn = _Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps=eps)
        self.mlp = _MLP(cfg)  # reads only hidden_size / intermediate_size

    def forward(self, emb: Tensor, h: Tensor, positions: Tensor, cache: list, mask: Tensor | _TTTChunks) -> Tensor:
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)
        h = h + self.self_attn(x, positions, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft model.

    Args:
        cfg: a validated :class:`Eagle3Config`.
        embed: the target's input embedding [V, H] (frozen buffer).
        target_norm_weight: the target's final RMSNorm weight [H] (frozen buffer; plain
            ``x / rms(x) · w`` RMSNorm with ``cfg.rms_norm_eps``, as Llama/Qwen3).
        target_lm_head: the target's lm_head [V, H] (frozen buffer; may be ``embed`` for tied targets).
        d2t: int64 [V_d], t2d: bool [V] (:func:`artcache.trainers.eagle3.vocab.build_vocab_map`); persistent
            buffers, so they are saved and loaded with the weights.
        dtype: dtype of the trainable parameters (default float32 master weights; use autocast for
            bf16 compute). Frozen buffers keep the dtype/device they were given; d2t/t2d move to the
            embedding's device.

    Trainable: ``fc``, ``midlayer``, ``norm``, ``lm_head``. Linear weights start from N(0, 0.02²),
    norms from 1.

    Raises:
        ConfigError: a tensor's shape disagrees with ``cfg``, or d2t/t2d are inconsistent
            (``t2d.sum() != V_d`` or ``arange(V_d) + d2t`` is not the ascending list of t2d's ids; not
            checked on the meta device, where only shapes exist).
    """

    def __init__(self, cfg: Eagle3Config, embed: Tensor, target_norm_weight: Tensor, target_lm_head: Tensor,
                 d2t: Tensor, t2d: Tensor, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        cfg.validate()
        V, Vd, H = cfg.vocab_size, cfg.draft_vocab_size, cfg.hidden_size
        for name, w, shape in (("embed", embed, (V, H)), ("target_lm_head", target_lm_head, (V, H)),
                               ("target_norm_weight", target_norm_weight, (H,)), ("d2t", d2t, (Vd,)),
                               ("t2d", t2d, (V,))):
            if tuple(w.shape) != shape:
                raise ConfigError(f"{name} has shape {tuple(w.shape)}, expected {list(shape)} "
                                  f"(vocab_size={V}, draft_vocab_size={Vd}, hidden_size={H})")
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating dtype, got {dtype}")
        dev = embed.device
        d2t, t2d = d2t.detach().to(dev, torch.long), t2d.detach().to(dev, torch.bool)
        used = torch.arange(Vd, device=dev) + d2t
        if dev.type != "meta" and (int(t2d.sum()) != Vd or not torch.equal(used, t2d.nonzero().squeeze(1))):
            raise ConfigError(f"d2t/t2d are inconsistent: t2d selects {int(t2d.sum())} ids, V_d={Vd}, and "
                              "arange(V_d) + d2t must equal the ascending ids where t2d is True")
        self.cfg = cfg
        self.register_buffer("embed_weight", embed.detach(), persistent=False)
        self.register_buffer("target_norm_weight", target_norm_weight.detach(), persistent=False)
        self.register_buffer("target_lm_head_weight", target_lm_head.detach(), persistent=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.fc = nn.Linear(EAGLE3_NUM_AUX * H, H, bias=False)
        self.midlayer = _Eagle3Layer(cfg)
        self.norm = RMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for mod in (self.fc, self.midlayer, self.norm, self.lm_head):
            mod.to(device=dev, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The persistent state (trainable weights plus d2t/t2d); the frozen target tensors are never in it."""
        return dict(self.state_dict())

    def used_ids(self) -> Tensor:
        """Target ids of the draft vocabulary, ascending: ``arange(V_d) + d2t`` (int64 [V_d])."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> Tensor:
        """int64 [V]: the draft id of each target id, -1 where the draft vocabulary lacks it."""
        out = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        out[self.used_ids()] = torch.arange(self.cfg.draft_vocab_size, device=out.device)
        return out

    def embed(self, ids: Tensor) -> Tensor:
        """Frozen target embedding lookup, cast to the module dtype. ids long [...] -> [..., H]."""
        return F.embedding(ids, self.embed_weight).to(self.dtype)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Draft logits over the draft vocabulary: ``lm_head(norm(hidden))``, [..., H] -> [..., V_d]."""
        return self.lm_head(self.norm(hidden.to(self.dtype)))

    def target_logits(self, last_hidden: Tensor, *, normed: bool = False) -> Tensor:
        """Frozen target logits over the full vocabulary: ``target_lm_head(final_norm(last_hidden))``.

        ``last_hidden`` [..., H] is the last decoder layer's un-normed output (output-of-layer L-1);
        pass ``normed=True`` for a state that already went through the final norm. The norm is computed
        in float32 (float64 for float64 input); the matmul runs in the lm_head's dtype.
        Returns [..., V] in the lm_head's dtype.
        """
        h = last_hidden
        if not normed:
            x = h.to(torch.promote_types(h.dtype, torch.float32))
            x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.cfg.rms_norm_eps)
            h = x * self.target_norm_weight.to(x.dtype)
        w = self.target_lm_head_weight
        return F.linear(h.to(w.dtype), w)

    def forward(self, aux_hidden: Tensor, input_ids: Tensor, valid: Tensor | None = None,
                steps: int | None = None, validate: bool = True, doc_ids: Tensor | None = None,
                position_ids: Tensor | None = None, attn_chunk: int | None = None) -> list[Tensor]:
        """Unroll the draft over ``steps`` TTT steps (default ``cfg.ttt_steps``).

        Step 0 at position t reads ``fc(aux_hidden[t])`` and the token ``input_ids[t + 1]``; step i > 0
        reads the step i-1 output at the same position t and the token ``input_ids[t + 1 + i]``
        (:func:`ttt_input_ids`; pad id 0 past the end). RoPE position of step i at t is ``t + i``.
        Attention: :func:`build_ttt_mask`'s, dense or in query chunks (``attn_chunk``). Step i's output at t is
        the draft's hidden state for predicting ``input_ids[t + 2 + i]`` (see
        :func:`artcache.trainers.eagle3.loss.eagle3_loss`).

        Args:
            aux_hidden: [b, T, 3, H] any float dtype, the three captured layers (output-of-layer,
                un-normed) in :func:`~artcache.layer_ids.eagle3_layer_ids` order.
            input_ids: [b, T] long.
            valid: optional [b, T] bool; False marks padding. Padded positions have their features
                and ids replaced by zeros (any garbage, NaN included, stays out) and are hidden as keys.
            steps: unroll length >= 1.
            validate: check the ids' range and whether ``valid`` is a right-padded prefix (both read
                device memory back: a synchronisation on a GPU). False when the caller guarantees
                both (a collated batch: ids verified against the plan's fingerprint, validity a prefix);
                the key mask is then left out, as for any right-padded batch.
            doc_ids: a packed batch (:mod:`artcache.trainers.packing`): [b, T] long, each position's
                document (-1 padding): attention and the TTT shifts stay inside a document.
            position_ids: [b, T] long RoPE positions (restarting per document); None: ``arange(T)``. Step i
                at t uses ``position_ids[t] + i``.
            attn_chunk: query positions per chunk of the TTT attention. Chunk [a, e) of step i attends to the
                step-0 keys [0, e) and the keys of positions [a, e) of steps 1..i under :func:`ttt_chunk_mask`
                (``C·(e + i·C)`` booleans; each chunk checkpointed under autograd), so no mask grows with
                steps·T²; the result equals the dense path's to float rounding. ``>= T``: the dense
                :func:`build_ttt_mask` ([T, steps·T] booleans). None: :func:`default_attn_chunk`.

        Returns:
            list of ``steps`` tensors [b, T, H] in the module dtype: each step's **pre-norm** output.

        Raises:
            ConfigError: shapes disagree with the config or with each other, ``steps < 1``, or ``attn_chunk < 1``.
            DataError: a valid id lies outside ``[0, V)``.
        """
        cfg = self.cfg
        if attn_chunk is not None and (isinstance(attn_chunk, bool) or not isinstance(attn_chunk, int)
                                       or attn_chunk < 1):
            raise ConfigError(f"attn_chunk must be an int >= 1 or None, got {attn_chunk!r}")
        steps = cfg.ttt_steps if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"steps must be an int >= 1, got {steps!r}")
        if aux_hidden.dim() != 4 or tuple(aux_hidden.shape[2:]) != (EAGLE3_NUM_AUX, cfg.hidden_size):
            raise ConfigError(f"aux_hidden must be [b, T, {EAGLE3_NUM_AUX}, {cfg.hidden_size}], "
                              f"got shape {tuple(aux_hidden.shape)}")
        b, T = aux_hidden.shape[:2]
        if tuple(input_ids.shape) != (b, T):
            raise ConfigError(f"input_ids shape {tuple(input_ids.shape)} != (b, T) = {(b, T)}")
        if valid is not None and tuple(valid.shape) != (b, T):
            raise ConfigError(f"valid shape {tuple(valid.shape)} != (b, T) = {(b, T)}")
        dev = aux_hidden.device
        ids = input_ids.to(dev).long()
        key_valid = None
        if valid is not None:
            vb = valid.to(dev).bool()
            aux_hidden = torch.where(vb[:, :, None, None], aux_hidden, torch.zeros((), dtype=aux_hidden.dtype,
                                                                                    device=dev))
            ids = torch.where(vb, ids, torch.zeros_like(ids))
            # a right-padded (prefix) validity needs no key mask: the causal part never reaches padding
            key_valid = vb if validate and bool((vb[:, 1:] & ~vb[:, :-1]).any()) else None
        if validate and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise DataError(f"input_ids hold ids in [{int(ids.min())}, {int(ids.max())}], "
                            f"outside [0, vocab_size={cfg.vocab_size})")
        docs = None if doc_ids is None else doc_ids.to(dev).long()
        if attn_chunk is None:
            attn_chunk = default_attn_chunk(T, dev)
        if attn_chunk >= T:
            mask = build_ttt_mask(T, steps, key_valid, device=dev, doc_ids=docs)
        else:
            mask = _TTTChunks(attn_chunk, key_valid, docs)
        h = self.fc(aux_hidden.reshape(b, T, EAGLE3_NUM_AUX * cfg.hidden_size).to(self.dtype))
        base = torch.arange(T, device=dev)[None] if position_ids is None else position_ids.to(dev).long()
        cache: list[tuple[Tensor, Tensor]] = []
        outs: list[Tensor] = []
        for i in range(steps):
            emb = self.embed(ttt_input_ids(ids, i, doc_ids=docs))
            step_mask = mask if isinstance(mask, _TTTChunks) else mask[..., : (i + 1) * T]
            h = self.midlayer(emb, h, base + i, cache, step_mask)
            outs.append(h)
        return outs
