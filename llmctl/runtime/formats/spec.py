"""Quantization settings and results shared by every method and format.

Owns: `QuantSpec` (bits, group size, symmetry, scale storage dtype), `QuantResult` (integer codes,
scales, zeros, optional act-order `g_idx`, dequantized weight) and the group-size check that
refuses layers whose input width the group size does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.errors import UsageError

CANDIDATE_GROUP_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    # Scales are rounded to this dtype as soon as they are computed, so the integer codes are
    # exactly the ones a checkpoint storing scales in this dtype reproduces.
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise UsageError(f"--bits must be 4 or 8, not {self.bits}")
        if self.group_size <= 0:
            raise UsageError(f"--group-size must be positive, not {self.group_size}")

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        return 1 << (self.bits - 1)


@dataclass
class QuantResult:
    """One quantized linear weight [out, in].

    codes: int32 [out, in] in [0, maxq]; scales: float32 [out, in/group]; zeros: int32 [out, in/group];
    g_idx: int32 [in] (group of each input column; None means column // group_size);
    weight: float32 [out, in], exactly (codes - zeros[:, g_idx]) * scales[:, g_idx].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    weight: torch.Tensor
    spec: QuantSpec
    g_idx: torch.Tensor | None = None

    def group_index(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx
        cols = self.codes.shape[1]
        return torch.arange(cols, dtype=torch.int32) // self.spec.group_size


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """(codes - zeros[:, g_idx]) * scales[:, g_idx] in float32; codes [out, in], scales/zeros [out, groups]."""
    g = g_idx.long()
    return (codes.float() - zeros.float()[:, g]) * scales.float()[:, g]


def check_group_size(layer: str, in_features: int, group_size: int) -> None:
    """Raise a one-line UsageError when `group_size` does not divide `in_features`."""
    if in_features % group_size == 0:
        return
    ok = [g for g in CANDIDATE_GROUP_SIZES if in_features % g == 0]
    hint = f"group sizes that work: {', '.join(map(str, ok))}" if ok else "no common group size divides it"
    raise UsageError(f"{layer}: {in_features} input features are not a multiple of --group-size {group_size}; {hint}")


def working_group_sizes(in_features: list[int]) -> list[int]:
    """Candidate group sizes that divide every width in `in_features`."""
    return [g for g in CANDIDATE_GROUP_SIZES if all(n % g == 0 for n in in_features)]
