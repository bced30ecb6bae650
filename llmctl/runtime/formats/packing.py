"""Shared primitives of the quantized layouts: the unpacked linear and int32 bit packing.

Owns: `UnpackedLinear` (what every format reader returns per quantized linear) and the
`pack_rows` / `unpack_rows` helpers the AWQ and GPTQ layouts use. Widths that divide 32 (2, 4, 8)
pack 32 / b whole fields per word; 3 bits pack densely, 32 values in 3 words with value j at bit
3j of the 96 (two values straddle a word boundary): AutoGPTQ's 3-bit layout, which is also what
compressed-tensors' `pack_to_int32` writes for rows of a multiple of 32. Imports no format module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.errors import ModelLoadError, UsageError
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


def pack_multiple(bits: int) -> int:
    """How many values one packed run holds: 32 / bits when bits divides 32, else 32 (the 32
    values of `bits` words); a packed dimension must be a multiple of it."""
    return 32 // bits if 32 % bits == 0 else 32


def pack_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack along dim 1: values int [R, C] -> int32 [R, C * bits / 32]; for bits dividing 32,
    field i of word j holds column j * per + order[i] (order defaults to 0..per-1, i.e.
    sequential); for other widths the dense layout (see the module docstring)."""
    if 32 % bits:
        return _pack_dense(values, bits)
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
    if 32 % bits:
        return _unpack_dense(packed, bits)
    per = 32 // bits
    order = order or list(range(per))
    shifts = torch.arange(per, dtype=torch.int64) * bits
    fields = (packed.to(torch.int64)[:, :, None] >> shifts) & (
        (1 << bits) - 1
    )  # [R, W, per] field i
    out = torch.empty_like(fields)
    out[:, :, order] = fields  # field i holds column order[i]
    return out.reshape(packed.shape[0], -1).to(torch.int32)


def _pack_dense(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C] (C a multiple of 32) -> int32 [R, C * bits / 32]: value j of each run of 32 at
    bit j * bits of the run's `bits` words, low bits first."""
    R, C = values.shape
    if C % 32:
        raise UsageError(f"cannot pack {C} {bits}-bit values: a multiple of 32 is needed")
    v = values.to(torch.int64).reshape(R, C // 32, 32) & ((1 << bits) - 1)
    words = torch.zeros(R, C // 32, bits + 1, dtype=torch.int64)  # one spill word, dropped
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        words[:, :, word] |= (v[:, :, j] << shift) & 0xFFFFFFFF
        if shift + bits > 32:  # the high bits of a straddling value open the next word
            words[:, :, word + 1] |= v[:, :, j] >> (32 - shift)
    return to_int32(words[:, :, :bits].reshape(R, -1))


def _unpack_dense(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_dense`: int32 [R, W] (W a multiple of bits) -> int32 [R, W * 32 / bits]."""
    R, W = packed.shape
    if W % bits:
        raise ModelLoadError(f"{W} words do not hold whole runs of 32 {bits}-bit values")
    w = (packed.to(torch.int64) & 0xFFFFFFFF).reshape(R, W // bits, bits)
    w = torch.cat([w, torch.zeros_like(w[:, :, :1])], dim=-1)  # [R, runs, bits + 1]
    out = torch.empty(R, W // bits, 32, dtype=torch.int64)
    for j in range(32):
        word, shift = divmod(j * bits, 32)
        out[:, :, j] = ((w[:, :, word] >> shift) | (w[:, :, word + 1] << (32 - shift))) & (
            (1 << bits) - 1
        )
    return out.reshape(R, -1).to(torch.int32)
