"""Attention with the features some model families add, in plain PyTorch: a sliding window,
logit soft-capping, attention sinks (one learned logit per head that takes part of the softmax)
and any key/value head size, over the paged KV cache or over dense K/V.

Owns: `Features` (a layer's settings) and `paged_attention_with`, which serves the transformers
path (models/transformers_backend.py) for layers whose attention the kernels of
kernels/attention.py do not compute; `attend`, the one formula both use. Semantics as
transformers defines them: query i sees key j when j <= i and, with a window w, j > i - w;
soft-capping is cap * tanh(score / cap) after scaling; a sink is a column of the softmax that
is then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.kernels.attention import PagedAttentionMetadata, write_kv


@dataclass(frozen=True)
class Features:
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [heads], one logit each

    @property
    def plain(self) -> bool:
        """Nothing beyond causal scaled attention: kernels/attention.py serves it."""
        return not self.sliding_window and not self.softcap and self.sinks is None


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
    q, k, v, k_cache, v_cache, meta: PagedAttentionMetadata, f: Features, native: bool = True
) -> torch.Tensor:
    """As kernels/attention.paged_attention (q [T, H, D], k/v [T, KVH, D] of the packed batch,
    K/V written to their slots first; the decode rows first), with `f`'s features. Returns
    [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, native)
    out = torch.empty_like(q)
    nd, bs = meta.num_decodes, meta.block_size
    if nd:
        lens = meta.decode_context_lens  # [nd]: each row's context, itself included
        width = int(lens.max())
        p = torch.arange(width, device=q.device)
        slots = meta.decode_block_tables.gather(1, (p // bs).expand(nd, -1)) * bs + p % bs
        kk = k_cache[:, slots].permute(1, 2, 0, 3)  # [nd, width, KVH, D]
        vv = v_cache[:, slots].permute(1, 2, 0, 3)
        k_pos = p.expand(nd, -1)
        valid = k_pos < lens[:, None]  # padding past each row's context
        out[:nd] = attend(q[:nd, None], kk, vv, (lens - 1)[:, None], k_pos, f, valid)[:, 0]
    for chunk in meta.prefills:
        s, e, done = chunk.start, chunk.start + chunk.length, chunk.num_computed
        kk = k_cache[:, chunk.slots].transpose(0, 1)[None]  # [1, done + length, KVH, D]
        vv = v_cache[:, chunk.slots].transpose(0, 1)[None]
        q_pos = torch.arange(done, done + chunk.length, device=q.device)[None]
        k_pos = torch.arange(done + chunk.length, device=q.device)[None]
        out[s:e] = attend(q[None, s:e], kk, vv, q_pos, k_pos, f)[0]
    return out
