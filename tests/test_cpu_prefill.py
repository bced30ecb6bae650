"""The bf16 prefill-attention kernel (kernels/cpu/prefill.py), in each mode this CPU runs (AMX
tiles, AVX512-BF16 registers), against float32 attention written out by hand, and its place in
chunk_attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.kernels.attention import chunk_attention, write_kv
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import prefill as cpu_prefill


@pytest.fixture(params=cpu_prefill.MODES)
def mode(request):
    """The kernel in one mode (the `choice`, KernelConfig.prefill_attention, that asks for it):
    amx needs amx_bf16 in /proc/cpuinfo and Linux's AMX permission, dpbf16 avx512_bf16 (an AMX
    CPU runs both); both need cc."""
    if cpu_prefill.mode(request.param) != request.param:
        pytest.skip(f"this CPU or compiler cannot run the {request.param} prefill kernel")
    return request.param


def _reference(q, k, v, nc, scale):
    """float32 causal attention of q [Tq, H, D] at positions nc.. over k, v [nc + Tq, KVH, D]."""
    tq, heads, _ = q.shape
    group = heads // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,lhd->htl", q.float(), kk) * scale
    keep = torch.arange(k.shape[0])[None, :] <= torch.arange(nc, nc + tq)[:, None]  # [Tq, L]
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", p, vv)


def _sdpa_bf16(q, k, v, nc, scale):
    keep = torch.arange(k.shape[0])[None, :] <= torch.arange(nc, nc + q.shape[0])[:, None]
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=keep, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _case(tq, nc, heads, kvh, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, heads, d, generator=g).bfloat16()
    k = torch.randn(nc + tq, kvh, d, generator=g).bfloat16()
    return q, k, torch.randn(nc + tq, kvh, d, generator=g).bfloat16()


@pytest.mark.parametrize(
    "tq,nc,heads,kvh,d",
    [
        (1, 0, 2, 1, 64),  # one token
        (15, 0, 9, 3, 64),  # under one tile of rows
        (16, 0, 9, 3, 64),
        (17, 0, 4, 4, 64),  # one row past a tile, no grouping
        (33, 0, 14, 2, 64),  # GQA 7
        (100, 45, 6, 3, 128),  # after a cached prefix, keys not a multiple of 32
        (64, 300, 8, 2, 128),
        (512, 0, 9, 3, 64),  # the SmolLM2-135M shape of the prefill
    ],
)
def test_prefill_kernel_matches_float32_attention(tq, nc, heads, kvh, d, mode):
    q, k, v = _case(tq, nc, heads, kvh, d)
    scale = d**-0.5
    ref = _reference(q, k, v, nc, scale)
    out = cpu_prefill.prefill_attention(q, k, v, nc, scale, mode)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = (out.float() - ref).abs()
    sdpa_err = (_sdpa_bf16(q, k, v, nc, scale).float() - ref).abs()
    # No worse than PyTorch's own bf16 attention: P and the output rounded to bf16, nothing else.
    assert err.max() <= 2 * sdpa_err.max() + 1e-3
    assert err.mean() <= 2 * sdpa_err.mean() + 1e-4
    assert err.max() < 3e-2


def test_prefill_kernel_reads_strided_views_and_threads_agree(mode):
    q, k, v = _case(70, 30, 6, 2, 64, seed=1)
    ref = cpu_prefill.prefill_attention(q, k, v, 30, 0.125, mode)
    # head-major caches, as chunk_attention gathers them: [KVH, L, D] viewed as [L, KVH, D]
    kh, vh = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    qs = torch.empty(6, 70, 64, dtype=q.dtype).copy_(q.transpose(0, 1)).transpose(0, 1)
    out = cpu_prefill.prefill_attention(qs, kh.transpose(0, 1), vh.transpose(0, 1), 30, 0.125, mode)
    assert torch.equal(out, ref)  # each output row's arithmetic depends on its own inputs only
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_prefill.prefill_attention(q, k, v, 30, 0.125, mode), ref)
    finally:
        torch.set_num_threads(threads)


def test_prefill_kernel_refuses_what_it_cannot_serve():
    q, k, _ = _case(8, 0, 4, 2, 64)
    assert not cpu_prefill.supports(q.float(), k.float())  # float32: SDPA
    q32, k32, _ = _case(8, 0, 4, 2, 32)
    assert not cpu_prefill.supports(q32, k32)  # head_dim not a multiple of 64


def test_sdpa_choice_turns_the_kernel_off(monkeypatch):
    """KernelConfig(prefill_attention="sdpa") (LLMCTL_KERNELS=prefill_attention=sdpa), or native
    off: chunk attention keeps SDPA, the kernel never called."""
    assert cpu_prefill.mode("sdpa") is None
    q, k, v = _case(8, 0, 4, 2, 64)
    assert not cpu_prefill.supports(q, k, "sdpa")
    calls = []
    real = cpu_prefill.prefill_attention
    monkeypatch.setattr(cpu_prefill, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    kc = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    slots = torch.arange(8)
    for kernels in (KernelConfig(prefill_attention="sdpa"), KernelConfig(native=False)):
        out = chunk_attention(q, k, v, kc, kc, slots, 0, 0.125, kernels=kernels)
        torch.testing.assert_close(out, _sdpa_bf16(q, k, v, 0, 0.125))
    assert calls == []


@pytest.mark.parametrize("prefix", [0, 37])
def test_chunk_attention_routes_bf16_to_the_kernel(prefix, mode, monkeypatch):
    """chunk_attention in bf16 with the kernel against its SDPA route, with and without a cached
    prefix in a paged (scattered slots) cache."""
    heads, kvh, d, tq = 9, 3, 64, 50
    q, k_all, v_all = _case(tq, prefix, heads, kvh, d, seed=2)
    kc = torch.zeros(kvh, 256, d, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(256, generator=torch.Generator().manual_seed(0))[: prefix + tq]
    write_kv(kc, vc, k_all, v_all, slots)
    args = (q, k_all[prefix:], v_all[prefix:], kc, vc, slots, prefix, d**-0.5)
    calls = []
    real = cpu_prefill.prefill_attention
    monkeypatch.setattr(cpu_prefill, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    out = chunk_attention(*args, kernels=KernelConfig(prefill_attention=mode))
    assert calls == [1]
    sdpa = chunk_attention(*args, kernels=KernelConfig(prefill_attention="sdpa"))
    assert calls == [1]
    ref = _reference(q, k_all, v_all, prefix, d**-0.5)
    assert (out.float() - ref).abs().max() <= 2 * (sdpa.float() - ref).abs().max() + 1e-3
