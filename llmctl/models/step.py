"""An engine step's lean path through the one forward implementation (models/llama.py, layers.py).

Owns: `applies` (which prepared models may take it: dense llama-family bf16 on the CPU with the C
kernels; models/prepare.py asks once, where `KernelConfig.decode_program` allows, and checks each
layer's weights), `Watch` (what prepare saw, checked each step), `begin` (whether one step may: no
gradients, not batch-invariant, the inputs and caches as the kernels read them, no forward hook
anywhere, the model as prepared) and `Step`, what such a step shares between its layers: the
buffers [T, width] each layer writes its norms, RoPE, attention and activation into (one
allocation a step, not one a call). On the lean path each layer's `forward` is called as a
method, not through nn.Module.__call__ (with no hook anywhere, the call does nothing else), skips
the per-call checks prepare made once, and hands its kernels the step's buffers; every other step
calls the same methods through the modules, with fresh outputs. The kernels and their order are
the same, so the hidden states are equal bit for bit (tests/test_decode_program.py). Decode steps
gain the most: at small batches the fixed cost per layer and step is most of their time.
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu.library import load

BF16 = torch.bfloat16
# the caches the lean step's kernels read (fp8 and int8 converted on write, read as bytes)
CACHE_DTYPES = (BF16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


class Step:
    """One lean step's buffers: `buffer(name, *shape)` is a bf16 [T, *shape] tensor, the same for
    every layer (each layer has consumed the previous one's by the time it writes it)."""

    __slots__ = ("rows", "buffers")

    def __init__(self, rows: int):
        self.rows = rows
        self.buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, *shape: int) -> torch.Tensor:
        b = self.buffers.get(name)
        if b is None:
            b = self.buffers[name] = torch.empty(self.rows, *shape, dtype=BF16)
        return b


def applies(model: nn.Module, kernels: KernelConfig) -> bool:
    """A model of ours whose steps may take the lean path: the C kernels on, a dense llama-family
    shape (no q/k norms, experts, Gemma norms or attention features: the buffers are shared on the
    plain layer order), bf16 embeddings on the CPU, the norm and RoPE kernels built."""
    c = model.config
    if not kernels.native or c.qk_norm or c.moe or c.gemma or c.attention_features:
        return False
    if c.hidden_size % 8 or c.head_dim % 16 or not len(model.model.layers):
        return False
    embed = model.model.embed_tokens.weight
    if embed.dtype is not BF16 or not embed.is_cpu:
        return False
    return load("core") is not None and load("rope") is not None


class Watch:
    """What `begin` checks each step, by identity, so that what models/prepare.py checked once
    for the lean path (each layer's kernels apply: plain bf16 weights, live merged linears) still
    holds, and no hook would be skipped: every module below the model where it was (each
    parent's entry; compress and eval swap and hook modules of a model an engine served), every
    parameter and buffer of theirs and of the merged linears (not registered in the model) where
    it was and over the same memory, the merged linears still the blocks', no module hooked.
    Not the model itself: the model keeps this, and a cycle would keep a dropped model's weights
    alive until the garbage collector runs."""

    def __init__(self, model: nn.Module):
        places = []  # (the owner's dict, key, value found there)
        below = [m for m in model.modules() if m is not model]
        merged = [m.__dict__["merged"] for m in below if m.__dict__.get("merged") is not None]
        for parent in [model, *below, *(m.linear for m in merged)]:
            for where in (parent._modules, parent._parameters, parent._buffers):
                places += [(where, key, value) for key, value in where.items()]
            if parent.__dict__.get("merged") is not None:
                places.append((parent.__dict__, "merged", parent.merged))
        self.owners, self.keys, self.values = (list(c) for c in zip(*places))
        self.modules = [*below, *(m.linear for m in merged)]
        self.tensors = [v for v in self.values if isinstance(v, torch.Tensor)]
        self.pointers = [t.data_ptr() for t in self.tensors]

    def unchanged(self) -> bool:
        """Every place holds what it held, every tensor its memory, no module is hooked (map:
        this runs every step)."""
        if not all(map(operator.is_, map(dict.get, self.owners, self.keys), self.values)):
            return False
        if not all(map(operator.eq, map(torch.Tensor.data_ptr, self.tensors), self.pointers)):
            return False
        return not _hooked(self.modules)


def begin(model: nn.Module, input_ids, positions, meta, kv_caches) -> Step | None:
    """A Step where this step may take the lean path (model.lean: its `Watch`, set by
    models/prepare.py where `applies`), else None: the module path serves."""
    t = input_ids.shape[0]
    if not t or meta.batch_invariant or torch.is_grad_enabled() or not input_ids.is_cpu:
        return None
    if positions.dim() != 1 or positions.dtype is not torch.int64 or positions.shape[0] != t:
        return None
    slots = meta.slot_mapping
    if not positions.is_contiguous() or slots.dtype is not torch.int64 or slots.shape[0] != t:
        return None
    if not slots.is_contiguous():
        return None
    if model.model.embed_tokens.weight.dtype is not BF16 or not model.lean.unchanged():
        return None
    shape = kv_caches[0][0].shape  # [kv_heads, slots, D]
    for k, v in kv_caches:  # the kernels read the caches by pointer: bf16, or fp8 bytes
        if k.dtype not in CACHE_DTYPES or v.dtype is not k.dtype or not k.is_cpu:
            return None
        if k.shape != shape or v.shape != shape or not (k.is_contiguous() and v.is_contiguous()):
            return None
    return Step(t)


def _hooked(modules: list[nn.Module]) -> bool:
    """Forward hooks on any of `modules` or globally: the module path must run, for them."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(map(_FORWARD_HOOKS, modules)) or any(map(_FORWARD_PRE_HOOKS, modules))


_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")
_FORWARD_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")


def method(module: nn.Module, step: Step | None):
    """What a layer calls for a submodule that takes no step (a linear): its forward directly on
    a lean step (no hooks to run), else the module (nn.Module.__call__: hooks run)."""
    return module if step is None else module.forward


def call(module: nn.Module, step: Step | None, *args):
    """module(*args), hooks seeing just those; on a lean step module.forward(*args, step)."""
    return module(*args) if step is None else module.forward(*args, step)
