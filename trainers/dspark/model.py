"""The DSpark draft (arXiv:2607.05147): the DFlash backbone plus a Markov head and a confidence head.

Facts from DeepSpec (``deepspec/modeling/dspark/qwen3/modeling.py``, ``markov_head.py``, ``common.py``)
and vLLM 0.32's loader (``vllm/model_executor/models/qwen3_dspark.py``); re-implemented here.

- **Backbone**: :class:`~artcache.trainers.dflash.DFlashDraft` itself (imported, not copied): ``fc`` over
  the m captured context layers -> ``context_norm`` -> keys/values of every non-causal layer; the block
  ``[x_p, MASK × (B-1)]`` at positions p … p+B-1 sees context strictly before p and its own block.
  DSpark changes only what the slots predict ("sample from anchor"): slot k predicts ``x_{p+k+1}``, so
  slot 0 (the anchor) predicts too and a block proposes B tokens.
- **Markov head** (vanilla): ``markov_w1`` (embedding V × r) of the previous token, ``markov_w2`` (r -> V,
  no bias); slot k's logits = ``lm_head(h_k) + markov_w2(markov_w1[prev_k])``. ``prev_0`` = the anchor
  x_p; in training ``prev_k`` = the data token slot k-1 predicts (teacher forcing); when drafting it is
  the draft's own previous proposal. ``gated``: the r-vector is multiplied by
  ``sigmoid(gate_proj([h_k ; W1[prev_k]]))`` first (DeepSpec's GatedMarkovHead).
- **Confidence head**: ``confidence_head.proj`` (Linear H + r -> 1, with bias) on ``[h_k ; W1[prev_k]]``;
  ``c_k = sigmoid(·)`` estimates the probability that slot k is accepted given slots < k were.
- **Target distribution**: ``softmax(lm_head(final_norm(h_{L-1})))`` with the target's frozen final RMSNorm
  and lm_head. The capture stores output-of-layer ``L - 1`` *before* the final norm (artcache's
  output-of-layer convention); :meth:`DSparkDraft.target_hidden` applies the norm, exactly once.

Key names are vLLM's (``fc``, ``layers.*``, ``norm``, ``markov_head.markov_w1``, ``markov_head.markov_w2``,
``confidence_head.proj``) except ``context_norm`` (vLLM/DeepSpec ``hidden_norm``), renamed by the export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from artcache.errors import ConfigError
from artcache.trainers.dflash.model import FROZEN_BUFFERS as DFLASH_FROZEN
from artcache.trainers.dflash.model import DFlashDraft

from .config import DSparkConfig

__all__ = ["FROZEN_BUFFERS", "DSparkDraft", "MarkovHead", "ConfidenceHead"]

#: Frozen target tensors (buffers): never trained, never in trainable_state_dict().
FROZEN_BUFFERS = (*DFLASH_FROZEN, "target_norm_weight")


class MarkovHead(nn.Module):
    """Low-rank transition bias from the previous token (DSpark's Markov head).

    ``markov_w1``: nn.Embedding [V, r]; ``markov_w2``: nn.Linear r -> V (weight [V, r], no bias);
    ``gate_proj`` (gated only): nn.Linear H + r -> r.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        self.head_type = head_type
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if head_type == "gated" else None

    def embed(self, prev: Tensor) -> Tensor:
        """``W1[prev]``: prev long [...] -> [..., r] in W1's dtype."""
        return self.markov_w1(prev.long())

    def bias_input(self, emb: Tensor, hidden: Tensor) -> Tensor:
        """The r-vector fed to ``markov_w2``: ``emb`` (vanilla) or ``sigmoid(G[h; emb]) * emb`` (gated)."""
        if self.gate_proj is None:
            return emb
        gate = torch.sigmoid(self.gate_proj(torch.cat((hidden.to(emb.dtype), emb), dim=-1)))
        return gate * emb


class ConfidenceHead(nn.Module):
    """``proj``: nn.Linear(input -> 1, bias). forward(features [..., input]) -> logits [...] in float32 (float64
    for a float64 head)."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: Tensor) -> Tensor:
        out = self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)
        return out.to(torch.promote_types(out.dtype, torch.float32))


class DSparkDraft(DFlashDraft):
    """DSpark draft model: :class:`DFlashDraft` (the backbone) plus its two heads.

    Args:
        cfg: a :class:`DSparkConfig`.
        embed_weight, lm_head_weight: the target's input embedding and lm_head, [V, H] (frozen buffers).
        target_norm_weight: the target's final RMSNorm weight [H] (frozen buffer, >= float32); its eps is
            ``cfg.rms_norm_eps`` (copied from the target config).
        dtype, attn_impl: as :class:`DFlashDraft`.

    Trainable: the backbone (``fc``, ``context_norm``, ``layers``, ``norm``), ``markov_head`` and
    ``confidence_head``. Linear and embedding weights start from N(0, 0.02²) (the HF/DeepSpec
    ``initializer_range``), biases from 0.

    Raises:
        ConfigError: ``cfg`` not a DSparkConfig, or a weight of the wrong shape.
    """

    def __init__(self, cfg: DSparkConfig, embed_weight: Tensor, lm_head_weight: Tensor, target_norm_weight: Tensor,
                 *, dtype: torch.dtype = torch.float32, attn_impl: str = "sdpa") -> None:
        if not isinstance(cfg, DSparkConfig):
            raise ConfigError(f"DSparkDraft needs a DSparkConfig, got {type(cfg).__name__}")
        super().__init__(cfg, embed_weight, lm_head_weight, dtype=dtype, attn_impl=attn_impl)
        H, V = cfg.hidden_size, cfg.vocab_size
        if tuple(target_norm_weight.shape) != (H,):
            raise ConfigError(f"target_norm_weight has shape {tuple(target_norm_weight.shape)}, expected [{H}]")
        norm_dtype = torch.promote_types(target_norm_weight.dtype, torch.float32)
        self.register_buffer("target_norm_weight", target_norm_weight.detach().to(norm_dtype), persistent=False)
        self.markov_head = MarkovHead(V, cfg.markov_rank, H, cfg.markov_head_type) if cfg.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(cfg.confidence_input_size) if cfg.enable_confidence_head else None
        for head in (self.markov_head, self.confidence_head):
            if head is None:
                continue
            for m in head.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            head.to(device=embed_weight.device, dtype=dtype)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """State dict of the trainable tensors only (never the frozen target tensors)."""
        return {k: v for k, v in self.state_dict().items() if k not in FROZEN_BUFFERS}

    # ---- heads ----------------------------------------------------------------------------------

    def markov_inputs(self, prev: Tensor, hidden: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(``W1[prev]`` [..., r], the r-vector ``markov_w2`` reads [..., r]); (None, None) without the head.

        Args:
            prev: long [...] previous tokens. hidden: [..., H] the slots' backbone states.
        """
        if self.markov_head is None:
            return None, None
        emb = self.markov_head.embed(prev)
        return emb, self.markov_head.bias_input(emb, hidden)

    def confidence_logits(self, hidden: Tensor, emb: Tensor | None) -> Tensor | None:
        """Confidence logits [...] (>= float32) from ``[hidden ; emb]`` (``emb`` = ``W1[prev]``), or None
        without the head."""
        if self.confidence_head is None:
            return None
        feats = torch.cat((hidden, emb.to(hidden.dtype)), dim=-1) if self.cfg.confidence_head_with_markov else hidden
        return self.confidence_head(feats)

    def draft_logits(self, hidden: Tensor, bias_in: Tensor | None) -> Tensor:
        """``lm_head(hidden) + markov_w2(bias_in)`` [..., V] in float32 (small inputs only: the loss
        chunks these rows itself)."""
        z = self.logits(hidden).float()
        if bias_in is not None:
            z = z + F.linear(bias_in.float(), self.markov_head.markov_w2.weight.float())
        return z

    def target_hidden(self, last: Tensor) -> Tensor:
        """``final_norm(h_{L-1})`` in float32 (float64 for float64 input): the target's RMSNorm
        (``h / sqrt(mean(h²) + eps) · w``), the one place the final norm is applied to the captured, pre-norm
        last-layer state. last [..., H]."""
        x = last.to(torch.promote_types(last.dtype, torch.float32))
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.cfg.rms_norm_eps) * self.target_norm_weight

    # ---- drafting -------------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, context_states: Tensor, anchor_ids: Tensor, temperatures: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """Greedy DSpark block as a serving engine drafts it (vLLM ``DSparkSpeculator._sample_sequential``).

        One parallel backbone pass over ``[x_p, MASK × (B-1)]`` (:meth:`infer_block`), then left to
        right: slot k's token = argmax(lm_head(h_k) + markov_w2(W1[prev_k])) with ``prev_0 = x_p`` and
        ``prev_k`` the proposal of slot k-1; its confidence = sigmoid(logit_k / T_k).

        Args:
            context_states: [b, p, m, H] captured context layers for positions 0 … p-1.
            anchor_ids: [b] long, x_p. temperatures: optional [B] (calibration; default 1).

        Returns:
            (tokens [b, B] long: proposals for x_{p+1} … x_{p+B}, confidences [b, B] float32 or None).
        """
        h = self.infer_block(context_states, anchor_ids)
        B = self.cfg.block_size
        prev = anchor_ids.long()
        toks, confs = [], []
        for k in range(B):
            emb, bias_in = self.markov_inputs(prev, h[:, k])
            tok = self.draft_logits(h[:, k], bias_in).argmax(dim=-1)
            c = self.confidence_logits(h[:, k], emb)
            if c is not None:
                t = 1.0 if temperatures is None else float(temperatures[k])
                confs.append(torch.sigmoid(c / t))
            toks.append(tok)
            prev = tok
        return torch.stack(toks, dim=1), (torch.stack(confs, dim=1) if confs else None)
