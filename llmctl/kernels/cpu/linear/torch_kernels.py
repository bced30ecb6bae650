"""The PyTorch linear kernels beside F.linear: bf16 widened to float32 for the float32 BLAS, and
oneDNN's packed weights.

Owns: `upcast` (with `use_upcast`): bf16 matmuls of many rows on CPUs without native bf16 (no
AVX512-BF16 or AMX), the weight widened to float32 one slab of rows at a time (a slab stays in
cache) and multiplied with the float32 BLAS. PyTorch's own bf16 matmul on these CPUs ran about 10
GFLOP/s at the engine's shapes; the C kernel (cpu_linear.c) 37-50 at 16 rows and 55-60 at 32;
this path 55-85 from 32 rows up, rising with the row count (1 thread, Qwen2.5-0.5B and SmolLM2
shapes). And `pack_weight`/`packed`: the weight reordered once into oneDNN's blocked layout, so
each call skips the reorder a plain linear pays per call (1.3-2x F.linear at 16-256 rows for the
float32 vocabulary projection, about 15% slower at 1 row; AVX2, 1 thread). None where PyTorch
was built without oneDNN.
"""

from __future__ import annotations

import torch

from llmctl.kernels.cpu.features import native_bf16
from llmctl.kernels.cpu.linear.c_kernels import PLAIN, grad_free

SLAB_BYTES = 1 << 20  # float32 bytes of weight widened at a time: about the size of an L2 cache
PACK_ROWS_HINT = 64  # the batch size oneDNN tunes the layout for; any row count works afterwards
PACKABLE = (torch.float32, torch.bfloat16)


def use_upcast(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference on the CPU, bf16 x and plain bf16 weight [N, K], on a CPU without native bf16."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if type(weight) not in PLAIN or weight.dim() != 2:
        return False
    return grad_free(x, weight) and not native_bf16()


def slab_rows(k: int) -> int:
    """Weight rows per slab: SLAB_BYTES of float32, a multiple of 16, at least 16."""
    return max(16, SLAB_BYTES // (4 * k) // 16 * 16)


def upcast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for bf16 x [..., K] and weight [N, K], computed in float32 (as the
    C kernel does) and returned in bf16 [..., N]."""
    n, k = weight.shape
    lead = x.shape[:-1]
    xt = x.reshape(-1, k).float().t()  # [K, M]
    w = weight.detach()
    rows = slab_rows(k)
    slab = torch.empty(min(rows, n), k)
    out_t = torch.empty(n, xt.shape[1])  # [N, M]: each slab's product is a contiguous block of rows
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        part = slab[: n1 - n0]
        part.copy_(w[n0:n1])
        torch.mm(part, xt, out=out_t[n0:n1])
    out = out_t.t()
    if bias is not None:
        out = out + bias.detach().float()
    return out.to(torch.bfloat16, memory_format=torch.contiguous_format).reshape(*lead, n)


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


def packed(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, K] in the packed weight's dtype -> x @ W^T (+ bias) [M, N], W packed by
    `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
