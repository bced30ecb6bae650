"""RTN, GPTQ, AWQ and the shared Hessian helpers, each on a tiny random layer."""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.hessian import HessianAccumulator, damped_cholesky_inverse
from llmctl.compress.quant.awq import (
    fold_into_norm,
    quantize_awq,
    scale_linear_input,
    search_scales,
)
from llmctl.compress.quant.gptq import quantize_gptq
from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.errors import LlmctlError, UsageError
from llmctl.runtime.formats.spec import QuantSpec, check_group_size, dequantize


def _layer(out_f=48, in_f=64, tokens=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    # correlated inputs with a few loud channels, like real activations
    mix = torch.randn(in_f, in_f, generator=g) / in_f**0.5 + torch.eye(in_f)
    x = torch.randn(tokens, in_f, generator=g) @ mix
    x[:, :4] *= 8.0
    return w, x


def _out_err(x, w, wq):
    return float((x @ (w - wq).t()).pow(2).mean())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_codes_scales_zeros_reconstruct_within_half_step(bits, symmetric):
    w, _ = _layer()
    spec = QuantSpec(bits=bits, group_size=16, symmetric=symmetric, scale_dtype=torch.float32)
    r = quantize_rtn(w, spec)
    assert r.codes.dtype == torch.int32 and r.codes.min() >= 0 and r.codes.max() <= 2**bits - 1
    assert r.scales.shape == (48, 4) and r.zeros.shape == (48, 4)
    if symmetric:
        assert (r.zeros == 2 ** (bits - 1)).all()
    assert torch.equal(r.weight, dequantize(r.codes, r.scales, r.zeros, r.group_index()))
    step = r.scales.repeat_interleave(16, dim=1)
    assert ((r.weight - w).abs() <= step / 2 + 1e-6).all()


def test_rtn_more_bits_smaller_error_and_zero_group_exact():
    w, _ = _layer()
    w[:, :16] = 0.0
    e4 = (quantize_rtn(w, QuantSpec(4, 16)).weight - w).abs().mean()
    r8 = quantize_rtn(w, QuantSpec(8, 16))
    assert (r8.weight - w).abs().mean() < e4 / 8
    assert (r8.weight[:, :16] == 0).all()


def test_group_size_refusal_names_layer_and_working_sizes():
    with pytest.raises(
        UsageError,
        match=r"mlp.down_proj: 704 .* --group-size 128; group sizes that work: 16, 32, 64",
    ):
        check_group_size("model.layers.0.mlp.down_proj", 704, 128)
    check_group_size("x", 704, 64)


def test_hessian_accumulator_matches_batch_formula():
    _, x = _layer()
    acc = HessianAccumulator(64)
    for chunk in x.reshape(4, -1, 64):
        acc.add(chunk[None])  # [1, tokens, in]
    assert acc.num_tokens == 512
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / 512, rtol=1e-4, atol=1e-4)


def test_damped_cholesky_inverse_is_factor_of_dampened_inverse():
    _, x = _layer(tokens=16)  # rank 16 < 64: singular without dampening
    H = 2 * x.t() @ x / 16
    U = damped_cholesky_inverse(H, 0.01)
    assert torch.equal(U, torch.triu(U))
    Hd = H + 0.01 * torch.diag(H).mean() * torch.eye(64)
    torch.testing.assert_close(U.t() @ U, torch.linalg.inv(Hd), rtol=1e-2, atol=1e-3)


def test_damped_cholesky_inverse_raises_instead_of_falling_back():
    with pytest.raises(LlmctlError, match="Cholesky"):
        damped_cholesky_inverse(-torch.eye(8), 0.01)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_output_error(act_order):
    w, x = _layer()
    H = 2 * x.t() @ x / x.shape[0]
    spec = QuantSpec(4, 16, symmetric=False)
    r = quantize_gptq(w, H, spec, act_order=act_order, column_block=32)
    rtn = quantize_rtn(w, spec)
    assert _out_err(x, w, r.weight) < 0.8 * _out_err(x, w, rtn.weight)
    assert torch.equal(r.weight, dequantize(r.codes, r.scales, r.zeros, r.group_index()))
    assert r.codes.min() >= 0 and r.codes.max() <= 15


def test_gptq_mask_keeps_pruned_weights_exactly_zero():
    w, x = _layer()
    mask = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    w = w.masked_fill(mask, 0.0)
    r = quantize_gptq(w, 2 * x.t() @ x / 512, QuantSpec(4, 16, symmetric=True), mask=mask)
    assert (r.weight[mask] == 0).all()
    assert (r.weight[~mask] != 0).float().mean() > 0.8


def test_awq_scale_search_reduces_error_and_folding_preserves_function():
    w, x = _layer()
    spec = QuantSpec(4, 16)
    found = search_scales(x, [w], spec)
    assert found.loss <= found.loss_unscaled and found.alpha > 0
    # folding: norm weight / s then linear columns * s computes the same function
    ln = torch.rand(64) + 0.5
    w2, ln2 = w.clone(), ln.clone()
    fold_into_norm(ln2, found.scales)
    scale_linear_input(w2, found.scales)
    torch.testing.assert_close((x * ln2) @ w2.t(), (x * ln) @ w.t(), rtol=1e-4, atol=1e-3)
    q_scaled = quantize_awq(w2, x * ln2, spec)
    q_plain = quantize_rtn(w, spec)
    err_awq = float(((x * ln2) @ q_scaled.weight.t() - (x * ln) @ w.t()).pow(2).mean())
    err_rtn = float(((x * ln) @ q_plain.weight.t() - (x * ln) @ w.t()).pow(2).mean())
    assert err_awq < err_rtn
