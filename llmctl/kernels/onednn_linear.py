"""oneDNN-packed weights for CPU matmuls (PyTorch's mkldnn ops): the weight is reordered once into
oneDNN's blocked layout, so each call skips the reorder that a plain linear pays per call.

Owns: packing a float32 or bfloat16 weight [N, K] and multiplying by it. Measured on an AVX2 CPU,
1 thread, for the float32 vocabulary projection (the widest matmul of a decode step): 1.3-2x plain
`F.linear` at 16-256 rows, but about 15% slower at 1 row, where the step is memory-bound; callers
keep the plain weight for few rows (and the autotuner, kernels/autotune.py, times both). Returns
None where PyTorch was built without oneDNN.
"""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 64  # the batch size oneDNN tunes the layout for; any row count works afterwards


PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` may pack this weight (a plain 2-D CPU tensor of a packable dtype)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKABLE
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] float32 or bfloat16 on the CPU -> an opaque packed tensor, or None when not
    available."""
    if not can_pack(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):  # an op missing or refused in this build of PyTorch
        return None


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] in the packed weight's dtype -> x @ W^T (+ bias) [M, N], W packed by
    `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
