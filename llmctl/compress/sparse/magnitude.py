"""Magnitude pruning: zero the weights of smallest absolute value; needs no calibration data."""

from __future__ import annotations

import torch

from llmctl.compress.sparse.masks import SparsityPattern, prune_mask


def magnitude_mask(
    weight: torch.Tensor, pattern: SparsityPattern, scope: str = "layer"
) -> torch.Tensor:
    """Bool mask (True = pruned) over weight [out, in] by |W|.

    N:M patterns choose within each group of M input columns; unstructured sparsity compares the
    whole layer (`scope="layer"`, the classic baseline) or each output row (`scope="row"`).
    """
    return prune_mask(weight.detach().abs().float(), pattern, scope)
