"""Element-wise CPU kernels of a decoder layer, in C (csrc/cpu_norm.c, cpu_act.c, cpu_rope.c,
cpu_argmax.c), as vLLM's CPU build has them.

Owns: `rms_norm` and `add_rms_norm` (x += r in place, then RMSNorm(x): a decoder layer's residual
add and the norm that reads it, one pass), `silu_mul` (into gate) and `silu_and_mul` (the merged
gate/up projection's output [..., 2F] -> [..., F]), `rope` (bf16 q and k rotated in one call per
layer, read straight from the merged q/k/v output's column slices), `argmax` (greedy sampling on
the logits in the model's dtype), `mask_rows` (structured outputs: a grammar's disallowed tokens
set to -inf), and for each the `use_*` test of whether it can serve a call.
Each follows the PyTorch reference's roundings step by step (bf16: every op rounded as the
separate tensor ops round), so results match it to the last bit but for expf's last bit in SiLU.
Callers test `use_*` first and keep the PyTorch path otherwise (no compiler, gradients, other
dtypes or devices, strided tensors).
"""

from __future__ import annotations

import functools

import torch

from llmctl.kernels.cpu.library import load

DTYPES = (torch.float32, torch.bfloat16)


def _no_grad(*ts: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in ts)


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [T, heads, D] with each token's heads contiguous (tokens any stride apart, as in a column
    slice of the merged q/k/v projection's output)."""
    return x.stride(2) == 1 and (x.stride(1) == x.shape[2] or x.shape[1] == 1)


def use_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference on the CPU, x and weight both float32 or both bfloat16, the last dimension a
    multiple of 8."""
    if x.dtype is not weight.dtype or x.dtype not in DTYPES or not x.is_cpu or x.shape[-1] % 8:
        return False
    return _no_grad(x, weight) and load("core") is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out=None) -> torch.Tensor:
    """RMSNorm of x [..., K] with weight [K], float32 or bfloat16 (Hugging Face's arithmetic, see
    cpu_norm.c), into `out` where given (contiguous, x's shape and dtype: a step's buffer, see
    models/step.py). Call only where `use_rms_norm(x, weight)`."""
    k = x.shape[-1]
    xc = x if x.is_contiguous() else x.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty_like(xc) if out is None else out
    rows = xc.numel() // k if k else 0
    if rows:
        bf16 = int(x.dtype == torch.bfloat16)
        load("core").rms_norm(
            xc.data_ptr(), w.data_ptr(), out.data_ptr(), rows, k, eps, bf16, torch.get_num_threads()
        )
    return out


def use_add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> bool:
    """x and r of one shape [..., K] and dtype (float32/bfloat16, the weight's), contiguous, on
    the CPU, K % 8 == 0, no gradients, the kernels built."""
    if x.dtype is not weight.dtype or r.dtype is not x.dtype or x.dtype not in DTYPES:
        return False
    if not x.is_cpu or x.shape != r.shape or x.dim() == 0 or x.shape[-1] % 8:
        return False
    if not (x.is_contiguous() and r.is_contiguous() and weight.is_contiguous()):
        return False
    return _no_grad(x, r, weight) and load("core") is not None


def add_rms_norm(
    x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, out=None
) -> torch.Tensor:
    """x.add_(r) (in place), then RMSNorm(x) with `weight` [K] (Hugging Face's arithmetic, see
    cpu_norm.c); returns the norm's output (into `out` where given, as for `rms_norm`). Call only
    where `use_add_rms_norm(x, r, weight)`."""
    k = x.shape[-1]
    out = torch.empty_like(x) if out is None else out
    rows = x.numel() // k
    if rows:
        load("core").add_rms_norm(
            x.data_ptr(), r.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, eps,
            int(x.dtype is torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
    return out


def use_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """gate and up of one float32/bfloat16 dtype and shape, contiguous, on the CPU."""
    if gate.dtype is not up.dtype or gate.dtype not in DTYPES or not gate.is_cpu:
        return False
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        return False
    return _no_grad(gate, up) and load("core") is not None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., F], written into gate (see cpu_act.c), one row at a
    time. Call only where `use_silu_mul(gate, up)`."""
    f = gate.shape[-1]
    rows = gate.numel() // f if f else 0
    if rows:
        load("core").silu_mul(
            gate.data_ptr(), up.data_ptr(), rows, f, int(gate.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )  # fmt: skip
    return gate


def use_silu_and_mul(x: torch.Tensor) -> bool:
    """x [..., 2F] contiguous float32/bfloat16 on the CPU, no gradients, the kernels built."""
    if x.dtype not in DTYPES or not x.is_cpu or x.dim() == 0 or x.shape[-1] % 2:
        return False
    return x.is_contiguous() and _no_grad(x) and load("core") is not None


def silu_and_mul(x: torch.Tensor, out=None) -> torch.Tensor:
    """x [..., 2F] (gate in the first F columns, up in the last F) -> silu(gate) * up [..., F] in
    x's dtype (into `out` where given: contiguous, that shape). Call only where
    `use_silu_and_mul(x)`."""
    f = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], f, dtype=x.dtype) if out is None else out
    rows = out.numel() // f if f else 0
    if rows:
        load("core").silu_and_mul(
            x.data_ptr(), out.data_ptr(), rows, f, int(x.dtype is torch.bfloat16),
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def use_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor) -> bool:
    """q [T, heads, D], k [T, kv_heads, D] bf16 on the CPU, each token's heads contiguous, no
    gradients; a contiguous float32 table; int64 positions [T]."""
    if q.dtype is not torch.bfloat16 or k.dtype is not torch.bfloat16 or not q.is_cpu:
        return False
    if q.dim() != 3 or k.dim() != 3 or positions.dim() != 1 or positions.dtype is not torch.int64:
        return False
    if not (heads_contiguous(q) and heads_contiguous(k)):
        return False
    if not cos.is_contiguous() or cos.dtype is not torch.float32 or q.shape[-1] % 2:
        return False
    if positions.shape[0] != q.shape[0]:
        return False
    return _no_grad(q, k) and load("rope") is not None


def rope(q, k, cos, sin, positions, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the table rows at `positions` (every position < the table's length: the
    caller's contract, as for the indexing it replaces): in place where contiguous, else into new
    contiguous tensors, or `out` (q's and k's shapes, contiguous) where given (q and k may be
    column slices of the merged q/k/v output); returns them. Bit-identical to models/rope.py's
    in-place bf16 path. Call only where `use_rope(...)`."""
    positions = positions if positions.is_contiguous() else positions.contiguous()
    q_out, k_out = out or (None, None)
    if q.is_contiguous() or q_out is None:
        q_out = q if q.is_contiguous() else torch.empty(q.shape, dtype=q.dtype)
    if k.is_contiguous() or k_out is None:
        k_out = k if k.is_contiguous() else torch.empty(k.shape, dtype=k.dtype)
    load("rope").rope_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), q_out.data_ptr(), k_out.data_ptr(),
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], cos.data_ptr(), sin.data_ptr(),
        positions.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out


def use_argmax(x: torch.Tensor) -> bool:
    """x [rows, 1 <= n < 2^31] float32 or bfloat16 on the CPU, each row contiguous; the kernels
    built with AVX-512 (without it torch.max measured faster than a scalar loop)."""
    return (
        x.dtype in DTYPES
        and x.device.type == "cpu"
        and x.dim() == 2
        and 0 < x.shape[1] < 2**31
        and x.stride(1) == 1
        and load("core") is not None
        and _argmax_built()
    )


@functools.cache
def _argmax_built() -> bool:
    """cpu_argmax.c was compiled with AVX-512 (fixed by the CPU and compiler: asked once)."""
    return load("core").argmax_rows_built() == 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's first index of its maximum, or of its first NaN (cpu_argmax.c;
    torch.max(dim=-1)'s indices). Call only where `use_argmax(x)`."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        load("core").argmax_rows(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), int(x.dtype is torch.bfloat16),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return out


def use_mask_rows(x: torch.Tensor, mask: torch.Tensor) -> bool:
    """x [rows, n] float32 or bfloat16 on the CPU, rows contiguous and written in place; mask
    [rows, words] int32, contiguous (a grammar engine's allowed-token bits)."""
    return (
        x.dtype in DTYPES
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.stride(1) == 1
        and mask.dtype is torch.int32
        and mask.is_contiguous()
        and mask.dim() == 2
        and mask.shape[0] == x.shape[0]
        and load("core") is not None
    )


def mask_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with every token whose bit in `mask` is clear set to -inf, in place (cpu_argmax.c's
    mask_rows; bit j % 32 of word j // 32 is token j). Call only where `use_mask_rows(x, mask)`."""
    if x.shape[0]:
        load("core").mask_rows(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), int(x.dtype is torch.bfloat16),
            mask.data_ptr(), mask.shape[1], torch.get_num_threads(),
        )  # fmt: skip
    return x
