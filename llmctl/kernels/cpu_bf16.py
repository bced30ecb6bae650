"""bfloat16 linear layers on CPUs without native bf16 arithmetic (no AVX512-BF16 or AMX).

Owns: the CPU's flags as /proc/cpuinfo lists them (`cpu_flags`, read here for every kernel module),
the rule for when such a CPU lacks bf16 units (`native_bf16`) and `upcast_linear`, which
serves bf16 matmuls of many rows there: it widens the weight to float32 one slab of rows at a time
(a slab stays in cache) and multiplies with the float32 BLAS. PyTorch's own bf16 matmul on these
CPUs ran about 10 GFLOP/s at the engine's shapes; the C kernel (cpu_linear.c, which widens each
tile of weight rows into a small float32 buffer) 37-50 at 16 rows and 55-60 at 32; this path
55-85 from 32 rows up, rising with the row count (1 thread, Qwen2.5-0.5B and SmolLM2 shapes).
Up to 16 rows per thread stay on the C kernel, where widening a whole slab per call costs more
than the BLAS saves.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

PLAIN = (
    torch.Tensor,
    torch.nn.Parameter,
)  # a weight's type unless it is a subclass (sparse, quantized)
SLAB_BYTES = 1 << 20  # float32 bytes of weight widened at a time: about the size of an L2 cache


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The flags of the first CPU in /proc/cpuinfo; empty where there is none (not Linux: unknown,
    so no kernel that needs a flag is used)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """The CPU has bf16 dot-product instructions, so PyTorch's (oneDNN's) bf16 matmul is fast;
    where the flags are unknown widening is correct either way."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def use_upcast(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference on the CPU, bf16 x and plain bf16 weight [N, K], on a CPU without native bf16."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if type(weight) not in PLAIN or weight.dim() != 2:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return not native_bf16()


def slab_rows(k: int) -> int:
    """Weight rows per slab: SLAB_BYTES of float32, a multiple of 16, at least 16."""
    return max(16, SLAB_BYTES // (4 * k) // 16 * 16)


def upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
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
