"""bf16 linears through float32 slabs (kernels/cpu/linear/torch_kernels.py) against float32 math,
and when they run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.kernels.cpu.library import load
from llmctl.kernels.cpu.linear import c_kernels, dispatch, torch_kernels


def _reference(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


@pytest.mark.parametrize("m,n,k", [(1, 8, 16), (40, 100, 64), (300, 48, 200), (64, 4100, 96)])
def test_upcast_linear_equals_float32_math(m, n, k, monkeypatch):
    monkeypatch.setattr(
        torch_kernels, "SLAB_BYTES", 4 * k * 32
    )  # 32-row slabs: several slabs and a ragged last one
    torch.manual_seed(m + n)
    x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    for bias in (None, b):
        out = torch_kernels.upcast(x, w, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n) and out.is_contiguous()
        # float32 sums in another order: equal up to one bf16 rounding step
        torch.testing.assert_close(out, _reference(x, w, bias), rtol=2**-7, atol=1e-2)


def test_upcast_linear_keeps_leading_dims():
    x, w = torch.randn(2, 5, 32).bfloat16(), torch.randn(24, 32).bfloat16()
    out = torch_kernels.upcast(x, w)
    assert out.shape == (2, 5, 24)
    torch.testing.assert_close(out, _reference(x, w), rtol=2**-7, atol=1e-2)
    assert torch_kernels.upcast(x[:, :0], w).shape == (2, 0, 24)


def test_slab_rows():
    assert (
        torch_kernels.slab_rows(896) % 16 == 0
        and torch_kernels.slab_rows(896) * 896 * 4 <= torch_kernels.SLAB_BYTES
    )
    assert torch_kernels.slab_rows(10**6) == 16


def test_use_upcast_rule(monkeypatch):
    x, w = torch.randn(64, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    monkeypatch.setattr(torch_kernels, "native_bf16", lambda: False)
    assert torch_kernels.use_upcast(x, w)
    assert not torch_kernels.use_upcast(x.float(), w.float())  # float32: the BLAS directly
    assert not torch_kernels.use_upcast(x, w.float())
    wg = w.clone().requires_grad_()
    assert not torch_kernels.use_upcast(x, wg)  # training needs autograd
    monkeypatch.setattr(torch_kernels, "native_bf16", lambda: True)
    assert not torch_kernels.use_upcast(x, w)  # native bf16: oneDNN's matmul


@pytest.mark.parametrize("native", [False, True])
def test_model_linear_routes_bf16_rows(native, monkeypatch):
    from llmctl.models.layers import Linear

    for module in (dispatch, torch_kernels):  # each reads the CPU's feature by its own name
        monkeypatch.setattr(module, "native_bf16", lambda: native)
    layer = Linear(64, 40, bias=True).bfloat16()
    calls = []
    monkeypatch.setattr(
        torch_kernels, "upcast", lambda *a: calls.append("upcast") or _reference(*a)
    )
    monkeypatch.setattr(c_kernels, "native", lambda *a: calls.append("native") or _reference(*a))
    few = torch.randn(2, 64).bfloat16()
    many = torch.randn(dispatch.NATIVE_ROWS_PER_THREAD * torch.get_num_threads() + 1, 64).bfloat16()
    with torch.no_grad():
        layer(few), layer(many)
    if native:
        assert calls == []  # both rows counts: F.linear
    elif load("core") is not None:
        assert calls == ["native", "upcast"]
    else:
        assert calls == ["upcast"]
