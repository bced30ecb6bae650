"""The CPU LoRA kernel (kernels/cpu/lora.py, csrc/cpu_lora.c) against its PyTorch reference:
rows of several adapters, base rows, a slot whose adapter skips the projection, ranks below the
padded maximum, a column slice of a merged output as y, float32 and bfloat16; and each row's
result independent of the other rows (batch invariance)."""

from __future__ import annotations

import pytest
import torch

from llmctl.kernels.cpu.library import load
from llmctl.kernels.cpu.lora import lora_apply, lora_reference, use_lora_apply

pytestmark = pytest.mark.skipif(load("lora") is None, reason="no C compiler")

SLOTS, R = 4, 16


def _case(dtype, t=23, k=72, n=37, seed=0):
    """x [t, k], y a column slice [t, n] of a wider output, A/Bt per slot, rows' slots, ranks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    wide = torch.randn(t, n + 9, generator=g).to(dtype)
    a = (torch.randn(SLOTS, R, k, generator=g) * 0.2).to(dtype)
    bt = (torch.randn(SLOTS, R, n, generator=g) * 0.2).to(dtype)
    ranks = torch.tensor([0, 16, 5, 0], dtype=torch.int32)  # slot 3's adapter skips this one
    a[2, 5:], bt[2, 5:] = 0, 0  # rank 5 zero-padded to R, as LoraLinear stores it
    row_slot = torch.randint(0, SLOTS, (t,), generator=g, dtype=torch.int32)
    row_slot[:4] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    return x, wide, a, bt, row_slot, ranks


@pytest.mark.parametrize("rows", [23, 150], ids=["one-thread-path", "threads-path"])
@pytest.mark.parametrize("grouped", [False, True], ids=["mixed-rows", "rows-by-adapter"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0)])
def test_kernel_matches_reference(dtype, tol, grouped, rows):
    """150 rows: the kernel shares them out among threads where torch has more than one."""
    x, wide, a, bt, row_slot, ranks = _case(dtype, t=rows)
    if grouped:
        row_slot = row_slot.sort().values
    ours, ref = wide.clone(), wide.clone()
    y = ours[:, 4:-5]  # a column slice: the row stride is the wide output's
    assert use_lora_apply(x, y, a)
    lora_apply(x, y, a, bt, row_slot, ranks)
    lora_reference(x, ref[:, 4:-5], a, bt, row_slot, ranks)
    # bf16: one rounding of y after a float32 update; the reference sums in another order, so
    # allow the last bit where the float sum lands next to a rounding boundary
    ulp = 0 if tol else (ref.float().abs() * 2**-7)
    assert ((ours.float() - ref.float()).abs() <= ulp + tol).all()
    untouched = (row_slot == 0) | (row_slot == 3)
    assert torch.equal(ours[untouched], wide[untouched])  # base rows and a skipping adapter
    assert not torch.equal(ours[row_slot == 1], wide[row_slot == 1])
    assert torch.equal(ours[:, :4], wide[:, :4]) and torch.equal(ours[:, -5:], wide[:, -5:])


@pytest.mark.parametrize("grouped", [False, True], ids=["mixed-rows", "rows-by-adapter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_update_does_not_depend_on_the_batch(dtype, grouped):
    """Alone or in a group of its adapter's rows (the kernel serves up to 4 consecutive rows of
    one adapter at once), a row's update is the same to the last bit."""
    x, wide, a, bt, row_slot, ranks = _case(dtype, t=150)  # together: the threads' path
    if grouped:  # as the engine orders decode rows: each adapter's rows one run
        row_slot = row_slot.sort().values
    together = wide.clone()
    lora_apply(x, together, a, bt, row_slot, ranks)
    for i in (1, 2, 17, 39, 149):
        alone = wide[i : i + 1].clone()
        lora_apply(x[i : i + 1], alone, a, bt, row_slot[i : i + 1], ranks)
        assert torch.equal(alone[0], together[i])


def test_mixed_dtypes_and_gradients_keep_the_pytorch_path():
    x, wide, a, _, _, _ = _case(torch.float32)
    assert not use_lora_apply(x.bfloat16(), wide, a)
    assert not use_lora_apply(x, wide, a.bfloat16())
    assert not use_lora_apply(x.requires_grad_(), wide, a)
