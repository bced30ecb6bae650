"""Second-order statistics of a linear layer's inputs, shared by GPTQ and SparseGPT.

Owns: `HessianAccumulator` (H = 2 X X^T averaged over tokens, accumulated batch by batch) and
`damped_cholesky_inverse`, the dampened upper Cholesky factor of H^-1 both methods walk column
by column.

Stable API (imported by llmctl/compress/sparse):
    damped_cholesky_inverse(H: Tensor [n, n], dampening: float = 0.01) -> Tensor [n, n]
        Returns U, upper triangular, with U^T U = (H' + d I)^-1 where H' is H with zero diagonal
        entries ("dead" inputs that never fired) replaced by 1 and d = dampening * mean(diag(H')).
        If the Cholesky factorisation fails, d is multiplied by 10 and retried (up to
        MAX_DAMP_RETRIES times, each logged as a warning); then it raises LlmctlError. It never
        falls back to another method. The caller should zero the weight columns of dead inputs
        (`dead_inputs(H)`) before using U. Input H is not modified; U is float32.
"""

from __future__ import annotations

import logging

import torch

from llmctl.errors import LlmctlError

log = logging.getLogger(__name__)

MAX_DAMP_RETRIES = 6


class HessianAccumulator:
    """Running H = (2 / n) * sum_t x_t x_t^T over all n tokens seen; `add` takes x [..., in]."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.num_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)  # [tokens, in]
        m = x.shape[0]
        if m == 0:
            return
        total = self.num_tokens + m
        # rescale the old average instead of summing, so H stays O(1) in magnitude for any n
        self.H.mul_(self.num_tokens / total)
        x = x * (2.0 / total) ** 0.5
        self.H.addmm_(x.t(), x)
        self.num_tokens = total


def dead_inputs(H: torch.Tensor) -> torch.Tensor:
    """Bool [in]: inputs whose diagonal entry is zero (never active in the calibration data)."""
    return torch.diag(H) == 0


def damped_cholesky_inverse(H: torch.Tensor, dampening: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor of the dampened inverse Hessian; see the module docstring."""
    H = H.detach().to(torch.float32).clone()
    n = H.shape[0]
    dead = dead_inputs(H)
    H[dead, dead] = 1.0
    idx = torch.arange(n, device=H.device)
    mean_diag = torch.diag(H).mean()
    damp_frac = dampening
    for attempt in range(MAX_DAMP_RETRIES + 1):
        Hd = H.clone()
        Hd[idx, idx] += damp_frac * mean_diag
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0 and torch.isfinite(U).all():
                return U
        if attempt < MAX_DAMP_RETRIES:
            log.warning(
                "Hessian not positive definite with dampening %.3g; retrying with %.3g",
                damp_frac,
                damp_frac * 10,
            )
            damp_frac *= 10
    raise LlmctlError(
        f"Cholesky factorisation failed even with dampening {damp_frac:g} of the mean diagonal; "
        "use more or more varied calibration data"
    )
