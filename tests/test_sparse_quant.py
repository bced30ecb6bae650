"""Sparse then quantized: GPTQ given the pruning mask keeps every pruned weight exactly zero."""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.quant.gptq import quantize_gptq
from llmctl.compress.sparse.masks import mask_of, parse_pattern
from llmctl.compress.sparse.prune import prune_linear
from llmctl.runtime.formats.spec import QuantSpec
from llmctl.runtime.semi_structured import satisfies_nm


def _layer(rows=32, cols=128, tokens=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    x = torch.randn(tokens, cols, generator=g) @ (
        torch.eye(cols) + 0.2 * torch.randn(cols, cols, generator=g)
    )
    h = 2 * x.T @ x / tokens
    return w, x, h


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_mask_keeps_pruned_weights_zero(act_order):
    w, x, h = _layer()
    pruned, line = prune_linear("l", w, parse_pattern("2:4", None), "sparsegpt", h)
    assert line.pattern_ok and line.sparsity == pytest.approx(0.5)
    mask = mask_of(pruned)
    spec = QuantSpec(bits=4, group_size=32, symmetric=False)
    res = quantize_gptq(pruned, h, spec, act_order=act_order, mask=mask)
    assert bool((res.weight[mask] == 0).all())  # exact zeros after dequantization
    assert satisfies_nm(res.weight, 2, 4)
    # and the quantized layer still tracks the sparse one (not zeroed wholesale)
    rel = float((x @ (res.weight - pruned).T).norm() / (x @ pruned.T).norm())
    assert rel < 0.2
    # without the mask GPTQ's error feedback refills pruned slots: the mask is what keeps them
    unmasked = quantize_gptq(pruned, h, spec, act_order=act_order)
    assert not bool((unmasked.weight[mask] == 0).all())
