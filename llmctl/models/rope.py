"""Rotary position embeddings: inverse frequencies (default, linear, llama3, YaRN, LongRoPE and
dynamic NTK scaling) and a cos/sin table (YaRN's and LongRoPE's scaled by their attention factor).

Owns: the RoPE math shared by every attention layer. Matches Hugging Face's float32 computation so
greedy outputs agree token for token. Two scalings depend on the sequence, as transformers
computes them:
- LongRoPE (Phi-3): the short factors for a sequence up to `original_max_position_embeddings`
  tokens, the long ones past it (transformers' Phi-3 re-prefills the whole sequence when it
  crosses). Our KV cache is never re-rotated, so the choice is the engine's: long where its
  context (`--max-model-len`, by default the model's) exceeds the original, as vLLM decides
  (`RotaryEmbedding.fit`); then every sequence equals transformers' once longer than the
  original, and a context capped at the original equals it throughout.
- dynamic NTK: a forward over positions up to n uses the base grown for a sequence of n tokens
  once n exceeds the original context. The table's row p holds position p turned by the base for
  a sequence ending at p, which is what transformers' decode step computes for it (a prompt
  longer than the original is turned by its own length there, all positions at once: here each
  by its own).
"""

from __future__ import annotations

import math

import torch

from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import elementwise
from llmctl.models.config import ModelConfig


def _default(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inverse_frequencies(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, after any scaling (LongRoPE: its `long`
    factors, else its short ones; dynamic: those of the original context, see `_dynamic`)."""
    dim = config.head_dim
    inv_freq = _default(config.rope_theta, dim)
    scaling = config.rope_scaling
    if not scaling or scaling["rope_type"] == "dynamic":
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return _yarn(config, inv_freq)
    if scaling["rope_type"] == "longrope":  # each frequency divided by its own factor
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"])
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (factors.float() * config.rope_theta**shape)
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
    """What cos and sin are scaled by: 1 but for YaRN and LongRoPE (their `attention_factor`; by
    default YaRN's from the factor and `mscale` / `mscale_all_dim`, LongRoPE's from the factor,
    itself by default the ratio of the context to the original)."""
    scaling = config.rope_scaling
    if not scaling or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = _yarn_factor(config), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def long_factors(config: ModelConfig, context: int) -> bool:
    """LongRoPE's choice for an engine of `context` tokens: the long factors where it exceeds the
    original context (see the module docstring). False for every other scaling."""
    scaling = config.rope_scaling
    if not scaling or scaling["rope_type"] != "longrope":
        return False
    return context > scaling["original_max_position_embeddings"]


def _dynamic(config: ModelConfig, n: int) -> torch.Tensor:
    """Dynamic NTK: [n, head_dim // 2] angles, row p turned by the base transformers grows for a
    sequence of p + 1 tokens (`_compute_dynamic_ntk_parameters`, in float32 as it computes it);
    rows within the original context by the plain base."""
    scaling, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    inv_freq = _default(base, dim)
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, D/2]
    if n <= original:
        return angles
    seq = torch.arange(original + 1, n + 1)  # the sequence lengths of rows original..n-1
    grown = base * ((factor * seq / original) - (factor - 1)) ** (dim / (dim - 2))  # [rows]
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (grown[:, None] ** shape)  # [rows, D/2]
    angles[original:] = (seq - 1).float()[:, None] * inv
    return angles


def _tables(config: ModelConfig, n: int, long: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim] float32, each row's two halves equal."""
    scaling = config.rope_scaling
    if scaling and scaling["rope_type"] == "dynamic":
        freqs = _dynamic(config, n)
    else:
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inverse_frequencies(config, long))
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
    scale = attention_factor(config)
    return (emb.cos(), emb.sin()) if scale == 1.0 else (emb.cos() * scale, emb.sin() * scale)


class RotaryEmbedding(torch.nn.Module):
    """Holds a [max_positions, head_dim] cos and sin table (float32) and rotates q/k by position."""

    kernels = KernelConfig()  # set by models/prepare.py: whether the C kernel may serve

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config, self.max_positions = config, max_positions  # to rebuild it (`rebuilt`)
        n = max_positions or config.max_position_embeddings
        self.long = long_factors(config, config.max_position_embeddings)
        cos, sin = _tables(config, n, self.long)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def fit(self, context: int) -> None:
        """The tables for an engine of `context` tokens (LongRoPE's factors: `long_factors`);
        rebuilt in place of the old ones where the choice changes."""
        long = long_factors(self.config, context)
        if long != self.long:
            n = self.cos.shape[0]
            self.cos, self.sin = (t.to(self.cos.device) for t in _tables(self.config, n, long))
            self.long = long

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
