"""Fused element-wise kernels for the engine's inference path on the CPU (C in cpu_act.c and
cpu_norm.c, built and loaded by cpu_native.py), as vLLM's CPU build has them:

- `silu_and_mul(x [..., 2F]) -> [..., F]`: silu(gate) * up for the merged gate/up projection's
  output (models/merged.py), one pass;
- `add_rms_norm(x, r, weight, eps)`: x += r in place, then RMSNorm(x), one pass (a decoder
  layer's residual add and the norm that reads it).

Each follows the PyTorch reference's roundings step by step (bf16: every op rounded as the
separate tensor ops round), so results match it to the last bit but for expf's last bit in SiLU.
Callers test `use_*` first and keep the PyTorch path otherwise (no compiler, gradients, other
dtypes or devices, strided tensors).
"""

from __future__ import annotations

import torch

from llmctl.kernels import cpu_native

_DTYPES = (torch.float32, torch.bfloat16)


def _no_grad(*ts: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def use_silu_and_mul(x: torch.Tensor) -> bool:
    """x [..., 2F] contiguous float32/bfloat16 on the CPU, no gradients, the kernels built."""
    if x.dtype not in _DTYPES or not x.is_cpu or x.dim() == 0 or x.shape[-1] % 2:
        return False
    return x.is_contiguous() and _no_grad(x) and cpu_native.library() is not None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2F] (gate in the first F columns, up in the last F) -> silu(gate) * up [..., F] in
    x's dtype. Call only where `use_silu_and_mul(x)`."""
    f = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], f, dtype=x.dtype)
    rows = out.numel() // f if f else 0
    if rows:
        cpu_native.library().silu_and_mul(
            x.data_ptr(),
            out.data_ptr(),
            rows,
            f,
            int(x.dtype is torch.bfloat16),
            torch.get_num_threads(),
        )
    return out


def use_add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> bool:
    """x and r of one shape [..., K] and dtype (float32/bfloat16, the weight's), contiguous, on
    the CPU, K % 8 == 0, no gradients, the kernels built."""
    if x.dtype is not weight.dtype or r.dtype is not x.dtype or x.dtype not in _DTYPES:
        return False
    if not x.is_cpu or x.shape != r.shape or x.dim() == 0 or x.shape[-1] % 8:
        return False
    if not (x.is_contiguous() and r.is_contiguous() and weight.is_contiguous()):
        return False
    return _no_grad(x, r, weight) and cpu_native.library() is not None


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x.add_(r) (in place), then RMSNorm(x) with `weight` [K] (Hugging Face's arithmetic, see
    cpu_norm.c); returns the norm's output. Call only where `use_add_rms_norm(x, r, weight)`."""
    k = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // k
    if rows:
        cpu_native.library().add_rms_norm(
            x.data_ptr(),
            r.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            k,
            eps,
            int(x.dtype is torch.bfloat16),
            torch.get_num_threads(),
        )
    return out
