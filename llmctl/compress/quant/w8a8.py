"""W8A8's activation side while compressing: each quantized linear's input rounded to int8 per
token, as the engine's Int8Linear and vLLM compute it, so the perplexity a W8A8 run reports
after quantizing is the one the written model scores.

Owns: `fake_quantize_rows` (x -> its int8 codes times their row scale, in x's dtype) and
`quantize_inputs` (a forward pre-hook on each named linear that applies it).
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.kernels.cpu.linear.int8 import native_applies, quantize_rows, quantize_rows_native


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each row replaced by Q(row) * scale (symmetric int8, scale max|row|/127;
    the C pass where it applies: the same codes, one pass)."""
    rows = x.reshape(-1, x.shape[-1])
    quantize = quantize_rows_native if native_applies(rows) else quantize_rows
    codes, scale = quantize(rows)
    return (codes.float() * scale).to(x.dtype).reshape(x.shape)


def _hook(module: nn.Module, inputs: tuple) -> tuple:
    return (fake_quantize_rows(inputs[0]), *inputs[1:])


def quantize_inputs(model: nn.Module, names: list[str]) -> list:
    """Register the int8 input rounding on the linears `names` (full module names) of `model`;
    returns the hook handles."""
    return [model.get_submodule(n).register_forward_pre_hook(_hook) for n in names]
