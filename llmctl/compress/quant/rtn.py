"""Round-to-nearest (RTN) quantization: min/max per group, symmetric or asymmetric.

Owns: `group_params` (scale and zero of a block of columns, used by GPTQ and AWQ too),
`quantize_with` (codes for given parameters) and `quantize_rtn` (a whole weight).
"""

from __future__ import annotations

import torch

from llmctl.runtime.formats.spec import QuantResult, QuantSpec, dequantize


def group_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for each row of `w` [rows, cols] (one group): returns (scale [rows], zero [rows] int32).

    Symmetric: s = max|w| / ((2^b - 1) / 2), z = 2^(b-1) (the compressed-tensors convention).
    Asymmetric: the range is widened to include 0, s = (max - min) / (2^b - 1), z = round(-min / s).
    """
    w = w.float()
    if spec.symmetric:
        amax = w.abs().amax(dim=1)
        scale = amax / (spec.maxq / 2)
        zero = torch.full_like(scale, spec.sym_zero)
    else:
        wmin = w.amin(dim=1).clamp(max=0)
        wmax = w.amax(dim=1).clamp(min=0)
        scale = (wmax - wmin) / spec.maxq
        zero = None
    # all-zero groups: any positive scale reproduces them exactly
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(spec.scale_dtype).float()
    scale = torch.where(
        scale > 0, scale, torch.full_like(scale, torch.finfo(spec.scale_dtype).tiny)
    )
    if zero is None:
        zero = torch.round(-wmin / scale).clamp(0, spec.maxq)
    return scale, zero.to(torch.int32)


def quantize_with(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """Integer codes [rows, cols] of `w` for per-row `scale`/`zero` [rows] (or broadcastable [rows, cols])."""
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, spec.maxq).to(torch.int32)


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec) -> QuantResult:
    """Quantize `weight` [out, in] group by group along the input dimension."""
    out_f, in_f = weight.shape
    g = spec.group_size
    w = weight.float().reshape(out_f * (in_f // g), g)  # one row per (output row, group)
    scale, zero = group_params(w, spec)
    codes = quantize_with(w, scale, zero, spec).reshape(out_f, in_f)
    scales = scale.reshape(out_f, in_f // g)
    zeros = zero.reshape(out_f, in_f // g)
    g_idx = torch.arange(in_f, dtype=torch.int32) // g
    return QuantResult(codes, scales, zeros, dequantize(codes, scales, zeros, g_idx), spec)
