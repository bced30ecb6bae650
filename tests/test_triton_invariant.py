"""The batch-invariant Triton kernels (kernels/cuda/invariant.py) on the CPU through
TRITON_INTERPRET=1: each against its PyTorch reference, and a row's result bit-identical alone, in
batches of 2..7 rows at every position, past a BLOCK_M tile, and (attention) whatever the KV block
size. The kernels run in a subprocess: the interpreter flag must be set before triton is imported.
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
    import torch.nn.functional as F
    from llmctl.kernels.cuda import invariant as ti
    from llmctl.kernels.attention import decode_attention
    from llmctl.models.layers import RMSNorm

    def rows_invariant(fn, x, name):
        # fn(rows [R, ...]) -> [R, ...]: row i alone == row i in every batch of 2..7 rows that
        # holds it (at every position), and in one batch of all rows
        alone = [fn(x[i : i + 1])[0] for i in range(x.shape[0])]
        full = fn(x)
        for i in range(x.shape[0]):
            assert torch.equal(full[i], alone[i]), (name, "all rows", i)
        for size in range(2, 8):
            for start in range(0, x.shape[0] - size + 1, 3):
                out = fn(x[start : start + size])
                for j in range(size):
                    assert torch.equal(out[j], alone[start + j]), (name, size, start, j)

    g = torch.Generator().manual_seed(0)
    for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.15), (torch.float16, 0.05)):
        # K = 72: a partial BLOCK_K step; N = 70: a partial BLOCK_N tile; 40 rows: 2 BLOCK_M tiles
        x = torch.randn(40, 72, generator=g).to(dt)
        w = (torch.randn(70, 72, generator=g) / 4).to(dt)
        b = torch.randn(70, generator=g).to(dt)
        ref = F.linear(x.float(), w.float(), b.float())
        err = (ti.linear(x, w, b).float() - ref).abs().max().item()
        assert err < tol, ("linear", dt, err)
        assert ti.linear(x, w, None).shape == (40, 70)
        rows_invariant(lambda r: ti.linear(r, w, b), x, f"linear {dt}")
        norm = RMSNorm(72, 1e-6).to(dt)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(72, generator=g))
            ref = norm(x)  # the model's own path (C kernel or PyTorch)
        err = (ti.rms_norm(x, norm.weight, 1e-6).float() - ref.float()).abs().max().item()
        assert err < tol, ("rms_norm", dt, err)
        rows_invariant(lambda r: ti.rms_norm(r, norm.weight, 1e-6), x, f"rms_norm {dt}")

    # attention: 9 rows over contexts up to 37 positions laid out in blocks of 1, 4 or 16
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        heads, kvh, d = 6, 2, 12
        lens = torch.tensor([37, 1, 16, 17, 5, 33, 2, 31, 9])
        keys = torch.randn(len(lens), kvh, 37, d, generator=g).to(dt)
        vals = torch.randn(len(lens), kvh, 37, d, generator=g).to(dt)
        q = torch.randn(len(lens), heads, d, generator=g).to(dt)
        outs = []
        for bs in (1, 4, 16):
            nb = -(-37 // bs)
            perm = torch.randperm(len(lens) * nb + 3, generator=g)  # scattered blocks
            tables = perm[: len(lens) * nb].view(len(lens), nb)
            kc = torch.zeros(kvh, (len(lens) * nb + 3) * bs, d, dtype=dt)
            vc = torch.zeros_like(kc)
            for i in range(len(lens)):
                slots = (tables[i][:, None] * bs + torch.arange(bs)).reshape(-1)[:37]
                kc[:, slots], vc[:, slots] = keys[i], vals[i]
            args = (kc, vc, tables, lens, d ** -0.5, bs)
            out = ti.paged_attention(q, *args)
            ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, d ** -0.5, bs)
            err = (out.float() - ref).abs().max().item()
            assert err < tol, ("attention", dt, bs, err)
            for size in (1, 2, 3, 7):
                for start in range(0, len(lens) - size + 1, 2):
                    sub = ti.paged_attention(
                        q[start : start + size], kc, vc, tables[start : start + size],
                        lens[start : start + size], d ** -0.5, bs,
                    )
                    assert torch.equal(sub, out[start : start + size]), ("attn rows", bs, size)
            outs.append(out)
        assert all(torch.equal(o, outs[0]) for o in outs), ("attention across block sizes", dt)
    print("OK")
    """
)


def test_invariant_triton_kernels_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
