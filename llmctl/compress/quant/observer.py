"""Range observers: the scale and zero point of one quantization group from its weights.

Owns: `range_params` (scale and zero of given per-row ranges, rounded to the spec's scale dtype),
`minmax_params` (the group's own min/max range) and `mse_params`, the MSE-optimal shrink search of
GPTQ's reference `mse` option and llm-compressor's `mse` observer: the range is shrunk by factors
p = 1, 1 - step, ..., min_shrink and each row keeps the p whose quantize-dequantize error
sum |w - Q(w)|^norm is smallest (norm 2.4, as both references use, weighs large errors a little
more than squared error). p = 1 is the min/max range, so the search never does worse than it on
that error.
"""

from __future__ import annotations

import torch

from llmctl.runtime.formats.spec import QuantSpec

MSE_MIN_SHRINK = 0.8  # smallest range factor tried
MSE_STEP = 0.01
MSE_NORM = 2.4


def range_params(
    wmin: torch.Tensor, wmax: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [rows] for ranges [wmin, wmax] [rows] (wmin <= 0 <= wmax).

    Symmetric: s = max(|wmin|, wmax) / ((2^b - 1) / 2), z = 2^(b-1) (the compressed-tensors
    convention). Asymmetric: s = (wmax - wmin) / (2^b - 1), z = round(-wmin / s).
    """
    if spec.symmetric:
        scale = torch.maximum(-wmin, wmax) / (spec.maxq / 2)
    else:
        scale = (wmax - wmin) / spec.maxq
    # all-zero groups: any positive scale reproduces them exactly
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(spec.scale_dtype).float()
    scale = torch.where(
        scale > 0, scale, torch.full_like(scale, torch.finfo(spec.scale_dtype).tiny)
    )
    if spec.symmetric:
        zero = torch.full_like(scale, spec.sym_zero)
    else:
        zero = torch.round(-wmin / scale).clamp(0, spec.maxq)
    return scale, zero.to(torch.int32)


def _ranges(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row range [min, max] of w [rows, cols], widened to include 0 (symmetric: +-max|w|)."""
    if spec.symmetric:
        amax = w.abs().amax(dim=1)
        return -amax, amax
    return w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)


def minmax_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [rows] from each row's min/max of w [rows, cols]."""
    wmin, wmax = _ranges(w.float(), spec)
    return range_params(wmin, wmax, spec)


def mse_params(
    w: torch.Tensor,
    spec: QuantSpec,
    *,
    min_shrink: float = MSE_MIN_SHRINK,
    step: float = MSE_STEP,
    norm: float = MSE_NORM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [rows] of w [rows, cols]: the shrink of each row's range with the least
    quantization error (see the module docstring)."""
    w = w.float()
    wmin, wmax = _ranges(w, spec)
    best_scale, best_zero = range_params(wmin, wmax, spec)
    best_err = _error(w, best_scale, best_zero, spec, norm)
    n = int(round((1.0 - min_shrink) / step))
    for k in range(1, n + 1):
        p = 1.0 - k * step
        scale, zero = range_params(wmin * p, wmax * p, spec)
        err = _error(w, scale, zero, spec, norm)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _error(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec, norm: float
) -> torch.Tensor:
    """sum over columns of |w - Q(w)|^norm, per row of w [rows, cols]: returns [rows]."""
    s, z = scale[:, None], zero[:, None].float()
    q = torch.clamp(torch.round(w / s) + z, 0, spec.maxq)
    return ((q - z) * s - w).abs().pow(norm).sum(dim=1)
