"""Shared primitives of the quantized layouts: the unpacked linear and int32 bit packing.

Owns: `UnpackedLinear` (what every format reader returns per quantized linear) and the
`pack_rows` / `unpack_rows` helpers the AWQ and GPTQ layouts use. Imports no format module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.errors import UsageError
from llmctl.runtime.formats.spec import QuantResult, dequantize


@dataclass
class UnpackedLinear:
    """One quantized linear as stored: codes int32 [out, in] in [0, 2^bits), scales float32
    [out, groups], zeros int32 [out, groups], g_idx int32 [in] (group of each input column)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    bias: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.g_idx)

    @classmethod
    def from_result(cls, r: QuantResult, bias: torch.Tensor | None = None) -> "UnpackedLinear":
        return cls(
            r.codes, r.scales, r.zeros, r.group_index(), r.spec.bits, r.spec.group_size, bias
        )


def to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bits (two's complement wrap)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack along dim 1: values int [R, C] -> int32 [R, C * bits / 32]; field i of word j holds
    column j * per + order[i] (order defaults to 0..per-1, i.e. sequential)."""
    per = 32 // bits
    R, C = values.shape
    if C % per:
        raise UsageError(f"cannot pack {C} values in int32 words of {per}")
    order = order or list(range(per))
    v = values.to(torch.int64).reshape(R, C // per, per)[:, :, order] & ((1 << bits) - 1)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return to_int32((v << shifts).sum(dim=-1))


def unpack_rows(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 [R, W] -> int32 [R, W * 32 / bits]."""
    per = 32 // bits
    order = order or list(range(per))
    shifts = torch.arange(per, dtype=torch.int64) * bits
    fields = (packed.to(torch.int64)[:, :, None] >> shifts) & (
        (1 << bits) - 1
    )  # [R, W, per] field i
    out = torch.empty_like(fields)
    out[:, :, order] = fields  # field i holds column order[i]
    return out.reshape(packed.shape[0], -1).to(torch.int32)
