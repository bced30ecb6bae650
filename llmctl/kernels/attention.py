"""Attention over the paged KV cache: plain-PyTorch reference implementations.

Owns: writing new K/V into cache slots and the two attention shapes the engine issues each step:
a batch of single-token decodes, and one multi-token chunk (prefill, possibly after cached context).
Cache layout per layer: [kv_heads, num_blocks * block_size, head_dim], head-major, so a gather of
any sequence's slots is already [kv_heads, L, D]: batched matmuls read it without a transposing
copy. Slot = block * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, D] into the flat slots [T] of the caches."""
    k_cache.index_copy_(1, slots, k.transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))


def block_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, nb] block ids -> [B, nb * block_size] slot ids, in position order."""
    offs = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :, None] * block_size + offs).reshape(block_tables.shape[0], -1)


def decode_attention(
    q: torch.Tensor,  # [B, heads, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B, L] slot ids of each sequence's positions (padding: any valid slot)
    context_lens: torch.Tensor,  # [B] int64, tokens in cache including the new one
    scale: float,
) -> torch.Tensor:
    """Returns [B, heads, D].

    Explicit batched matmuls rather than SDPA: for one query token per sequence, PyTorch's CPU
    flash kernel measured about 5x slower here (B=64, 9 heads, 3 KV heads, 272 positions, bf16).
    Query heads are grouped by the KV head they share, so K/V are never repeated per query head."""
    b, heads, d = q.shape
    kvh = k_cache.shape[0]
    length = slots.shape[1]
    flat = slots.reshape(-1)
    k = k_cache.index_select(1, flat).view(kvh * b, length, d)  # [kv_heads * B, L, D]
    v = v_cache.index_select(1, flat).view(kvh * b, length, d)
    qg = q.view(b, kvh, heads // kvh, d).transpose(0, 1).reshape(kvh * b, heads // kvh, d)
    scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale  # [kv_heads * B, group, L]
    valid = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    scores = scores.view(kvh, b, -1, length).masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kvh * b, -1, length)
    out = torch.bmm(probs, v).view(kvh, b, heads // kvh, d)
    return out.transpose(0, 1).reshape(b, heads, d)


def chunk_attention(
    q: torch.Tensor,  # [Tq, heads, D]: tokens at positions num_computed .. num_computed + Tq - 1
    k_new: torch.Tensor,  # [Tq, kv_heads, D]
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [>= num_computed + Tq] slot ids of the sequence's positions
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
        k = k_cache.index_select(1, slots[:total]).unsqueeze(0)  # [1, kv_heads, total, D]
        v = v_cache.index_select(1, slots[:total]).unsqueeze(0)
        qpos = torch.arange(num_computed, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [Tq, total]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class PrefillChunk:
    """One multi-token chunk inside the packed batch: tokens [start, start + length)."""

    __slots__ = ("start", "length", "num_computed", "slots")

    def __init__(self, start: int, length: int, num_computed: int, slots: torch.Tensor):
        self.start, self.length, self.num_computed, self.slots = start, length, num_computed, slots


class PagedAttentionMetadata:
    """Where each packed token's K/V goes and what it attends to. Decodes come first in the batch."""

    __slots__ = ("slot_mapping", "num_decodes", "decode_block_tables", "decode_context_lens", "prefills",
                 "block_size", "_decode_slots")

    def __init__(self, slot_mapping, num_decodes, decode_block_tables, decode_context_lens, prefills, block_size):
        self.slot_mapping = slot_mapping  # [T] int64
        self.num_decodes = num_decodes  # tokens [0, num_decodes) are one-token decodes
        self.decode_block_tables = decode_block_tables  # [num_decodes, max_blocks] int64 or None
        self.decode_context_lens = decode_context_lens  # [num_decodes] int64 or None
        self.prefills = prefills  # list[PrefillChunk]
        self.block_size = block_size
        self._decode_slots = None

    @property
    def decode_slots(self) -> torch.Tensor:
        """[num_decodes, max_blocks * block_size] slot ids, computed once per step for all layers."""
        if self._decode_slots is None:
            self._decode_slots = block_slots(self.decode_block_tables, self.block_size)
        return self._decode_slots


def _triton_kernels(t: torch.Tensor):
    """The Triton (write_kv, decode_attention) on CUDA when triton imports; None elsewhere."""
    if not t.is_cuda:
        return None
    try:
        from llmctl.kernels.triton_attention import decode_attention_triton, write_kv_triton
    except ImportError:  # no triton: the references run on CUDA too
        return None
    return write_kv_triton, decode_attention_triton


def _decode(q, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float, triton) -> torch.Tensor:
    if triton is not None:
        return triton[1](q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, meta.block_size)
    return decode_attention(q, k_cache, v_cache, meta.decode_slots, meta.decode_context_lens, scale)


def paged_attention(q, k, v, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] for the packed batch; writes K/V, returns [T, heads, D]."""
    triton = _triton_kernels(q)
    (triton[0] if triton else write_kv)(k_cache, v_cache, k, v, meta.slot_mapping)
    nd = meta.num_decodes
    if nd == q.shape[0]:
        return _decode(q, k_cache, v_cache, meta, scale, triton)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale, triton)
    for p in meta.prefills:
        s, e = p.start, p.start + p.length
        out[s:e] = chunk_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, p.slots, p.num_computed, scale)
    return out
