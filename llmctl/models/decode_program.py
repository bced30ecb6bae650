"""The engine's steps as a flat run of kernel calls, without nn.Module dispatch.

Owns: `DecodeProgram`, built by models/prepare.py for a bfloat16 model on the CPU
(projections merged, no q/k norm, the native kernels built). For an engine step it calls the
kernels the module path (`LlamaForCausalLM.forward`) would call, in the same order on the same
values, so the hidden states are equal bit for bit (tested), but without what that path pays per
layer and per step: a dozen module calls, the kernels' applicability checks, their wrappers'
argument handling and a temporary per call (the step's buffers are allocated once and shared by
every layer). Each linear still takes the kernel its autotune plan chose for the step's row count
(`Linear.forward` itself where that is not the bf16 dot-product kernel); attention is the decode
kernel `kernels/attention.py` would pick, called directly, for a step of one-token decodes, and
`paged_attention` itself for any other (prefill chunks, speculative verification). Decode steps
gain the most: their fixed cost per layer is most of their time at small batches. Built by
models/prepare.py where the engine's KernelConfig allows it (`decode_program`, `native`).

The program holds references into the model; a step runs it only while those are what the model
holds (`current`: same modules, parameters and memory, still merged, no forward hooks anywhere),
otherwise the module path serves, as it does for batch-invariant steps, gradients, other dtypes
and devices.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from llmctl.kernels.attention import PagedAttentionMetadata, paged_attention
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import attention as cpu_attention
from llmctl.kernels.cpu.library import load
from llmctl.kernels.cpu.linear.c_kernels import dpbf16_library

BF16 = torch.bfloat16


def _plain(t: torch.Tensor | None) -> bool:
    """A contiguous bfloat16 CPU tensor of the plain class (not quantized, not sparse), or None."""
    return t is None or (
        type(t.data) is torch.Tensor and t.dtype is BF16 and t.is_cpu and t.is_contiguous()
    )


class _Reads:
    """Records each module, parameter and attribute the program reads from the model, where it
    found it and (for tensors) the memory it had, so that `current` can tell, by identity, whether
    the model still holds the same: a module replaced (quantized), a parameter reassigned or
    moved, projections re-merged."""

    def __init__(self):
        self.found: list[tuple[dict, str, object]] = []  # (the owner's dict, key, value read)
        self.memory: list[tuple[torch.Tensor, int]] = []  # (tensor read, its data pointer)

    def _read(self, where: dict, key: str):
        value = where.get(key)
        self.found.append((where, key, value))
        if isinstance(value, torch.Tensor):
            self.memory.append((value, value.data_ptr()))
        return value

    def module(self, owner: nn.Module, name: str):
        return self._read(owner._modules, name)

    def param(self, owner: nn.Module, name: str):
        return self._read(owner._parameters, name)

    def attr(self, owner: nn.Module, name: str):
        return self._read(owner.__dict__, name)

    def seal(self) -> None:
        """The reads as columns, once, for `unchanged` (transposing costs more than testing)."""
        self.columns = tuple(zip(*self.found)), tuple(zip(*self.memory))

    def unchanged(self) -> bool:
        """Every read finds what it found at build, every tensor its memory (`seal` first; map:
        this runs every step)."""
        (wheres, keys, values), (tensors, pointers) = self.columns
        if not all(map(operator.is_, map(dict.get, wheres, keys), values)):
            return False
        return all(map(operator.eq, map(torch.Tensor.data_ptr, tensors), pointers))


class _Linear:
    """One linear of a layer: the module (Linear.forward serves where the plan does not pick the
    dot-product kernel) and, for that kernel, its weight and bias."""

    __slots__ = ("module", "weight", "bias", "n", "k", "pointers")

    def __init__(self, module: nn.Linear, reads: _Reads):
        self.module = module
        self.weight, self.bias = reads.param(module, "weight"), reads.param(module, "bias")
        self.n, self.k = self.weight.shape
        # (weight, bias) pointers: `current` checks each step that the memory is still there
        bias = None if self.bias is None else self.bias.data_ptr()
        self.pointers = (self.weight.data_ptr(), bias)

    def buildable(self) -> bool:
        """Our Linear (it has a plan) over plain bf16 tensors."""
        plain = _plain(self.weight) and _plain(self.bias) and self.weight.dim() == 2
        return plain and hasattr(self.module, "plan")

    def __call__(self, x: torch.Tensor, out: torch.Tensor, step: _Step) -> torch.Tensor:
        """x [T, K] (rows contiguous) -> [T, N]: into `out` through the dot-product kernel where
        the plan picks it for T rows, else whatever Linear.forward returns."""
        plan = self.module.plan
        chosen = None if plan is None else plan.kernel(step.rows)
        if chosen is None or chosen.name != "dpbf16":
            return type(self.module).forward(self.module, x)
        step.dot.linear_dpbf16(
            x.data_ptr(),
            x.stride(0),
            *self.pointers,
            out.data_ptr(),
            step.rows,
            self.n,
            self.k,
            step.threads,
        )
        return out


class _Layer:
    """What the program reads of one decoder layer."""

    __slots__ = ("scale", "qkv", "sizes", "o", "gate_up", "down", "norm1", "norm2", "eps")

    def __init__(self, layer: nn.Module, reads: _Reads):
        attn, mlp = reads.module(layer, "self_attn"), reads.module(layer, "mlp")
        self.scale = attn.scale
        for block in (attn, mlp):  # the merged linear serves only while its parts are unchanged
            merged = reads.attr(block, "merged")
            if merged is None:
                raise _NotMerged
            for name, part in zip(_PARTS[type(block).__name__], merged.parts):
                if reads.module(block, name) is not part:
                    raise _NotMerged
                reads.param(part, "weight")
        self.qkv, self.sizes = _Linear(attn.merged.linear, reads), attn.merged.sizes
        self.o = _Linear(reads.module(attn, "o_proj"), reads)
        self.gate_up = _Linear(mlp.merged.linear, reads)
        self.down = _Linear(reads.module(mlp, "down_proj"), reads)
        norm1 = reads.module(layer, "input_layernorm")
        norm2 = reads.module(layer, "post_attention_layernorm")
        self.norm1, self.norm2 = reads.param(norm1, "weight"), reads.param(norm2, "weight")
        self.eps = norm1.eps

    def linears(self) -> tuple[_Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


_PARTS = {"Attention": ("q_proj", "k_proj", "v_proj"), "MLP": ("gate_proj", "up_proj")}


class _NotMerged(Exception):
    """A block with no merged linear, or one that no longer serves its parts: no program."""


def _hooked(modules: list[nn.Module]) -> bool:
    """Forward hooks on any of `modules` or globally: the module path must run, for them."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(map(_FORWARD_HOOKS, modules)) or any(map(_FORWARD_PRE_HOOKS, modules))


_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")
_FORWARD_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


class DecodeProgram:
    """See the module docstring. Build with `DecodeProgram.build(model)`."""

    def __init__(self, model: nn.Module, kernels: KernelConfig):
        self.kernels = kernels
        # No reference to `model` itself: the model holds the program, and a cycle would keep a
        # dropped model's weights alive until the garbage collector runs.
        self.config = model.config
        self.reads = reads = _Reads()
        inner = reads.module(model, "model")
        self.embed = reads.param(reads.module(inner, "embed_tokens"), "weight")
        final = reads.module(inner, "norm")
        self.norm, self.eps = reads.param(final, "weight"), final.eps
        layers = reads.module(inner, "layers")
        self.layers = [_Layer(reads.module(layers, str(i)), reads) for i in range(len(layers))]
        reads.found.append((layers._modules, str(len(layers)), None))  # no layer added
        reads.seal()
        self.rotary = model.model.layers[0].self_attn._rotary[0]  # the table every layer uses
        # the modules whose forward the module path calls (the root's hooks run before this)
        self.modules = [*inner.modules(), self.rotary]

    @classmethod
    def build(cls, model: nn.Module, kernels: KernelConfig) -> DecodeProgram | None:
        """The program for `model` under `kernels`, or None where it does not apply (see the
        module docstring)."""
        c = model.config
        if not kernels.native or c.qk_norm or c.moe or c.gemma or c.attention_features:
            return None
        if c.hidden_size % 8 or c.head_dim % 16:
            return None
        if load("core") is None or load("rope") is None:
            return None
        if not len(model.model.layers):
            return None
        embed, rotary = model.model.embed_tokens, model.model.layers[0].self_attn._rotary[0]
        if type(embed) is not nn.Embedding or embed.max_norm is not None:
            return None
        tables = (rotary.cos, rotary.sin)  # RoPE's float32 tables, read by pointer
        if not _plain(embed.weight) or not all(
            t.dtype is torch.float32 and t.is_contiguous() for t in tables
        ):
            return None
        try:
            program = cls(model, kernels)
        except _NotMerged:
            return None
        norms = [program.norm, *(w for r in program.layers for w in (r.norm1, r.norm2))]
        linears = [lin for r in program.layers for lin in r.linears()]
        if not all(map(_plain, norms)) or not all(lin.buildable() for lin in linears):
            return None
        return program

    def current(self) -> bool:
        """The model still holds what the program reads, and nothing hooks its modules."""
        return not _hooked(self.modules) and self.reads.unchanged()

    def serves(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> bool:
        """Whether the program computes this step: on the CPU, no gradients, not batch-invariant,
        caches as the kernels read them, the model unchanged."""
        t = input_ids.shape[0]
        if not t or meta.batch_invariant:
            return False
        if torch.is_grad_enabled() or not input_ids.is_cpu or positions.dtype is not torch.int64:
            return False
        if positions.dim() != 1 or not positions.is_contiguous() or positions.shape[0] != t:
            return False
        slots = meta.slot_mapping
        if slots.dtype is not torch.int64 or not slots.is_contiguous() or slots.shape[0] != t:
            return False
        shape = kv_caches[0][0].shape
        for k, v in kv_caches:  # the kernels read every layer's cache by pointer, as layer 0's
            if k.dtype is not BF16 or v.dtype is not BF16 or k.shape != shape:
                return False
            if v.shape != shape or not (k.is_contiguous() and v.is_contiguous()):
                return False
        return self.current()

    def run(self, input_ids, positions, meta: PagedAttentionMetadata, kv_caches) -> torch.Tensor:
        """LlamaForCausalLM.forward for a step `serves` accepted: final hidden states [T, hidden]
        (normed); K/V written to the caches."""
        step = _Step(self, positions, meta, kv_caches[0][0])
        x = F.embedding(input_ids, self.embed)  # [T, hidden], fresh
        delta = None
        for rec, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = step.norm(x, delta, rec.norm1, rec.eps)
            attn = step.attention(rec, step.rope(rec.qkv(h, step.qkv, step), rec), k_cache, v_cache)
            h = step.norm(x, rec.o(attn.view(step.rows, -1), step.o, step), rec.norm2, rec.eps)
            act = step.silu_and_mul(rec.gate_up(h, step.gate_up, step))
            delta = rec.down(act, step.down, step)
        return step.norm(x, delta, self.norm, self.eps)


class _Step:
    """One step's shared arguments and buffers (every layer reads and writes the same shapes)."""

    def __init__(self, program: DecodeProgram, positions, meta, k_cache0: torch.Tensor):
        c, t = program.config, positions.shape[0]
        self.rows, self.threads = t, torch.get_num_threads()
        self.lib, self.dot, self.rot = load("core"), dpbf16_library(), load("rope")
        self.c, self.meta, self.rotary = c, meta, program.rotary
        self.positions = positions
        self.kv_shape = k_cache0.shape  # [KVH, slots, D], every layer's
        # One-token decodes only, with their longest context given: the decode kernel directly;
        # any other step (prefill chunks, speculative verification) through paged_attention.
        self.decode_only = meta.num_decodes == t and meta.decode_max_len > 0
        if self.decode_only:
            self.tables = meta.decode_block_tables.to(torch.int64).contiguous()
            self.lens = meta.decode_context_lens.to(torch.int64).contiguous()
            cpu_attention.check_decode_shapes(
                c.num_heads, c.head_dim, self.kv_shape[0], self.tables.shape[1], meta.block_size,
                meta.decode_max_len,
            )  # fmt: skip
        nq = c.q_size + 2 * c.kv_size

        def buf(*shape):
            return torch.empty(*shape, dtype=BF16)

        self.h = buf(t, c.hidden_size)
        self.qkv, self.o, self.down = buf(t, nq), buf(t, c.hidden_size), buf(t, c.hidden_size)
        self.gate_up, self.act = buf(t, 2 * c.intermediate_size), buf(t, c.intermediate_size)
        self.q, self.k = buf(t, c.num_heads, c.head_dim), buf(t, c.num_kv_heads, c.head_dim)
        self.attn = buf(t, c.num_heads, c.head_dim)
        self.kernels = program.kernels
        self.choice = program.kernels.decode_attention
        kernel = cpu_attention.decode_kernel(BF16, k_cache0.dtype, self.choice)
        self.dpbf16 = kernel in ("paged_decode_amx", "paged_decode_dpbf16")
        if self.dpbf16:  # called directly (its arguments are the step's)
            self.decode_bf16 = getattr(self.lib, kernel)

    def norm(self, x, delta, weight, eps: float) -> torch.Tensor:
        """RMSNorm.add_forward(x, delta): x += delta in place (none for the first layer), then
        the norm of x into the step's buffer, by the kernels of kernels/cpu/elementwise.py."""
        if delta is None:
            self.lib.rms_norm(
                x.data_ptr(), weight.data_ptr(), self.h.data_ptr(), self.rows, x.shape[1], eps,
                1, self.threads,
            )  # fmt: skip
            return self.h
        if not delta.is_contiguous():
            delta = delta.contiguous()
        self.lib.add_rms_norm(
            x.data_ptr(), delta.data_ptr(), weight.data_ptr(), self.h.data_ptr(), self.rows,
            x.shape[1], eps, 1, self.threads,
        )  # fmt: skip
        return self.h

    def rope(self, qkv: torch.Tensor, rec: _Layer) -> torch.Tensor:
        """q and k rotated out of the merged projection [T, q + 2 kv] into the step's buffers (as
        elementwise.rope does for column slices); returns qkv, whose v columns attention reads."""
        if not qkv.is_contiguous():
            qkv = qkv.contiguous()
        c, ld = self.c, qkv.stride(0)
        base = qkv.data_ptr()
        self.rot.rope_bf16(
            base, ld, base + 2 * rec.sizes[0], ld, self.q.data_ptr(), self.k.data_ptr(),
            self.rows, c.num_heads, c.num_kv_heads, c.head_dim, self.rotary.cos.data_ptr(),
            self.rotary.sin.data_ptr(), self.positions.data_ptr(), self.threads,
        )  # fmt: skip
        return qkv

    def attention(self, rec: _Layer, qkv: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
        """K/V written to their slots, then attention of q over each sequence's cache: for a
        decode-only step the kernels paged_attention picks for one, called directly; otherwise
        paged_attention itself. Returns [T, heads, D]."""
        c, meta = self.c, self.meta
        kvh, slots, d = self.kv_shape
        if not self.decode_only:
            v = qkv[:, rec.sizes[0] + rec.sizes[1] :].view(self.rows, kvh, d)
            return paged_attention(
                self.q, self.k, v, k_cache, v_cache, meta, rec.scale, self.kernels
            )
        v_ptr = qkv.data_ptr() + 2 * (rec.sizes[0] + rec.sizes[1])
        self.lib.write_kv(
            self.k.data_ptr(), c.kv_size, v_ptr, qkv.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), meta.slot_mapping.data_ptr(), self.rows, kvh, d, slots, 2,
            self.threads,
        )  # fmt: skip
        scale = rec.scale
        if not self.dpbf16:
            return cpu_attention.paged_decode_attention(
                self.q, k_cache, v_cache, self.tables, self.lens, scale, meta.block_size,
                meta.decode_max_len, self.choice,
            )  # fmt: skip
        failed = self.decode_bf16(
            self.q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self.tables.data_ptr(),
            self.lens.data_ptr(), self.attn.data_ptr(), self.rows, c.num_heads, kvh, d, slots,
            self.tables.shape[1], meta.block_size, scale, meta.decode_max_len, self.threads,
        )  # fmt: skip
        if failed:
            raise MemoryError("paged_decode_attention: out of memory for its score buffers")
        return self.attn

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the merged gate/up output [T, 2F] into the step's buffer [T, F]."""
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        f = self.act.shape[1]
        self.lib.silu_and_mul(
            gate_up.data_ptr(), self.act.data_ptr(), self.rows, f, 1, self.threads
        )  # fmt: skip
        return self.act
