"""SparseGPT (Frantar & Alistarh, 2023): prune column by column and push each pruned weight's error
onto the not-yet-processed columns through the inverse Hessian, as GPTQ does for rounding error.

Input is the upper Cholesky factor U of H^-1 (H^-1 = U^T U, H = 2 X X^T / T of the layer's
inputs), the same factor GPTQ uses (`llmctl.compress.hessian.damped_cholesky_inverse`). Row i of U
restricted to columns >= i is the OBS update direction for column i once columns < i are fixed,
and U[i, i]^2 is the matching inverse-Hessian diagonal, so the saliency of weight w in column i is
w^2 / U[i, i]^2.

Masks are chosen lazily: unstructured sparsity picks the lowest-saliency fraction of each block of
`column_block` columns when the block starts; N:M picks the m-n lowest in each group of m columns
when the sweep reaches the group, so both see the weights already updated by earlier columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.compress.sparse.masks import SparsityPattern, global_prune_mask, nm_prune_mask


@dataclass
class SparseGPTResult:
    weight: torch.Tensor  # [out, in] pruned and updated, float32, exact zeros where mask is True
    mask: torch.Tensor  # [out, in] bool, True = pruned
    loss: float  # OBS estimate of the added squared error, sum over rows of sum w^2 / (2 U_ii^2)


def sparsegpt_prune(
    weight: torch.Tensor,
    hinv_chol: torch.Tensor,
    pattern: SparsityPattern,
    column_block: int = 128,
) -> SparseGPTResult:
    """Prune weight [out, in] to `pattern`, updating the kept weights; hinv_chol is U [in, in]
    (upper)."""
    rows, cols = weight.shape
    if hinv_chol.shape != (cols, cols):
        raise ValueError(
            f"Cholesky factor {tuple(hinv_chol.shape)} does not match {cols} input columns"
        )
    if pattern.structured:
        if cols % pattern.m or column_block % pattern.m:  # type: ignore[operator]
            raise ValueError(
                f"{cols} columns / block {column_block} are not multiples of the group width "
                f"{pattern.m}"
            )
    w_all = weight.detach().float().clone()
    u_all = hinv_chol.detach().float().to(w_all.device)
    mask = torch.zeros_like(w_all, dtype=torch.bool)
    loss = torch.zeros((), dtype=torch.float64, device=w_all.device)
    for start in range(0, cols, column_block):
        end = min(start + column_block, cols)
        block_mask, block_err, block_loss = _prune_block(w_all, u_all, start, end, pattern)
        mask[:, start:end] = block_mask
        loss += block_loss
        # Lazy batch update: the rest of the row absorbs this block's errors at once.
        w_all[:, end:] -= block_err @ u_all[start:end, end:]
    return SparseGPTResult(weight=w_all, mask=mask, loss=float(loss))


def _prune_block(
    w_all: torch.Tensor, u_all: torch.Tensor, start: int, end: int, pattern: SparsityPattern
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sweep columns start..end-1 in place in w_all; returns (mask, scaled errors, loss) of the
    block."""
    w = w_all[:, start:end]  # view [rows, count]: edits land in w_all
    u = u_all[start:end, start:end]  # [count, count]
    diag = torch.diagonal(u)  # [count]
    count = end - start
    err = torch.zeros_like(w)  # [rows, count] (w - q) / U_ii per column
    if pattern.structured:
        mask = torch.zeros_like(w, dtype=torch.bool)
    else:
        mask = global_prune_mask(w * w / (diag * diag).unsqueeze(0), pattern.sparsity)
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    for i in range(count):
        if pattern.structured and i % pattern.m == 0:  # type: ignore[operator]
            group = slice(i, i + pattern.m)  # type: ignore[operator]
            saliency = w[:, group] ** 2 / (diag[group] ** 2).unsqueeze(0)
            mask[:, group] = nm_prune_mask(saliency, pattern.n, pattern.m)  # type: ignore[arg-type]
        col = w[:, i].clone()
        kept = col.masked_fill(mask[:, i], 0)
        e = (col - kept) / diag[i]  # [rows]
        loss += (e.double() ** 2).sum() / 2
        w[:, i:] -= e.unsqueeze(1) * u[i, i:].unsqueeze(0)
        w[:, i] = kept  # exact zeros, not 1e-9 leftovers of the subtraction
        err[:, i] = e
    return mask, err, loss
