"""LoRA's many-adapter low-rank update on the CPU, one call per projection (csrc/cpu_lora.c, as
punica's BGMV): y[t] += (x[t] @ A[s].T) @ Bt[s] with s = row_slot[t], for every row at once.

Owns: `use_lora_apply` (whether the C kernel can serve a call), `lora_apply` (the kernel) and
`lora_reference` (the same arithmetic in PyTorch, what tests compare the kernel with and what
serves where the kernel does not: other devices, no compiler). Shapes: x [T, K] and y [T, N]
(rows contiguous, any row stride: y may be a column slice of a merged projection's output), A
[slots, R, K], Bt [slots, R, N] (B transposed, the adapter's scale folded in), row_slot int32
[T] (slot 0: no adapter), ranks int32 [slots] (0: the slot's adapter skips this projection).
"""

from __future__ import annotations

import torch

from llmctl.kernels.cpu.library import load

DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor) -> bool:
    """2-D with contiguous rows (any row stride); one stride() call (this runs 7 times a layer)."""
    s = t.stride()
    return len(s) == 2 and s[1] == 1 and s[0] >= t.shape[1]


def use_lora_apply(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> bool:
    """x, y and A one dtype (float32/bfloat16) on the CPU, x and y rows contiguous, no gradients,
    the kernel built."""
    if x.dtype not in DTYPES or y.dtype is not x.dtype or a.dtype is not x.dtype:
        return False
    if not (x.is_cpu and y.is_cpu):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad or a.requires_grad):
        return False
    return _rows(x) and _rows(y) and load("lora") is not None


def lora_apply(x, y, a, bt, row_slot: torch.Tensor, ranks: torch.Tensor) -> None:
    """y += the update of each row's adapter, in place (see the module docstring; a and bt
    contiguous, row_slot and ranks int32 contiguous CPU tensors). Call only where
    `use_lora_apply(x, y, a)`."""
    t, k = x.shape
    n, r = y.shape[1], a.shape[1]
    if not t:
        return
    bf16 = int(x.dtype is torch.bfloat16)
    failed = load("lora").lora_apply(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), bt.data_ptr(),
        row_slot.data_ptr(), ranks.data_ptr(), t, k, n, r, bf16, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"lora_apply: no scratch memory for rows of {k} + {n} floats")


def lora_reference(x, y, a, bt, row_slot: torch.Tensor, ranks: torch.Tensor) -> None:
    """`lora_apply` in PyTorch (float32 arithmetic, y rounded once), one slot at a time."""
    slots = row_slot.long()
    for s in sorted(set(slots.tolist()) - {0}):
        r = int(ranks[s])
        if not r:
            continue
        rows = (slots == s).nonzero().flatten()
        xa = x[rows].float() @ a[s, :r].float().T  # [rows, r]
        y[rows] = (y[rows].float() + xa @ bt[s, :r].float()).to(y.dtype)
