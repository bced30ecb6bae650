"""The AVX512-BF16 paged decode kernel (cpu_paged_attention_dpbf16.c) against the PyTorch reference
and the generic C kernel, and the properties batch-invariant mode relies on: each test runs in
both variants, `vdpbf16ps` items and AMX tiles (`paged_decode_amx`; skipped where the CPU lacks
AMX-BF16)."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmctl.kernels.attention import PagedAttentionMetadata, decode_attention, paged_attention
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import attention as cpu_attention
from tests.test_cpu_native import _case

pytestmark = [
    pytest.mark.skipif(
        shutil.which("cc") is None and shutil.which("gcc") is None,
        reason="needs a C compiler to build the native kernels",
    ),
    pytest.mark.skipif(
        not cpu_attention.dpbf16_available(),
        reason="the CPU lacks avx512_bf16 (or the compiler its intrinsics): the kernel never runs",
    ),
]

LENS = [1, 15, 16, 17, 703, 2, 64, 129]  # one token, a block's edges, long, odd and even


# the variant -> the KernelConfig.decode_attention choice that runs it
CHOICE = {"dpbf16": "dpbf16", "amx": "auto"}


@pytest.fixture(autouse=True, params=["dpbf16", "amx"])
def variant(request):
    """The kernel variant under test, chosen through KernelConfig.decode_attention (`choice`):
    "auto" takes AMX tiles where they run, "dpbf16" never does."""
    if request.param == "amx" and not cpu_attention.amx_available():
        pytest.skip("this CPU or compiler cannot run AMX-BF16 tiles")
    want = "paged_decode_amx" if request.param == "amx" else "paged_decode_dpbf16"
    bf16 = torch.bfloat16
    assert cpu_attention.decode_kernel(bf16, bf16, CHOICE[request.param]) == want
    return request.param


def _run(q, kc, vc, tables, lens, bs, variant, threads=1):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        d = q.shape[-1]
        return cpu_attention.paged_decode_attention(
            q, kc, vc, tables, lens, d**-0.5, bs, int(lens.max()), CHOICE[variant]
        )
    finally:
        torch.set_num_threads(before)


# SmolLM2-135M, Qwen2.5-0.5B, a D=128 head, D % 32 == 16, and more than 8 heads per KV head
@pytest.mark.parametrize(
    "heads,kvh,d", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (6, 1, 48), (16, 1, 64)]
)
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference(heads, kvh, d, bs, threads, variant):
    q, kc, vc, tables, lt = _case(heads, kvh, d, bs, LENS, torch.bfloat16, seed=bs + d)
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lt, d**-0.5, bs)
    out = _run(q, kc, vc, tables, lt, bs, variant, threads=threads)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # the output's bf16 rounding (1/256 relative) plus P rounded to bf16 before P V
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1.6e-2)
    # closer than PyTorch's own bf16 decode (bf16 scores and P): measured 0.6-0.7x its mean error,
    # and 1.2-1.3x the generic kernel's (float32 P)
    torch_bf16 = decode_attention(q, kc, vc, tables, lt, d**-0.5, bs).float()
    assert (out.float() - ref).abs().mean() < (torch_bf16 - ref).abs().mean()


def test_a_row_alone_equals_the_row_in_its_batch(variant):
    q, kc, vc, tables, lt = _case(14, 2, 64, 16, LENS, torch.bfloat16, seed=5)
    full = _run(q, kc, vc, tables, lt, 16, variant)
    for rows in ([4], [0, 4], [3, 1, 7], [6, 2]):
        idx = torch.tensor(rows)
        width = max(-(-LENS[i] // 16) for i in rows)  # a narrower table, a smaller max_len
        part = _run(q[idx], kc, vc, tables[idx, :width], lt[idx], 16, variant)
        assert torch.equal(part, full[idx]), rows


def test_threads_agree_bit_for_bit(variant):
    q, kc, vc, tables, lt = _case(9, 3, 64, 16, LENS, torch.bfloat16, seed=7)
    one = _run(q, kc, vc, tables, lt, 16, variant)
    assert torch.equal(one, _run(q, kc, vc, tables, lt, 16, variant, threads=2))


def _relayout(cache, tables, lens, bs, new_bs):
    """The same sequences' rows in a fresh cache with blocks of new_bs, in reversed block order."""
    kvh, _, d = cache.shape
    need = [-(-int(n) // new_bs) for n in lens]
    out = torch.zeros(kvh, (sum(need) + 1) * new_bs, d, dtype=cache.dtype)
    new_tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    free = list(range(sum(need), 0, -1))
    for i, n in enumerate(lens.tolist()):
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(n)])
        new_tables[i, : need[i]] = torch.tensor([free.pop() for _ in range(need[i])])
        new_slots = new_tables[i, torch.arange(n) // new_bs] * new_bs + torch.arange(n) % new_bs
        out[:, new_slots] = cache[:, slots]
    return out, new_tables


@pytest.mark.parametrize("new_bs", [32, 5])
def test_block_size_does_not_change_a_bit(new_bs, variant):
    q, kc, vc, tables, lt = _case(9, 3, 64, 16, LENS, torch.bfloat16, seed=11)
    k2, t2 = _relayout(kc, tables, lt, 16, new_bs)
    v2, _ = _relayout(vc, tables, lt, 16, new_bs)
    relaid = _run(q, k2, v2, t2, lt, new_bs, variant)
    if variant == "amx" and new_bs % 16:  # blocks AMX tiles do not fit: the vdpbf16ps items
        assert torch.equal(relaid, _run(q, k2, v2, t2, lt, new_bs, "dpbf16"))
        return
    assert torch.equal(_run(q, kc, vc, tables, lt, 16, variant), relaid)


def test_served_for_bf16_only_and_switched_off_by_the_config(variant, monkeypatch):
    """bf16 query and cache only (a float32 query is not rounded to bf16), unless
    KernelConfig.decode_attention is "generic" (LLMCTL_KERNELS=decode_attention=generic), which
    the calling layer hands paged_attention."""
    bf16, f32 = torch.bfloat16, torch.float32
    want = "paged_decode_amx" if variant == "amx" else "paged_decode_dpbf16"
    assert cpu_attention.decode_kernel(bf16, bf16, CHOICE[variant]) == want
    assert cpu_attention.decode_kernel(f32, bf16, CHOICE[variant]) == "paged_decode_bf16"
    assert cpu_attention.decode_kernel(f32, f32, CHOICE[variant]) == "paged_decode_f32"
    assert cpu_attention.decode_kernel(bf16, bf16, "generic") == "paged_decode_bf16"
    q, kc, vc, tables, lt = _case(9, 3, 64, 16, [5, 40], torch.bfloat16)
    kernels = []
    real = cpu_attention.load("core")

    class Library:  # the core library, recording which decode kernel each call takes
        def __getattr__(self, name):
            kernels.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_attention, "load", lambda name: Library())
    for choice in (CHOICE[variant], "generic"):
        meta = PagedAttentionMetadata(
            torch.zeros(0, dtype=torch.long), 2, tables, lt, [], 16, decode_max_len=40
        )
        empty = torch.zeros(0, 3, 64, dtype=torch.bfloat16)
        paged_attention(q, empty, empty, kc, vc, meta, 0.125, KernelConfig(decode_attention=choice))
    assert kernels[-2:] == [want, "paged_decode_bf16"]
