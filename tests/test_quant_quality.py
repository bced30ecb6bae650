"""Issue 17's quality options on tiny random layers: the MSE range search (observer.py), GPTQ's
refitted act-order groups, and that the min/max path is unchanged."""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.hessian import HessianAccumulator
from llmctl.compress.quant.awq import quantize_awq, search_scales
from llmctl.compress.quant.gptq import quantize_gptq
from llmctl.compress.quant.observer import _error, minmax_params, mse_params
from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.runtime.formats.spec import QuantSpec, dequantize


def _layer(out_f=32, in_f=128, tokens=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed weights (Student-t like): an outlier per group makes min/max wasteful
    w = torch.randn(out_f, in_f, generator=g) / torch.rand(out_f, in_f, generator=g).add(0.05)
    mix = torch.randn(in_f, in_f, generator=g) / in_f**0.5 + torch.eye(in_f)
    x = torch.randn(tokens, in_f, generator=g) @ mix
    x[:, ::17] *= 6.0  # a few loud input channels, so act-order reorders
    return w, x


def _hessian(x):
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return acc.H


def _out_err(x, w, wq):
    return float((x @ (w - wq).t()).pow(2).mean())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_mse_search_never_worse_than_minmax_and_shrinks_some_groups(symmetric, bits):
    w, _ = _layer()
    rows = w.reshape(-1, 32)
    spec = QuantSpec(bits, 32, symmetric, torch.float32)
    s0, z0 = minmax_params(rows, spec)
    s1, z1 = mse_params(rows, spec)
    e0, e1 = _error(rows, s0, z0, spec, 2.4), _error(rows, s1, z1, spec, 2.4)
    assert (e1 <= e0).all()
    # the search does move heavy-tailed groups (fewer at 8 bits, where min/max wastes less)
    if bits == 4:
        assert (e1 < e0).float().mean() > 0.2
    assert (s1 <= s0 + 1e-7).all()  # only shrinks
    assert (s1 >= 0.8 * s0 - 1e-6).all()


def test_mse_with_no_shrink_is_minmax_and_minmax_is_the_old_formula():
    w, _ = _layer()
    rows = w.reshape(-1, 32)
    spec = QuantSpec(4, 32, False, torch.float32)
    s, z = minmax_params(rows, spec)
    lo, hi = rows.amin(1).clamp(max=0), rows.amax(1).clamp(min=0)
    assert torch.allclose(s, (hi - lo) / 15)
    assert torch.equal(z, torch.round(-lo / s).clamp(0, 15).to(torch.int32))
    s2, z2 = mse_params(rows, spec, min_shrink=1.0)
    assert torch.equal(s, s2) and torch.equal(z, z2)


def test_rtn_mse_lowers_weight_error_and_keeps_the_format_contract():
    w, _ = _layer()
    spec = QuantSpec(4, 32, True, torch.float16)
    plain, mse = quantize_rtn(w, spec), quantize_rtn(w, spec, mse=True)
    assert (mse.weight - w).pow(2).sum() < (plain.weight - w).pow(2).sum()
    assert torch.equal(mse.weight, dequantize(mse.codes, mse.scales, mse.zeros, mse.group_index()))
    assert torch.equal(mse.scales, mse.scales.half().float())  # stored dtype, exactly
    assert (mse.zeros == 8).all()


@pytest.mark.parametrize("mse", [False, True])
def test_gptq_refit_groups_beats_static_groups_and_rtn(mse):
    w, x = _layer()
    H = _hessian(x)
    spec = QuantSpec(4, 32, True, torch.float32)
    rtn = _out_err(x, w, quantize_rtn(w, spec).weight)
    static = quantize_gptq(w, H, spec, act_order=True, mse=mse)
    refit = quantize_gptq(w, H, spec, act_order=True, refit_groups=True, mse=mse)
    assert torch.equal(
        refit.weight, dequantize(refit.codes, refit.scales, refit.zeros, refit.group_index())
    )
    assert _out_err(x, w, refit.weight) < _out_err(x, w, static.weight) < rtn


def test_gptq_refit_reads_pending_updates_of_later_blocks():
    """Lazy batches must not change the result: the refit of a group whose columns lie in later
    blocks sees the current block's pending updates."""
    w, x = _layer(out_f=8)
    H = _hessian(x)
    spec = QuantSpec(4, 32, False, torch.float32)
    small = quantize_gptq(w, H, spec, act_order=True, refit_groups=True, column_block=8)
    whole = quantize_gptq(w, H, spec, act_order=True, refit_groups=True, column_block=128)
    assert torch.allclose(small.scales, whole.scales, rtol=1e-4, atol=1e-6)
    assert (small.codes == whole.codes).float().mean() > 0.99


def test_gptq_without_act_order_ignores_refit_and_mask_still_exact_zero():
    w, x = _layer()
    H = _hessian(x)
    spec = QuantSpec(4, 32, True, torch.float32)
    a = quantize_gptq(w, H, spec)
    b = quantize_gptq(w, H, spec, refit_groups=True)
    assert torch.equal(a.codes, b.codes)
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[:, ::3] = True
    w2 = w.masked_fill(mask, 0.0)
    r = quantize_gptq(w2, H, spec, act_order=True, refit_groups=True, mse=True, mask=mask)
    assert (r.weight[mask] == 0).all()


def test_awq_paper_scales_follow_activations_only_and_mse_reaches_rtn():
    w, x = _layer()
    spec = QuantSpec(4, 32, False, torch.float32)
    found = search_scales(x, [w], spec, n_grid=10, duo=False)
    assert found.loss <= found.loss_unscaled
    if found.alpha > 0:  # s = mean|x|^alpha, centred: a constant multiple of it
        ratio = found.scales / x.abs().mean(dim=0).pow(found.alpha)
        assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4)
    plain = quantize_awq(w, x, spec, clip=False, mse=True)
    assert torch.equal(plain.weight, quantize_rtn(w, spec, mse=True).weight)
    clipped = quantize_awq(w, x, spec, mse=True)
    assert _out_err(x, w, clipped.weight) <= _out_err(x, w, plain.weight) * 1.05


def test_observer_and_act_order_defaults_reach_the_recipe_and_change_the_weights(tmp_path, capsys):
    """quantize resolves --observer (mse for every method) and records it
    and act_order (off by default) in recipe.yaml; minmax gives other weights than mse."""
    from safetensors.torch import load_file

    from llmctl.cli import main
    from llmctl.runtime.resolve import DEMO_MODEL_DIR

    base = ["quantize", str(DEMO_MODEL_DIR), "--rtn", "--group-size", "32", "-q"]
    base += ["--num-samples", "4", "--seq-len", "32"]
    outs = {}
    for name, extra in (("default", []), ("minmax", ["--observer", "minmax"])):
        outs[name] = tmp_path / name
        assert main([*base, "-o", str(outs[name]), *extra]) == 0
    recipe = (outs["default"] / "recipe.yaml").read_text()
    assert "observer: mse" in recipe and "act_order: false" in recipe
    assert "observer: minmax" in (outs["minmax"] / "recipe.yaml").read_text()
    a = load_file(str(outs["default"] / "model.safetensors"))
    b = load_file(str(outs["minmax"] / "model.safetensors"))
    scales = [k for k in a if k.endswith("weight_scale")]
    assert scales and any(not torch.equal(a[k], b[k]) for k in scales)
    assert main([*base, "-o", str(tmp_path / "bad"), "--observer", "p99"]) == 2
    assert "--observer must be mse or minmax" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_awq_default_ranges_the_unclipped_q_k_with_mse_and_leaves_the_rest():
    """AWQ's default: the MSE range search only for q/k_proj (its clip search skips them);
    --observer minmax (unclipped_mse False) is the old AWQ. v_proj of the first layer reads the
    same inputs either way and is unchanged (later linears read the changed q/k's outputs)."""
    from llmctl.compress.args import QuantizeArgs
    from llmctl.compress.driver import calibrate_layers
    from llmctl.compress.quant.layer_methods import AwqMethod
    from tests.test_quant_driver import ids, tiny_model

    assert QuantizeArgs(None, "o", "awq").resolve().observer == "mse"
    spec = QuantSpec(4, 16, False, torch.float32)
    calib = ids(n=4, s=16)
    new = calibrate_layers(tiny_model(), calib, AwqMethod(spec)).records
    old = calibrate_layers(tiny_model(), calib, AwqMethod(spec, unclipped_mse=False)).records
    for name in new:
        a, b = new[name].result, old[name].result
        if name.endswith(("q_proj", "k_proj")):
            assert not torch.equal(a.codes, b.codes), name
        elif name == "model.layers.0.self_attn.v_proj":
            assert torch.equal(a.weight, b.weight), name


def test_gptq_method_defaults_static_groups_without_act_order_and_refits_with_it():
    """The command's GPTQ: groups fitted on the original weights up front (llm-compressor's
    rule), unless act-order, where each group is refitted when its first column comes up."""
    from llmctl.compress.quant.layer_methods import gptq_method

    w, x = _layer()
    H = _hessian(x)
    spec = QuantSpec(4, 32, True, torch.float32)
    for act_order, expected in (
        (False, dict(static_groups=True)),
        (True, dict(act_order=True, refit_groups=True)),
    ):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data.copy_(w)
        got = gptq_method(spec, act_order=act_order).fn("x", linear, H).result
        want = quantize_gptq(w, H, spec, mse=True, column_block=32, **expected)
        assert torch.equal(got.codes, want.codes), act_order
        if not act_order:  # and it is not the fit at each group's first column
            assert not torch.equal(quantize_gptq(w, H, spec, mse=True).scales, got.scales)
