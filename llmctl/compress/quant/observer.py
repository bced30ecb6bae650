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
    quantization error (see the module docstring); on a tie, the widest range."""
    w = w.float()
    wmin, wmax = _ranges(w, spec)
    n = int(round((1.0 - min_shrink) / step))
    # the factors as float32, as `wmin * p` would round a Python float p: [K]
    shrink = torch.tensor([1.0 - k * step for k in range(n + 1)], dtype=torch.float32)
    rows = max(1, _SEARCH_ELEMENTS // max(1, shrink.numel() * w.shape[1]))
    scales, zeros = [], []
    for r0 in range(0, w.shape[0], rows):  # chunks of rows bound the [K, rows, cols] temporaries
        s, z = _search(
            w[r0 : r0 + rows], wmin[r0 : r0 + rows], wmax[r0 : r0 + rows], shrink, spec, norm
        )
        scales.append(s)
        zeros.append(z)
    return torch.cat(scales), torch.cat(zeros)


_SEARCH_ELEMENTS = 1 << 18  # elements of one chunk's [K, rows, cols] error tensor (fits L2)


def _search(w, wmin, wmax, shrink, spec: QuantSpec, norm: float):
    """All K shrink factors at once for w [rows, cols]: the candidates' scales and zeros
    [K, rows], their errors [K, rows], and per row the first factor with the least error."""
    scale, zero = range_params(
        wmin[None, :] * shrink[:, None], wmax[None, :] * shrink[:, None], spec
    )
    err = _error(w[None], scale, zero, spec, norm)  # [K, rows]
    best = torch.nan_to_num(err, nan=float("inf")).argmin(dim=0, keepdim=True)  # [1, rows]
    return scale.gather(0, best)[0], zero.gather(0, best)[0]


def _error(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec, norm: float
) -> torch.Tensor:
    """sum over columns of |w - Q(w)|^norm, per row of w [..., rows, cols] for the parameters
    [..., rows]: returns [..., rows]. One temporary, updated in place: on the CPU the search is
    bound by memory traffic and the pow, not by arithmetic."""
    s, z = scale[..., None], zero[..., None].float()
    e = w / s  # [..., rows, cols], becomes Q(w) - w, then its error
    e.round_().add_(z).clamp_(0, spec.maxq).sub_(z).mul_(s).sub_(w).abs_()
    # |e|^norm as exp(norm log|e|) (log 0 = -inf gives 0): 3x faster than pow_ on the CPU,
    # within a few float32 ulps of it
    e.log_().mul_(norm).exp_()
    return e.sum(dim=-1)
