"""bfloat16 linear layers on AMX tiles (cpu_linear_amx.c), over weights packed into the tile layout.

Owns: whether this CPU runs the kernel (`amx_bf16` in /proc/cpuinfo, the kernel built, Linux's
permission for the tile state, asked once), building and loading it as its own small library (a
failure loses only this kernel, warned once), `pack` (a weight [N, K] into the tile layout, a
copy of the same size) and `linear`, the tensor-level call. Which row counts it serves is the
autotuner's choice (kernels/autotune.py, candidate "amx"): where the CPU lacks AMX it is never
timed, so the other kernels stay in place.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmctl.kernels import cpu_bf16, cpu_dpbf16, cpu_native

SOURCE = Path(__file__).with_name("cpu_linear_amx.c")
FLAGS = ("amx_bf16", "amx_tile")
ALIGN = 32  # N and K: multiples of this (tile pairs of 16 columns, tiles of 32 K)


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """The CPU executes AMX-BF16 tiles and AVX512-BF16 (which the AMX kernels use beside them),
    by /proc/cpuinfo; Linux's permission is each kernel's own probe."""
    return cpu_dpbf16.cpu_has_dpbf16() and set(FLAGS) <= cpu_bf16.cpu_flags()


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel; None where the CPU lacks AMX-BF16 (or AVX512-BF16, used for the output),
    native kernels are disabled, the build fails (warned once) or Linux refuses the tile state."""
    if not (cpu_native.enabled() and cpu_has_amx()):
        return None
    lib = cpu_native.load(SOURCE, "AMX linear kernel")
    if lib is None:
        return None
    if not lib.linear_amx_built() or not lib.linear_amx_available():
        return None
    lib.amx_pack_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.amx_pack_bf16.restype = None
    lib.linear_amx_bf16.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64] * 4
        + [ctypes.c_int]
    )
    lib.linear_amx_bf16.restype = ctypes.c_int
    return lib


def applies(weight: torch.Tensor) -> bool:
    """Whether the kernel can serve this weight [N, K] on this CPU."""
    return (
        weight.dtype is torch.bfloat16
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.shape[0] % ALIGN == 0
        and weight.shape[1] % ALIGN == 0
        and weight.shape[1] > 0
        and library() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] -> its tile layout (same size, see cpu_linear_amx.c); None where `applies`
    does not hold."""
    if not applies(weight):
        return None
    w = weight.detach().contiguous()
    out = torch.empty_like(w)
    library().amx_pack_bf16(w.data_ptr(), out.data_ptr(), *w.shape)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """x [..., K] bf16 -> x W^T (+ bias) [..., N] bf16, W packed by `pack`. x's rows need unit
    stride (any row stride)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        bias = bias.to(torch.bfloat16).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        failed = library().linear_amx_bf16(
            x2.data_ptr(), x2.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k,
            torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("AMX linear: out of memory for its scratch")
    return y.view(*x.shape[:-1], n)
