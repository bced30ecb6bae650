"""Attention with the features some model families add: a sliding window, logit soft-capping,
attention sinks (one learned logit per head that takes part of the softmax) and any key/value
head size, over the paged KV cache or over dense K/V.

Owns: `Features` (a layer's settings) and `paged_attention_with`, which serves the transformers
path (models/transformers_backend.py) for layers whose attention is not plain causal attention;
`attend`, the one formula in plain PyTorch. Semantics as transformers defines them: query i sees
key j when j <= i and, with a window w, j > i - w; soft-capping is cap * tanh(score / cap) after
scaling; a sink is a column of the softmax that is then dropped.

A window alone takes the fast kernels of kernels/attention.py: decode rows whose context fits in
the window read the cache in place; when some do not and the C `vdpbf16ps` kernel runs (bf16),
every row is read in place by its variant that skips a row's first tokens (each row's block table
shifted to its window's first block); elsewhere each row's last w positions are gathered into a
scratch cache of consecutive blocks (w x kv_heads x D a row) that the decode kernel reads. A
prefill chunk whose whole context fits is plain chunk attention; a longer one takes the C
prefill kernel with the window (bf16), else SDPA under the window's mask. Everything else
(soft-capping, sinks) runs `attend` over only the positions a query can see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmctl.kernels.attention import (
    PagedAttentionMetadata,
    chunk_attention,
    decode_cached,
    write_kv,
)
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import attention as cpu_attention
from llmctl.kernels.cpu import prefill as cpu_prefill
from llmctl.kernels.kv_dtype import to_cache, widen


@dataclass(frozen=True)
class Features:
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads], one logit each

    @property
    def window_only(self) -> bool:
        """No soft-capping and no sinks: causal attention, perhaps windowed."""
        return not self.softcap and self.sinks is None

    @property
    def plain(self) -> bool:
        """Nothing beyond causal scaled attention: kernels/attention.py serves it."""
        return self.window_only and not self.sliding_window


def attend(q, k, v, q_pos, k_pos, f: Features, k_valid=None) -> torch.Tensor:
    """q [N, Tq, H, D], k [N, L, KVH, D], v [N, L, KVH, Dv], q_pos [N, Tq], k_pos [N, L]
    (k_valid [N, L] bool: padding keys are False) -> [N, Tq, H, Dv], in q's dtype; scores in
    float32."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads != kv_heads:  # grouped-query: each K/V head serves heads // kv_heads query heads
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("nqhd,nkhd->nhqk", q.float(), k.float()) * f.scale  # [N, H, Tq, L]
    if f.softcap:
        scores = torch.tanh(scores / f.softcap) * f.softcap
    seen = k_pos[:, None, :] <= q_pos[:, :, None]  # [N, Tq, L]
    if f.sliding_window:
        seen &= k_pos[:, None, :] > q_pos[:, :, None] - f.sliding_window
    if k_valid is not None:
        seen &= k_valid[:, None, :]
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    if f.sinks is not None:
        sink = f.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhqk,nkhd->nqhd", probs, v.float())
    return out.to(q.dtype)


def paged_attention_with(
    q, k, v, k_cache, v_cache, meta: PagedAttentionMetadata, f: Features, kernels: KernelConfig
) -> torch.Tensor:
    """As kernels/attention.paged_attention (q [T, H, D], k/v [T, KVH, D] of the packed batch,
    K/V written to their slots first; the decode rows first), with `f`'s features. Returns
    [T, H, D]."""
    k, v = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)  # as kernels/attention.py
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kernels.native)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decodes(q[:nd], k_cache, v_cache, meta, f, kernels)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.start + chunk.length
        out[s:e] = _chunk(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, f, kernels)
    return out


def _window_slots(tables, lens, bs: int, width: int, padded: int):
    """Each row's last `width` positions (from 0 where it has fewer), laid out in `padded` >=
    width columns, the columns past them repeating its last position: (slots [n, padded],
    positions [n, padded], how many are real [n])."""
    starts = (lens - width).clamp(min=0)
    p = starts[:, None] + torch.arange(padded, device=lens.device)  # [n, padded]
    p = torch.minimum(p, (lens - 1)[:, None])
    slots = tables.gather(1, p // bs) * bs + p % bs
    return slots, p, lens - starts


def _rows(meta: PagedAttentionMetadata, rows: torch.Tensor) -> PagedAttentionMetadata:
    """The decode metadata of a subset of the decode rows (indices [n])."""
    lens = meta.decode_context_lens[rows]
    return PagedAttentionMetadata(
        None, rows.numel(), meta.decode_block_tables[rows], lens, [], meta.block_size, None,
        meta.workspace, int(lens.max()),
    )  # fmt: skip


def _decodes(q, k_cache, v_cache, meta: PagedAttentionMetadata, f: Features, kernels):
    """The decode rows q [nd, H, D] -> [nd, H, Dv]."""
    window, lens = f.sliding_window, meta.decode_context_lens
    longest = meta.decode_max_len or int(lens.max())
    if f.window_only and (not window or longest <= window):
        return decode_cached(q, k_cache, v_cache, meta, f.scale, kernels)
    if not f.window_only:
        width = min(window or longest, longest)
        tables, bs = meta.decode_block_tables, meta.block_size
        slots, pos, counts = _window_slots(tables, lens, bs, width, width)
        kk = widen(k_cache[:, slots].permute(1, 2, 0, 3), q.dtype)  # [nd, width, KVH, D]
        vv = widen(v_cache[:, slots].permute(1, 2, 0, 3), q.dtype)
        valid = torch.arange(width, device=q.device)[None] < counts[:, None]
        return attend(q[:, None], kk, vv, (lens - 1)[:, None], pos, f, valid)[:, 0]
    if kernels.native and cpu_attention.skips_served(q, k_cache, kernels.decode_attention):
        return _windows_in_place(q, k_cache, v_cache, meta, f, kernels)
    # rows within the window read the cache in place; the others their gathered windows
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    inside = lens <= window
    if inside.any():
        rows = inside.nonzero().squeeze(1)
        out[rows] = decode_cached(q[rows], k_cache, v_cache, _rows(meta, rows), f.scale, kernels)
    rows = (~inside).nonzero().squeeze(1)
    out[rows] = _gathered_windows(q[rows], k_cache, v_cache, _rows(meta, rows), f, kernels)
    return out


def _windows_in_place(q, k_cache, v_cache, meta: PagedAttentionMetadata, f: Features, kernels):
    """Every decode row over its window, read in place by the C kernel that skips each row's
    first tokens: the row's table starts at the block of its window's first position, and the
    positions of that block before it are skipped (P = 0). One call, no gather."""
    tables, lens, skips, longest = _window_tables(meta, f.sliding_window)
    return cpu_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, f.scale, meta.block_size, longest,
        kernels.decode_attention, skips=skips,
    )  # fmt: skip


def _window_tables(meta: PagedAttentionMetadata, window: int):
    """(tables [n, blocks], lens [n], skips [n], max len) of the decode rows shifted to their
    windows' first blocks; derived once a step, for every layer with this window."""
    key = ("window", window)
    if key not in meta.derived:
        bs, tables, lens = meta.block_size, meta.decode_block_tables, meta.decode_context_lens
        first = (lens - window).clamp(min=0)  # the first position a row's query sees
        shift = first // bs * bs  # [n]: positions before the window's first block
        width = min(tables.shape[1], -(-(window + bs - 1) // bs))
        cols = (shift // bs)[:, None] + torch.arange(width, device=lens.device)
        shifted = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))
        longest = min(meta.decode_max_len or int(lens.max()), window + bs - 1)
        meta.derived[key] = (shifted, lens - shift, first - shift, longest)
    return meta.derived[key]


def _gathered_windows(q, k_cache, v_cache, meta: PagedAttentionMetadata, f: Features, kernels):
    """Decode rows whose context is longer than the window: each row's window gathered into
    consecutive blocks of a scratch cache, which the decode kernel reads."""
    bs, width = meta.block_size, f.sliding_window
    padded = -(-width // bs) * bs
    slots, _, counts = _window_slots(
        meta.decode_block_tables, meta.decode_context_lens, bs, width, padded
    )
    kk = k_cache.index_select(1, slots.flatten())  # [KVH, n * padded, D]
    vv = v_cache.index_select(1, slots.flatten())
    n, per_row = q.shape[0], padded // bs
    tables = torch.arange(n * per_row, device=q.device).view(n, per_row)
    window_meta = PagedAttentionMetadata(
        None, n, tables, counts, [], bs, None, meta.workspace, width
    )  # fmt: skip
    return decode_cached(q, kk, vv, window_meta, f.scale, kernels)


def _chunk(q, k, v, k_cache, v_cache, chunk, f: Features, kernels) -> torch.Tensor:
    """One prefill chunk q [n, H, D] at positions done.. -> [n, H, Dv]."""
    done, n, window = chunk.num_computed, chunk.length, f.sliding_window
    if f.window_only and (not window or done + n <= window):
        return chunk_attention(
            q, k, v, k_cache, v_cache, chunk.slots, done, f.scale, kernels=kernels
        )
    if f.window_only:
        return _windowed_chunk(q, k, v, k_cache, v_cache, chunk, f, kernels)
    first = max(0, done + 1 - window) if window else 0  # the first key any query here sees
    slots = chunk.slots[first : done + n]
    q_pos = torch.arange(done, done + n, device=q.device)
    k_pos = torch.arange(first, done + n, device=q.device)
    kk = widen(k_cache[:, slots].transpose(0, 1)[None], q.dtype)  # [1, done + n - first, KVH, D]
    vv = widen(v_cache[:, slots].transpose(0, 1)[None], q.dtype)
    return attend(q[None], kk, vv, q_pos[None], k_pos[None], f)[0]


def _windowed_chunk(q, k, v, k_cache, v_cache, chunk, f: Features, kernels) -> torch.Tensor:
    """A chunk longer than the window, no other feature: its queries at positions below the
    window see every key before them (plain chunk attention, the fast kernels); the rest run
    SDPA with the window as a mask, [1, H, m, D] over [1, KVH, keys, D]. Where the C prefill
    kernel runs (bf16), the whole chunk is one call of it with the window, over the keys from the
    first one any of its queries sees."""
    done, n, window = chunk.num_computed, chunk.length, f.sliding_window
    if kernels.native and cpu_prefill.supports(q, k, kernels.prefill_attention):
        first = max(0, done + 1 - window)  # the first key any query of the chunk sees
        kk = k_cache.index_select(1, chunk.slots[first : done + n]).transpose(0, 1)
        vv = v_cache.index_select(1, chunk.slots[first : done + n]).transpose(0, 1)
        kk, vv = widen(kk, q.dtype), widen(vv, q.dtype)  # [done + n - first, KVH, D]
        return cpu_prefill.prefill_attention(
            q, kk, vv, done - first, f.scale, kernels.prefill_attention, window
        )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = max(0, min(n, window - done))  # queries [0, split) have no lower bound
    if split:
        out[:split] = chunk_attention(
            q[:split], k[:split], v[:split], k_cache, v_cache, chunk.slots, done, f.scale,
            kernels=kernels,
        )  # fmt: skip
    start = done + split  # the position of the first query with a lower bound
    first = start + 1 - window
    slots = chunk.slots[first : done + n]
    q_pos = torch.arange(start, done + n, device=q.device)
    k_pos = torch.arange(first, done + n, device=q.device)
    seen = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)
    rest = F.scaled_dot_product_attention(
        q[split:].transpose(0, 1)[None], widen(k_cache[:, slots][None], q.dtype),
        widen(v_cache[:, slots][None], q.dtype),
        attn_mask=seen, scale=f.scale, enable_gqa=True,
    )  # fmt: skip
    out[split:] = rest[0].transpose(0, 1)
    return out
