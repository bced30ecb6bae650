"""A W8A8 int8 linear layer: int8 weights per output channel, activations quantized per token at
run time.

Owns: `Int8Linear`, what a compressed-tensors `int-quantized` checkpoint with dynamic per-token
input activations (llm-compressor's and `llmctl quantize --scheme w8a8`'s W8A8) loads into.
y = (Q(x) Wq^T) * x_scale * w_scale (+ b): Q(x) the int8 codes of each row of x with its scale
max|x_row| / 127, Wq int8 [out, in] with one scale per output row. Which kernel computes a call
(torch._int_mm, or the dequantized weight) is measured once per shape and row bucket
(llmctl.kernels.cpu.linear.int8.choose_kernel) and remembered by the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.kernels.cpu.linear import int8 as k8


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W = qweight * weight_scale[:, None] and x rounded to int8 per row;
    a drop-in for nn.Linear in our model."""

    bits = 8

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = in_features  # one scale per output row, as QuantLinear's per channel
        self.bias: torch.Tensor | None = None
        self.kernel: str | None = None  # a fixed kernel (tests); None: measured per row bucket
        self.plan: dict[int, str] = {}  # row bucket -> the kernel measured fastest there

    @classmethod
    def from_unpacked(cls, u, dtype: torch.dtype, device: str | torch.device = "cpu"):
        """From an UnpackedLinear of 8-bit symmetric per-channel codes (zero point 128)."""
        out_f, in_f = u.codes.shape
        if u.bits != 8 or u.scales.shape[1] != 1 or not bool((u.zeros == 128).all()):
            raise ValueError("Int8Linear takes 8-bit symmetric per-channel weights")
        self = cls(in_f, out_f)
        q = (u.codes - 128).to(torch.int8)
        self.register_buffer("qweight", q.contiguous().to(device))  # int8 [out, in]
        # float32 scales: the int32 products are rescaled in float32 before the cast to dtype
        self.register_buffer("weight_scale", u.scales.float().reshape(out_f).to(device))
        self._dtype = dtype
        if u.bias is not None:
            self.bias = nn.Parameter(u.bias.to(device, dtype), requires_grad=False)
        return self

    @property
    def weight_dtype(self) -> torch.dtype:
        return self._dtype

    def codes(self) -> torch.Tensor:
        """Integer codes [out, in] around the zero point 128, as QuantLinear.codes."""
        return self.qweight.to(torch.int32) + 128

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] in `dtype` (default: the model dtype)."""
        dtype = dtype or self._dtype
        return (self.qweight.float() * self.weight_scale[:, None]).to(dtype)

    def kernel_for(self, rows: int, dtype: torch.dtype) -> str:
        if self.kernel is not None:
            return self.kernel
        b = k8.bucket(rows)
        if b not in self.plan:
            device = self.qweight.device.type
            self.plan[b] = k8.choose_kernel(self.out_features, self.in_features, b, dtype, device)
        return self.plan[b]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        kernel = self.kernel_for(x2.shape[0], x2.dtype)
        y = k8.w8a8_linear(x2, self.qweight, self.weight_scale, kernel)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, W8A8 int8, plan={self.plan}"
