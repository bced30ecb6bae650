"""Pure pruning functions on tiny layers: masks, magnitude, Wanda and SparseGPT (no model
needed)."""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.sparse.magnitude import magnitude_mask
from llmctl.compress.sparse.masks import (
    SparsityPattern,
    apply_mask,
    nm_prune_mask,
    parse_pattern,
    zero_fraction,
)
from llmctl.compress.sparse.sparsegpt import sparsegpt_prune
from llmctl.compress.sparse.wanda import InputNormAccumulator, input_norms_from_hessian, wanda_mask
from llmctl.errors import UsageError
from llmctl.runtime.semi_structured import satisfies_nm


def _hinv_chol(h: torch.Tensor, dampening: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1, via the shared helper when it exists."""
    try:
        from llmctl.compress.hessian import damped_cholesky_inverse
    except ImportError:
        damp = dampening * torch.diagonal(h).mean()
        hd = h + damp * torch.eye(h.shape[0], dtype=h.dtype)
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
    return damped_cholesky_inverse(h.clone(), dampening)


def _layer(rows: int = 16, cols: int = 64, tokens: int = 512, seed: int = 0):
    """A weight [rows, cols] and correlated inputs X [tokens, cols] with uneven channel scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    scales = torch.exp(torch.randn(cols, generator=g))  # some channels carry 5-10x more signal
    x = torch.randn(tokens, cols, generator=g) @ mix * scales
    return w, x


def _hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T.double() @ x.double() / x.shape[0]


def _recon_error(x: torch.Tensor, w: torch.Tensor, w_new: torch.Tensor) -> float:
    return float(((x @ w.T - x @ w_new.T) ** 2).sum())


# ---------------------------------------------------------------- patterns and masks


def test_parse_pattern_forms_and_errors():
    assert parse_pattern(None, None) == SparsityPattern(sparsity=0.5, n=2, m=4)
    p = parse_pattern("4:8", None)
    assert (p.n, p.m, p.sparsity, p.label()) == (4, 8, 0.5, "4:8")
    u = parse_pattern(None, 0.7)
    assert not u.structured and u.sparsity == 0.7 and u.label() == "unstructured-70%"
    for bad in ("2-4", "4:2", "0:4", "4:4", "x"):
        with pytest.raises(UsageError):
            parse_pattern(bad, None)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(UsageError):
            parse_pattern(None, bad)
    with pytest.raises(UsageError):
        parse_pattern("2:4", 0.5)


def test_nm_mask_prunes_lowest_in_each_group():
    scores = torch.tensor([[4.0, 1.0, 3.0, 2.0, 0.5, 0.1, 9.0, 8.0]])
    mask = nm_prune_mask(scores, 2, 4)
    assert mask.tolist() == [[False, True, False, True, True, True, False, False]]
    with pytest.raises(ValueError):
        nm_prune_mask(torch.ones(2, 6), 2, 4)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_magnitude_nm_exact_group_counts(n, m):
    w, _ = _layer(cols=64)
    mask = magnitude_mask(w, SparsityPattern(sparsity=1 - n / m, n=n, m=m))
    assert (mask.reshape(16, -1, m).sum(-1) == m - n).all()
    pruned = apply_mask(w, mask)
    assert satisfies_nm(pruned, n, m)
    # every kept weight of a group is at least as large as every pruned one of that group
    groups = w.abs().reshape(16, -1, m)
    gmask = mask.reshape(16, -1, m)
    kept_min = groups.masked_fill(gmask, float("inf")).min(-1).values
    pruned_max = groups.masked_fill(~gmask, -1.0).max(-1).values
    assert (kept_min >= pruned_max).all()


def test_magnitude_unstructured_layer_and_row_scopes():
    w, _ = _layer(rows=8, cols=40)
    pattern = parse_pattern(None, 0.3)
    layer = magnitude_mask(w, pattern, scope="layer")
    assert int(layer.sum()) == round(w.numel() * 0.3)
    assert float(w.abs()[~layer].min()) >= float(w.abs()[layer].max())
    row = magnitude_mask(w, pattern, scope="row")
    assert (row.sum(1) == 12).all()
    w[0] *= 100  # a loud row survives whole under the layer scope, not under the row scope
    assert int(magnitude_mask(w, pattern, scope="layer")[0].sum()) == 0
    assert int(magnitude_mask(w, pattern, scope="row")[0].sum()) == 12


def test_satisfies_nm_and_zero_fraction():
    w = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 3.0, 4.0]])
    assert satisfies_nm(w, 2, 4) and zero_fraction(w) == 0.5
    w[0, 0] = 5.0
    assert not satisfies_nm(w, 2, 4)
    assert not satisfies_nm(torch.zeros(1, 6), 2, 4)  # partial group


# ---------------------------------------------------------------- Wanda


def test_wanda_norms_from_accumulator_and_hessian_agree():
    _, x = _layer(cols=32, tokens=300)
    acc = InputNormAccumulator(32)
    acc.add(x[:100].reshape(4, 25, 32))  # any leading shape
    acc.add(x[100:])
    assert acc.tokens == 300
    exact = x.double().norm(dim=0).float()
    torch.testing.assert_close(acc.norms(), exact, rtol=1e-5, atol=1e-5)
    from_h = input_norms_from_hessian(_hessian(x))
    torch.testing.assert_close(from_h / from_h[0], exact / exact[0], rtol=1e-4, atol=1e-5)


def test_wanda_uses_activation_norms():
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    pattern = parse_pattern("2:4", None)
    flat = wanda_mask(w, torch.ones(4), pattern)
    assert torch.equal(flat, magnitude_mask(w, pattern))
    loud_first = wanda_mask(w, torch.tensor([100.0, 1.0, 1.0, 1.0]), pattern)
    assert loud_first.tolist() == [[False, True, True, False], [False, False, True, True]]
    unstructured = wanda_mask(w, torch.tensor([1.0, 1.0, 1.0, 10.0]), parse_pattern(None, 0.25))
    assert unstructured.tolist() == [
        [True, False, False, False],
        [False, False, True, False],
    ]  # magnitude: col 3


def test_wanda_reconstructs_better_than_magnitude():
    w, x = _layer()
    acc = InputNormAccumulator(w.shape[1])
    acc.add(x)
    pattern = parse_pattern("2:4", None)
    err_wanda = _recon_error(x, w, apply_mask(w, wanda_mask(w, acc.norms(), pattern)))
    err_mag = _recon_error(x, w, apply_mask(w, magnitude_mask(w, pattern)))
    assert err_wanda < err_mag


# ---------------------------------------------------------------- SparseGPT


@pytest.mark.parametrize("spec", ["2:4", "4:8", 0.5, 0.6])
def test_sparsegpt_pattern_and_exact_zeros(spec):
    w, x = _layer(rows=12, cols=96)
    pattern = parse_pattern(spec, None) if isinstance(spec, str) else parse_pattern(None, spec)
    res = sparsegpt_prune(w, _hinv_chol(_hessian(x)), pattern, column_block=32)
    assert torch.equal(
        res.mask, res.weight == 0
    )  # pruned exactly zero, kept ones (random floats) not
    if pattern.structured:
        assert satisfies_nm(res.weight, pattern.n, pattern.m)
        assert (res.mask.reshape(12, -1, pattern.m).sum(-1) == pattern.m - pattern.n).all()
    else:  # the fraction is reached in every block of 32 columns
        per_block = res.mask.reshape(12, 3, 32).sum((0, 2))
        assert (per_block == round(12 * 32 * pattern.sparsity)).all()
    assert res.loss > 0


def test_sparsegpt_beats_magnitude_and_wanda_on_reconstruction():
    w, x = _layer(rows=32, cols=128, tokens=1024)
    pattern = parse_pattern("2:4", None)
    h = _hessian(x)
    res = sparsegpt_prune(w, _hinv_chol(h), pattern, column_block=64)
    err_sgpt = _recon_error(x, w, res.weight)
    err_wanda = _recon_error(
        x, w, apply_mask(w, wanda_mask(w, input_norms_from_hessian(h), pattern))
    )
    err_mag = _recon_error(x, w, apply_mask(w, magnitude_mask(w, pattern)))
    assert err_sgpt < err_wanda < err_mag
    # the update matters: SparseGPT's own mask without the update reconstructs worse
    assert err_sgpt < _recon_error(x, w, apply_mask(w, res.mask))


def test_sparsegpt_with_isotropic_hessian_is_magnitude():
    """H = c I: no cross-column correlation, so no update and saliency ordering = |w|."""
    w, _ = _layer(rows=8, cols=64)
    u = _hinv_chol(3.0 * torch.eye(64, dtype=torch.float64), dampening=0.0)
    pattern = parse_pattern("2:4", None)
    res = sparsegpt_prune(w, u, pattern)
    assert torch.equal(res.mask, magnitude_mask(w, pattern))
    torch.testing.assert_close(res.weight, apply_mask(w, res.mask))


def test_sparsegpt_block_size_independent_for_nm():
    """N:M masks are chosen per group, so the lazy block update must not change the result."""
    w, x = _layer(rows=8, cols=64)
    u = _hinv_chol(_hessian(x))
    pattern = parse_pattern("2:4", None)
    a = sparsegpt_prune(w, u, pattern, column_block=8)
    b = sparsegpt_prune(w, u, pattern, column_block=64)
    assert torch.equal(a.mask, b.mask)
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-4, atol=1e-4)


def test_sparsegpt_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        sparsegpt_prune(torch.randn(4, 8), torch.eye(6), parse_pattern("2:4", None))
    with pytest.raises(ValueError):
        sparsegpt_prune(torch.randn(4, 6), torch.eye(6), parse_pattern("2:4", None))
