"""GPTQ: quantize a weight column by column, pushing each column's error onto the columns not yet
quantized through the inverse Hessian of the layer's inputs (Frantar et al., 2022).

Owns: `quantize_gptq(weight, H, spec, ...)`. Lazy batches of `column_block` columns (updates inside
a block are applied at once to the rest of the matrix at the block's end); act-order with static
groups (group parameters come from the original column order, so `g_idx` stays
column // group_size and every format can store the result); an optional `mask` of weights that
are pruned and must stay exactly zero (sparse-then-quantize).
"""

from __future__ import annotations

import torch

from llmctl.compress.hessian import damped_cholesky_inverse, dead_inputs
from llmctl.compress.quant.rtn import group_params, quantize_with
from llmctl.runtime.formats.spec import QuantResult, QuantSpec, dequantize


def quantize_gptq(
    weight: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    *,
    dampening: float = 0.01,
    column_block: int = 128,
    act_order: bool = False,
    mask: torch.Tensor | None = None,
) -> QuantResult:
    """Quantize `weight` [out, in] given H [in, in] = 2 X X^T / n.

    mask: bool [out, in], True where the weight is pruned; those entries get code == zero point,
    so they dequantize to exactly 0.
    """
    out_f, in_f = weight.shape
    W = weight.detach().float().clone()
    W[:, dead_inputs(H)] = 0.0
    M = mask.clone() if mask is not None else None
    W, H, M, perm, scales, zeros = _in_order(W, H, M, spec, act_order)
    U = damped_cholesky_inverse(H, dampening)  # [in, in] upper, in permuted order
    codes = torch.zeros(out_f, in_f, dtype=torch.int32)
    for b0 in range(0, in_f, column_block):
        b1 = min(b0 + column_block, in_f)
        err = _quantize_block(W, U, M, perm, codes, scales, zeros, (b0, b1), spec, act_order)
        W[:, b1:] -= err @ U[b0:b1, b1:]
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    g_idx = torch.arange(in_f, dtype=torch.int32) // spec.group_size
    return QuantResult(codes, scales, zeros, dequantize(codes, scales, zeros, g_idx), spec)


def _in_order(W: torch.Tensor, H: torch.Tensor, M: torch.Tensor | None, spec, act_order: bool):
    """(W, H, M in processing order, perm, scales [out, groups], zeros [out, groups]).

    Static groups: parameters from the original weight, before any error feedback, when act-order
    permutes columns; otherwise a group's parameters are taken when its first column comes up
    (in _quantize_block) and the order is the identity."""
    out_f, in_f = W.shape
    gs = spec.group_size
    n_groups = in_f // gs
    scales = torch.zeros(out_f, n_groups)
    zeros = torch.zeros(out_f, n_groups, dtype=torch.int32)
    if not act_order:
        return W, H, M, torch.arange(in_f), scales, zeros
    for g in range(n_groups):
        scales[:, g], zeros[:, g] = group_params(W[:, g * gs : (g + 1) * gs], spec)
    perm = torch.argsort(torch.diag(H), descending=True)
    if M is not None:
        M = M[:, perm]
    return W[:, perm], H[perm][:, perm], M, perm, scales, zeros


def _quantize_block(W, U, M, perm, codes, scales, zeros, block, spec, act_order) -> torch.Tensor:
    """Quantize columns b0..b1-1 of W (processing order) into `codes`, each column's error pushed
    onto the block's later columns at once; returns the scaled errors [out, b1 - b0] for the
    columns after the block. Fills `scales`/`zeros` of groups that start here (no act-order)."""
    b0, b1 = block
    gs = spec.group_size
    W1 = W[:, b0:b1].clone()  # [out, B] receives intra-block updates immediately
    Err = torch.zeros_like(W1)
    U1 = U[b0:b1, b0:b1]
    for i in range(b1 - b0):
        col = b0 + i
        g = int(perm[col]) // gs
        if not act_order and col % gs == 0:
            # the group's columns as they are now: updated ones in W1, later blocks in W
            cur = W1[:, i : i + gs]
            if cur.shape[1] < gs:  # the group runs past this block
                cur = torch.cat([cur, W[:, b1 : b1 + gs - cur.shape[1]]], dim=1)
            scales[:, g], zeros[:, g] = group_params(cur, spec)
        w = W1[:, i]
        q = quantize_with(w[:, None], scales[:, g], zeros[:, g], spec)[:, 0]
        if M is not None:
            q = torch.where(M[:, col], zeros[:, g], q)
        codes[:, col] = q
        dq = (q.float() - zeros[:, g].float()) * scales[:, g]
        err = (w - dq) / U1[i, i]  # [out]
        W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
        Err[:, i] = err
    return Err
