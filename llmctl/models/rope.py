"""Rotary position embeddings: inverse frequencies (default, linear, llama3 and YaRN scaling) and a
cos/sin table (YaRN's scaled by its attention factor).

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
    if scaling["rope_type"] == "yarn":
        return _yarn(config, inv_freq)
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


def _yarn_factor(config: ModelConfig) -> float:
    """YaRN's context-extension factor: given, or the ratio of the context lengths."""
    return float(
        config.rope_scaling.get("factor") or config.max_position_embeddings / _original(config)
    )


def _original(config: ModelConfig) -> float:
    """The context YaRN extends: `original_max_position_embeddings`, else (as transformers
    fills it in) the model's own."""
    return float(
        config.rope_scaling.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )


def _yarn(config: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as transformers computes it: dimensions rotating fewer than
    `beta_slow` times over the original context are interpolated (divided by the factor), those
    rotating more than `beta_fast` times kept, a linear ramp between. inv_freq [D/2] float32."""
    scaling, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = _original(config)

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each dimension extrapolated (kept as trained)
    return (inv_freq / _yarn_factor(config)) * (1 - keep) + inv_freq * keep


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are scaled by: 1 but for YaRN (its `attention_factor`, by default from
    the factor and `mscale` / `mscale_all_dim`)."""
    scaling = config.rope_scaling
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = _yarn_factor(config), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


class RotaryEmbedding(torch.nn.Module):
    """Holds a [max_positions, head_dim] cos and sin table (float32) and rotates q/k by position."""

    kernels = KernelConfig()  # set by models/prepare.py: whether the C kernel may serve

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config, self.max_positions = config, max_positions  # to rebuild it (`rebuilt`)
        n = max_positions or config.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inverse_frequencies(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        scale = attention_factor(config)
        cos, sin = (
            (emb.cos(), emb.sin()) if scale == 1.0 else (emb.cos() * scale, emb.sin() * scale)
        )
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

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
