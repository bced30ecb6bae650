"""The batch-invariant linear, MLP and RMSNorm paths: every output row computed in an order fixed
by that row alone, whatever other rows share the call.

Owns: `linear`, `silu_mul` and `rms_norm` as the model uses them when the engine runs with
`EngineConfig.batch_invariant`, and the choice of the Triton kernels (`triton_kernels`; on CUDA,
kernels/cuda/invariant.py; the attention side is in attention.py: every token, prefill or
decode, through a decode kernel). On the CPU, where the C kernels apply
(cpu/linear/c_kernels.native_applies, cpu/elementwise.use_silu_mul) they serve any row count,
since each output element is one reduction whose order depends on neither the row count nor the
threads; elsewhere (a quantized or sparse weight, no C
compiler, K % 8 != 0) the fallback calls the layer once per row, so each row always meets the same
shapes and so the same kernel choices.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import elementwise
from llmctl.kernels.cpu.linear import c_kernels

DEFAULT = KernelConfig()


def triton_kernels(t: torch.Tensor, kernels: KernelConfig = DEFAULT) -> ModuleType | None:
    """kernels/cuda/invariant for a CUDA tensor t (or any, with `kernels.triton_on_cpu`: run
    under TRITON_INTERPRET=1, how the CUDA path is tested without a GPU); None elsewhere or
    without triton."""
    if not (t.is_cuda or kernels.triton_on_cpu):
        return None
    try:
        from llmctl.kernels.cuda import invariant as triton_invariant
    except ImportError:  # the engine refuses batch-invariant CUDA runs without triton
        return None
    return triton_invariant


def _triton_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A plain float32/float16/bfloat16 weight [N, K] of x's dtype, no gradients."""
    if type(weight) not in c_kernels.PLAIN or weight.dim() != 2 or x.dtype is not weight.dtype:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def _per_row(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn applied to one row [1, K] of each x [..., K] at a time; rows stacked back [..., N]."""
    lead = xs[0].shape[:-1]
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    rows = [fn(*(f[i : i + 1] for f in flat)) for i in range(flat[0].shape[0])]
    if not rows:
        return fn(*xs)
    return torch.cat(rows).reshape(*lead, rows[0].shape[-1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    layer: Callable[[torch.Tensor], torch.Tensor],
    kernels: KernelConfig = DEFAULT,
) -> torch.Tensor:
    """layer(x) for x [..., K] with a row-count-independent reduction order; returns [..., N].
    `weight`/`bias`: the layer's when it is a plain dense linear; None for any other layer."""
    tk = triton_kernels(x, kernels)
    if tk is not None and weight is not None and _triton_linear_applies(x, weight):
        return tk.linear(x, weight, bias)
    if weight is not None and kernels.native and c_kernels.native_applies(x, weight):
        return c_kernels.native(x, weight, bias)
    return _per_row(layer, x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, native: bool = True) -> torch.Tensor:
    """silu(gate) * up, gate and up [..., F] (gate may be overwritten); returns [..., F]."""
    if gate.is_cuda:  # elementwise, one formula per element: PyTorch's CUDA kernels serve
        return F.silu(gate) * up
    if native and elementwise.use_silu_mul(gate, up):
        return elementwise.silu_mul(gate, up)
    return _per_row(lambda g, u: F.silu(g) * u, gate, up)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: KernelConfig = DEFAULT
) -> torch.Tensor | None:
    """The Triton RMSNorm of x [..., N] (one program a row) where `triton_kernels` applies; None:
    the caller's own path, which on the CPU is already one fixed-order reduction a row."""
    tk = triton_kernels(x, kernels)
    return None if tk is None else tk.rms_norm(x, weight, eps)
