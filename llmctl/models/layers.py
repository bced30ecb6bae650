"""The layers decoder models are built from, each a drop-in for its Hugging Face counterpart
(parameter names equal theirs, so checkpoints load and save one to one): `Linear`, `RMSNorm`,
`Attention` (q/k/v, optional q/k norms, RoPE, paged attention) and `MLP` (gated SiLU).

Owns: each layer's forward paths and what it holds once prepared for inference
(models/prepare.py): `kernels` (the engine's KernelConfig: which kernels may serve), a linear's
`plan` and `packed` copies (kernels/cpu/linear), the `merged` q/k/v and gate/up linears
(models/merged.py). Unprepared layers (calibration, eval, training) take the default
KernelConfig and no plan. A model file (models/llama.py) composes these. The engine's forward
methods take an optional `step` (models/step.py): on a lean step they call their sublayers'
forward directly, skip the per-call checks prepare made once, and hand their kernels the step's
buffers; the kernels and their order stay the same, so the results do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.kernels import invariant
from llmctl.kernels.attention import PagedAttentionMetadata, paged_attention
from llmctl.kernels.attention_features import Features, attend, paged_attention_with
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import elementwise
from llmctl.kernels.cpu.linear import dispatch
from llmctl.models import merged as merging
from llmctl.models.config import ModelConfig
from llmctl.models.rope import RotaryEmbedding
from llmctl.models.step import Step, call, method

DEFAULT_KERNELS = KernelConfig()


class Linear(nn.Linear):
    """nn.Linear whose CPU inference goes where it measured faster than F.linear: one call to
    kernels/cpu/linear/dispatch.linear, which takes the `plan`'s kernel for the call's row count
    (chosen by timing when an engine starts), else the static rule (few rows through the C
    kernel, many bf16 rows on CPUs without native bf16 through float32 BLAS on widened slabs, a
    oneDNN-packed copy where the layer holds one); anything with gradients is plain F.linear. A
    subclass, so hooks and isinstance checks still see an nn.Linear and checkpoints keep their
    names."""

    kernels: KernelConfig = DEFAULT_KERNELS
    plan: Any = None  # kernels/cpu/linear/autotune.Plan
    # packing kernel name -> its copy of the weight (oneDNN-packed, AMX tile order), where the
    # plan (or, for the float32 vocabulary projection, models/prepare.py) uses one
    packed: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(self, x)


def project(
    layer: nn.Module,
    x: torch.Tensor,
    fixed_order: bool,
    kernels: KernelConfig = DEFAULT_KERNELS,
    step: Step | None = None,
) -> torch.Tensor:
    """layer(x) (its forward called directly on a lean `step`, models/step.py); with
    `fixed_order` (batch-invariant mode) through kernels/invariant.py, whose rows do not depend on
    each other's presence. Any linear module (dense, quantized, sparse)."""
    if not fixed_order:
        return method(layer, step)(x)
    special = getattr(layer, "invariant_forward", None)  # a LoRA wrapper (models/lora.py)
    if special is not None:
        return special(x, kernels)
    if type(layer) is not Linear:  # quantized and other modules: one row a call
        return invariant.linear(x, None, None, layer, kernels)
    return invariant.linear(x, layer.weight, layer.bias, layer, kernels)


class RMSNorm(nn.Module):
    """RMSNorm; `offset` (Gemma): the scale is 1 + weight, applied in float32 before rounding
    (the C kernels take the sum as their weight: equal in float32, within rounding in bf16)."""

    kernels: KernelConfig = DEFAULT_KERNELS

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def scale(self) -> torch.Tensor:
        return self.weight + 1 if self.offset else self.weight

    def forward(self, x: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
        """`fixed_order` (batch-invariant mode): one program a row where the Triton kernels apply
        (kernels/invariant.py); the CPU paths below are one fixed-order reduction a row anyway."""
        kernels, weight = self.kernels, self.scale()
        out = invariant.rms_norm(x, weight, self.eps, kernels) if fixed_order else None
        if out is not None:
            return out
        # one pass in C: PyTorch takes 5+ ops, ~20 us a row
        if kernels.native and elementwise.use_rms_norm(x, weight):
            return elementwise.rms_norm(x, weight, self.eps)
        if x.dtype == torch.float32:  # the same arithmetic, fused: about 1.2-1.5x faster on the CPU
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        # Normalise in float32, as the reference implementations do; Llama scales in the model
        # dtype, Gemma in float32.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * weight.float()).to(dtype)
        return weight * xf.to(dtype)

    def add_forward(self, x, r: torch.Tensor | None, fixed_order: bool = False, step=None):
        """x.add_(r) (inference: x is the residual stream, updated in place), then self(x); one
        pass in C where it applies (vLLM's fused_add_rms_norm). r None: self(x) alone. A lean
        `step` (models/step.py: x and r [T, hidden] bf16, the weight checked when prepared): the C
        kernel into its buffer, with no checks a call."""
        if step is not None:
            out = step.buffer("norm", x.shape[-1])
            if r is None:
                return elementwise.rms_norm(x, self.weight, self.eps, out)
            r = r if r.is_contiguous() else r.contiguous()
            return elementwise.add_rms_norm(x, r, self.weight, self.eps, out)
        if r is None:
            return self(x, fixed_order)
        fused = not fixed_order and self.kernels.native
        weight = self.scale()
        if fused and elementwise.use_add_rms_norm(x, r, weight):
            return elementwise.add_rms_norm(x, r, weight, self.eps)
        return self(x.add_(r), fixed_order)


class Attention(nn.Module):
    kernels: KernelConfig = DEFAULT_KERNELS

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, window: int | None = None):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = config.attn_scale or d**-0.5
        # a window or soft-capping: kernels/attention_features.py serves this layer
        features = Features(self.scale, window, config.attn_softcap)
        self.features = None if features.plain else features
        bias = config.attention_bias
        self.q_proj = Linear(h, config.q_size, bias=bias)
        self.k_proj = Linear(h, config.kv_size, bias=bias)
        self.v_proj = Linear(h, config.kv_size, bias=bias)
        # qwen2 (and qwen2_moe) have biases on q/k/v only; llama and qwen3 put `attention_bias`
        # on o_proj too.
        o_bias = bias and not config.model_type.startswith("qwen2")
        self.o_proj = Linear(config.q_size, h, bias=o_bias)
        self.norm_whole = config.qk_norm_whole
        if config.qk_norm:  # per head, or (olmoe: `norm_whole`) over the whole projection
            q_dim, k_dim = (config.q_size, config.kv_size) if self.norm_whole else (d, d)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, config.gemma)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, config.gemma)
        else:
            self.q_norm = self.k_norm = None
        self._rotary = [rotary]  # a list, so the shared table is not registered once per layer
        self.merged: merging.Merged | None = None  # q/k/v as one linear (merge_projections)

    def projections(self) -> tuple[nn.Module, ...]:
        """The linears reading x, in the merged weight's row order [q_size + 2 kv_size]."""
        return self.q_proj, self.k_proj, self.v_proj

    def _project_qkv(self, x: torch.Tensor, fixed_order: bool, step: Step | None):
        """x [..., hidden] -> q [..., q_size], k, v [..., kv_size]: one GEMM where merged."""
        m = self.merged
        if step is not None and m is not None:  # live: the step's Watch saw it unchanged
            return m.linear.forward(x).split_with_sizes(m.sizes, dim=-1)  # of [T, q + 2 kv]
        if (
            m is not None
            and not fixed_order
            and not torch.is_grad_enabled()
            and m.live(*self.projections())
        ):
            return m.linear(x).split_with_sizes(m.sizes, dim=-1)  # slices of [..., q + 2 kv]
        kernels = self.kernels
        return tuple(project(p, x, fixed_order, kernels, step) for p in self.projections())

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, fixed_order=False, step=None):
        """x [..., hidden] -> q [..., heads, D], k and v [..., kv_heads, D], RoPE applied; q and
        k contiguous (on a lean `step`, models/step.py, in its buffers), v possibly a column slice
        of the merged projection (read through its strides)."""
        lead = x.shape[:-1]
        q, k, v = self._project_qkv(x, fixed_order, step)
        # olmoe: [..., q_size] and [..., kv_size] rows normed (the kernels read contiguous rows)
        if whole := self.q_norm is not None and self.norm_whole:
            q = self.q_norm(q.contiguous(), fixed_order)
            k = self.k_norm(k.contiguous(), fixed_order)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not whole:  # the norm kernels read contiguous rows
            q = self.q_norm(q.contiguous(), fixed_order)
            k = self.k_norm(k.contiguous(), fixed_order)
        # The bf16 RoPE kernel reads merged slices and writes new contiguous q and k (no copies
        # first); elsewhere the rotation runs in place and the copies follow.
        q, k = call(self._rotary[0], step, positions, q, k)
        return q.contiguous(), k.contiguous(), v

    def forward(self, x, positions, meta: PagedAttentionMetadata, kv_cache, step=None):
        """x [T, hidden] -> [T, hidden]; K/V written to `kv_cache`. A lean `step`: see qkv."""
        fixed, kernels = meta.batch_invariant, self.kernels
        q, k, v = self.qkv(x, positions, fixed, step)  # [T, heads, D], [T, kv_heads, D]
        kc, vc, f = kv_cache[0], kv_cache[1], self.features
        if f is None:
            out = None if step is None else step.buffer("attn", self.num_heads, self.head_dim)
            out = paged_attention(q, k, v, kc, vc, meta, self.scale, kernels, out)
        else:
            out = paged_attention_with(q, k, v.contiguous(), kc, vc, meta, f, kernels)
        return project(self.o_proj, out.reshape(x.shape[0], -1), fixed, kernels, step)

    def forward_dense(self, x: torch.Tensor, positions: torch.Tensor, past=None):
        """Causal attention without the paged cache: x [B, S, hidden] at `positions` [S], after
        `past` = (k, v) [B, kv_heads, P, D] where given (the speculative draft's dense
        per-request cache; calibration, eval and training give none). Returns (out [B, S,
        hidden], (k, v) [B, kv_heads, P + S, D])."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x, positions)  # [B, S, heads, D], [B, S, kv_heads, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        causal: dict = dict(is_causal=True)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
            total = k.shape[2]  # each query sees the past and itself: [S, total]
            causal = dict(attn_mask=torch.arange(total, device=x.device) <= positions[:, None])
        if self.features is not None:  # [B, S, heads, D] with the layer's window and cap
            pos = positions.expand(b, -1)
            kpos = torch.arange(k.shape[2], device=x.device).expand(b, -1)
            out = attend(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, kpos, self.features
            )
            return self.o_proj(out.reshape(b, s, -1)), (k, v)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True, **causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), (k, v)


class MLP(nn.Module):
    kernels: KernelConfig = DEFAULT_KERNELS

    def __init__(self, config: ModelConfig, intermediate: int | None = None):
        super().__init__()
        h, f = config.hidden_size, intermediate or config.intermediate_size
        self.gelu = config.gemma  # gelu(gate, tanh approximation) * up, else silu(gate) * up
        self.gate_proj = Linear(h, f, bias=False)
        self.up_proj = Linear(h, f, bias=False)
        self.down_proj = Linear(f, h, bias=False)
        self.merged: merging.Merged | None = None  # gate/up as one linear (merge_projections)

    def projections(self) -> tuple[nn.Module, ...]:
        """The linears reading x, in the merged weight's row order [2 intermediate]."""
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fixed_order: bool = False, step: Step | None = None):
        """x [..., hidden] -> [..., hidden]. A lean `step` (models/step.py): the merged gate/up's
        activation into its buffer."""
        if self.gelu:
            return self._gelu(x)
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        m = self.merged
        if step is not None and m is not None:  # live and bf16: the step's Watch says so
            y = m.linear.forward(x)  # [T, 2 intermediate]: gate | up
            act = elementwise.silu_and_mul(y, step.buffer("act", m.sizes[0]))
            return self.down_proj.forward(act)
        kernels = self.kernels
        if fixed_order:  # batch-invariant mode: see kernels/invariant.py
            gate = project(self.gate_proj, x, True, kernels)
            up = project(self.up_proj, x, True, kernels)
            act = invariant.silu_mul(gate, up, kernels.native)
            return project(self.down_proj, act, True, kernels)
        if m is not None and m.live(*self.projections()):
            y = m.linear(x)  # [..., 2 intermediate]: gate | up
            if kernels.native and elementwise.use_silu_and_mul(y):
                return self.down_proj(elementwise.silu_and_mul(y))
            gate, up = y.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate).mul_(up))
        gate, up = method(self.gate_proj, step)(x), method(self.up_proj, step)(x)
        down = method(self.down_proj, step)  # lean without a merged gate/up: directly too
        if kernels.native and elementwise.use_silu_mul(gate, up):  # one pass in C, into gate
            return down(elementwise.silu_mul(gate, up))
        h = F.silu(gate, inplace=True)  # in place: no [T, intermediate] temporaries
        return down(h.mul_(up))

    def _gelu(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's MLP: down(gelu_tanh(gate) * up), through the merged gate/up where live."""
        m = self.merged
        if m is not None and not torch.is_grad_enabled() and m.live(*self.projections()):
            gate, up = m.linear(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = F.gelu(gate, approximate="tanh")
        return self.down_proj(h * up if torch.is_grad_enabled() else h.mul_(up))
