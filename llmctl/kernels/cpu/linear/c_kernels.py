"""The C linear kernels: tensor-level wrappers over csrc/cpu_linear.c, cpu_linear_dpbf16.c and
cpu_linear_amx.c.

Owns: `SOURCES` (every C file and header these kernels are compiled from: the autotuner's cache
key hashes them, so editing any of them re-times), and per kernel whether it can serve a weight
(`*_applies`) and its call: `native` (float32 or bf16 weights, float32 sums in a fixed order: 8
lanes along K, summed by `hsum`, whatever the rows, tiles and threads, which batch-invariant mode
relies on), `dpbf16` (bf16, AVX512-BF16) and `amx` (bf16 on AMX tiles, over `amx_pack`'s copy).
"""

from __future__ import annotations

import functools

import torch

from llmctl.kernels.cpu.features import has_amx, has_dpbf16
from llmctl.kernels.cpu.library import CSRC, load

SOURCES = tuple(
    CSRC / n
    for n in ("cpu_linear.c", "cpu_vec.h", "cpu_linear_dpbf16.c", "cpu_linear_amx.c", "cpu_amx.h")
)
PLAIN = (torch.Tensor, torch.nn.Parameter)  # a weight's type unless a subclass (sparse, quantized)
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
AMX_ALIGN = 32  # N and K: multiples of this (tile pairs of 16 columns, tiles of 32 K)


def grad_free(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def native_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `native` can compute x @ weight^T at all, whatever the row count: inference on the
    CPU, a plain float32/bfloat16 weight [N, K] of x's dtype, K % 8 == 0, the kernels built."""
    dtype = weight.dtype
    if x.dtype is not dtype or dtype not in NATIVE_DTYPES or not x.is_cpu:
        return False
    if type(weight) not in PLAIN or weight.dim() != 2 or weight.shape[1] % 8:
        return False
    return grad_free(x, weight) and load("core") is not None


def native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K] float32 or bfloat16, on the CPU;
    returns [..., N] in x's dtype. Call only where `native_applies(x, weight)`."""
    # Each tensor op here costs about a microsecond and this runs ~200 times per decode step, so
    # conversions and copies happen only where needed.
    n, k = weight.shape
    xf = x if x.dim() == 2 else x.reshape(-1, k)
    if xf.dtype is not torch.float32:
        xf = xf.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if bias is not None:
        bias = bias.detach().float().contiguous()
    m = xf.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        load("core").linear(
            xf.data_ptr(), k, w.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), m, n, k, int(w.dtype is torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], n)
    return out if x.dtype is torch.float32 else out.to(x.dtype)


@functools.cache
def dpbf16_library():
    """The dot-product kernel's library; None where the CPU lacks AVX512-BF16 or the compiler the
    intrinsics."""
    lib = load("linear_dpbf16") if has_dpbf16() else None
    return lib if lib is not None and lib.linear_dpbf16_built() else None


def dpbf16_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference on the CPU, bf16 x and a plain bf16 weight [N, K], the kernel built."""
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or not x.is_cpu:
        return False
    if type(weight) not in PLAIN or weight.dim() != 2:
        return False
    return grad_free(x, weight) and dpbf16_library() is not None


def dpbf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 x [..., K] and weight [N, K]; returns bf16 [..., N] (float32 sums,
    rounded once). Call only where `dpbf16_applies(x, weight)`."""
    n, k = weight.shape
    xf = x if x.dim() == 2 else x.reshape(-1, k)
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.bfloat16).contiguous()
    m = xf.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    if m and n:
        dpbf16_library().linear_dpbf16(
            xf.data_ptr(), xf.stride(0), w.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), m, n, k, torch.get_num_threads(),
        )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


@functools.cache
def amx_library():
    """The AMX kernel's library; None where the CPU lacks AMX-BF16 (or AVX512-BF16, used for the
    output), the build fails or Linux refuses the tile state."""
    lib = load("linear_amx") if has_amx() else None
    if lib is None or not lib.linear_amx_built() or not lib.linear_amx_available():
        return None
    return lib


def amx_applies(weight: torch.Tensor) -> bool:
    """Whether the AMX kernel can serve this weight [N, K] on this CPU."""
    return (
        weight.dtype is torch.bfloat16
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.shape[0] % AMX_ALIGN == 0
        and weight.shape[1] % AMX_ALIGN == 0
        and weight.shape[1] > 0
        and amx_library() is not None
    )


def amx_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] -> its tile layout (same size, see cpu_linear_amx.c); None where
    `amx_applies` does not hold."""
    if not amx_applies(weight):
        return None
    w = weight.detach().contiguous()
    out = torch.empty_like(w)
    amx_library().amx_pack_bf16(w.data_ptr(), out.data_ptr(), *w.shape)
    return out


def amx(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """x [..., K] bf16 -> x W^T (+ bias) [..., N] bf16, W packed by `amx_pack`. x's rows need
    unit stride (any row stride)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        bias = bias.to(torch.bfloat16).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        failed = amx_library().linear_amx_bf16(
            x2.data_ptr(), x2.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("AMX linear: out of memory for its scratch")
    return y.view(*x.shape[:-1], n)
