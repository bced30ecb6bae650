"""GPTQ: quantize a weight column by column, pushing each column's error onto the columns not yet
quantized through the inverse Hessian of the layer's inputs (Frantar et al., 2022).

Owns: `quantize_gptq(weight, H, spec, ...)`. Lazy batches of `column_block` columns (updates
inside a block are applied at once to the rest of the matrix at the block's end); act-order with
groups that stay in the original column order (so `g_idx` stays column // group_size and every
format can store the result), their parameters either static (fitted on the original weights up
front) or refitted (on the group's error-updated weights when its first column comes up); an
optional MSE range search per group; an optional `mask` of weights that are pruned and must stay
exactly zero (sparse-then-quantize).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.compress.hessian import damped_cholesky_inverse, dead_inputs
from llmctl.compress.quant.rtn import group_params
from llmctl.runtime.formats.spec import QuantResult, QuantSpec, dequantize


@dataclass
class _Groups:
    """Per-group parameters and where each group's columns sit in the quantization order."""

    scales: torch.Tensor  # [out, G]
    zeros: torch.Tensor  # [out, G] int32
    positions: torch.Tensor  # [G, gs]: permuted positions of each group's columns
    first: torch.Tensor  # [in] bool: this position is its group's first in quantization order
    fitted: bool  # parameters fixed up front (static groups from the original weights)
    first_list: list[bool] | None = None  # `first` as Python bools, for the column loop


def _plan_groups(
    W: torch.Tensor, perm: torch.Tensor, spec: QuantSpec, *, fit_now: bool, mse: bool
) -> _Groups:
    """Group bookkeeping for W [out, in] in original order quantized in order `perm` [in]."""
    out_f, in_f = W.shape
    gs = spec.group_size
    n_groups = in_f // gs
    scales = torch.zeros(out_f, n_groups)
    zeros = torch.zeros(out_f, n_groups, dtype=torch.int32)
    if fit_now:
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = group_params(W[:, g * gs : (g + 1) * gs], spec, mse=mse)
    positions = torch.argsort(perm).reshape(n_groups, gs)  # inverse permutation, per group
    first = torch.zeros(in_f, dtype=torch.bool)
    first[positions.amin(dim=1)] = True
    return _Groups(scales, zeros, positions, first, fit_now)


def _current_columns(W, W1, Err, U, b0: int, b1: int, pos: torch.Tensor) -> torch.Tensor:
    """The present values [out, len(pos)] of permuted columns pos (all >= the current one):
    inside the block W1 holds them; later columns still owe the block's pending update."""
    inside = pos < b1
    cur = torch.empty(W.shape[0], pos.numel())
    cur[:, inside] = W1[:, pos[inside] - b0]
    later = pos[~inside]
    if later.numel():
        cur[:, ~inside] = W[:, later] - Err @ U[b0:b1, later]
    return cur


def quantize_gptq(
    weight: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    *,
    dampening: float = 0.01,
    column_block: int = 128,
    act_order: bool = False,
    mask: torch.Tensor | None = None,
    mse: bool = False,
    refit_groups: bool = False,
    static_groups: bool = False,
) -> QuantResult:
    """Quantize `weight` [out, in] given H [in, in] = 2 X X^T / n.

    mask: bool [out, in], True where the weight is pruned; those entries get code == zero point,
    so they dequantize to exactly 0. mse: each group's range from the MSE shrink search
    (llmctl.compress.quant.observer) instead of its min/max. refit_groups (act-order only): fit a
    group's parameters when its first column comes up, on the group's error-updated weights,
    instead of on the original weights up front. static_groups: fit every group on the original
    weights up front, also without act-order (as llm-compressor does).
    """
    W = weight.detach().float().clone()
    W[:, dead_inputs(H)] = 0.0
    M = mask.clone() if mask is not None else None
    in_f = W.shape[1]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_f)
    # static groups (asked for, or act-order without refit): parameters from the original weight
    fit_now = static_groups or (act_order and not refit_groups)
    groups = _plan_groups(W, perm, spec, fit_now=fit_now, mse=mse)
    if act_order:
        W, H = W[:, perm], H[perm][:, perm]
        M = M[:, perm] if M is not None else None
    U = damped_cholesky_inverse(H, dampening)  # [in, in] upper, in permuted order
    codes = torch.zeros(W.shape, dtype=torch.int32)
    # group of each permuted position and whether it opens its group, as Python values: the
    # column loop reads them once per column, where a tensor read would cost a dispatch each
    g_of = (perm // spec.group_size).tolist()
    groups.first_list = groups.first.tolist()
    for b0 in range(0, in_f, column_block):
        b1 = min(b0 + column_block, in_f)
        Err = _quantize_block(W, U, M, codes, groups, g_of, spec, b0, b1, mse)
        W[:, b1:] -= Err @ U[b0:b1, b1:]
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    scales, zeros = groups.scales, groups.zeros
    g_idx = torch.arange(in_f, dtype=torch.int32) // spec.group_size
    return QuantResult(codes, scales, zeros, dequantize(codes, scales, zeros, g_idx), spec)


def _quantize_block(W, U, M, codes, groups: _Groups, g_of, spec, b0: int, b1: int, mse: bool):
    """Quantize permuted columns [b0, b1) into codes with error feedback inside the block;
    returns the block's scaled errors Err [out, b1 - b0] for the update of later columns.
    Per column a handful of in-place ops: the loop runs once per input column of every linear."""
    W1 = W[:, b0:b1].clone()  # [out, B] receives intra-block updates immediately
    Err = torch.zeros_like(W1)  # zero for columns not yet done: _current_columns reads it
    Q1 = torch.empty_like(W1)  # the block's codes, as floats until the block ends
    U1 = U[b0:b1, b0:b1]
    diag = U1.diagonal().tolist()
    g_now = None
    for i in range(b1 - b0):
        col = b0 + i
        g = g_of[col]
        if not groups.fitted and groups.first_list[col]:
            cur = _current_columns(W, W1, Err, U, b0, b1, groups.positions[g])
            groups.scales[:, g], groups.zeros[:, g] = group_params(cur, spec, mse=mse)
            g_now = None
        if g != g_now:  # [out] each, reused by every column of the group
            scale, zero, g_now = groups.scales[:, g].contiguous(), groups.zeros[:, g].float(), g
        w = W1[:, i]
        q = torch.div(w, scale).round_().add_(zero).clamp_(0, spec.maxq)
        if M is not None:
            q = torch.where(M[:, col], zero, q)
        Q1[:, i] = q
        err = Err[:, i]
        # err = (w - dq) / U[i, i] with dq = (q - zero) * scale, the rounding of the plain formula
        torch.sub(q, zero, out=err).mul_(scale).neg_().add_(w).div_(diag[i])
        W1[:, i:].sub_(err[:, None] * U1[i, i:][None, :])
    codes[:, b0:b1] = Q1.to(torch.int32)
    return Err
