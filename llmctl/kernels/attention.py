"""Attention over the paged KV cache: the dispatcher and the plain-PyTorch references.

Owns: `paged_attention`, which sends each step to the Triton kernels (CUDA, kernels/cuda), the C
kernels (CPU, kernels/cpu/attention.py and prefill.py, as the calling layer's KernelConfig allows)
or the PyTorch references here; writing new K/V into cache slots; and the references for the two
attention shapes the engine issues each step: a batch of single-token decodes, and one multi-token
chunk (prefill, possibly after cached context).
Cache layout per layer: [kv_heads, num_blocks * block_size, head_dim], head-major, so a gather of
any sequence's slots is already [kv_heads, L, D]: batched matmuls read it without a transposing
copy. Slot = block * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from llmctl.kernels import invariant
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import attention as cpu_attention
from llmctl.kernels.cpu import prefill as cpu_prefill
from llmctl.kernels.kv_dtype import to_cache, widen, write_rows

DEFAULT_KERNELS = KernelConfig()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    native: bool = True,
) -> None:
    """k, v [T, kv_heads, D] into the flat slots [T] of the caches, in the caches' dtype (in one C
    call where `native` and it applies)."""
    if native and cpu_attention.use_write_kv_i8(k_cache, v_cache, k, v, slots):
        return cpu_attention.write_kv_i8(k_cache, v_cache, k, v, slots)
    k, v = to_cache(k, k_cache.dtype, native), to_cache(v, v_cache.dtype, native)
    if native and cpu_attention.use_write_kv(k_cache, v_cache, k, v, slots):
        return cpu_attention.write_kv(k_cache, v_cache, k, v, slots)
    write_rows(k_cache, slots, k)
    write_rows(v_cache, slots, v)


class GatherWorkspace:
    """Reusable buffers for the K and V that decode attention gathers each layer.

    A fresh allocation of this size (tens of MB at batch 64) every layer costs page faults that
    measured as much as the copy itself on the CPU; the buffers grow to the largest step and stay.
    """

    def __init__(self):
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def get(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            self._k is None
            or self._k.numel() < numel
            or self._k.dtype != like.dtype
            or self._k.device != like.device
        ):
            self._k = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._v = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._k[:numel], self._v[:numel]


def decode_attention(
    q: torch.Tensor,  # [B, heads, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, nb] block ids of each sequence (padding: any valid block)
    context_lens: torch.Tensor,  # [B] int64, cached tokens with the new one (<= nb * block_size)
    scale: float,
    block_size: int,
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:
    """Returns [B, heads, D].

    K/V are gathered a whole block at a time: the cache viewed as
    [kv_heads, num_blocks, block_size * D] makes each block one contiguous row, which copies about
    4x faster than gathering token slots (B=64, 528 positions, fp32, 1 thread). Explicit batched
    matmuls rather than SDPA: for one query token per sequence, PyTorch's CPU flash kernel measured
    about 5x slower here. Query heads are grouped by the KV head they share, so K/V are never
    repeated per query head."""
    b, heads, d = q.shape
    kvh, w = k_cache.shape[0], k_cache.shape[-1]  # w: a cached row (D, or int8's D + scale)
    nb = block_tables.shape[1]
    length = nb * block_size
    flat = block_tables.reshape(-1)  # [B * nb]
    kb = k_cache.view(kvh, -1, block_size * w)  # [kv_heads, num_blocks, block_size * w]
    vb = v_cache.view(kvh, -1, block_size * w)
    if workspace is None:
        k, v = kb.index_select(1, flat), vb.index_select(1, flat)
    else:
        k, v = workspace.get(kvh * flat.numel() * block_size * w, k_cache)
        torch.index_select(kb, 1, flat, out=k.view(kvh, flat.numel(), block_size * w))
        torch.index_select(vb, 1, flat, out=v.view(kvh, flat.numel(), block_size * w))
    k = widen(k.view(kvh * b, length, w), q.dtype)  # [kv_heads * B, L, D]
    v = widen(v.view(kvh * b, length, w), q.dtype)
    qg = q.view(b, kvh, heads // kvh, d).transpose(0, 1).reshape(kvh * b, heads // kvh, d)
    scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale  # [kv_heads * B, group, L]
    valid = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    scores = scores.view(kvh, b, -1, length).masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kvh * b, -1, length)
    out = torch.bmm(probs, v).view(kvh, b, heads // kvh, d)
    return out.transpose(0, 1).reshape(b, heads, d)


def length_groups(
    context_lens: list[int], block_size: int, max_groups: int = 4
) -> list[tuple[int, int, int]]:
    """Split decodes sorted by context length (longest first) into at most `max_groups` runs of
    equal count: (start, end, blocks) per run, `blocks` the widest table in it. Each run pads only
    to its own longest sequence, so gathered bytes follow the real lengths, not B x the longest."""
    b = len(context_lens)
    groups, size = [], -(-b // max_groups)
    for s in range(0, b, size):
        e = min(b, s + size)
        groups.append((s, e, -(-max(context_lens[s:e]) // block_size)))
    return groups


def chunk_attention(
    q: torch.Tensor,  # [Tq, heads, D]: tokens at positions num_computed .. num_computed + Tq - 1
    k_new: torch.Tensor,  # [Tq, kv_heads, D]
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [>= num_computed + Tq] slot ids of the sequence's positions
    num_computed: int,
    scale: float,
    lower_right: bool | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:
    """Causal attention of one chunk over its cached prefix and itself; returns [Tq, heads, D].

    A chunk with nothing cached before it is plain causal attention (SDPA's flash backend on CUDA).
    After a cached prefix the mask is causal aligned to the bottom right; `lower_right` (default: on
    CUDA) says so with PyTorch's CausalBias, which SDPA dispatches to its flash kernel there,
    instead of a materialised [Tq, total] mask that only the slower backends take. bfloat16 on a
    CPU with AMX goes to kernels/cpu/prefill.py (1.5-2x SDPA's CPU flash kernel there), as
    `kernels` (native, prefill_attention) allows."""
    tq = q.shape[0]
    # An fp8 cache: the chunk's own K/V as the cache holds them too (paged_attention passes them
    # so), so a prompt's outputs do not depend on how it was chunked or what the prefix cache hit.
    native = kernels.native
    k_new, v_new = widen(k_new, q.dtype, native), widen(v_new, q.dtype, native)
    mode = kernels.prefill_attention
    if native and cpu_prefill.supports(q, k_new, mode):
        if num_computed == 0:
            return cpu_prefill.prefill_attention(q, k_new, v_new, 0, scale, mode)
        # [kvh, total, D] gathered, widened (an fp8 cache: the gathered rows only), [total, kvh, D]
        k = widen(k_cache.index_select(1, slots[: num_computed + tq]), q.dtype, native)
        v = widen(v_cache.index_select(1, slots[: num_computed + tq]), q.dtype, native)
        return cpu_prefill.prefill_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), num_computed, scale, mode
        )
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, Tq, D]
    if num_computed == 0:  # nothing cached before: plain causal attention on the new K/V
        k = k_new.transpose(0, 1).unsqueeze(0)
        v = v_new.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    total = num_computed + tq
    k = widen(k_cache.index_select(1, slots[:total]).unsqueeze(0), q.dtype)  # [1, kvh, total, D]
    v = widen(v_cache.index_select(1, slots[:total]).unsqueeze(0), q.dtype)
    if q.is_cuda if lower_right is None else lower_right:
        group = q.shape[1] // k.shape[1]
        if group > 1:  # CausalBias's flash route takes equal head counts only
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            qh, k, v, attn_mask=causal_lower_right(tq, total), scale=scale
        )
    else:
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
    """Where each packed token's K/V goes and what it attends to. Decodes come first in the
    batch."""

    __slots__ = (
        "slot_mapping",
        "num_decodes",
        "decode_block_tables",
        "decode_context_lens",
        "prefills",
        "block_size",
        "decode_groups",
        "workspace",
        "decode_max_len",
        "batch_invariant",
        "derived",
    )

    def __init__(
        self,
        slot_mapping,
        num_decodes,
        decode_block_tables,
        decode_context_lens,
        prefills,
        block_size,
        decode_groups=None,
        workspace: GatherWorkspace | None = None,
        decode_max_len: int = 0,
        batch_invariant: bool = False,
    ):
        self.slot_mapping = slot_mapping  # [T] int64
        self.num_decodes = num_decodes  # tokens [0, num_decodes) are one-token decodes
        self.decode_block_tables = decode_block_tables  # [num_decodes, max_blocks] int64 or None
        self.decode_context_lens = decode_context_lens  # [num_decodes] int64 or None
        self.prefills = prefills  # list[PrefillChunk]
        self.block_size = block_size
        # (start, end, blocks) runs of decodes, longest first (see length_groups); None: one run
        self.decode_groups = decode_groups
        self.workspace = workspace
        self.decode_max_len = decode_max_len  # max(decode_context_lens) as an int; 0: not given
        # Every token is a "decode" row (prefill tokens too, each with its own context length),
        # and linears and the MLP take the fixed-order paths of kernels/invariant.py.
        self.batch_invariant = batch_invariant
        # views of these fields that every layer of a step would otherwise derive again (a
        # window's shifted block tables: attention_features.py), keyed by what derives them
        self.derived: dict = {}


def _triton_kernels(t: torch.Tensor):
    """The Triton (write_kv, decode_attention) on CUDA when triton imports; None elsewhere."""
    if not t.is_cuda:
        return None
    try:
        from llmctl.kernels.cuda.attention import decode_attention_triton, write_kv_triton
    except ImportError:  # no triton: the references run on CUDA too
        return None
    return write_kv_triton, decode_attention_triton


def _decode(
    q,
    k_cache,
    v_cache,
    meta: PagedAttentionMetadata,
    scale: float,
    triton,
    kernels: KernelConfig = DEFAULT_KERNELS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    fixed = invariant.triton_kernels(q, kernels) if meta.batch_invariant else None
    if fixed is not None:  # keys in tiles of a fixed size, whatever the block size
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        return fixed.paged_attention(q, k_cache, v_cache, tables, lens, scale, meta.block_size)
    if triton is not None:
        return triton[1](
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            meta.block_size,
        )
    tables, lens, bs = meta.decode_block_tables, meta.decode_context_lens, meta.block_size
    if meta.decode_max_len and kernels.native and cpu_attention.supports(q, k_cache):
        return cpu_attention.paged_decode_attention(  # reads blocks in place
            q, k_cache, v_cache, tables, lens, scale, bs, meta.decode_max_len,
            kernels.decode_attention, out,
        )  # fmt: skip
    if meta.batch_invariant:
        return _decode_per_row(q, k_cache, v_cache, tables, lens, scale, bs)
    if not meta.decode_groups or len(meta.decode_groups) == 1:
        return decode_attention(q, k_cache, v_cache, tables, lens, scale, bs, meta.workspace)
    out = torch.empty_like(q)
    for s, e, nb in meta.decode_groups:
        out[s:e] = decode_attention(
            q[s:e], k_cache, v_cache, tables[s:e, :nb], lens[s:e], scale, bs, meta.workspace
        )
    return out


def decode_cached(q, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float, kernels):
    """Attention of the decode rows q [B, heads, D] over K/V already in the caches (as
    paged_attention's decode part, without writing K/V): [B, heads, D]."""
    return _decode(q, k_cache, v_cache, meta, scale, _triton_kernels(q), kernels)


def _decode_per_row(q, k_cache, v_cache, tables, lens, scale: float, bs: int) -> torch.Tensor:
    """Decode attention one row at a time over exactly its own positions, so a row's shapes (and
    so its reduction order) depend on its context length alone, not on its batch-mates or the
    block size: the batch-invariant path where the C kernel does not apply. q [B, heads, D]."""
    b, heads, d = q.shape
    kvh = k_cache.shape[0]
    out = torch.empty_like(q)
    offsets = torch.arange(bs, device=q.device)
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, : -(-n // bs)]
        slots = (blocks[:, None] * bs + offsets).reshape(-1)[:n]  # [n]
        k = widen(k_cache.index_select(1, slots), q.dtype)  # [kv_heads, n, D]
        v = widen(v_cache.index_select(1, slots), q.dtype)
        qg = q[i].view(kvh, heads // kvh, d)
        scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale  # [kv_heads, group, n]
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[i] = torch.bmm(probs, v).view(heads, d)
    return out


def paged_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: PagedAttentionMetadata,
    scale: float,
    kernels: KernelConfig = DEFAULT_KERNELS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] for the packed batch; writes K/V and returns
    [T, heads, D]. `kernels`: which CPU kernels may serve (the calling layer's KernelConfig).
    `out` [T, heads, D] contiguous: a lean step's buffer (models/step.py, which checked once for
    every layer that the caches, slots and K/V are as the C kernels read them, and the C kernels
    on): K/V through the C write at any row count, and a step of decodes alone into `out`."""
    triton = None if out is not None else _triton_kernels(q)
    nd = meta.num_decodes
    if triton or nd < q.shape[0]:  # prefill chunks attend over K/V as the cache holds them
        k, v = (
            to_cache(k, k_cache.dtype, kernels.native),
            to_cache(v, v_cache.dtype, kernels.native),
        )
    if triton:
        triton[0](k_cache, v_cache, k, v, meta.slot_mapping)
    elif out is not None and k.dtype is k_cache.dtype:
        cpu_attention.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    else:  # a quantized cache's decode rows are converted by the write (int8: in C)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kernels.native)
    if nd == q.shape[0]:
        return _decode(q, k_cache, v_cache, meta, scale, triton, kernels, out)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale, triton, kernels)
    for p in meta.prefills:
        s, e = p.start, p.start + p.length
        out[s:e] = chunk_attention(
            q[s:e], k[s:e], v[s:e], k_cache, v_cache, p.slots, p.num_computed, scale,
            kernels=kernels,
        )  # fmt: skip
    return out
