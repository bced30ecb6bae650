"""Which kernel computes a linear layer's call: the candidates by name, the static rule, and
`linear`, the one call `Linear.forward` makes.

Owns: `Candidate` and `CANDIDATES` (every kernel that can serve a CPU linear: F.linear in the
weight's dtype, the C kernels of c_kernels, float32 widening and oneDNN-packed weights of
torch_kernels; `BY_NAME`), the static rule (`static`: what serves a call without a measured
choice) and `linear`. A layer (models' `Linear`) holds what was decided for it when it was
prepared for inference: `plan` (autotune.Plan: the candidate per row count, or None), `packed`
(candidate name -> its copy of the weight) and `kernels` (the KernelConfig: `native` off keeps
every C kernel out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmctl.kernels.cpu.features import native_bf16
from llmctl.kernels.cpu.linear import c_kernels as c
from llmctl.kernels.cpu.linear import torch_kernels as t

# (x, weight, bias, packed): packed maps a packing candidate's name to its copy of the weight
Kernel = Callable[[torch.Tensor, torch.Tensor, Any, Any], torch.Tensor]

# float32: rows per thread up to which the C kernel beat F.linear (MKL) on every SmolLM2-135M and
# Qwen2.5-0.5B decoder shape, weights cold in cache (1 thread: 1.1-2.2x at 1-16 rows, 0.8-1.0x at
# 32-64; 2 threads: 1.3-3x up to 32 rows). bfloat16, on a CPU without native bf16 (where F.linear's
# bf16 path is a slow fallback, 3-4x slower at any row count): up to the same count; above it
# torch_kernels.upcast measured 1.2-2.2x the kernel at 32-2048 rows, 1 thread. With native bf16
# (AVX512-BF16, AMX) F.linear serves every bf16 row count.
NATIVE_ROWS_PER_THREAD = 16


@dataclass(frozen=True)
class Candidate:
    name: str
    run: Kernel
    applies: Callable[[torch.Tensor], bool]  # for this weight [N, K] on this CPU
    # weight -> the copy of it this kernel reads (None: cannot); None for kernels of the plain one
    pack: Callable[[torch.Tensor], Any] | None = None
    # A kernel for few rows (a register tile per call): against the BLAS it only falls further
    # behind as rows grow, so once far behind it is not timed at larger buckets. The BLAS-backed
    # ones gain with rows and are timed at every bucket.
    few_rows: bool = False
    native: bool = False  # one of our C kernels (KernelConfig.native)

    @property
    def packs(self) -> bool:
        return self.pack is not None


def _probe(w: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, w.shape[1], dtype=w.dtype)


def _packed_run(x: torch.Tensor, w: torch.Tensor, b: Any, packed: dict) -> torch.Tensor:
    y = t.packed(x.reshape(-1, x.shape[-1]), packed["packed"], b)
    return y.view(*x.shape[:-1], y.shape[-1])


def _no_grad_applies(test: Callable[[torch.Tensor, torch.Tensor], bool]):
    def applies(w: torch.Tensor) -> bool:
        with torch.no_grad():
            return test(_probe(w), w)

    return applies


CANDIDATES = (
    Candidate("torch", lambda x, w, b, p: F.linear(x, w, b), lambda w: True),
    Candidate(
        "native",
        lambda x, w, b, p: c.native(x, w, b),
        _no_grad_applies(c.native_applies),
        few_rows=True,
        native=True,
    ),
    Candidate(
        "dpbf16",
        lambda x, w, b, p: c.dpbf16(x, w, b),
        lambda w: w.dtype is torch.bfloat16 and c.dpbf16_library() is not None,
        few_rows=True,
        native=True,
    ),
    Candidate("upcast", lambda x, w, b, p: t.upcast(x, w, b), lambda w: w.dtype is torch.bfloat16),
    Candidate("packed", _packed_run, t.can_pack, pack=t.pack_weight),
    Candidate(
        "amx",
        lambda x, w, b, p: c.amx(x, w, b, p["amx"]),
        c.amx_applies,
        pack=c.amx_pack,
        native=True,
    ),
)
BY_NAME = {cand.name: cand for cand in CANDIDATES}


def use_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The static rule for the C kernel: where it can serve (c_kernels.native_applies: inference on
    the CPU, a plain float32/bfloat16 weight of x's dtype, K % 8 == 0), few rows, and for bfloat16
    a CPU without native bf16. (Called per layer per step: the cheapest tests first.)"""
    if weight.dtype is torch.bfloat16 and native_bf16():
        return False
    if x.numel() > weight.shape[-1] * NATIVE_ROWS_PER_THREAD * torch.get_num_threads():
        return False
    return c.native_applies(x, weight)


def static(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """A call without a measured choice: few rows through the C kernel (unless the layer's
    KernelConfig turns C kernels off; 1.1-1.3x the packed weight at 4-16 rows); on CPUs without
    native bf16, many bf16 rows through float32 BLAS on widened slabs; rows [M, K] where the layer
    holds a oneDNN-packed copy without a plan (the float32 vocabulary projection, packed by
    models/prepare.py), the packed weight (1.2-1.5x F.linear at 16-64 rows); else F.linear."""
    w, b = layer.weight, layer.bias
    if layer.kernels.native and use_native(x, w):
        return c.native(x, w, b)
    if t.use_upcast(x, w):
        return t.upcast(x, w, b)
    packed = layer.packed
    if packed and layer.plan is None and "packed" in packed and _packs(x, w):
        return t.packed(x, packed["packed"], b)
    return F.linear(x, w, b)


def _packs(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype is w.dtype and x.is_cpu and not torch.is_grad_enabled()


def linear(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a prepared or plain `Linear`: the candidate its plan chose for x's row count,
    where the plan measured one (inference in the weight's dtype), else `static`."""
    plan = layer.plan
    if plan is not None and x.dtype is layer.weight.dtype and not torch.is_grad_enabled():
        k = layer.in_features
        cand = plan.kernel(x.numel() // k if k else 0)
        if cand is not None:
            return cand.run(x, layer.weight, layer.bias, layer.packed)
    return static(layer, x)
