"""The Triton dequantize-GEMM (llmctl/kernels/cuda/quant.py) against its plain-PyTorch reference,
on the CPU through TRITON_INTERPRET=1 (and on CUDA when there is one), and QuantLinear's routing.

The kernel runs in a subprocess: the interpreter flag must be set before triton is first imported.
bfloat16 is checked on CUDA only: triton 3.9's interpreter multiplies bf16's uint16 storage in
tl.dot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llmctl.models.qlinear import QuantLinear, _use_triton

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import llmctl.models.qlinear as ql
    from llmctl.runtime.formats.packing import UnpackedLinear
    from llmctl.kernels.cuda.quant import quant_matmul_reference, quant_matmul_triton

    device, dtypes = sys.argv[1], [getattr(torch, d) for d in sys.argv[2].split(",")]
    g = torch.Generator().manual_seed(0)
    # (bits, group, M, N, K): M and N off the block sizes (16/32/64 and 64), BLOCK_K below, at and
    # equal to the group size, several groups per row.
    for bits, gs, m, n, k in [(4, 32, 1, 40, 64), (4, 16, 5, 72, 64), (4, 128, 33, 24, 256),
                              (8, 64, 33, 100, 128), (8, 32, 5, 20, 64)]:
        for dt in dtypes:
            shape = (n, k // 2 if bits == 4 else k)
            q = torch.randint(0, 256 if bits == 4 else 2**bits, shape, generator=g,
                              dtype=torch.uint8)
            s = (torch.rand(n, k // gs, generator=g) * 0.01 + 0.001).to(dt)
            z = torch.randint(0, 2**bits, (n, k // gs), generator=g, dtype=torch.uint8)
            x = torch.randn(m, k, generator=g).to(dt)
            q, s, z, x = (t.to(device) for t in (q, s, z, x))
            ref = quant_matmul_reference(x, q, s, z, bits, gs).float()
            out = quant_matmul_triton(x, q, s, z, bits, gs)
            assert out.dtype == dt and out.shape == (m, n)
            # fp32 accumulation both sides; half types also round W and y to dt in the kernel
            tol = 1e-5 if dt == torch.float32 else 4e-3
            err = (out.float() - ref).abs().max().item()
            assert err <= tol * ref.abs().max().item(), (bits, gs, m, n, k, dt, err)

    # QuantLinear's packed buffers go straight into the kernel: forward through it (routing forced
    # on so the CPU interpreter runs it too) matches the dequantized matmul, bias and act-order
    # included.
    ql._use_triton = lambda *a: True
    for bits in (4, 8):
        codes = torch.randint(0, 2**bits, (48, 64), generator=g, dtype=torch.int32)
        u = UnpackedLinear(codes, torch.rand(48, 4, generator=g) * 0.01 + 0.001,
                           torch.randint(0, 2**bits, (48, 4), generator=g, dtype=torch.int32),
                           torch.randperm(64, generator=g).to(torch.int32) // 16, bits, 16,
                           bias=torch.randn(48, generator=g))
        lin = ql.QuantLinear.from_unpacked(u, torch.float32, device)
        assert not lin.use_int4_kernel
        x = torch.randn(3, 64, generator=g).to(device)
        ref = x @ u.dequantize().to(device).t() + u.bias.to(device)
        torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4)
    print("OK")
    """
)


def _run(device: str, dtypes: str, **env) -> None:
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, device, dtypes],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_quant_gemm_matches_reference_in_interpreter():
    pytest.importorskip("triton", reason="triton is a Linux x86_64 dependency of llmctl")
    _run("cpu", "float32,float16", TRITON_INTERPRET="1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quant_gemm_matches_reference_on_cuda():
    pytest.importorskip("triton")
    _run("cuda", "float32,float16,bfloat16")


def test_quant_linear_routes_small_cuda_batches_to_triton():
    from llmctl.kernels.cuda import quant as triton_quant

    cuda, cpu, small = torch.device("cuda"), torch.device("cpu"), QuantLinear.TRITON_MAX_TOKENS
    assert _use_triton(cuda, 1, 64) is triton_quant.available()
    assert _use_triton(cuda, small, 128) is triton_quant.available()
    assert not _use_triton(cuda, small + 1, 64)  # prefill: dequantize + cuBLAS
    assert not _use_triton(cpu, 1, 64)  # CPU paths unchanged
    assert not _use_triton(cuda, 1, 96) and not _use_triton(
        cuda, 1, 8
    )  # group not a power of two >= 16
