"""Attention over the paged KV cache: plain-PyTorch reference implementations.

Owns: writing new K/V into cache slots and the two attention shapes the engine issues each step:
a batch of single-token decodes, and one multi-token chunk (prefill, possibly after cached context).
Cache layout per layer: [num_blocks, block_size, kv_heads, head_dim]; slot = block * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into the flat slots [T] of the caches."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """block_tables [B, nb] -> [B, kv_heads, nb * block_size, D] (padding blocks included)."""
    b, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache[block_tables].view(b, nb * bs, kvh, d).transpose(1, 2)


def decode_attention(
    q: torch.Tensor,  # [B, heads, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64; unused entries point at any valid block
    context_lens: torch.Tensor,  # [B] int64, tokens in cache including the new one
    scale: float,
) -> torch.Tensor:
    """Returns [B, heads, D].

    Explicit batched matmuls rather than SDPA: for one query token per sequence, PyTorch's CPU
    flash kernel measured about 5x slower here (B=64, 9 heads, 3 KV heads, 272 positions, bf16).
    Query heads are grouped by the KV head they share ([B, kv_heads, group, D]), so K/V are never
    repeated per query head."""
    b, heads, d = q.shape
    kvh = k_cache.shape[2]
    k = gather_context(k_cache, block_tables)  # [B, kv_heads, L, D]
    v = gather_context(v_cache, block_tables)
    length = k.shape[2]
    qg = q.view(b, kvh, heads // kvh, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, kv_heads, group, L]
    valid = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(b, heads, d)


def chunk_attention(
    q: torch.Tensor,  # [Tq, heads, D]: tokens at positions num_computed .. num_computed + Tq - 1
    k_new: torch.Tensor,  # [Tq, kv_heads, D]
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [nb] int64
    num_computed: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk over its cached prefix and itself; returns [Tq, heads, D]."""
    tq = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, Tq, D]
    if num_computed == 0:  # nothing cached before: plain causal attention on the new K/V
        k = k_new.transpose(0, 1).unsqueeze(0)
        v = v_new.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = num_computed + tq
        bs = k_cache.shape[1]
        nb = (total + bs - 1) // bs
        k = gather_context(k_cache, block_table[None, :nb])[:, :, :total]
        v = gather_context(v_cache, block_table[None, :nb])[:, :, :total]
        qpos = torch.arange(num_computed, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [Tq, total]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class PrefillChunk:
    """One multi-token chunk inside the packed batch: tokens [start, start + length)."""

    __slots__ = ("start", "length", "num_computed", "block_table")

    def __init__(self, start: int, length: int, num_computed: int, block_table: torch.Tensor):
        self.start, self.length, self.num_computed, self.block_table = start, length, num_computed, block_table


class PagedAttentionMetadata:
    """Where each packed token's K/V goes and what it attends to. Decodes come first in the batch."""

    __slots__ = ("slot_mapping", "num_decodes", "decode_block_tables", "decode_context_lens", "prefills")

    def __init__(self, slot_mapping, num_decodes, decode_block_tables, decode_context_lens, prefills):
        self.slot_mapping = slot_mapping  # [T] int64
        self.num_decodes = num_decodes  # tokens [0, num_decodes) are one-token decodes
        self.decode_block_tables = decode_block_tables  # [num_decodes, max_blocks] int64 or None
        self.decode_context_lens = decode_context_lens  # [num_decodes] int64 or None
        self.prefills = prefills  # list[PrefillChunk]


def _kernels_for(t: torch.Tensor):
    """(write_kv, decode_attention) for the tensor's device: Triton on CUDA when present."""
    if t.is_cuda:
        try:
            from llmctl.kernels.triton_attention import decode_attention_triton, write_kv_triton

            return write_kv_triton, decode_attention_triton
        except ImportError:  # no triton: the references run on CUDA too
            pass
    return write_kv, decode_attention


def paged_attention(q, k, v, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] for the packed batch; writes K/V, returns [T, heads, D]."""
    write, decode = _kernels_for(q)
    write(k_cache, v_cache, k, v, meta.slot_mapping)
    nd = meta.num_decodes
    if nd == q.shape[0]:
        return decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    for p in meta.prefills:
        s, e = p.start, p.start + p.length
        out[s:e] = chunk_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, p.block_table, p.num_computed, scale)
    return out
