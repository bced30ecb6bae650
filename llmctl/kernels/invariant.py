"""The batch-invariant linear and MLP paths: every output row computed in an order fixed by that
row alone, whatever other rows share the call.

Owns: `linear` and `silu_mul` as the model uses them when the engine runs with
`EngineConfig.batch_invariant` (the attention side is in attention.py: every token, prefill or
decode, through the decode kernel). Where the C kernels apply (cpu_native.linear_applies,
use_silu_mul) they serve any row count, since each output element is one reduction whose order
depends on neither the row count nor the threads; elsewhere (a quantized or sparse weight, no C
compiler, K % 8 != 0) the fallback calls the layer once per row, so each row always meets the same
shapes and so the same kernel choices.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from llmctl.kernels import cpu_native


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
) -> torch.Tensor:
    """layer(x) for x [..., K] with a row-count-independent reduction order; returns [..., N].
    `weight`/`bias`: the layer's when it is a plain dense linear; None for any other layer."""
    if weight is not None and cpu_native.linear_applies(x, weight):
        return cpu_native.linear(x, weight, bias)
    return _per_row(layer, x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up [..., F] (gate may be overwritten); returns [..., F]."""
    if cpu_native.use_silu_mul(gate, up):
        return cpu_native.silu_mul(gate, up)
    return _per_row(lambda g, u: F.silu(g) * u, gate, up)
