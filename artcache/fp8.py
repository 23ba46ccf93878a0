"""fp8 artifacts: captured layers stored as float8_e4m3fn codes with one fp32 scale per token row per layer.

Scheme (contract dtype ``float8_e4m3fn``; docs/format.md, "fp8 artifacts"): for each token t and
captured layer l, with x = the hidden state row ``hidden[t, l, :]`` in float32 (the target's compute
dtype converted exactly),

    s[t, l]         = max_h |x[h]| / 448                       (float32; 448 = largest finite e4m3fn)
    code[t, l, h]   = e4m3fn(clamp(x[h] / s[t, l], -448, 448))  (round to nearest even)
    x̂[t, l, h]      = float32(code[t, l, h]) * s[t, l]          (dequantised, then cast to the consumer's dtype)

A row of zeros has s = 0 and codes 0 (the division uses 1 there), so it dequantises to exact zeros;
NaN/Inf never reach the quantiser (the capture is checked first) and a NaN, Inf or negative scale is
refused at publication, by every read (the artifact is quarantined) and by ``fsck``
(:func:`artcache.store.check_scales`). Each code is the e4m3fn value nearest x / s (3 mantissa bits): the error
of an element is at most 2^-4 of its magnitude where |x / s| >= 2^-6 (e4m3fn normals), and at most
2^-10 · s below that (subnormals).

The same per-row absmax scaling with e4m3 codes is what SGLang/vLLM call per-token dynamic fp8
quantisation (``scaled_fp8_quant(..., use_per_token_if_dynamic=True)``); here it is kept per layer too.
"""

from __future__ import annotations

import torch

#: the contract dtype of fp8 artifacts
FP8_DTYPE = "float8_e4m3fn"
#: largest finite float8_e4m3fn value
E4M3_MAX = 448.0
#: the artifact tensor holding the scales
SCALES = "hidden_scales"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., H] (any float dtype, any device) row by row over its last axis.

    Returns:
        ``(codes, scales)``: codes [..., H] float8_e4m3fn and scales [...] float32, on ``x``'s device,
        contiguous. See the module docstring for the exact formula.
    """
    xf = x.float()
    scales = xf.abs().amax(dim=-1) / E4M3_MAX
    div = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (xf / div.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.contiguous(), scales.contiguous()


def stored_hidden(x: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The artifact tensors holding hidden states ``x`` [..., T, m, H] stored as ``dtype``:
    ``{"hidden_states": x.to(dtype)}``, or for float8_e4m3fn the codes and ``hidden_scales`` [..., T, m]
    (:func:`quantize_rows`). Contiguous, on ``x``'s device."""
    if dtype == torch.float8_e4m3fn:
        codes, scales = quantize_rows(x)
        return {"hidden_states": codes, SCALES: scales}
    return {"hidden_states": x.to(dtype).contiguous()}


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float32(codes) * scales[..., None]`` cast to ``dtype``: codes [..., H] float8_e4m3fn, scales [...]
    float32, on one device. Returns [..., H] ``dtype``.

    Raises:
        ValueError: the shapes do not match ([..., H] against [...]) or ``codes`` is not float8_e4m3fn.
    """
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes must be float8_e4m3fn, got {codes.dtype}")
    if tuple(scales.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)} "
                         "(need [...] for [..., H])")
    out = codes.float().mul_(scales.float().unsqueeze(-1))
    return out if dtype == torch.float32 else out.to(dtype)


def relative_error(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error per captured layer of ``x`` [T, m, H] against its dequantised fp8 form:
    ``||x̂[:, l] - x[:, l]|| / ||x[:, l]||`` as float32 [m] (0 where the layer is all zeros)."""
    xf = x.float()
    err = (dequantize_rows(codes, scales) - xf).square().sum(dim=(0, 2)).sqrt()
    ref = xf.square().sum(dim=(0, 2)).sqrt()
    return torch.where(ref > 0, err / torch.where(ref > 0, ref, torch.ones_like(ref)), torch.zeros_like(ref))


__all__ = ["E4M3_MAX", "FP8_DTYPE", "SCALES", "dequantize_rows", "quantize_rows", "relative_error",
           "stored_hidden"]
