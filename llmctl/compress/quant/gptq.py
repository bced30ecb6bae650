"""GPTQ: quantize a weight column by column, pushing each column's error onto the columns not yet
quantized through the inverse Hessian of the layer's inputs (Frantar et al., 2022).

Owns: `quantize_gptq(weight, H, spec, ...)`. Lazy batches of `block_size` columns (updates inside a
block are applied at once to the rest of the matrix at the block's end); act-order with static
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
    percdamp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    mask: torch.Tensor | None = None,
) -> QuantResult:
    """Quantize `weight` [out, in] given H [in, in] = 2 X X^T / n.

    mask: bool [out, in], True where the weight is pruned; those entries get code == zero point,
    so they dequantize to exactly 0.
    """
    out_f, in_f = weight.shape
    gs = spec.group_size
    n_groups = in_f // gs
    W = weight.detach().float().clone()
    dead = dead_inputs(H)
    W[:, dead] = 0.0
    M = mask.clone() if mask is not None else None

    # Static groups: parameters from the original weight, before any error feedback, when act-order
    # permutes columns; otherwise a group's parameters are taken when its first column comes up.
    scales = torch.zeros(out_f, n_groups)
    zeros = torch.zeros(out_f, n_groups, dtype=torch.int32)
    if act_order:
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = group_params(W[:, g * gs : (g + 1) * gs], spec)
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
        if M is not None:
            M = M[:, perm]
    else:
        perm = torch.arange(in_f)

    U = damped_cholesky_inverse(H, percdamp)  # [in, in] upper, in permuted order
    codes = torch.zeros(out_f, in_f, dtype=torch.int32)
    for b0 in range(0, in_f, block_size):
        b1 = min(b0 + block_size, in_f)
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
        W[:, b1:] -= Err @ U[b0:b1, b1:]

    if act_order:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
    g_idx = torch.arange(in_f, dtype=torch.int32) // gs
    return QuantResult(codes, scales, zeros, dequantize(codes, scales, zeros, g_idx), spec)
