"""Weight-only quantized GEMM for the CUDA path: y = x W^T with W = (q - z) * s read packed.

Owns: the Triton dequantize-GEMM kernel (`_dequant_gemm_kernel`), its launch wrapper
`quant_matmul_triton`, and the plain-PyTorch reference `quant_matmul_reference` (dequantize, then
matmul) that tests compare it with on the CPU through TRITON_INTERPRET=1. The layout is the one
`QuantLinear` keeps off CPU: 4-bit codes two per uint8 along K (even column low nibble, odd column
high), other bit widths one code per uint8; scales and zeros per group of `group_size` input
columns. Bias and act-order permutation are the caller's. triton is imported only if installed:
`available()` says whether the kernel can run.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference still works
    triton = None


def available() -> bool:
    return triton is not None


def quant_matmul_reference(x, qweight, scales, zeros, bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, with W [N, K] = (q - z) * s dequantized in fp32.
    qweight uint8 [N, K/2] (bits == 4) or [N, K]; scales [N, K/group]; zeros uint8 [N, K/group]."""
    if bits == 4:
        q = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(
            qweight.shape[0], -1
        )  # [N, K]
    else:
        q = qweight
    n, k = q.shape
    q = q.float().reshape(n, k // group_size, group_size)
    w = (q - zeros.float()[..., None]) * scales.float()[..., None]  # [N, groups, group]
    return (x.float() @ w.reshape(n, k).t()).to(x.dtype)


if triton is not None:

    @triton.jit
    def _dequant_gemm_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_qn,
        stride_sn,
        stride_ym,
        PACKED4: tl.constexpr,
        GROUP: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Program (i, j): rows [i*BM, (i+1)*BM) of x, outputs [j*BN, (j+1)*BN). K is walked in tiles
        # of BLOCK_K, which divides GROUP (and so K): each tile's columns share one scale/zero per
        # output.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None], other=0.0
            )  # [BM, BK]
            if PACKED4:  # byte kk // 2 holds columns 2j (low nibble) and 2j + 1 (high nibble)
                b = tl.load(
                    q_ptr + offs_n[:, None] * stride_qn + (kk // 2)[None, :],
                    mask=n_mask[:, None],
                    other=0,
                )
                q = (b.to(tl.int32) >> ((kk & 1) * 4)[None, :]) & 15  # [BN, BK]
            else:
                q = tl.load(
                    q_ptr + offs_n[:, None] * stride_qn + kk[None, :], mask=n_mask[:, None], other=0
                )
            g = k0 // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0).to(
                tl.float32
            )  # [BN]
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
            w = (q.to(tl.float32) - z[:, None]) * s[:, None]  # [BN, BK]
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            y,
            mask=m_mask[:, None] & n_mask[None, :],
        )


def quant_matmul_triton(x, qweight, scales, zeros, bits: int, group_size: int) -> torch.Tensor:
    """As `quant_matmul_reference` (same shapes and layout), in one Triton kernel: fp32
    accumulation, output in x's dtype. group_size: a power of two >= 16 dividing K."""
    m, k = x.shape
    n = qweight.shape[0]
    assert group_size >= 16 and group_size & (group_size - 1) == 0 and k % group_size == 0, (
        k,
        group_size,
    )
    assert scales.shape == zeros.shape == (n, k // group_size), (scales.shape, zeros.shape)
    x = x.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, min(group_size, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dequant_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        y.stride(0),
        PACKED4=bits == 4,
        GROUP=group_size,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y
