"""Causal prefill attention in bfloat16 on the CPU (csrc/cpu_prefill_attention.c): AMX tiles or
AVX512-BF16.

Owns: which of the kernel's two modes serves (`mode`: "amx" where the CPU has AMX-BF16 and Linux
grants the process its tile state, asked once; "dpbf16", `vdpbf16ps` on zmm registers, where it
has AVX512-BF16 only; `KernelConfig.prefill_attention` may ask for dpbf16 or sdpa), whether it can
serve a chunk (`supports`), and the tensor-level call `prefill_attention`. Where neither mode
runs (or with sdpa) chunk attention keeps PyTorch's SDPA, which the tests compare against.
"""

from __future__ import annotations

import functools

import torch

from llmctl.kernels.cpu.features import has_dpbf16
from llmctl.kernels.cpu.library import load

MODES = ("amx", "dpbf16")


@functools.cache
def runnable_modes() -> tuple[str, ...]:
    """The modes this CPU and compiler run, best first (the AMX probe asks Linux for the tiles)."""
    lib = load("prefill") if has_dpbf16() else None
    if lib is None or not lib.prefill_dpbf16_available():  # no intrinsics in the compiler
        return ()
    return ("amx", "dpbf16") if lib.prefill_amx_available() else ("dpbf16",)


def mode(choice: str = "auto") -> str | None:
    """The mode serving prefill for `KernelConfig.prefill_attention` (`choice`): "amx",
    "dpbf16", or None where chunk attention keeps SDPA."""
    modes = runnable_modes()
    if choice == "sdpa" or not modes:
        return None
    if choice == "dpbf16" or (choice == "amx" and "amx" not in modes):
        return "dpbf16"
    return modes[0]


def supports(q: torch.Tensor, k: torch.Tensor, choice: str = "auto") -> bool:
    """Whether prefill_attention can serve q [Tq, heads, D], k [L, kv_heads, D]: bfloat16 on the
    CPU, D % 64 == 0, heads a multiple of kv_heads, no gradients, a mode for `choice`."""
    if q.dtype is not torch.bfloat16 or k.dtype is not torch.bfloat16 or not q.is_cpu:
        return False
    if q.shape[-1] % 64 or q.shape[1] % k.shape[1]:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    return mode(choice) is not None


def prefill_attention(
    q: torch.Tensor,  # [Tq, heads, D] bf16: positions nc .. nc + Tq - 1
    k: torch.Tensor,  # [nc + Tq, kv_heads, D] bf16: every key the chunk sees
    v: torch.Tensor,
    num_computed: int,
    scale: float,
    choice: str = "auto",  # KernelConfig.prefill_attention
    window: int = 0,  # a sliding window: query at position p sees keys p - window + 1 .. p
) -> torch.Tensor:
    """Causal attention of the chunk over its prefix and itself; returns [Tq, heads, D] bf16.
    Any strides with a contiguous last dimension. Call only where `supports(q, k, choice)`.
    Positions are relative to k's first key, so with a window k may start at the first key any
    query sees."""
    tq, heads, d = q.shape
    if k.shape[0] != num_computed + tq or v.shape != k.shape:
        raise ValueError(f"prefill_attention: {tuple(k.shape)} keys for {num_computed} + {tq}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(tq, heads, d, dtype=q.dtype)
    failed = load("prefill").prefill_attention_bf16(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), tq, num_computed, heads,
        k.shape[1], d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0),
        out.stride(1), scale, torch.get_num_threads(), mode(choice) == "amx", window,
    )  # fmt: skip
    if failed == 2:
        raise ValueError(f"prefill_attention: head_dim {d}, {heads} heads over {k.shape[1]}")
    if failed:
        raise MemoryError("prefill_attention: out of memory for its packed K/V")
    return out
