"""Wanda (Sun et al., 2023): prune by |W_ij| * ||X_j||_2, weight magnitude times input activation
norm.

X_j is input channel j of the linear over all calibration tokens. Weights compete per output row
(unstructured) or within each group of M input columns of a row (N:M); no weight is updated.
"""

from __future__ import annotations

import torch

from llmctl.compress.sparse.masks import SparsityPattern, prune_mask


class InputNormAccumulator:
    """Running sum of squares of each input channel over calibration tokens (O(in_features)
    memory)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.sum_sq = torch.zeros(in_features, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """x: [..., in_features] inputs of the linear (any batch/sequence shape)."""
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        self.sum_sq += (flat * flat).sum(0)
        self.tokens += flat.shape[0]

    def norms(self) -> torch.Tensor:
        """||X_j||_2 per input channel, float32 [in_features]."""
        return self.sum_sq.sqrt().float()


def input_norms_from_hessian(hessian: torch.Tensor) -> torch.Tensor:
    """Per-channel norms up to one common factor, from H = (2/T) X X^T: sqrt(diag H) = sqrt(2/T)
    ||X_j||.

    A factor shared by all channels does not change which weights are lowest, so Wanda can reuse
    the Hessian the calibration driver already accumulates for GPTQ/SparseGPT.
    """
    return torch.diagonal(hessian).clamp_min(0).sqrt().float()


def wanda_scores(weight: torch.Tensor, input_norms: torch.Tensor) -> torch.Tensor:
    """|W| * ||X_j||: weight [out, in], input_norms [in] -> scores [out, in] (float32)."""
    if input_norms.shape != (weight.shape[1],):
        raise ValueError(
            f"input norms {tuple(input_norms.shape)} do not match weight {tuple(weight.shape)}"
        )
    return weight.detach().abs().float() * input_norms.to(weight.device).float().unsqueeze(0)


def wanda_mask(
    weight: torch.Tensor, input_norms: torch.Tensor, pattern: SparsityPattern
) -> torch.Tensor:
    """Bool mask (True = pruned): per output row for unstructured sparsity, per M-group for N:M."""
    return prune_mask(wanda_scores(weight, input_norms), pattern, scope="row")
