"""Triton kernels for the CUDA path: KV-cache writes through the slot mapping, and decode attention
that reads the block table directly (no gathered copy of the context).

Owns: the kernels and their launch wrappers. Their plain-PyTorch references are `write_kv` and
`decode_attention` in `llmctl/kernels/attention.py`; tests compare the two on the CPU with
TRITON_INTERPRET=1. Importing this module needs triton; callers check `triton_available()` first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    head_stride,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    # Program (t, h): token t, KV head h; its D values go to cache[h, slot, :].
    t = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, D_PAD)
    mask = offs < HEAD_DIM
    src = (t * nh + h) * HEAD_DIM + offs
    dst = h * head_stride + slot * HEAD_DIM + offs
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def write_kv_triton(k_cache, v_cache, k, v, slots) -> None:
    """k, v [T, kv_heads, D] into caches [kv_heads, num_slots, D] at flat `slots` [T]."""
    t, kvh, d = k.shape
    _write_kv_kernel[(t, kvh)](
        k.contiguous(),
        v.contiguous(),
        k_cache,
        v_cache,
        slots,
        k_cache.stride(0),
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
    )


@triton.jit
def _paged_decode_kernel(
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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Program (b, h): sequence b, KV head h, all GROUP query heads that share it. Online softmax
    # over the sequence's blocks, read in place through its block table.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, BLOCK_SIZE)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [G, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    for i in range(0, n_blocks):
        block = tl.load(block_tables_ptr + b * stride_bt + i).to(tl.int64)
        base = (
            kvh * head_stride + (block * BLOCK_SIZE + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
        )
        kv_mask = ((i * BLOCK_SIZE + offs_s) < ctx)[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)  # [S, D]
        v = tl.load(v_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        s = tl.where(((i * BLOCK_SIZE + offs_s) < ctx)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def decode_attention_triton(
    q, k_cache, v_cache, block_tables, context_lens, scale: float, block_size: int
) -> torch.Tensor:
    """As `attention.decode_attention`, but reading block tables [B, max_blocks] directly:
    q [B, heads, D] -> [B, heads, D]; caches [kv_heads, num_slots, D]."""
    b, heads, d = q.shape
    kvh = k_cache.shape[0]
    bs = block_size
    group = heads // kvh
    out = torch.empty_like(q)
    q = q.contiguous()
    _paged_decode_kernel[(b, kvh)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale,
        block_tables.stride(0),
        k_cache.stride(0),
        NUM_HEADS=heads,
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
        GROUP=group,
        G_PAD=max(triton.next_power_of_2(group), 1),
        BLOCK_SIZE=bs,
    )
    return out
