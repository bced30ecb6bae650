"""The native bf16 RoPE (kernels/cpu/elementwise.py) is bit-identical to models/rope.py's PyTorch
path."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmctl.kernels.cpu import elementwise
from llmctl.models.config import ModelConfig
from llmctl.models.rope import RotaryEmbedding, _rotate_in_place

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="needs a C compiler to build the native kernel",
)


def _rotary(head_dim: int, scaling=None) -> RotaryEmbedding:
    config = ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=head_dim * 4,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=scaling,
        max_position_embeddings=4096,
    )
    return RotaryEmbedding(config)


@pytest.mark.parametrize("rows,heads,kvh,d", [(1, 4, 2, 64), (7, 9, 3, 64), (130, 14, 2, 128)])
def test_native_rope_is_bit_identical_to_the_torch_path(rows, heads, kvh, d):
    rot = _rotary(d, {"rope_type": "llama3", "factor": 8.0} if d == 128 else None)
    g = torch.Generator().manual_seed(rows)
    q = (torch.randn(rows, heads, d, generator=g) * 3).bfloat16()
    k = (torch.randn(rows, kvh, d, generator=g) * 3).bfloat16()
    q[0, 0, 0], k[0, 0, 1] = 1e38, -1e-40  # large and subnormal values round alike too
    positions = torch.randint(0, 4096, (rows,), generator=g)
    cos = rot.cos[positions].to(q.dtype).unsqueeze(-2)
    sin = rot.sin[positions].to(q.dtype).unsqueeze(-2)
    want_q, want_k = _rotate_in_place(q.clone(), cos, sin), _rotate_in_place(k.clone(), cos, sin)
    assert elementwise.use_rope(q, k, rot.cos, positions)
    with torch.inference_mode():
        got_q, got_k = rot(positions, q, k)  # dispatches to the kernel, in place
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(got_q.view(torch.int16), want_q.view(torch.int16))
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))


def test_native_rope_leaves_float32_and_gradients_to_torch():
    rot = _rotary(64)
    q, k, pos = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.arange(3)
    assert not elementwise.use_rope(q, k, rot.cos, pos)
    qb = q.bfloat16().requires_grad_()
    assert not elementwise.use_rope(qb, k.bfloat16(), rot.cos, pos)


@pytest.mark.parametrize("rows", [2, 5, 70])  # one token: a contiguous view, rotated in place
def test_native_rope_reads_the_merged_projection_slices(rows):
    """q and k as column slices of the merged q/k/v output [T, q + 2 kv] (tokens strided): rotated
    into new contiguous tensors, the same bits as rotating contiguous copies, the source left
    as it was (v still reads it)."""
    heads, kvh, d = 9, 3, 64
    rot = _rotary(d)
    g = torch.Generator().manual_seed(rows)
    merged = (torch.randn(rows, (heads + 2 * kvh) * d, generator=g) * 3).bfloat16()
    before = merged.clone()
    q, k, _ = merged.split([heads * d, kvh * d, kvh * d], dim=-1)
    q, k = q.view(rows, heads, d), k.view(rows, kvh, d)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    assert not q.is_contiguous() and elementwise.use_rope(q, k, rot.cos, positions)
    with torch.inference_mode():
        want_q, want_k = rot(positions, q.contiguous(), k.contiguous())
        got_q, got_k = rot(positions, q, k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q.view(torch.int16), want_q.view(torch.int16))
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(merged.view(torch.int16), before.view(torch.int16))
    assert not elementwise.use_rope(q.transpose(1, 2), k, rot.cos, positions)  # heads not rows
