"""The CPU decode-attention reference: block gathers, length-sorted runs, reused buffers."""

from __future__ import annotations

import torch

from llmctl.kernels.attention import (
    GatherWorkspace,
    PagedAttentionMetadata,
    _decode,
    decode_attention,
    length_groups,
)


def _naive(q, kc, vc, tables, lens, scale, bs):
    """Per sequence, per head: softmax(q K^T) V over the sequence's own positions."""
    out = torch.empty_like(q)
    heads, kvh = q.shape[1], kc.shape[0]
    for b in range(q.shape[0]):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(int(lens[b]))])
        for h in range(heads):
            k, v = kc[h // (heads // kvh), slots], vc[h // (heads // kvh), slots]
            out[b, h] = torch.softmax(q[b, h] @ k.T * scale, -1) @ v
    return out


def test_length_groups_split_sorted_lengths_into_equal_runs():
    assert length_groups([40, 33, 20, 17, 9, 4, 2, 1], 4) == [
        (0, 2, 10),
        (2, 4, 5),
        (4, 6, 3),
        (6, 8, 1),
    ]
    assert length_groups([5, 3, 1], 4, max_groups=4) == [(0, 1, 2), (1, 2, 1), (2, 3, 1)]


def test_grouped_decode_attention_equals_naive_attention():
    torch.manual_seed(0)
    heads, kvh, d, bs, num_blocks = 6, 2, 8, 4, 40
    kc, vc = torch.randn(kvh, num_blocks * bs, d), torch.randn(kvh, num_blocks * bs, d)
    lens = [23, 20, 14, 9, 8, 5, 3, 1, 1]  # longest first, as the model runner orders decodes
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[used : used + need] + [0] * (6 - need))  # padded with a valid block id
        used += need
    q = torch.randn(len(lens), heads, d)
    t, l = torch.tensor(tables), torch.tensor(lens)
    ref = _naive(q, kc, vc, tables, lens, 0.3, bs)
    torch.testing.assert_close(
        decode_attention(q, kc, vc, t, l, 0.3, bs), ref, rtol=1e-5, atol=1e-5
    )
    ws = GatherWorkspace()
    meta = PagedAttentionMetadata(None, len(lens), t, l, [], bs, length_groups(lens, bs), ws)
    torch.testing.assert_close(_decode(q, kc, vc, meta, 0.3, None), ref, rtol=1e-5, atol=1e-5)
    first = ws.get(1, kc)[0]
    torch.testing.assert_close(_decode(q, kc, vc, meta, 0.3, None), ref, rtol=1e-5, atol=1e-5)
    assert (
        ws.get(1, kc)[0].data_ptr() == first.data_ptr()
    )  # the buffers are reused, not reallocated


def test_chunk_attention_after_cached_prefix_lower_right_bias_equals_explicit_mask():
    """The CausalBias route (CUDA's flash path; materialised on the CPU) against the explicit mask,
    and both against attention written out by hand, with grouped KV heads."""
    from llmctl.kernels.attention import chunk_attention, write_kv

    torch.manual_seed(0)
    heads, kvh, d, prefix, tq = 6, 2, 16, 11, 5
    kc, vc = torch.zeros(kvh, 64, d), torch.zeros(kvh, 64, d)
    slots = torch.randperm(64)[: prefix + tq]
    k_all, v_all = torch.randn(prefix + tq, kvh, d), torch.randn(prefix + tq, kvh, d)
    write_kv(kc, vc, k_all, v_all, slots)
    q = torch.randn(tq, heads, d)
    args = (q, k_all[prefix:], v_all[prefix:], kc, vc, slots, prefix, d**-0.5)
    explicit = chunk_attention(*args, lower_right=False)
    bias = chunk_attention(*args, lower_right=True)
    torch.testing.assert_close(bias, explicit)
    for t in range(tq):  # query t sees positions 0 .. prefix + t
        kk = k_all[: prefix + t + 1].repeat_interleave(heads // kvh, dim=1)  # [L, heads, D]
        vv = v_all[: prefix + t + 1].repeat_interleave(heads // kvh, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[t], kk) * d**-0.5, dim=-1)
        torch.testing.assert_close(
            explicit[t], torch.einsum("hl,lhd->hd", p, vv), rtol=1e-5, atol=1e-5
        )
