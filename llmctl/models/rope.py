"""Rotary position embeddings: inverse frequencies (default, linear, llama3 scaling) and a cos/sin
table.

Owns: the RoPE math shared by every attention layer. Matches Hugging Face's float32 computation so
greedy outputs agree token for token.
"""

from __future__ import annotations

import math

import torch

from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import elementwise
from llmctl.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after any scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: low frequencies divided by `factor`, high kept, a smooth ramp in between.
    factor = float(scaling["factor"])
    low, high = (
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
    )
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds a [max_positions, head_dim] cos and sin table (float32) and rotates q/k by position."""

    kernels = KernelConfig()  # set by models/prepare.py: whether the C kernel may serve

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config, self.max_positions = config, max_positions  # to rebuild it (`rebuilt`)
        n = max_positions or config.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inverse_frequencies(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, step=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...]; q [..., heads, D], k [..., kv_heads, D] with the same leading shape.
        A lean `step` (models/step.py): the C kernel writes new q and k into its buffers."""
        if step is not None:  # bf16 [T, heads, D], contiguous heads; the tables checked once
            out = step.buffer("q", *q.shape[1:]), step.buffer("k", *k.shape[1:])
            return elementwise.rope(q, k, self.cos, self.sin, positions, out)
        # bf16 inference: one C call
        if self.kernels.native and elementwise.use_rope(q, k, self.cos, positions):
            return elementwise.rope(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].to(q.dtype).unsqueeze(-2)  # [..., 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(-2)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return _rotate_in_place(q, cos, sin), _rotate_in_place(k, cos, sin)


def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, written into x with half-width temporaries (inference: x is
    a fresh projection output). The tables repeat their first half, so half of each is enough."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    x1_sin = x1 * s
    x1.mul_(c).sub_(x2 * s)
    x2.mul_(c).add_(x1_sin)
    return x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
