"""Weighted cross-entropy through a **frozen** lm_head, chunk by chunk: the loss every draft that
predicts target tokens with the target's own head shares (DFlash, DSpark).

``Σ_i w_i · CE(h_i Wᵀ, t_i)`` over rows ``h`` [R, H] with targets ``t`` [R] and row weights ``w``
[R] (0 = the row adds nothing), W [V, H] frozen: no gradient for it. Three implementations
(:data:`CE_IMPLS`), one function (:func:`linear_ce`):

- ``"reference"``: logits per chunk upcast to float32 (float64 for a float64 model) before the
  softmax; the gradient w.r.t. ``h`` is computed during the forward pass and kept ([R, H]), so no
  [R, V] tensor outlives its chunk and nothing is recomputed ("fused linear cross-entropy").
  Its arithmetic is the DFlash loss's since the CPU runs of this repository (tests pin it bit for bit).
- ``"chunked"``: the same algorithm with **bf16 matmuls** (the lm_head cast to bf16 once and
  cached, :func:`compute_weight`) and a float32 log-sum-exp per chunk; the softmax gradient is
  written in bf16 and multiplied by the bf16 lm_head. One [chunk, V] bf16 logits block and its fp32
  working copy exist at a time; with ``compile=True`` the per-chunk softmax/CE/argmax/gradient body
  is one ``torch.compile``-d function (on CUDA: fused Triton kernels reading the bf16 logits, no fp32
  [chunk, V] copy written at all).
- ``"liger"``: Liger-Kernel's fused linear cross-entropy (``liger_kernel``, the speculators RFC's
  loss; optional extra ``artcache[liger]``), ``reduction="none"`` weighted here; CUDA only, and only
  when the package imports (:func:`liger_available`). Liger defers the gradient to backward for
  ``reduction="none"`` (three matmuls per chunk instead of two) and reads one count back to the host.

All three compute the same function: agreement within bf16 rounding is tested on the CPU (chunked) and
in the GPU lane (liger).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from artcache.errors import ConfigError
from artcache.trainers import CE_IMPLS

__all__ = ["CE_IMPLS", "CeImpl", "compute_weight", "liger_available", "linear_ce"]

CeImpl = Literal["reference", "chunked", "liger"]


@functools.cache
def liger_available() -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy can be imported (it needs Triton)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return False
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except Exception:  # no Triton (CPU wheels), or a Triton that does not match torch
        return False
    return True


_WEIGHT_CACHE: dict[tuple, Tensor] = {}


def compute_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` in ``dtype``, cast once per (tensor, version): the frozen lm_head in the matmul dtype.

    The cache key holds the tensor's storage pointer, shape and in-place version counter, so a buffer
    modified in place or replaced gets a fresh copy; at most a few entries live (the cache is cleared
    when it grows past 8). Returns ``weight`` itself when it already has ``dtype``.
    """
    if weight.dtype == dtype:
        return weight
    key = (weight.data_ptr(), weight.device, tuple(weight.shape), weight._version, dtype)
    out = _WEIGHT_CACHE.get(key)
    if out is None:
        if len(_WEIGHT_CACHE) >= 8:
            _WEIGHT_CACHE.clear()
        out = _WEIGHT_CACHE[key] = weight.detach().to(dtype)
    return out


def _reference_chunk(hc: Tensor, tc: Tensor, wc: Tensor, weight: Tensor, acc_dtype: torch.dtype,
                     need_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(Σ w·CE, argmax, dL/dh) of one chunk in ``acc_dtype`` (the reference arithmetic)."""
    logits = F.linear(hc.to(weight.dtype), weight)
    logits = logits.to(torch.promote_types(logits.dtype, acc_dtype))
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, tc[:, None]).squeeze(1)
    part = (ce * wc).sum()
    preds = logits.argmax(dim=-1)
    grad = None
    if need_grad:
        p = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place over the logits buffer
        p[torch.arange(p.shape[0], device=p.device), tc] -= 1.0
        p.mul_(wc[:, None].to(p.dtype))
        grad = p.to(weight.dtype) @ weight
    return part, preds, grad


def _softmax_ce_body(logits: Tensor, tc: Tensor, wc: Tensor, need_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row CE [c] (float32), argmax [c] and the weighted softmax gradient [c, V] (logits' dtype;
    an empty tensor when ``need_grad`` is False) of bf16/fp16/fp32 ``logits`` [c, V]. Log-sum-exp,
    CE and softmax in float32."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, tc[:, None]).squeeze(1)
    preds = logits.argmax(dim=-1)
    if not need_grad:
        return ce, preds, logits.new_empty(0)
    w32 = wc.float()
    g = torch.exp(z - lse[:, None]) * w32[:, None]
    g = g.scatter_add(1, tc[:, None], -w32[:, None])
    return ce, preds, g.to(logits.dtype)


@functools.cache
def _compiled_body():
    return torch.compile(_softmax_ce_body, dynamic=False, fullgraph=True)


def _chunked_chunk(hc: Tensor, tc: Tensor, wc: Tensor, wmat: Tensor, need_grad: bool,
                   compile: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    logits = F.linear(hc.to(wmat.dtype), wmat)  # bf16 × bf16 -> bf16, fp32 accumulation in the GEMM
    body = _compiled_body() if compile else _softmax_ce_body
    ce, preds, g = body(logits, tc, wc, need_grad)
    # an elementwise sum, not a dot product: autocast would run ``@`` in bf16
    part = (ce.to(torch.promote_types(ce.dtype, wc.dtype)) * wc).sum()
    return part, preds, (g @ wmat) if need_grad else None


class _LinearCE(torch.autograd.Function):
    """Σ w·CE(h Wᵀ, t) over row chunks with dL/dh computed in the forward pass (frozen W)."""

    @staticmethod
    def forward(ctx, h: Tensor, t: Tensor, w: Tensor, weight: Tensor, chunk_rows: int, need_grad: bool,
                acc_dtype: torch.dtype, impl: str, compile: bool):  # noqa: D102
        loss_sum = torch.zeros((), dtype=acc_dtype, device=h.device)
        preds = torch.empty_like(t)
        grad_h = torch.empty_like(h) if need_grad else None
        wmat = weight if impl == "reference" else compute_weight(weight, _matmul_dtype(h, weight))
        for s in range(0, h.shape[0], chunk_rows):
            hc, tc, wc = h[s:s + chunk_rows], t[s:s + chunk_rows], w[s:s + chunk_rows]
            if impl == "reference":
                part, pc, gc = _reference_chunk(hc, tc, wc, wmat, acc_dtype, need_grad)
            else:
                part, pc, gc = _chunked_chunk(hc, tc, wc, wmat, need_grad, compile)
            loss_sum = loss_sum + part.to(acc_dtype)
            preds[s:s + chunk_rows] = pc
            if need_grad:
                grad_h[s:s + chunk_rows] = gc.to(h.dtype)
        ctx.save_for_backward(grad_h if need_grad else None)
        ctx.mark_non_differentiable(preds)
        return loss_sum, preds

    @staticmethod
    def backward(ctx, g_loss: Tensor, g_preds: Tensor | None):  # noqa: D102
        (grad_h,) = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * g_loss.to(grad_h.dtype)
        return gh, None, None, None, None, None, None, None, None


def _matmul_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """bf16 on CUDA and wherever the inputs are bf16 already; fp16 stays fp16; float64 stays float64
    (a float64 model is a reference run); float32 on a CPU becomes bf16 (the point of the path)."""
    if torch.float64 in (h.dtype, weight.dtype):
        return torch.float64
    if torch.float16 in (h.dtype, weight.dtype):
        return torch.float16
    return torch.bfloat16


def _liger(h: Tensor, t: Tensor, w: Tensor, weight: Tensor, acc_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = _matmul_dtype(h, weight)
    out = liger_fused_linear_cross_entropy(h.to(dtype), compute_weight(weight, dtype), t, reduction="none",
                                           return_predicted_tokens=True)
    return (out.loss.to(acc_dtype) * w.to(acc_dtype)).sum(), out.predicted_tokens


def linear_ce(h: Tensor, weight: Tensor, targets: Tensor, row_weights: Tensor, *, chunk_rows: int,
              impl: CeImpl = "reference", acc_dtype: torch.dtype = torch.float32,
              compile: bool = False) -> tuple[Tensor, Tensor]:
    """Weighted cross-entropy of rows ``h`` through the frozen ``weight`` (module docstring).

    Args:
        h: [R, H] hidden rows (any float dtype; gradient flows to it). weight: [V, H] frozen lm_head.
        targets: [R] long target ids in [0, V). row_weights: [R] float (``acc_dtype``); 0 drops a row.
        chunk_rows: rows per chunk (bounds the [chunk, V] logits block). impl: one of :data:`CE_IMPLS`.
        acc_dtype: dtype of the loss sum (float32, or float64 for a float64 model).
        compile: ``"chunked"`` only: ``torch.compile`` the per-chunk softmax body.

    Returns:
        (``loss_sum`` scalar ``acc_dtype`` = Σ w·CE with a gradient w.r.t. ``h`` when autograd records,
        ``preds`` [R] long = argmax of each row's logits, no gradient).

    Raises:
        ConfigError: unknown ``impl``, bad ``chunk_rows``, or ``"liger"`` where Liger cannot run
            (not installed, or not on CUDA).
    """
    if impl not in CE_IMPLS:
        raise ConfigError(f"lm_head loss implementation {impl!r} is not accepted: one of {', '.join(CE_IMPLS)}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    need_grad = torch.is_grad_enabled() and h.requires_grad
    if impl == "liger":
        if h.device.type != "cuda" or not liger_available():
            raise ConfigError("--loss-impl liger needs CUDA and the liger-kernel package (pip install "
                              "'artcache[liger]'); use --loss-impl chunked")
        return _liger(h, targets, row_weights, weight, acc_dtype)
    return _LinearCE.apply(h, targets, row_weights, weight, chunk_rows, need_grad, acc_dtype, impl, compile)
