"""Triton kernels against their plain-PyTorch references, on the CPU through TRITON_INTERPRET=1.

The kernels run in a subprocess: the interpreter flag must be set before triton is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is a Linux x86_64 dependency of llmctl")

SCRIPT = textwrap.dedent(
    """
    import torch
    from llmctl.kernels.attention import decode_attention, write_kv
    from llmctl.kernels.cuda.attention import decode_attention_triton, write_kv_triton

    torch.manual_seed(0)
    for heads, kvh, d, bs in [(4, 2, 16, 4), (6, 2, 8, 2), (3, 3, 12, 4), (8, 1, 16, 8)]:
        nb = 12
        kc = torch.randn(kvh, nb * bs, d); vc = torch.randn(kvh, nb * bs, d)
        kc2, vc2 = kc.clone(), vc.clone()
        slots = torch.tensor([5, 0, 17, nb * bs - 1])
        k = torch.randn(4, kvh, d); v = torch.randn(4, kvh, d)
        write_kv(kc, vc, k, v, slots)
        write_kv_triton(kc2, vc2, k, v, slots)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), "kv write"
        tables = torch.tensor([[3, 7, 1, 0], [2, 5, 9, 11], [4, 0, 0, 0]])
        lens = torch.tensor([3 * bs - 1, 4 * bs, 1])
        q = torch.randn(3, heads, d)
        ref = decode_attention(q, kc, vc, tables, lens, d ** -0.5, bs)
        out = decode_attention_triton(q, kc, vc, tables, lens, d ** -0.5, bs)
        err = (ref - out).abs().max().item()
        assert err < 1e-5, (heads, kvh, d, bs, err)
    from llmctl.kernels.kv_dtype import to_cache  # fp8 caches (--kv-cache-dtype fp8)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        kc = torch.zeros(2, 48, 16, dtype=dt); vc = torch.zeros_like(kc)
        kc2, vc2 = kc.clone(), vc.clone()
        slots = torch.tensor([5, 0, 17, 47])
        k = torch.randn(4, 2, 16) * 3; v = torch.randn(4, 2, 16)
        write_kv(kc, vc, k, v, slots)
        write_kv_triton(kc2, vc2, to_cache(k, dt), to_cache(v, dt), slots)
        assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8)), "fp8 kv write"
        tables = torch.tensor([[3, 7, 1, 0], [2, 5, 9, 11], [4, 0, 0, 0]])
        lens = torch.tensor([11, 16, 1])
        q = torch.randn(3, 4, 16)
        ref = decode_attention(q, kc, vc, tables, lens, 0.25, 4)
        out = decode_attention_triton(q, kc, vc, tables, lens, 0.25, 4)
        assert (ref - out).abs().max().item() < 1e-5, dt
    print("OK")
    """
)


def test_triton_kernels_match_references_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
