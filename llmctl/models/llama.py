"""Our model code for the Llama family: llama, mistral, qwen2 (q/k/v bias) and qwen3 (q/k RMSNorm).

Owns: the decoder modules and two forward paths over the same weights:
- `forward(input_ids [T], positions [T], meta, kv_caches)`: the engine's packed, paged-KV path
  (with `meta.batch_invariant`, every projection and the MLP through `project` and
  kernels/invariant.py, whose rows do not depend on each other);
- `forward_dense(input_ids [B, S])`: plain causal attention with no cache (calibration, eval).
Parameter names equal Hugging Face's, so checkpoints load (and save) one to one. At engine start
(`tune_linears`) q/k/v and gate/up are merged into one linear each (models/merged.py) for the
engine's path; the element-wise steps there run fused in C where they can (kernels/cpu_fused.py:
SiLU-and-multiply, residual add + RMSNorm). On the CPU in bf16, the engine's steps (but
batch-invariant ones) run as models/decode_program.py's flat sequence of those kernels instead,
where it applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.kernels import autotune, cpu_bf16, cpu_fused, cpu_native, invariant
from llmctl.kernels.attention import PagedAttentionMetadata, paged_attention
from llmctl.kernels.onednn_linear import pack_weight, packed_linear
from llmctl.models import merged as merging
from llmctl.models.config import ModelConfig
from llmctl.models.decode_program import DecodeProgram
from llmctl.models.rope import RotaryEmbedding


class Linear(nn.Linear):
    """nn.Linear whose CPU inference goes where it measured faster than F.linear: with a `plan`
    (kernels/autotune.py, set when an engine starts), the kernel timed fastest for the call's row
    count; without one, or for a row count the plan did not measure, the static rules: few rows
    through the native kernel (kernels/cpu_linear.c), and on CPUs without native bf16 many bf16
    rows through the float32 BLAS on widened weight slabs (kernels/cpu_bf16.py); everything else,
    and anything with gradients, is plain F.linear. A subclass, so hooks and isinstance checks
    still see an nn.Linear and checkpoints keep their names."""

    plan: autotune.Plan | None = None
    # packing kernel name -> its copy of the weight (oneDNN-packed, AMX tile order), where the
    # plan uses one
    packed: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if plan is not None and x.dtype is self.weight.dtype and not torch.is_grad_enabled():
            kernel = plan.kernel(x.numel() // self.in_features if self.in_features else 0)
            if kernel is not None:
                return kernel(x, self.weight, self.bias, self.packed)
        if cpu_native.use_linear(x, self.weight):
            return cpu_native.linear(x, self.weight, self.bias)
        if cpu_bf16.use_upcast(x, self.weight):
            return cpu_bf16.upcast_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def project(layer: nn.Module, x: torch.Tensor, fixed_order: bool) -> torch.Tensor:
    """layer(x); with `fixed_order` (batch-invariant mode) through kernels/invariant.py, whose
    rows do not depend on each other's presence. Any linear module (dense, quantized, sparse)."""
    if not fixed_order:
        return layer(x)
    if type(layer) is not Linear:  # quantized and other modules: one row a call
        return invariant.linear(x, None, None, layer)
    return invariant.linear(x, layer.weight, layer.bias, layer)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
        """`fixed_order` (batch-invariant mode): one program a row where the Triton kernels apply
        (kernels/invariant.py); the CPU paths below are one fixed-order reduction a row anyway."""
        if fixed_order and (out := invariant.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        if cpu_native.use_rms_norm(
            x, self.weight
        ):  # one pass in C: PyTorch takes 5+ ops, ~20 us a row
            return cpu_native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # the same arithmetic, fused: about 1.2-1.5x faster on the CPU
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32, as the reference implementation does, then scale in the model dtype.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor, r: torch.Tensor | None, fixed_order: bool = False):
        """x.add_(r) (inference: x is the residual stream, updated in place), then self(x); one
        pass in C where it applies (vLLM's fused_add_rms_norm). r None: self(x) alone."""
        if r is None:
            return self(x, fixed_order)
        if not fixed_order and cpu_fused.use_add_rms_norm(x, r, self.weight):
            return cpu_fused.add_rms_norm(x, r, self.weight, self.eps)
        return self(x.add_(r), fixed_order)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = d**-0.5
        bias = config.attention_bias
        self.q_proj = Linear(h, config.q_size, bias=bias)
        self.k_proj = Linear(h, config.kv_size, bias=bias)
        self.v_proj = Linear(h, config.kv_size, bias=bias)
        # qwen2 has biases on q/k/v only; llama and qwen3 put `attention_bias` on o_proj too.
        self.o_proj = Linear(config.q_size, h, bias=bias and config.model_type != "qwen2")
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self._rotary = [rotary]  # a list, so the shared table is not registered once per layer
        self.merged: merging.Merged | None = None  # q/k/v as one linear (merge_projections)

    def projections(self) -> tuple[nn.Module, ...]:
        """The linears reading x, in the merged weight's row order [q_size + 2 kv_size]."""
        return self.q_proj, self.k_proj, self.v_proj

    def _project_qkv(self, x: torch.Tensor, fixed_order: bool):
        """x [..., hidden] -> q [..., q_size], k, v [..., kv_size]: one GEMM where merged."""
        m = self.merged
        if (
            m is not None
            and not fixed_order
            and not torch.is_grad_enabled()
            and m.live(*self.projections())
        ):
            return m.linear(x).split(m.sizes, dim=-1)  # column slices of [..., q + 2 kv]
        return tuple(project(p, x, fixed_order) for p in self.projections())

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, fixed_order: bool = False):
        """x [..., hidden] -> q [..., heads, D], k and v [..., kv_heads, D], RoPE applied; q and
        k contiguous, v possibly a column slice of the merged projection (read through its
        strides)."""
        lead = x.shape[:-1]
        q, k, v = self._project_qkv(x, fixed_order)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # the norm kernels read contiguous rows
            q = self.q_norm(q.contiguous(), fixed_order)
            k = self.k_norm(k.contiguous(), fixed_order)
        # The bf16 RoPE kernel reads merged slices and writes new contiguous q and k (no copies
        # first); elsewhere the rotation runs in place and the copies follow.
        q, k = self._rotary[0](positions, q, k)
        return q.contiguous(), k.contiguous(), v

    def forward(self, x, positions, meta: PagedAttentionMetadata, kv_cache) -> torch.Tensor:
        fixed = meta.batch_invariant
        q, k, v = self.qkv(x, positions, fixed)  # [T, heads, D], [T, kv_heads, D]
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return project(self.o_proj, out.reshape(x.shape[0], -1), fixed)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, past):
        """x [S, hidden] at `positions` after `past` = (k, v) [kv_heads, P, D] or None (a dense,
        contiguous per-request cache, used by the speculative draft model). Returns (out, cache)."""
        q, k, v = self.qkv(x, positions)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, S, D]
        if past is not None:
            k, v = torch.cat((past[0], k), dim=1), torch.cat((past[1], v), dim=1)
        s, total = x.shape[0], k.shape[1]
        mask = torch.arange(total, device=x.device)[None, :] <= (positions[:, None])  # [S, total]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(s, -1)), (k, v)

    def forward_dense(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden], positions [S]."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x, positions)  # [B, S, heads, D]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, f, bias=False)
        self.up_proj = Linear(h, f, bias=False)
        self.down_proj = Linear(f, h, bias=False)
        self.merged: merging.Merged | None = None  # gate/up as one linear (merge_projections)

    def projections(self) -> tuple[nn.Module, ...]:
        """The linears reading x, in the merged weight's row order [2 intermediate]."""
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if fixed_order:  # batch-invariant mode: see kernels/invariant.py
            gate, up = project(self.gate_proj, x, True), project(self.up_proj, x, True)
            return project(self.down_proj, invariant.silu_mul(gate, up), True)
        m = self.merged
        if m is not None and m.live(*self.projections()):
            y = m.linear(x)  # [..., 2 intermediate]: gate | up
            if cpu_fused.use_silu_and_mul(y):
                return self.down_proj(cpu_fused.silu_and_mul(y))
            gate, up = y.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate).mul_(up))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if cpu_native.use_silu_mul(gate, up):  # one pass in C, into gate
            return self.down_proj(cpu_native.silu_mul(gate, up))
        h = F.silu(gate, inplace=True)  # in place: no [T, intermediate] temporaries
        return self.down_proj(h.mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(config, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, meta, kv_cache, delta=None):
        """The engine's path (inference only): x [T, hidden] the residual stream, updated in
        place; `delta` [T, hidden] the previous layer's output not yet added to it (None: none).
        Returns (x, this layer's MLP output): the next layer (or the final norm) adds it, fused
        with its RMSNorm, as each residual add here is."""
        fixed = meta.batch_invariant
        h = self.input_layernorm.add_forward(x, delta, fixed)
        a = self.self_attn(h, positions, meta, kv_cache)
        return x, self.mlp(self.post_attention_layernorm.add_forward(x, a, fixed), fixed)

    def forward_cached(self, x, positions, past):
        a, cache = self.self_attn.forward_cached(self.input_layernorm(x), positions, past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache

    def forward_dense(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.model = LlamaModel(config, self.rotary)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_head: torch.Tensor | None = None  # see pack_lm_head
        self.decode_program: DecodeProgram | None = None  # built by tune_linears

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(
        self, input_ids, positions, meta: PagedAttentionMetadata, kv_caches
    ) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden] (normed); K/V written to the
        caches."""
        program = self.decode_program
        if program is not None and program.serves(input_ids, positions, meta, kv_caches):
            return program.run(input_ids, positions, meta, kv_caches)
        x, delta = self.model.embed_tokens(input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, delta = layer(x, positions, meta, kv, delta)
        return self.model.norm.add_forward(x, delta, meta.batch_invariant)

    def merge_projections(self) -> tuple[list[Linear], set[int]]:
        """Merge each decoder layer's q/k/v and gate/up into one linear each for the engine's
        path (models/merged.py; kept separate where they are not plain `Linear` modules of one
        dtype, or with LLMCTL_MERGE_LINEARS=0). The parameters keep their names and memory.
        Returns the merged linears and the ids of the parts they serve."""
        linears, parts = [], set()
        for layer in self.model.layers:
            for block in (layer.self_attn, layer.mlp):
                block.merged = merging.refreshed(block.merged, block.projections(), Linear)
                if block.merged is not None:
                    linears.append(block.merged.linear)
                    parts.update(id(p) for p in block.merged.parts)
        return linears, parts

    def _plain_head(self) -> bool:
        """lm_head is our bias-free Linear over a plain tensor (not quantized, not a sparse
        subclass)."""
        head = self.lm_head
        return type(head) is Linear and head.bias is None and type(head.weight.data) is torch.Tensor

    def pack_lm_head(self) -> bool:
        """Keep a oneDNN-packed copy of the vocabulary projection for batched logits (inference on
        the CPU in float32). Costs one more vocab x hidden matrix of memory (none more where the
        autotuner packed it already); returns whether it was made."""
        if self._plain_head():
            head = self.lm_head
            held = (head.packed or {}).get("packed")  # the autotuner's oneDNN copy, if it made one
            self.packed_head = held if held is not None else pack_weight(head.weight)
        return self.packed_head is not None

    def tune_linears(self, max_rows: int, logit_rows: int, enabled: bool = True) -> None:
        """Choose each plain CPU linear's kernels by measurement (kernels/autotune.py): decoder
        linears see at most `max_rows` rows a call (the token budget), the vocabulary projection
        `logit_rows`. Not `enabled`: drop the plans (the static rules serve). Merges the
        projections first (`merge_projections`): the merged shapes are the ones tuned. Then
        builds the decode program over the result (models/decode_program.py)."""
        merged, parts = self.merge_projections()
        layers = [
            m
            for m in (*self.modules(), *merged)
            if type(m) is Linear
            and id(m) not in parts
            and type(m.weight.data) is torch.Tensor
            and m.weight.device.type == "cpu"
            and m.weight.dtype in (torch.float32, torch.bfloat16)
        ]
        for m in layers:
            m.plan = m.packed = None
        if enabled and layers:
            rows = [logit_rows if m is self.lm_head else max_rows for m in layers]
            for m, plan in zip(layers, autotune.tune(layers, rows)):
                # name -> copy, for the packing kernels the plan chose
                packed = {n: autotune.BY_NAME[n].pack(m.weight) for n in plan.packings}
                if all(p is not None for p in packed.values()):
                    m.plan, m.packed = plan, packed or None
        self.decode_program = DecodeProgram.build(self)

    def compute_logits(
        self, hidden: torch.Tensor, fixed_order: bool = False, float32: bool = True
    ) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: float32, or with `float32=False` as the
        projection gives them (the model's dtype: the engine's greedy steps read bf16 logits
        as they are); `fixed_order`: batch-invariant."""
        if fixed_order:
            logits = project(self.lm_head, hidden, True)
        # Few rows: the native kernel inside lm_head (1.1-1.3x the packed weight at 4-16 rows, both
        # shapes, 1 thread); more rows: the packed weight (1.2-1.5x F.linear at 16-64 rows).
        elif (
            self.packed_head is not None
            and hidden.dim() == 2
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and self._plain_head()
            and self.lm_head.plan is None
            and not cpu_native.use_linear(hidden, self.lm_head.weight)
        ):
            logits = packed_linear(hidden, self.packed_head)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def forward_cached(self, input_ids: torch.Tensor, start: int, cache: list | None):
        """Tokens [S] at positions start.. after a dense per-layer cache (None: empty).
        Returns (float32 logits of the last token [V], the extended cache)."""
        positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        new_cache = []
        for i, layer in enumerate(self.model.layers):
            x, c = layer.forward_cached(x, positions, None if cache is None else cache[i])
            new_cache.append(c)
        return self.compute_logits(self.model.norm(x[-1:]))[0], new_cache

    @staticmethod
    def trim_cache(cache: list | None, length: int) -> list | None:
        """Keep the first `length` positions of a `forward_cached` cache."""
        if cache is None or length == 0:
            return None
        return [(k[:, :length], v[:, :length]) for k, v in cache]

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, vocab] float32 logits, causal, no cache."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer.forward_dense(x, positions)
        return self.compute_logits(self.model.norm(x))
