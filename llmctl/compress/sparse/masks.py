"""Sparsity patterns (N:M or unstructured) and the mask helpers every pruning method shares.

A mask is a bool tensor shaped like the weight [out_features, in_features]; True = pruned.
N:M follows NVIDIA's spelling: "2:4" keeps at most 2 non-zeros in every group of 4 consecutive
input columns of a row (so at least 2 zeros), "4:8" keeps at most 4 of 8. Both are 50% sparse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from llmctl.errors import UsageError


@dataclass(frozen=True)
class SparsityPattern:
    """What to prune: `n`:`m` (keep n of every m) or an unstructured fraction `sparsity`."""

    sparsity: float  # fraction of zeros aimed for (n:m -> 1 - n/m)
    n: int | None = None  # weights kept per group; None for unstructured
    m: int | None = None  # group width along the input dimension; None for unstructured

    @property
    def structured(self) -> bool:
        return self.m is not None

    @property
    def zeros_per_group(self) -> int:
        if self.m is None or self.n is None:
            raise ValueError("unstructured pattern has no groups")
        return self.m - self.n

    def label(self) -> str:
        """`2:4` or `unstructured-50%`, as written to config.json and reports."""
        if self.structured:
            return f"{self.n}:{self.m}"
        return f"unstructured-{self.sparsity * 100:g}%"

    def fits(self, in_features: int) -> bool:
        """Whether a layer with this many input columns can take the pattern (whole groups only)."""
        return self.m is None or in_features % self.m == 0


_NM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
MAX_GROUP = 128  # the default SparseGPT block: every allowed M divides it
PATTERN_RULE = f"N:M needs 0 < N < M and M a power of two up to {MAX_GROUP} (usually 2:4 or 4:8)"


def parse_pattern(pattern: str | None, sparsity: float | None) -> SparsityPattern:
    """Turn `--pattern 2:4` or `--sparsity 0.5` into a pattern; one of the two, default 2:4."""
    if pattern is not None and sparsity is not None:
        raise UsageError("give either --pattern N:M or --sparsity FRACTION, not both")
    if sparsity is not None:
        if not 0.0 < sparsity < 1.0:
            raise UsageError(f"--sparsity must be between 0 and 1 (exclusive), got {sparsity}")
        return SparsityPattern(sparsity=float(sparsity))
    text = "2:4" if pattern is None else pattern
    match = _NM.match(text)
    if not match:
        raise UsageError(f"--pattern must look like N:M (for example 2:4 or 4:8), got {text!r}")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m or m & (m - 1) or m > MAX_GROUP:
        raise UsageError(f"--pattern {text} is not allowed: {PATTERN_RULE}")
    return SparsityPattern(sparsity=1.0 - n / m, n=n, m=m)


def nm_prune_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """In every group of `m` consecutive columns of every row, prune the m-n lowest scores.

    scores: [rows, cols] with cols % m == 0 (higher = more important). Returns bool [rows, cols].
    """
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(f"{cols} columns are not a multiple of the group width {m}")
    groups = scores.reshape(rows, cols // m, m)  # [rows, groups, m]
    lowest = torch.topk(groups, m - n, dim=-1, largest=False).indices  # [rows, groups, m-n]
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(-1, lowest, True)
    return mask.reshape(rows, cols)


def row_prune_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Prune the round(cols * sparsity) lowest scores of each row (Wanda's per-output comparison
    group)."""
    rows, cols = scores.shape
    k = int(round(cols * sparsity))
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k > 0:
        mask.scatter_(1, torch.topk(scores, k, dim=1, largest=False).indices, True)
    return mask


def global_prune_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Prune the round(numel * sparsity) lowest scores of the whole tensor (exactly that many, ties
    included)."""
    k = int(round(scores.numel() * sparsity))
    flat = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if k > 0:
        flat[torch.topk(scores.flatten(), k, largest=False).indices] = True
    return flat.reshape(scores.shape)


def prune_mask(scores: torch.Tensor, pattern: SparsityPattern, scope: str = "row") -> torch.Tensor:
    """Mask for `pattern` from importance scores; unstructured masks compare per `row` or
    `layer`."""
    if pattern.structured:
        return nm_prune_mask(scores, pattern.n, pattern.m)  # type: ignore[arg-type]
    if scope == "row":
        return row_prune_mask(scores, pattern.sparsity)
    if scope == "layer":
        return global_prune_mask(scores, pattern.sparsity)
    raise ValueError(f"unknown scope {scope!r} (row or layer)")


def apply_mask(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` with the masked entries set to exactly zero."""
    return weight.masked_fill(mask, 0)


def zero_fraction(weight: torch.Tensor) -> float:
    """Fraction of entries that are exactly zero."""
    return float((weight == 0).sum().item()) / max(1, weight.numel())


def mask_of(weight: torch.Tensor) -> torch.Tensor:
    """The pruning mask a sparsified weight carries: True where it is exactly zero."""
    return weight == 0
