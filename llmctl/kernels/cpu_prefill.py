"""Causal prefill attention in bfloat16 (kernels/cpu_prefill_attention.c): AMX tiles or AVX512-BF16.

Owns: building and loading that kernel (through cpu_native.build, the same cache and rules),
which of its two modes this CPU runs (`mode`), whether it can serve a chunk (`supports`), and the
tensor-level call `prefill_attention`. Mode "amx" where the CPU has AMX-BF16 and Linux grants the
process its tile state (asked once); mode "dpbf16" (`vdpbf16ps` on zmm registers) where it has
AVX512-BF16 only. Elsewhere, with no compiler, or with LLMCTL_NATIVE_KERNELS=0 or
LLMCTL_PREFILL_ATTENTION=sdpa, `available()` is False and chunk_attention keeps PyTorch's SDPA,
which the tests compare against. LLMCTL_PREFILL_ATTENTION=dpbf16 skips AMX where both exist.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from llmctl.kernels import cpu_dpbf16, cpu_native

SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")


MODES = ("amx", "dpbf16")


@functools.cache
def _loaded() -> tuple[ctypes.CDLL, str] | None:
    """The library and the mode it runs here; None where neither mode can."""
    wanted = os.environ.get("LLMCTL_PREFILL_ATTENTION", "auto")
    if not cpu_native.enabled() or wanted == "sdpa" or not cpu_dpbf16.cpu_has_dpbf16():
        return None
    lib = cpu_native.load(SOURCE, "bf16 prefill attention")
    if lib is None:
        return None
    lib.prefill_amx_available.restype = lib.prefill_dpbf16_available.restype = ctypes.c_int
    if not lib.prefill_dpbf16_available():  # the compiler lacked the AVX512-BF16 intrinsics
        return None
    fn = lib.prefill_attention_bf16
    fn.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64] * 2
        + [ctypes.c_int] * 3
        + [ctypes.c_int64] * 6
        + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    )
    fn.restype = ctypes.c_int
    # AMX only when asked for or left to us, and granted (the probe asks Linux for tile state).
    amx = wanted in ("auto", "amx") and lib.prefill_amx_available()
    return lib, "amx" if amx else "dpbf16"


def mode() -> str | None:
    """ "amx", "dpbf16", or None where chunk_attention keeps SDPA."""
    loaded = _loaded()
    return None if loaded is None else loaded[1]


def available() -> bool:
    return _loaded() is not None


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether prefill_attention can serve q [Tq, heads, D], k [L, kv_heads, D]: bfloat16 on the
    CPU, D % 64 == 0, heads a multiple of kv_heads, no gradients, the kernel available."""
    if q.dtype is not torch.bfloat16 or k.dtype is not torch.bfloat16 or not q.is_cpu:
        return False
    if q.shape[-1] % 64 or q.shape[1] % k.shape[1]:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    return available()


def prefill_attention(
    q: torch.Tensor,  # [Tq, heads, D] bf16: positions nc .. nc + Tq - 1
    k: torch.Tensor,  # [nc + Tq, kv_heads, D] bf16: every key the chunk sees
    v: torch.Tensor,
    num_computed: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the chunk over its prefix and itself; returns [Tq, heads, D] bf16.
    Any strides with a contiguous last dimension. Call only where `supports(q, k)`."""
    tq, heads, d = q.shape
    if k.shape[0] != num_computed + tq or v.shape != k.shape:
        raise ValueError(f"prefill_attention: {tuple(k.shape)} keys for {num_computed} + {tq}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(tq, heads, d, dtype=q.dtype)
    lib, how = _loaded()
    failed = lib.prefill_attention_bf16(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        tq,
        num_computed,
        heads,
        k.shape[1],
        d,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        torch.get_num_threads(),
        how == "amx",
    )
    if failed == 2:
        raise ValueError(f"prefill_attention: head_dim {d}, {heads} heads over {k.shape[1]}")
    if failed:
        raise MemoryError("prefill_attention: out of memory for its packed K/V")
    return out
