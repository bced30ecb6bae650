"""The AMX linear kernel (kernels/cpu/linear/c_kernels.py, cpu_linear_amx.c): its packed layout,
its products against float32 F.linear, and the autotuner's rule of one packed copy per shape. The
kernel's tests run where the CPU has AMX-BF16 and Linux grants the tile state; elsewhere they skip
(the kernel is then never a candidate)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmctl.kernels.cpu.linear import autotune, c_kernels, dispatch

needs_amx = pytest.mark.skipif(
    c_kernels.amx_library() is None, reason="this CPU or compiler cannot run AMX-BF16 tiles"
)


@needs_amx
def test_pack_puts_pairs_of_k_in_tile_columns():
    n, k = 64, 96
    w = torch.randint(-100, 100, (n, k)).bfloat16()
    p = c_kernels.amx_pack(w).view(n // 16, k // 32, 16, 16, 2)  # [nb, kt, r, n, pair]
    for nb, kt, r, col, pair in [(0, 0, 0, 0, 1), (1, 2, 5, 7, 1), (3, 1, 15, 15, 0)]:
        assert p[nb, kt, r, col, pair] == w[16 * nb + col, 32 * kt + 2 * r + pair]
    want = w.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
    assert torch.equal(p, want)


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("n,k", [(32, 32), (96, 576), (64, 160)])
def test_linear_matches_float32(rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = c_kernels.amx_pack(w)
    for bias in (b, None):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        y = c_kernels.amx(x, w, bias, packed)
        assert y.dtype is torch.bfloat16 and y.shape == (rows, n)
        # accumulated in float32 and rounded once: within one bf16 step of the float32 result
        torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-2)


@needs_amx
def test_strided_rows_leading_dims_and_threads():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g).bfloat16()
    wide = torch.randn(2, 19, 160, generator=g).bfloat16()
    x = wide[..., 16:144]  # rows at stride 160, not contiguous
    packed = c_kernels.amx_pack(w)
    y = c_kernels.amx(x, w, None, packed)
    assert y.shape == (2, 19, 64)
    assert torch.equal(y, c_kernels.amx(x.contiguous(), w, None, packed))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = c_kernels.amx(x, w, None, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, one)  # threads split columns; each element's sum is the same
    assert c_kernels.amx(x[:, :0], w, None, packed).shape == (2, 0, 64)


def test_applies_only_to_aligned_bf16_weights():
    aligned = torch.zeros(64, 96, dtype=torch.bfloat16)
    assert not c_kernels.amx_applies(aligned.float())
    assert not c_kernels.amx_applies(torch.zeros(48, 96, dtype=torch.bfloat16))
    assert not c_kernels.amx_applies(torch.zeros(64, 80, dtype=torch.bfloat16))
    assert c_kernels.amx_applies(aligned) == (c_kernels.amx_library() is not None)
    if c_kernels.amx_library() is None:
        assert c_kernels.amx_pack(aligned) is None


def test_one_packed_copy_per_shape():
    """Buckets that chose two kinds of packed copy keep the kind most of them chose; the others
    re-choose among the plain kernels and that copy."""
    names = ("torch", "packed", "amx")
    alive = [dispatch.BY_NAME[n] for n in names]
    timed = {
        1: {"torch": 5.0, "packed": 4.0, "amx": 2.0},
        8: {"torch": 6.0, "packed": 5.0, "amx": 3.0},
        2048: {"torch": 10.0, "packed": 8.0, "amx": 12.0},
        4096: {"torch": 9.0, "packed": 20.0, "amx": 30.0},
    }
    choices = {1: "amx", 8: "amx", 2048: "packed", 4096: "torch"}
    g = autotune._Group("k", 4096, [0], alive, dict(choices), timed)
    changed = autotune._rechoose_packed(g)
    assert g.choices == {1: "amx", 8: "amx", 2048: "torch", 4096: "torch"}
    assert changed == {2048: "torch"}
    plan = autotune.Plan(g.choices, 4096)
    assert plan.packings == ("amx",) and plan.packs
    assert autotune.Plan({1: "torch"}, 8).packings == ()
