"""The bf16 dot-product linear kernel (cpu_linear_dpbf16.c, AVX512-BF16 `vdpbf16ps`).

Owns: whether this CPU has the instructions (`cpu_has_dpbf16`, by cpu_bf16.cpu_flags), building and
loading the kernel as its own small library (a failure loses only this kernel, warned once), and
`linear`, its tensor-level wrapper. `applies` says whether it can serve a call; which row counts
it serves is the autotuner's choice (kernels/autotune.py): it is never called where the CPU lacks
the flags, so the existing paths stay the fallback everywhere else.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmctl.kernels import cpu_bf16, cpu_native

SOURCE = Path(__file__).with_name("cpu_linear_dpbf16.c")
FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_dpbf16() -> bool:
    """The CPU executes AVX512-BF16 (and the AVX-512 subsets the kernel's loads need)."""
    return set(FLAGS) <= cpu_bf16.cpu_flags()


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel; None where the CPU lacks the flags, native kernels are disabled, or the
    build fails (warned once)."""
    if not (cpu_native.enabled() and cpu_has_dpbf16()):
        return None
    lib = cpu_native.load(SOURCE, "bf16 dot-product kernel")
    if lib is None:
        return None
    if not lib.linear_dpbf16_built():  # the compiler lacked the intrinsics
        return None
    lib.linear_dpbf16.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.linear_dpbf16.restype = None
    return lib


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` can serve x @ weight^T: inference on the CPU, bf16 x and a plain bf16
    weight [N, K], the CPU's AVX512-BF16 and the kernel built."""
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or not x.is_cpu:
        return False
    if type(weight) not in cpu_bf16.PLAIN or weight.dim() != 2:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for bf16 x [..., K] and weight [N, K]; returns bf16 [..., N]
    (float32 sums, rounded once). Call only where `applies(x, weight)`."""
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
        library().linear_dpbf16(
            xf.data_ptr(),
            xf.stride(0),
            w.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            torch.get_num_threads(),
        )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
