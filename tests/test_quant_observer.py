"""The vectorised MSE range search gives the same scales and zeros as the one-factor-at-a-time
loop it replaced (issue 17, speed): the loop is kept here as the reference."""

import pytest
import torch

from llmctl.compress.quant import observer
from llmctl.compress.quant.observer import _ranges, mse_params, range_params
from llmctl.runtime.formats.spec import QuantSpec


def _loop_error(w, scale, zero, spec, norm):
    s, z = scale[:, None], zero[:, None].float()
    q = torch.clamp(torch.round(w / s) + z, 0, spec.maxq)
    return ((q - z) * s - w).abs().pow(norm).sum(dim=1)


def _loop_mse(w, spec, min_shrink=0.8, step=0.01, norm=2.4):
    wmin, wmax = _ranges(w, spec)
    best_scale, best_zero = range_params(wmin, wmax, spec)
    best_err = _loop_error(w, best_scale, best_zero, spec, norm)
    for k in range(1, int(round((1.0 - min_shrink) / step)) + 1):
        p = 1.0 - k * step
        scale, zero = range_params(wmin * p, wmax * p, spec)
        err = _loop_error(w, scale, zero, spec, norm)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mse_search_equals_the_loop(bits, symmetric, dtype):
    torch.manual_seed(bits)
    w = torch.randn(300, 64) * 0.02
    w[0] = 0.0  # an all-zero group
    w[1, :3] = 0.5  # an outlier row, where shrinking loses
    spec = QuantSpec(bits, 64, symmetric, dtype)
    got, want = mse_params(w, spec), _loop_mse(w, spec)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_mse_search_in_row_chunks_equals_one_chunk(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(257, 32)
    spec = QuantSpec(4, 32, False, torch.float16)
    whole = mse_params(w, spec)
    monkeypatch.setattr(observer, "_SEARCH_ELEMENTS", 21 * 32 * 10)  # 10 rows a chunk
    chunked = mse_params(w, spec)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert torch.equal(whole[0], _loop_mse(w, spec)[0])
