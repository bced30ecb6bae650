"""bf16 linears through float32 slabs (kernels/cpu_bf16.py) against float32 math, and when they
run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.kernels import cpu_bf16, cpu_native


def _reference(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (40, 100, 64), (300, 48, 200), (64, 4100, 96)])
def test_upcast_linear_equals_float32_math(m, n, k, monkeypatch):
    monkeypatch.setattr(
        cpu_bf16, "SLAB_BYTES", 4 * k * 32
    )  # 32-row slabs: several slabs and a ragged last one
    torch.manual_seed(m + n)
    x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    for bias in (None, b):
        out = cpu_bf16.upcast_linear(x, w, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n) and out.is_contiguous()
        # float32 sums in another order: equal up to one bf16 rounding step
        torch.testing.assert_close(out, _reference(x, w, bias), rtol=2**-7, atol=1e-2)


def test_upcast_linear_keeps_leading_dims():
    x, w = torch.randn(2, 5, 32).bfloat16(), torch.randn(24, 32).bfloat16()
    out = cpu_bf16.upcast_linear(x, w)
    assert out.shape == (2, 5, 24)
    torch.testing.assert_close(out, _reference(x, w), rtol=2**-7, atol=1e-2)
    assert cpu_bf16.upcast_linear(x[:, :0], w).shape == (2, 0, 24)


def test_slab_rows():
    assert (
        cpu_bf16.slab_rows(896) % 16 == 0
        and cpu_bf16.slab_rows(896) * 896 * 4 <= cpu_bf16.SLAB_BYTES
    )
    assert cpu_bf16.slab_rows(10**6) == 16


def test_use_upcast_rule(monkeypatch):
    x, w = torch.randn(64, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda: False)
    assert cpu_bf16.use_upcast(x, w)
    assert not cpu_bf16.use_upcast(x.float(), w.float())  # float32: the BLAS directly
    assert not cpu_bf16.use_upcast(x, w.float())
    wg = w.clone().requires_grad_()
    assert not cpu_bf16.use_upcast(x, wg)  # training needs autograd
    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda: True)
    assert not cpu_bf16.use_upcast(x, w)  # native bf16: oneDNN's matmul


@pytest.mark.parametrize("native", [False, True])
def test_model_linear_routes_bf16_rows(native, monkeypatch):
    from llmctl.models.llama import Linear

    monkeypatch.setattr(cpu_bf16, "native_bf16", lambda: native)
    layer = Linear(64, 40, bias=True).bfloat16()
    calls = []
    monkeypatch.setattr(
        cpu_bf16, "upcast_linear", lambda *a: calls.append("upcast") or _reference(*a)
    )
    monkeypatch.setattr(cpu_native, "linear", lambda *a: calls.append("native") or _reference(*a))
    few = torch.randn(2, 64).bfloat16()
    many = torch.randn(
        cpu_native.LINEAR_ROWS_PER_THREAD * torch.get_num_threads() + 1, 64
    ).bfloat16()
    with torch.no_grad():
        layer(few), layer(many)
    if native:
        assert calls == []  # both rows counts: F.linear
    elif cpu_native.library() is not None:
        assert calls == ["native", "upcast"]
    else:
        assert calls == ["upcast"]
