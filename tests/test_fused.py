"""Merged projections (models/merged.py) and the fused element-wise kernels
(kernels/cpu/elementwise.py) against the PyTorch reference: float32 tight, bfloat16 to bf16
tolerance, odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import elementwise as cpu_fused
from llmctl.kernels.cpu.library import load
from llmctl.models import merged as merging
from llmctl.models.layers import Linear, RMSNorm
from llmctl.models.prepare import Serving, prepare_for_inference
from llmctl.runtime.weights import load_model
from tests.conftest import make_random_model

needs_native = pytest.mark.skipif(
    load("core") is None, reason="native CPU kernels unavailable (no C compiler)"
)


def _reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm arithmetic in plain tensor ops."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,f", [(1, 1), (3, 13), (17, 96), (65, 1537)])
def test_silu_and_mul_matches_pytorch(dtype, rows, f):
    torch.manual_seed(rows + f)
    x = (torch.randn(rows, 2 * f) * 4).to(dtype)
    ref = F.silu(x[:, :f]).mul_(x[:, f:])  # the reference's two roundings in bf16
    with torch.inference_mode():
        assert cpu_fused.use_silu_and_mul(x)
        out = cpu_fused.silu_and_mul(x)
    assert out.shape == (rows, f) and out.dtype is dtype
    if dtype is torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:  # expf may differ in its last bit: one bf16 step at most
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    x3 = x.view(1, rows, 2 * f)  # leading dimensions kept
    assert cpu_fused.silu_and_mul(x3).shape == (1, rows, f)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 8), (5, 24), (67, 584)])
def test_add_rms_norm_matches_add_then_norm(dtype, rows, k):
    torch.manual_seed(rows * k)
    x, r = torch.randn(rows, k).to(dtype), (torch.randn(rows, k) * 3).to(dtype)
    w = (torch.rand(k) + 0.5).to(dtype)
    ref_x = x.clone().add_(r)
    ref = _reference_norm(ref_x, w, 1e-6)
    got_x = x.clone()
    with torch.inference_mode():
        assert cpu_fused.use_add_rms_norm(got_x, r, w)
        out = cpu_fused.add_rms_norm(got_x, r, w, 1e-6)
    assert torch.equal(got_x, ref_x)  # the residual stream, updated in place as add_ does
    if dtype is torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_fused_kernels_refuse_what_they_cannot_serve():
    x = torch.randn(4, 16)
    assert not cpu_fused.use_silu_and_mul(x[:, :14])  # strided
    assert not cpu_fused.use_silu_and_mul(torch.randn(4, 15))  # odd width
    assert not cpu_fused.use_silu_and_mul(x.double())
    assert not cpu_fused.use_add_rms_norm(x, torch.randn(4, 16).bfloat16(), torch.ones(16))
    assert not cpu_fused.use_add_rms_norm(torch.randn(4, 12), torch.randn(4, 12), torch.ones(12))
    g = torch.randn(4, 16, requires_grad=True)
    assert not cpu_fused.use_add_rms_norm(g, x, torch.ones(16))


def test_rms_norm_add_forward_equals_add_then_norm():
    norm = RMSNorm(24, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24) + 0.5)
    x, r = torch.randn(3, 24), torch.randn(3, 24)
    with torch.inference_mode():
        ref = norm(x.clone().add_(r))
        x2 = x.clone()
        out = norm.add_forward(x2, r)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x2, x + r)
        assert torch.equal(norm.add_forward(x2, None), norm(x2))


def _linears(n_out=(8, 4, 4), k=16, bias=False, dtype=torch.float32):
    torch.manual_seed(0)
    return [Linear(k, n, bias=bias).to(dtype) for n in n_out]


@pytest.mark.parametrize("bias", [False, True])
def test_merge_views_the_parts_and_matches_them(bias):
    parts = _linears(bias=bias)
    before = [(p.weight.clone(), None if p.bias is None else p.bias.clone()) for p in parts]
    x = torch.randn(5, 16)
    with torch.no_grad():
        refs = [p(x) for p in parts]
    m = merging.merge(parts, Linear)
    assert m is not None and m.sizes == (8, 4, 4) and m.live(*parts)
    storage = m.linear.weight.untyped_storage().data_ptr()
    for p, (w, b) in zip(parts, before):
        assert torch.equal(p.weight, w) and p.weight.untyped_storage().data_ptr() == storage
        assert p.weight.requires_grad and isinstance(p.weight, torch.nn.Parameter)
        if bias:
            assert torch.equal(p.bias, b)
    with torch.no_grad():
        for got, ref in zip(m.linear(x).split(m.sizes, dim=-1), refs):
            torch.testing.assert_close(got, ref)
        parts[1].weight.mul_(2)  # in place through a part: the merged weight sees it
        torch.testing.assert_close(m.linear(x)[:, 8:12], parts[1](x))


def test_merge_refuses_mixed_parts_and_notices_replaced_ones():
    parts = _linears()
    assert merging.merge([parts[0], torch.nn.Linear(16, 4)], Linear) is None  # not our Linear
    assert merging.merge([parts[0], Linear(8, 4)], Linear) is None  # another K
    assert merging.merge([parts[0], parts[1].bfloat16()], Linear) is None  # another dtype
    parts = _linears()
    m = merging.merge(parts, Linear)
    parts[2].weight.data = parts[2].weight.data.clone()  # e.g. pruned into a new tensor
    assert not m.live(*parts)
    m = merging.merge(parts, Linear)
    assert m.live(*parts) and not m.live(parts[0], Linear(16, 4), parts[2])
    handle = parts[0].register_forward_hook(lambda *a: None)  # calibration's input hooks
    assert not m.live(*parts)
    handle.remove()
    assert m.live(*parts)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp(request.param), request.param)


def _prepare(model, dtype: str, **kernels) -> None:
    """What an engine start does to the model (no plans)."""
    config = KernelConfig(autotune=False, **kernels)
    prepare_for_inference(model, config, Serving("cpu", getattr(torch, dtype), 64, 8))


def _logits(model, ids):
    with torch.inference_mode():
        return model.forward_dense(ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_model_keeps_names_memory_and_outputs(tiny, dtype, monkeypatch):
    model, _ = load_model(tiny, dtype, "cpu")
    names = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 160, (2, 11))
    ref = _logits(model, ids)
    _prepare(model, dtype)  # engine start: merges, no plans
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.merged is not None and mlp.merged is not None
    assert mlp.merged.linear.weight.shape == (2 * 96, 64)
    state = model.state_dict()
    assert state.keys() == names.keys() and all(torch.equal(state[k], names[k]) for k in names)
    assert sum(p.numel() for p in model.parameters()) == params  # nothing registered twice
    got = _logits(model, ids)
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    _prepare(model, dtype, merge_linears=False)
    assert attn.merged is None and mlp.merged is None
    torch.testing.assert_close(_logits(model, ids), ref, rtol=tol, atol=tol)


def test_merged_model_trains_through_the_parts(tiny):
    model, _ = load_model(tiny, "float32", "cpu")
    twin, _ = load_model(tiny, "float32", "cpu")
    _prepare(model, "float32")
    model.requires_grad_(True), twin.requires_grad_(True)  # as the distill student is
    ids = torch.randint(0, 160, (2, 9))
    for m in (model, twin):
        m.forward_dense(ids).logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_engine_tokens_merged_or_not(shakespeare_model, monkeypatch):
    from llmctl.engine.params import SamplingParams
    from llmctl.llm import LLM

    prompts = [[int(t) for t in torch.randint(0, 60, (n,))] for n in (3, 40, 17)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    merged = LLM(str(shakespeare_model), dtype="float32")
    assert merged.runtime.model.layers[0].mlp.merged is not None
    out = [o.output_token_ids for o in merged.generate(prompts, params)]
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,merge_linears=0")
    plain = LLM(str(shakespeare_model), dtype="float32")
    assert plain.runtime.model.layers[0].mlp.merged is None
    assert [o.output_token_ids for o in plain.generate(prompts, params)] == out
