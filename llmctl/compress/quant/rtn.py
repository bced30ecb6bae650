"""Round-to-nearest (RTN) quantization: one range per group (min/max or MSE-searched),
symmetric or asymmetric.

Owns: `group_params` (scale and zero of a block of columns, used by GPTQ and AWQ too),
`quantize_with` (codes for given parameters) and `quantize_rtn` (a whole weight).
"""

from __future__ import annotations

import torch

from llmctl.compress.quant.observer import minmax_params, mse_params
from llmctl.runtime.formats.spec import QuantResult, QuantSpec, dequantize


def group_params(
    w: torch.Tensor, spec: QuantSpec, *, mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for each row of `w` [rows, cols] (one group): (scale [rows], zero [rows]
    int32), from the row's min/max (llmctl.compress.quant.observer.range_params gives the
    formulas) or, with mse, from the MSE-optimal shrink of that range (observer.mse_params)."""
    return mse_params(w, spec) if mse else minmax_params(w, spec)


def quantize_with(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec
) -> torch.Tensor:
    """Integer codes [rows, cols] of `w` for per-row `scale`/`zero` [rows] (or broadcastable
    [rows, cols])."""
    if scale.dim() == 1:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, spec.maxq).to(torch.int32)


def quantize_rtn(weight: torch.Tensor, spec: QuantSpec, *, mse: bool = False) -> QuantResult:
    """Quantize `weight` [out, in] group by group along the input dimension; mse: each group's
    range from the MSE shrink search instead of its min/max."""
    out_f, in_f = weight.shape
    g = spec.group_size
    w = weight.float().reshape(out_f * (in_f // g), g)  # one row per (output row, group)
    scale, zero = group_params(w, spec, mse=mse)
    codes = quantize_with(w, scale, zero, spec).reshape(out_f, in_f)
    scales = scale.reshape(out_f, in_f // g)
    zeros = zero.reshape(out_f, in_f // g)
    g_idx = torch.arange(in_f, dtype=torch.int32) // g
    return QuantResult(codes, scales, zeros, dequantize(codes, scales, zeros, g_idx), spec)
