"""GPTQ's shared-input path (issue 17, speed): q/k/v and gate/up share one Hessian accumulator and
are quantized as one stacked weight; the result matches quantizing each linear on its own."""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.driver import HessianMethod, calibrate_layers
from llmctl.compress.quant.layer_methods import gptq_method
from llmctl.errors import LlmctlError
from llmctl.runtime.formats.spec import QuantSpec
from tests.test_quant_driver import ids, tiny_model


class Counting(HessianMethod):
    """HessianMethod that counts the X^T X products (accumulator adds) it does."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.adds = 0

    def observe(self, name, x):
        before = {id(a): a.num_tokens for a in self.acc.values()}
        super().observe(name, x)
        self.adds += sum(a.num_tokens != before.get(id(a), 0) for a in set(self.acc.values()))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group", [16, None])
def test_stacked_gptq_matches_per_linear_gptq(act_order, group):
    spec = QuantSpec(4, group, True, torch.float32)
    method = gptq_method(spec, act_order=act_order)
    grouped = Counting(method.fn, method.group_fn)
    single = Counting(method.fn)  # the per-linear path (each linear its own GPTQ call)
    a, b = tiny_model(), tiny_model()
    calib = ids(n=6, s=24)
    ra = calibrate_layers(a, calib, grouped, batch_size=2).records
    rb = calibrate_layers(b, calib, single, batch_size=2).records
    assert ra.keys() == rb.keys() and len(ra) == 14
    for name in ra:
        qa, qb = ra[name].result, rb[name].result
        assert qa.codes.shape == qb.codes.shape
        # float tolerance: a code may flip where a value sits on a rounding boundary
        assert (qa.codes == qb.codes).float().mean() > 0.999, name
        assert torch.allclose(qa.scales, qb.scales, rtol=1e-5, atol=1e-7), name
        assert abs(ra[name].error - rb[name].error) < 1e-4 * max(rb[name].error, 1e-6) + 1e-7
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-6)
    # 3 batches x 2 layers: 4 accumulators per layer read (qkv, o, gate/up, down), not 7
    assert grouped.adds == 3 * 2 * 4
    assert single.adds == 3 * 2 * 4  # sharing is the accumulator's, with or without group_fn


def test_per_linear_path_unchanged_by_sharing():
    """Without sharing (each linear its own accumulator, the old path) the records are the
    same: sharing one H changes nothing but the work."""
    spec = QuantSpec(4, 16, True, torch.float32)
    method = gptq_method(spec)
    a, b = tiny_model(), tiny_model()
    calib = ids(n=4, s=16)
    ra = calibrate_layers(a, calib, HessianMethod(method.fn)).records

    class Unshared(HessianMethod):
        def observe(self, name, x):
            self._last = None  # never sees the previous input: one accumulator per linear
            super().observe(name, x.clone())

    rb = calibrate_layers(b, calib, Unshared(method.fn)).records
    for name in ra:
        assert torch.equal(ra[name].result.codes, rb[name].result.codes), name


def test_input_shared_in_one_batch_only_is_refused():
    m = HessianMethod(lambda *a: None)
    x = torch.randn(2, 3, 8)
    m.observe("q", x)
    m.observe("k", x)  # k follows q
    m.observe("q", torch.randn(2, 3, 8))
    with pytest.raises(LlmctlError, match="shared in one batch"):
        m.observe("k", torch.randn(2, 3, 8))
