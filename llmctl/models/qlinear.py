"""A linear layer that keeps its weight quantized (packed) in memory.

Owns: `QuantLinear`. Codes of 2, 3 and 4 bits are all held as 4-bit codes (values below 16, the
zero point and scale unchanged), so they share the 4-bit storage and kernels; only how a checkpoint
packs them differs. On CPU, such weights whose output width is a multiple of 64 are stored in
the layout of PyTorch's int4 kernel (`aten._convert_weight_to_int4pack_for_cpu`) and multiplied
with `aten._weight_int4pack_mm_for_cpu` for small batches (decode); above `SMALL_BATCH_TOKENS`
tokens (prefill), the weight is dequantized to the compute dtype for that call and a dense
matmul runs, which is faster there. Other weights (8-bit, odd widths, CUDA) are kept as codes
(two 4-bit codes per byte, or one 8-bit code per byte, the layouts the Triton kernel reads) and
dequantized per call, except on CUDA at or below `TRITON_MAX_TOKENS` rows, where the
Triton dequantize-GEMM in `llmctl/kernels/cuda/quant.py` reads the stored codes directly (see
`_use_triton`).

The int4 kernel computes w = (q - 8) * scale + zero_f per group, so our (q - z) * s is passed as
scale = s, zero_f = (8 - z) * s. Its packed layout depends on the CPU build PyTorch dispatches to
(found at first use by `_int4_block_rows`): rows in blocks of B (64 with AVX-512, 32 with AVX2),
byte k * B/2 + i of a block holds row i (low nibble) and row i + B/2 (high nibble) of column k.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.errors import ModelLoadError

INT4_GROUP_SIZES = (32, 64, 128, 256)


@functools.lru_cache(maxsize=1)
def _int4_block_rows() -> int | None:
    """Row-block width B of the CPU int4 kernel's packed layout, or None (no kernel, unknown
    layout)."""
    try:
        q = torch.randint(
            0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
        )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError):
        return None
    for block in (64, 32):
        if torch.equal(_unpack_int4_cpu(packed, 128, 64, block), q):
            return block
    return None


def _int4_layout_ok() -> bool:
    return _int4_block_rows() is not None


def _unpack_int4_cpu(
    packed: torch.Tensor, n: int, k: int, block: int | None = None
) -> torch.Tensor:
    """Codes int32 [n, k] from the CPU int4 kernel's packed uint8 [n, k / 2] (row blocks of
    `block`)."""
    block = block or _int4_block_rows()
    f = packed.contiguous().reshape(n // block, k, block // 2)
    return torch.cat([f & 15, f >> 4], dim=-1).permute(0, 2, 1).reshape(n, k).to(torch.int32)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int [n, k] in [0, 16) -> uint8 [n, k / 2]: even columns low nibble, odd columns high."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).reshape(p.shape[0], -1)


def _use_triton(device: torch.device, rows: int, group_size: int) -> bool:
    """Whether a forward on `device` with `rows` rows of x runs the Triton dequantize-GEMM (which
    needs a power-of-two group size >= 16; per-channel groups of odd width dequantize instead)."""
    if device.type != "cuda" or rows > QuantLinear.TRITON_MAX_TOKENS:
        return False
    if group_size < 16 or group_size & (group_size - 1):
        return False
    from llmctl.kernels.cuda import quant as triton_quant

    return triton_quant.available()


def _int4_activation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype for PyTorch's CPU int4 kernel: float32 rows are rounded to bf16 first,
    since the kernel's float32 path measured 10-20x slower than its bf16 one (1536x576, 1-16 rows,
    AVX2 EPYC) and slower than a dense float32 matmul; the rounding (~0.3% relative) is far below
    the 4-bit weight error."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W = (q - z) * s stored packed; a drop-in for nn.Linear in our model."""

    SMALL_BATCH_TOKENS = 32  # int4 kernel at or below this many rows of x, dequantize + dense above
    # CUDA: Triton dequantize-GEMM at or below this many rows (decode), dequantize + cuBLAS above
    # (prefill). A guess from the usual crossover, not yet measured on a GPU.
    TRITON_MAX_TOKENS = 64

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.use_int4_kernel = False
        self.bias: torch.Tensor | None = None
        self.register_buffer("perm", None)  # input column order grouping act-order columns, or None

    @classmethod
    def from_unpacked(
        cls, u, dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> "QuantLinear":
        """Build from an UnpackedLinear: codes [out, in], scales/zeros [out, groups],
        g_idx [in]."""
        out_f, in_f = u.codes.shape
        self = cls(in_f, out_f, u.bits, u.group_size)
        codes, g_idx = u.codes, u.g_idx.long()
        expected = torch.arange(in_f) // u.group_size
        if not torch.equal(g_idx, expected):  # act-order checkpoint: regroup the input columns
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], expected):
                raise ModelLoadError(
                    f"g_idx with groups of unequal size (group size {u.group_size}) is not "
                    "supported"
                )
            self.perm = perm.to(device)
            codes = codes[:, perm]
        device = torch.device(device)
        self.use_int4_kernel = (
            device.type == "cpu"
            and u.bits <= 4
            and out_f % 64 == 0
            and u.group_size in INT4_GROUP_SIZES
            and in_f % u.group_size == 0
            and _int4_layout_ok()
        )
        s = u.scales.float()
        z = u.zeros.float()
        self.register_buffer("scales", s.to(device, dtype))  # [out, groups]
        self.register_buffer(
            "zeros", u.zeros.to(device, torch.uint8 if u.bits <= 8 else torch.int32)
        )
        if self.use_int4_kernel:
            c = self.int4_shift
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                (codes + c).to(torch.int32).contiguous(), 1
            )
            self.register_buffer("qweight", packed)
            sz = torch.stack([s.t(), ((8 - z - c) * s).t()], dim=-1)  # [groups, out, 2]
            self.register_buffer("scale_zeros", sz.to(_int4_activation_dtype(dtype)).contiguous())
        elif u.bits <= 4:
            self.register_buffer("qweight", _pack_nibbles(codes).to(device))
        else:
            self.register_buffer("qweight", codes.to(torch.uint8).to(device))
        if u.bias is not None:
            self.bias = nn.Parameter(u.bias.to(device, dtype), requires_grad=False)
        return self

    @property
    def int4_shift(self) -> int:
        """What the int4 kernel's copy adds to codes and zero points (8 - 2^(bits-1)): it centres
        2- and 3-bit codes on the kernel's fixed 8, so the zero term it rounds to bf16,
        (8 - z) * s, stays near 0 as for 4-bit codes instead of near 6 or 4 scales."""
        return 8 - (1 << (self.bits - 1)) if self.bits <= 4 else 0

    @property
    def storage_bits(self) -> int:
        """Bits per stored code: 2- and 3-bit codes are held as 4-bit ones."""
        return 4 if self.bits <= 4 else self.bits

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def codes(self) -> torch.Tensor:
        """Integer codes [out, in] (in the stored, possibly regrouped, column order)."""
        if self.use_int4_kernel:
            q = _unpack_int4_cpu(self.qweight, self.out_features, self.in_features)
            return q - self.int4_shift
        if self.bits <= 4:
            return _unpack_nibbles(self.qweight)
        return self.qweight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] in `dtype` (default: the scales' dtype), stored column order."""
        dtype = dtype or self.scales.dtype
        q = self.codes().to(dtype).reshape(self.out_features, -1, self.group_size)
        w = (q - self.zeros.to(dtype)[..., None]) * self.scales.to(dtype)[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.use_int4_kernel and x2.shape[0] <= self.SMALL_BATCH_TOKENS:
            dt = _int4_activation_dtype(x2.dtype)
            sz = self.scale_zeros if self.scale_zeros.dtype == dt else self.scale_zeros.to(dt)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(dt).contiguous(), self.qweight, self.group_size, sz
            )
            y = y.to(x2.dtype)
        elif not self.use_int4_kernel and _use_triton(x2.device, x2.shape[0], self.group_size):
            from llmctl.kernels.cuda.quant import quant_matmul_triton

            y = quant_matmul_triton(
                x2, self.qweight, self.scales, self.zeros, self.storage_bits, self.group_size
            )
        else:
            y = F.linear(x2, self.dequantize(x2.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kernel = "int4 kernel" if self.use_int4_kernel else "dequantize"
        return (
            f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
            f"group={self.group_size}, {kernel}"
        )
