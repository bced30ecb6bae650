"""AWQ: activation-aware weight quantization (Lin et al., 2023), as pure functions on tensors.

Owns: the per-input-channel scale search (`search_scales`: s = mean|x|^alpha, alpha on a grid in
[0, 1], chosen per scaling group to minimise the output error of the group's linears after
quantization), the clipping search (`search_clip`: per output row and group, the shrink of the
weight range that minimises that group's output error), `quantize_awq` (clip then RTN) and the
folding helpers that move 1/s into the preceding operation.

Objective (documented simplification): the error is measured on the outputs of the scaled linears
themselves (X W^T against X/s Q(W s)^T), not on the whole attention or MLP block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.runtime.formats.spec import QuantResult, QuantSpec


@dataclass
class ScaleSearch:
    scales: (
        torch.Tensor
    )  # [in] multiply the linears' input columns, divide the previous op's output
    alpha: float
    loss: float
    loss_unscaled: float  # alpha = 0, plain RTN


def fake_quant(w: torch.Tensor, spec: QuantSpec, mse: bool = False) -> torch.Tensor:
    """Quantize-dequantize `w` [out, in] with RTN (mse: the MSE range search per group)."""
    return quantize_rtn(w, spec, mse=mse).weight


def search_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    spec: QuantSpec,
    n_grid: int = 20,
    max_tokens: int = 4096,
    block: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    duo: bool = True,
    mse: bool = False,
) -> ScaleSearch:
    """Best per-input-channel scale for linears sharing the input x [tokens, in]; weights:
    [out_i, in].

    Grid point k = 0 is the unscaled baseline (s = 1, reported as alpha 0); k >= 1 tries
    alpha = k / n_grid with s = mean|x|^alpha / mean|w|^(1 - alpha) per input channel (AutoAWQ's
    "duo" scaling), normalised around 1. The loss is the mean squared error of
    `block(effective weights)` against `block(weights)`, where the effective weight of each
    linear is Q(W s) / s; without `block`, the linears' own outputs on x. duo False: the paper's
    s = mean|x|^alpha alone (AwqMethod's default). mse: each candidate quantized with the MSE
    range search instead of min/max.
    """
    x = _sample_tokens(x.float(), max_tokens)
    x_mean = x.abs().mean(dim=0).clamp(min=1e-8)  # [in]
    w_all = torch.cat([w.float() for w in weights])  # [sum out, in]
    # weight magnitude per input channel, relative within each quantization group
    wg = w_all.abs().reshape(w_all.shape[0], -1, spec.group_size)
    w_mean = (
        (wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-8))
        .reshape(w_all.shape)
        .mean(dim=0)
        .clamp(min=1e-8)
    )
    if block is None:
        block = lambda ws: torch.cat([x @ w.t() for w in ws], dim=-1)  # noqa: E731
    with torch.no_grad():
        ref = block([w.float() for w in weights])
        best: ScaleSearch | None = None
        loss0 = 0.0
        for k in range(n_grid + 1):
            alpha = k / n_grid
            if k == 0:
                s = torch.ones_like(x_mean)
            elif duo:
                s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha)).clamp(min=1e-4)
            else:
                s = x_mean.pow(alpha).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (range-neutral)
            eff = [fake_quant(w.float() * s[None, :], spec, mse) / s[None, :] for w in weights]
            loss = float((block(eff) - ref).float().pow(2).mean())
            if k == 0:
                loss0 = loss
            if best is None or loss < best.loss:
                best = ScaleSearch(s, alpha, loss, loss0)
    best.loss_unscaled = loss0
    return best


def search_clip(
    x: torch.Tensor,
    w: torch.Tensor,
    spec: QuantSpec,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    max_tokens: int = 512,
    H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per (output row, group) clipping ratio in [1 - max_shrink, 1]: returns ratios
    [out, groups]. The error of a group is that group's share of the output error: on at most
    max_tokens of the inputs x [tokens, in] (AutoAWQ's estimate) or, given H [in, in] = 2 X X^T / n
    of all calibration tokens, exactly d H_gg d^T for the group's weight error d [gs] and the
    diagonal block H_gg [gs, gs] of H."""
    out_f, in_f = w.shape
    gs = spec.group_size
    G = in_f // gs
    if H is not None:
        idx = torch.arange(G)
        hg = H.float().reshape(G, gs, G, gs)[idx, :, idx, :]  # [G, gs, gs] diagonal blocks
        err_of = lambda d: torch.einsum("ogk,gkl,ogl->og", d, hg, d)  # noqa: E731
    else:
        xg = _sample_tokens(x, max_tokens).float().reshape(-1, G, gs)  # [n, G, gs]
        err_of = lambda d: torch.einsum("ngk,ogk->nog", xg, d).pow(2).mean(dim=0)  # noqa: E731
    wg = w.float().reshape(out_f, G, gs)
    best_err = torch.full((out_f, G), float("inf"))
    best_ratio = torch.ones(out_f, G)
    steps = max(1, int(max_shrink * n_grid))
    for k in range(steps + 1):
        ratio = 1.0 - k / n_grid
        wc = clip_groups(wg, torch.full((out_f, G), ratio), spec)
        wq = fake_quant(wc.reshape(out_f, in_f), spec).reshape(out_f, G, gs)
        err = err_of(wg - wq)  # [out, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio


def _sample_tokens(x: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """At most max_tokens evenly spaced rows of x [tokens, in]: keeps the grid searches cheap."""
    if x.shape[0] <= max_tokens:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, max_tokens).long()]


def clip_groups(wg: torch.Tensor, ratio: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Clamp each group of wg [out, G, gs] to its range shrunk by ratio [out, G]."""
    r = ratio[..., None]
    if spec.symmetric:
        m = wg.abs().amax(dim=-1, keepdim=True) * r
        return torch.maximum(torch.minimum(wg, m), -m)
    lo = wg.amin(dim=-1, keepdim=True).clamp(max=0) * r
    hi = wg.amax(dim=-1, keepdim=True).clamp(min=0) * r
    return torch.maximum(torch.minimum(wg, hi), lo)


def quantize_awq(
    w: torch.Tensor,
    x: torch.Tensor | None,
    spec: QuantSpec,
    clip: bool = True,
    *,
    mse: bool = False,
    clip_tokens: int = 512,
    H: torch.Tensor | None = None,
) -> QuantResult:
    """Clip (searched on at most clip_tokens of the inputs x [tokens, in], or on the Hessian H
    [in, in] of all of them when given) then quantize an already-scaled weight [out, in]; mse:
    the RTN step takes each group's range from the MSE shrink search."""
    if clip and x is not None:
        out_f, in_f = w.shape
        ratio = search_clip(x, w, spec, max_tokens=clip_tokens, H=H)
        w = clip_groups(w.float().reshape(out_f, -1, spec.group_size), ratio, spec).reshape(
            out_f, in_f
        )
    return quantize_rtn(w, spec, mse=mse)


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor) -> None:
    """RMSNorm weight [in] /= s (in place): the norm's output is what the linears read."""
    norm_weight.data.div_(s.to(norm_weight.dtype))


def fold_into_linear_output(
    weight: torch.Tensor, bias: torch.Tensor | None, s: torch.Tensor
) -> None:
    """Rows of a previous linear's weight [out, in] (and its bias [out]) /= s [out], in place."""
    weight.data.div_(s.to(weight.dtype)[:, None])
    if bias is not None:
        bias.data.div_(s.to(bias.dtype))


def scale_linear_input(weight: torch.Tensor, s: torch.Tensor) -> None:
    """Columns of weight [out, in] *= s [in], in place."""
    weight.data.mul_(s.to(weight.dtype)[None, :])
