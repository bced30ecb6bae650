"""Quantization settings and results shared by every method and format.

Owns: `QuantSpec` (bits, group size or per channel, symmetry, scale storage dtype), `QuantResult`
(integer codes, scales, zeros, optional act-order `g_idx`, dequantized weight) and the one
`--group-size` rule that quantize, recipes and `profile --estimate` share: `parse_group_size`
(auto, channel, or a power of two of at least 16) and `resolve_group_size` (auto picks 128, else
the largest of 64 and 32 that divides every layer's input width, else per channel; an explicit
size that does not divide a layer is refused, naming the sizes that work).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from llmctl.errors import UsageError

CANDIDATE_GROUP_SIZES = (16, 32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 128
AUTO_GROUP_SIZES = (128, 64, 32)  # what auto tries, in order (all run on vLLM's Marlin kernels)
MIN_GROUP_SIZE = 16
BITS = (2, 3, 4, 8)
BITS_TEXT = "2, 3, 4 or 8"  # for messages
GROUP_SIZE_RULE = "auto, channel, or a power of two of at least 16 (32, 64, 128, ...)"


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int | None = 128  # None: per channel (one group spanning each row)
    symmetric: bool = True
    # Scales are rounded to this dtype as soon as they are computed, so the integer codes are
    # exactly the ones a checkpoint storing scales in this dtype reproduces.
    scale_dtype: torch.dtype = torch.float16
    # W8A8 (`--scheme w8a8`): the consumer also quantizes each token's activations to int8 at
    # run time (dynamic, symmetric); the weights are 8-bit symmetric per channel
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise UsageError(f"--bits must be {BITS_TEXT}, not {self.bits}")
        if self.group_size is not None and self.group_size <= 0:
            raise UsageError(f"--group-size must be positive, not {self.group_size}")

    def for_width(self, layer: str, in_features: int) -> "QuantSpec":
        """This spec with the concrete group size of a layer of `in_features` inputs (its whole
        width per channel); refuses a group size that does not divide it."""
        if self.group_size is None:
            return replace(self, group_size=in_features)
        check_group_size(layer, in_features, self.group_size)
        return self

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        return 1 << (self.bits - 1)


@dataclass
class QuantResult:
    """One quantized linear weight [out, in].

    codes: int32 [out, in] in [0, maxq]; scales: float32 [out, in/group];
    zeros: int32 [out, in/group]; g_idx: int32 [in] (group of each input column; None means
    column // group_size);
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


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """(codes - zeros[:, g_idx]) * scales[:, g_idx] in float32; codes [out, in], scales/zeros
    [out, groups]."""
    g = g_idx.long()
    return (codes.float() - zeros.float()[:, g]) * scales.float()[:, g]


def check_group_size(layer: str, in_features: int, group_size: int) -> None:
    """Raise a one-line UsageError when `group_size` does not divide `in_features`."""
    if in_features % group_size == 0:
        return
    ok = [g for g in CANDIDATE_GROUP_SIZES if in_features % g == 0]
    hint = (
        f"group sizes that work: {', '.join(map(str, ok))}"
        if ok
        else "no common group size divides it"
    )
    raise UsageError(
        f"{layer}: {in_features} input features are not a multiple of --group-size {group_size}; "
        f"{hint}"
    )


def working_group_sizes(in_features: list[int]) -> list[int]:
    """Candidate group sizes that divide every width in `in_features`."""
    return [g for g in CANDIDATE_GROUP_SIZES if all(n % g == 0 for n in in_features)]


def parse_group_size(value: object) -> int | str:
    """--group-size as given: "auto", "channel" or a power of two >= 16; else UsageError."""
    text = str(value).strip().lower()
    if text in ("auto", "channel"):
        return text
    g = int(text) if re.fullmatch(r"\d+", text) else 0
    if isinstance(value, bool) or g < MIN_GROUP_SIZE or g & (g - 1):
        raise UsageError(f"--group-size takes {GROUP_SIZE_RULE}; got {value!r}")
    return g


def resolve_group_size(
    value: object, widths: list[tuple[str, int]], *, channel_format: str | None = None
) -> tuple[int | None, str | None]:
    """(group size, or None for per channel; a note when auto did not pick 128) for linears with
    these (name, input width)s. channel_format: a format that cannot store per-channel scales."""
    g = parse_group_size(value)
    if g == "channel" and channel_format:
        raise UsageError(
            f"--format {channel_format} stores groups only; --group-size channel "
            "needs --format compressed-tensors or gptq"
        )
    if g == "channel":
        return None, None
    if g != "auto":
        bad = [(n, k) for n, k in widths if k % int(g)]
        if bad:
            ok = working_group_sizes([k for _, k in widths])
            hint = (
                f"group sizes that work for every layer: {', '.join(map(str, ok))}"
                if ok
                else "no power-of-two group size fits every layer"
            ) + " (or auto, channel)"
            raise UsageError(
                f"{bad[0][0]}: {bad[0][1]} input features are not a multiple of "
                f"--group-size {g} ({len(bad)} layers affected); {hint}"
            )
        return int(g), None
    fits = [c for c in AUTO_GROUP_SIZES if all(k % c == 0 for _, k in widths)]
    if fits and fits[0] == DEFAULT_GROUP_SIZE:
        return fits[0], None
    name, k = next((n, k) for n, k in widths if k % DEFAULT_GROUP_SIZE)
    why = f"{DEFAULT_GROUP_SIZE} does not divide the {k} input columns of {name}"
    if fits:
        return fits[0], f"--group-size auto chose {fits[0]}: {why}"
    if channel_format:
        sizes = ", ".join(map(str, AUTO_GROUP_SIZES))
        raise UsageError(
            f"--group-size auto: no group size of {sizes} divides every layer ({why}) "
            f"and --format {channel_format} cannot store per-channel scales; "
            "use --format compressed-tensors or gptq, or --ignore"
        )
    others = " or ".join(map(str, AUTO_GROUP_SIZES[1:]))
    return None, f"--group-size auto chose per-channel scales: {why}, nor does {others}"
