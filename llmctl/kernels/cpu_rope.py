"""Rotary embedding of bfloat16 q and k in one C call per layer (kernels/cpu_rope.c).

Owns: building and loading that kernel (through cpu_native.build: the same cache and rules),
`use_rope` (when it applies) and `rope`. Bit-identical to models/rope.py's in-place bf16 path,
which it replaces on the CPU at inference; with no compiler or LLMCTL_NATIVE_KERNELS=0 the
PyTorch path runs. q and k may be column slices of the merged q/k/v projection's output (their
tokens strided): they are then rotated into new contiguous tensors, in place otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmctl.kernels import cpu_native

SOURCE = Path(__file__).with_name("cpu_rope.c")


@functools.cache
def library() -> ctypes.CDLL | None:
    if not cpu_native.enabled():
        return None
    lib = cpu_native.load(SOURCE, "native RoPE")
    if lib is None:
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    # (q, ldq, k, ldk, q_out, k_out, rows, heads, kv_heads, D, cos, sin, positions, threads)
    lib.rope_bf16.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, i32, ptr, ptr, ptr, i32]
    lib.rope_bf16.restype = None
    return lib


def use_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor) -> bool:
    """q [T, heads, D], k [T, kv_heads, D] bf16 on the CPU, each token's heads contiguous, no
    gradients; a contiguous float32 table; int64 positions [T]."""
    if q.dtype is not torch.bfloat16 or k.dtype is not torch.bfloat16 or not q.is_cpu:
        return False
    if q.dim() != 3 or k.dim() != 3 or positions.dim() != 1 or positions.dtype is not torch.int64:
        return False
    if not (cpu_native.heads_contiguous(q) and cpu_native.heads_contiguous(k)):
        return False
    if not cos.is_contiguous() or cos.dtype is not torch.float32 or q.shape[-1] % 2:
        return False
    if positions.shape[0] != q.shape[0]:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False
    return library() is not None


def rope(q, k, cos, sin, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the table rows at `positions` (every position < the table's length: the
    caller's contract, as for the indexing it replaces): in place where contiguous, else into new
    contiguous tensors; returns them."""
    positions = positions if positions.is_contiguous() else positions.contiguous()
    q_out = q if q.is_contiguous() else torch.empty(q.shape, dtype=q.dtype)
    k_out = k if k.is_contiguous() else torch.empty(k.shape, dtype=k.dtype)
    library().rope_bf16(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        q_out.data_ptr(),
        k_out.data_ptr(),
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        cos.data_ptr(),
        sin.data_ptr(),
        positions.data_ptr(),
        torch.get_num_threads(),
    )
    return q_out, k_out
