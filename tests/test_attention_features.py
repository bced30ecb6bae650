"""Sliding-window decode attention in bf16 (kernels/attention_features.py): every row read in
place by the C kernel that skips each row's first tokens, against the gathered-window path it
replaced, a float32 reference over exactly the window, and itself row by row."""

from __future__ import annotations

import pytest
import torch

from llmctl.kernels import attention_features as af
from llmctl.kernels.attention import PagedAttentionMetadata, decode_cached
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import attention as cpu_attention

KVH, G, D, BS, BLOCKS = 2, 3, 64, 16, 200
LENS = [5, 40, 100, 517, 33, 260, 64, 65]

pytestmark = pytest.mark.skipif(
    not cpu_attention.dpbf16_available(), reason="needs the AVX512-BF16 decode kernel"
)


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(KVH, BLOCKS * BS, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(KVH, BLOCKS * BS, D, generator=g).to(torch.bfloat16)
    tables = torch.stack([torch.randperm(BLOCKS, generator=g)[:40] for _ in LENS])
    q = torch.randn(len(LENS), KVH * G, D, generator=g).to(torch.bfloat16)
    return q, kc, vc, tables, torch.tensor(LENS)


def _meta(tables, lens):
    return PagedAttentionMetadata(None, len(lens), tables, lens, [], BS, None, None, int(max(lens)))


def _reference(q, kc, vc, tables, lens, window: int) -> torch.Tensor:
    """float32 attention of each row over positions [len - window, len)."""
    out = torch.empty(q.shape)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window), n)
        slots = tables[b, pos // BS] * BS + pos % BS
        k, v = kc[:, slots].float(), vc[:, slots].float()
        p = torch.softmax(q[b].float().view(KVH, G, D) @ k.transpose(1, 2) * D**-0.5, -1)
        out[b] = (p @ v).view(-1, D)
    return out


def _gathered(q, kc, vc, tables, lens, f, kernels):
    """The path the in-place kernel replaced: rows within the window in place, the others'
    windows gathered into a scratch cache."""
    meta, out = _meta(tables, lens), torch.empty_like(q)
    inside = lens <= f.sliding_window
    rows = (~inside).nonzero().squeeze(1)
    out[rows] = af._gathered_windows(q[rows], kc, vc, af._rows(meta, rows), f, kernels)
    rows = inside.nonzero().squeeze(1)
    out[rows] = decode_cached(q[rows], kc, vc, af._rows(meta, rows), f.scale, kernels)
    return out


@pytest.mark.parametrize("window", [8, 17, 64, 100, 512])
def test_windows_read_in_place_equal_the_gathered_windows(window):
    q, kc, vc, tables, lens = _case()
    f, kernels = af.Features(D**-0.5, window, None), KernelConfig()
    meta = _meta(tables, lens)
    got = af._decodes(q, kc, vc, meta, f, kernels)
    assert ("window", window) in meta.derived  # the in-place kernel served
    assert torch.equal(got, _gathered(q, kc, vc, tables, lens, f, kernels))
    torch.testing.assert_close(got.float(), _reference(q, kc, vc, tables, lens, window),
                               rtol=0, atol=2e-2)  # fmt: skip
    if window <= 64:  # a window one token wider is visible beyond the tolerance
        wider = _reference(q, kc, vc, tables, lens, window + 1)
        assert (got.float() - wider).abs().max() > 2e-2


def test_a_row_alone_equals_the_row_in_the_batch():
    q, kc, vc, tables, lens = _case(1)
    f, kernels = af.Features(D**-0.5, 64, None), KernelConfig()
    batch = af._decodes(q, kc, vc, _meta(tables, lens), f, kernels)
    for b in range(len(LENS)):
        one = af._decodes(
            q[b : b + 1], kc, vc, _meta(tables[b : b + 1], lens[b : b + 1]), f, kernels
        )
        assert torch.equal(one, batch[b : b + 1]), b


def test_zero_skips_is_the_plain_kernel():
    q, kc, vc, tables, lens = _case(2)
    plain = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens, 0.125, BS, max(LENS))
    skipped = cpu_attention.paged_decode_attention(
        q,
        kc,
        vc,
        tables,
        lens,
        0.125,
        BS,
        max(LENS),
        skips=torch.zeros(len(LENS), dtype=torch.int64),
    )
    assert torch.equal(plain, skipped)


def _chunk_reference(q, kc, vc, slots, done: int, window: int) -> torch.Tensor:
    """float32: query i at position done + i over keys max(0, p - window + 1) .. p."""
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        p = done + i
        s = slots[max(0, p - window + 1) : p + 1]
        k, v = kc[:, s].float(), vc[:, s].float()
        w = torch.softmax(q[i].float().view(KVH, G, D) @ k.transpose(1, 2) * D**-0.5, -1)
        out[i] = (w @ v).view(-1, D)
    return out


@pytest.mark.parametrize(("done", "n", "window"), [(0, 70, 32), (40, 50, 33), (600, 48, 512)])
def test_a_chunk_longer_than_its_window_takes_the_prefill_kernel(done, n, window):
    """The C prefill kernel with a window (P = 0 before each query's window) equals a float32
    reference over exactly each query's window, as closely as the masked-SDPA path it replaced."""
    from llmctl.kernels.attention import PrefillChunk
    from llmctl.kernels.cpu import prefill as cpu_prefill

    if not cpu_prefill.supports(torch.zeros(1, 2, D, dtype=torch.bfloat16),
                                torch.zeros(1, 1, D, dtype=torch.bfloat16)):  # fmt: skip
        pytest.skip("needs the C prefill kernel")
    g = torch.Generator().manual_seed(done + n)
    kc = torch.randn(KVH, BLOCKS * BS, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(KVH, BLOCKS * BS, D, generator=g).to(torch.bfloat16)
    slots = torch.randperm(BLOCKS * BS, generator=g)[: done + n]
    q = torch.randn(n, KVH * G, D, generator=g).to(torch.bfloat16)
    k, v = kc[:, slots[done:]].transpose(0, 1), vc[:, slots[done:]].transpose(0, 1)
    chunk = PrefillChunk(0, n, done, slots)
    f = af.Features(D**-0.5, window, None)
    got = af._windowed_chunk(q, k, v, kc, vc, chunk, f, KernelConfig())
    sdpa = af._windowed_chunk(q, k, v, kc, vc, chunk, f, KernelConfig(native=False))
    ref = _chunk_reference(q, kc, vc, slots, done, window)
    err, sdpa_err = (got.float() - ref).abs().max(), (sdpa.float() - ref).abs().max()
    assert err <= max(2 * sdpa_err, 1e-2), (err, sdpa_err)
    wider = _chunk_reference(q, kc, vc, slots, done, window + 1)
    assert (got.float() - wider).abs().max() > 4 * err  # one key more is visible
