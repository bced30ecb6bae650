"""Shared primitives of the quantized layouts: the unpacked linear and int32 bit packing.

Owns: `UnpackedLinear` (what every format reader returns per quantized linear) and the
`pack_rows` / `unpack_rows` helpers the AWQ and GPTQ layouts use, on compressed-tensors'
`pack_to_int32` / `unpack_from_int32`: widths that divide 32 (2, 4, 8) pack 32 / b whole fields
per word; 3 bits pack densely, 32 values in 3 words with value j at bit 3j of the 96 (two values
straddle a word boundary), which is also AutoGPTQ's 3-bit layout for rows of a multiple of 32.
Only the AWQ interleave (a column order) is ours. Imports no format module.
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
    # W8A8: activations quantized per token to int8 at run time (compressed-tensors
    # `int-quantized` with dynamic token-strategy input_activations)
    int8_activations: bool = False

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.g_idx)

    @classmethod
    def from_result(cls, r: QuantResult, bias: torch.Tensor | None = None) -> "UnpackedLinear":
        return cls(
            r.codes, r.scales, r.zeros, r.group_index(), r.spec.bits, r.spec.group_size, bias
        )


def pack_multiple(bits: int) -> int:
    """How many values one packed run holds: 32 / bits when bits divides 32, else 32 (the 32
    values of `bits` words); a packed dimension must be a multiple of it."""
    return 32 // bits if 32 % bits == 0 else 32


def pack_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack along dim 1: values int [R, C] in [0, 2^bits) -> int32 [R, C * bits / 32], with
    compressed-tensors' `pack_to_int32` (value j of a row at bit j * bits, low bits first).
    order: the AWQ interleave, the one thing here no library exposes: field i of word j holds
    column j * per + order[i] (a permutation of each run of per = 32 / bits columns)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    R, C = values.shape
    per = pack_multiple(bits)
    if C % per and 32 % bits:
        raise UsageError(f"cannot pack {C} {bits}-bit values: a multiple of 32 is needed")
    if C % per:
        raise UsageError(f"cannot pack {C} values in int32 words of {per}")
    v = values.to(torch.int64) & ((1 << bits) - 1)
    if order is not None:
        v = v.reshape(R, C // per, per)[:, :, order].reshape(R, C)
    # pack_to_int32 takes signed codes (it adds 2^(bits-1) back before packing)
    return pack_to_int32((v - (1 << (bits - 1))).to(torch.int8), bits)


def unpack_rows(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 [R, W] -> int32 [R, W * 32 / bits] (compressed-tensors'
    `unpack_from_int32`, then the AWQ interleave undone)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    R, W = packed.shape
    if 32 % bits and W % bits:
        raise ModelLoadError(f"{W} words do not hold whole runs of 32 {bits}-bit values")
    C = W * 32 // bits
    v = unpack_from_int32(packed.to(torch.int32), bits, torch.Size((R, C))).to(torch.int32)
    v = v + (1 << (bits - 1))
    if order is None:
        return v
    per = pack_multiple(bits)
    out = torch.empty_like(v).reshape(R, C // per, per)
    out[:, :, order] = v.reshape(R, C // per, per)  # field i holds column order[i]
    return out.reshape(R, C)
