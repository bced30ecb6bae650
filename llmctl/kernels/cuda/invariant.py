"""Batch-invariant Triton kernels for the CUDA path: a row's result depends on that row alone,
never on how many rows share the launch or where a prompt was chunked.

Owns: the fixed-order linear (x @ W^T + b), RMSNorm, and paged attention over a fixed KV tile,
with their launch wrappers; kernels/invariant.py dispatches to them. Why each is row-invariant:
- linear: one program per (BLOCK_M, BLOCK_N) output tile, a FIXED config (no autotuning, block
  sizes not chosen by M, no split-K); K is reduced in BLOCK_K steps, in order, into a float32
  accumulator. A row's value never meets another row's, and its reduction order depends on K only;
- RMSNorm: one program per row, the whole row in one block (a tree sum whose shape is set by the
  hidden size);
- attention: one program per (token, KV head), keys read through the block table in tiles of
  KV_TILE positions whatever the engine's block size, an online softmax over the tiles in order.
  Batch-invariant mode lays every token out as its own decode row (engine/model_runner.py), so a
  prefill token, in a chunk or in a whole prompt, reduces over its keys exactly as a decode does.
SiLU-and-multiply is elementwise: PyTorch's CUDA kernels compute each element with one formula,
so they serve (on the CPU a vectorised body and a scalar tail can differ in the last bit, which is
why the CPU keeps its C kernel or one row a call there: kernels/invariant.py).
Plain-PyTorch references: F.linear, the model's RMSNorm, attention.decode_attention; tests compare
them on the CPU with TRITON_INTERPRET=1. Importing this module needs triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32  # fixed: never chosen from the shapes
KV_TILE = 16  # keys per online-softmax step, independent of the KV block size


def _interpreting() -> bool:
    """Under TRITON_INTERPRET=1 (tests on the CPU) tl.dot is numpy's matmul, i.e. the host BLAS,
    whose microkernel may sum a row in an order set by the row's place in the tile (seen with
    OpenBLAS on AMD Zen 5): the linear then reduces each tile as a broadcast product summed over K
    in order instead, which a GPU's MMA does implicitly. (The interpreter's tl.dot would also
    multiply a 16-bit float's uint16 storage.)"""
    return os.environ.get("TRITON_INTERPRET") == "1"


# M is not specialised on (Triton compiles separate variants for M == 1 and M % 16 == 0), so one
# compiled kernel serves every row count.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    WIDEN: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # Program (i, j): out[i*BM:(i+1)*BM, j*BN:(j+1)*BN]; x [M, K], w [N, K], both row-major.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):  # in order, one BK step at a time: no split-K
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )  # [BM, BK]
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )  # [BK, BN]
        if INTERPRETED:  # [BM, BK, 1] * [1, BK, BN] summed over K: a row's order ignores its place
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif WIDEN:  # float32 products, no TF32 rounding (exact for 16-bit inputs)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:  # 16-bit inputs on the tensor cores, float32 accumulation
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N] -> [..., N] in x's dtype, float32 accumulation."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    w = weight.contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _linear_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
            x2,
            w,
            bias if bias is not None else w,
            out,
            m,
            n,
            k,
            x2.stride(0),
            w.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            WIDEN=x.dtype == torch.float32,
            INTERPRETED=_interpreting(),
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
        )
    return out.reshape(*lead, n)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, FLOAT32: tl.constexpr, BLOCK: tl.constexpr):
    # Program r: row r of x [R, N], read whole; mean of squares in float32.
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + r * N + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * inv
    if not FLOAT32:  # as the model's RMSNorm: normalise in float32, scale in the model dtype
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * N + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N] with weight [N]; returns [..., N] in x's dtype."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight.contiguous(),
            out,
            n,
            eps,
            FLOAT32=x.dtype == torch.float32,
            BLOCK=triton.next_power_of_2(n),
        )
    return out.view(x.shape)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_bt,
    head_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    # Program (b, h): token b, KV head h and its GROUP query heads, over positions [0, ctx) in
    # tiles of TILE positions; position p is at slot table[p // BLOCK_SIZE] * BLOCK_SIZE + p % ...
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, TILE)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_off = b * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)  # [G, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(0, ctx, TILE):
        pos = t0 + offs_t  # [TILE]
        live = pos < ctx
        block = tl.load(block_tables_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=live, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        base = kvh * head_stride + slot[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = live[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, D]
        v = tl.load(v_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, TILE]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    q, k_cache, v_cache, block_tables, context_lens, scale: float, block_size: int
) -> torch.Tensor:
    """Each row of q [B, heads, D] over its own context_lens[b] positions, read in place through
    block_tables [B, max_blocks] from caches [kv_heads, num_slots, D]; returns [B, heads, D]."""
    b, heads, d = q.shape
    kvh = k_cache.shape[0]
    group = heads // kvh
    out = torch.empty_like(q)
    if b:
        _attention_kernel[(b, kvh)](
            q.contiguous(),
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            scale,
            block_tables.stride(0),
            k_cache.stride(0),
            NUM_HEADS=heads,
            HEAD_DIM=d,
            D_PAD=triton.next_power_of_2(d),
            GROUP=group,
            G_PAD=triton.next_power_of_2(group),
            BLOCK_SIZE=block_size,
            TILE=KV_TILE,
        )
    return out
