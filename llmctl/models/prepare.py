"""Preparing a model for inference: the one step between loading a model and serving it.

Owns: `prepare_for_inference(model, kernels, ...)`, called by the engine's model runner only. It
hands every layer the engine's KernelConfig (which kernels may serve), fits the RoPE tables to
the engine's context (LongRoPE's factors: models/rope.py), merges each decoder layer's
q/k/v and gate/up into one linear each (models/merged.py), chooses each plain CPU linear's kernel
per row count by measurement (kernels/cpu/linear/autotune.py: decoder linears see at most the
token budget, the vocabulary projection at most `logit_rows`), keeps a oneDNN-packed copy of the
float32 vocabulary projection for batched logits, and says whether the engine's steps may take
the lean path (models/step.py: the same layer methods called directly, on buffers shared by the
step's layers) where it applies. Each is undone or redone on a second call (a new engine over
the same model). A model of transformers' code (the
transformers path) has no layers of ours to merge: its plain `nn.Linear` modules become our
`Linear` (the same parameters; only the class changes), so they take the same tuned kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu.linear import autotune, dispatch, torch_kernels
from llmctl.models import lora
from llmctl.models import merged as merging
from llmctl.models import step as steps
from llmctl.models.layers import MLP, Attention, Linear, RMSNorm
from llmctl.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class Serving:
    """What the engine will ask of the model: its device and dtype, the most rows a decoder linear
    and the vocabulary projection see in one call, and whether every step is batch-invariant."""

    device: str
    dtype: torch.dtype
    max_rows: int
    logit_rows: int
    batch_invariant: bool = False
    context: int | None = None  # the longest sequence it serves (None: the model's context)


def prepare_for_inference(model: nn.Module, kernels: KernelConfig, serving: Serving) -> None:
    """See the module docstring. `model`: ours (models/llama.py) or the transformers path's
    wrapper (models/transformers_backend.py; no `layers`)."""
    cpu = serving.device == "cpu"
    ours = hasattr(model, "layers")
    if cpu and not ours:
        _adopt_linears(model)
    # merged, tuned and packed for the CPU's kernels; elsewhere the layers as loaded
    merge = cpu and ours
    merged, parts = merge_projections(model, kernels.merge_linears) if merge else ([], set())
    for m in (*model.modules(), *merged):
        if hasattr(type(m), "kernels"):
            m.kernels = kernels
    if ours:
        model.lean = None
        context = min(
            serving.context or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
        )
        for m in model.modules():  # LongRoPE's factors for this context (models/rope.py)
            if isinstance(m, RotaryEmbedding):
                m.fit(context)
    if not cpu:
        return
    linears = _tunable(model, merged, parts)
    for m in linears:
        m.plan = m.packed = None
    if kernels.autotune and not serving.batch_invariant and linears:
        _tune(model, linears, serving, kernels.native)
    if serving.dtype == torch.float32 and not serving.batch_invariant:
        _pack_lm_head(model.lm_head)
    if ours and kernels.decode_program and steps.applies(model, kernels) and _lean_layers(model):
        model.lean = steps.Watch(model)


def _lean_layers(model: nn.Module) -> bool:
    """Every decoder layer as the lean path (models/step.py) calls its kernels without checking
    each call: norms, plain Linears (merged ones live) over contiguous bf16 weights, RoPE on
    contiguous float32 tables, nothing else holding parameters (a quantized or sparse layer);
    models/step.Watch tells, each step, that it still is."""
    for m in model.model.layers.modules():
        if isinstance(m, (Attention, MLP)) and m.merged and not m.merged.live(*m.projections()):
            return False
        linear = type(m) is Linear and (m.bias is None or _bf16(m.bias))
        if not (linear or type(m) is RMSNorm) and m._parameters:
            return False
        if m._parameters and not _bf16(m.weight):
            return False
    rotary = model.model.layers[0].self_attn._rotary[0]
    return all(t.dtype is torch.float32 and t.is_contiguous() for t in (rotary.cos, rotary.sin))


def _bf16(t: torch.Tensor) -> bool:
    """A plain contiguous bfloat16 CPU tensor (not quantized, not sparse)."""
    plain = type(t.data) is torch.Tensor and t.dim() in (1, 2)
    return plain and t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous()


def _adopt_linears(model: nn.Module) -> None:
    """Every module of exactly nn.Linear becomes our Linear (a subclass: hooks, names and
    isinstance checks see no difference)."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Linear


def merge_projections(model: nn.Module, enabled: bool = True) -> tuple[list[Linear], set[int]]:
    """Merge each decoder layer's q/k/v and gate/up into one linear each for the engine's path
    (kept separate where they are not plain `Linear` modules of one dtype, or not `enabled`).
    The parameters keep their names and memory. Returns the merged linears and the ids of the
    parts they serve."""
    for block in _blocks(model):
        block.merged = _refreshed(block.merged, block.projections()) if enabled else None
    merged = [block.merged for block in _blocks(model) if block.merged is not None]
    # a LoRA merged linear serves through its plain base, tuned as the others (models/lora.py)
    linears = [x for m in merged for x in lora.served(m.linear)]
    return linears, {id(x) for m in merged for p in m.parts for x in lora.served(p)}


def _refreshed(current, parts) -> merging.Merged | None:
    """The block's merge of `parts` (models/merged.py; models/lora.py where any is wrapped for
    LoRA adapters: one GEMM for the base, each wrapped part's update into its columns)."""
    if lora.wrapped(parts):
        return lora.refreshed(current, parts)
    return merging.refreshed(current, parts, Linear)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Every attention and MLP block (experts' too): the blocks that may hold a merged linear."""
    return [m for m in model.modules() if isinstance(m, (Attention, MLP))]


def _tunable(model: nn.Module, merged: list[Linear], parts: set[int]) -> list[Linear]:
    """Our plain CPU float32/bf16 linears that serve the engine (merged ones, not their parts)."""
    return [
        m
        for m in (*model.modules(), *merged)
        if type(m) is Linear
        and id(m) not in parts
        and type(m.weight.data) is torch.Tensor
        and m.weight.device.type == "cpu"
        and m.weight.dtype in (torch.float32, torch.bfloat16)
    ]


def _tune(model: nn.Module, linears: list[Linear], serving: Serving, native: bool) -> None:
    """A plan per linear, and the packed copies its plan chose (none where one cannot be made)."""
    rows = [serving.logit_rows if m is model.lm_head else serving.max_rows for m in linears]
    for m, plan in zip(linears, autotune.tune(linears, rows, native=native)):
        packed = {n: dispatch.BY_NAME[n].pack(m.weight) for n in plan.packings}
        if all(p is not None for p in packed.values()):
            m.plan, m.packed = plan, packed or None


def _pack_lm_head(head: nn.Module) -> None:
    """A oneDNN-packed copy of the vocabulary projection for batched float32 logits (one more
    vocab x hidden matrix of memory; none more where the autotuner packed it already)."""
    plain = type(head) is Linear and head.bias is None and type(head.weight.data) is torch.Tensor
    if not plain or head.plan is not None:  # a plan serves every row count it measured
        return
    packed = torch_kernels.pack_weight(head.weight)
    if packed is not None:
        head.packed = {"packed": packed}


def drop_weight_copies(model: nn.Module) -> None:
    """Forget every packed copy of a weight (and the plans that read them): the weights are about
    to change in place (on-policy distillation trains the model an engine served), and a copy
    would go stale. The next `prepare_for_inference` makes them anew."""
    merged = [
        x for b in _blocks(model) if b.merged is not None for x in lora.served(b.merged.linear)
    ]
    for m in (*model.modules(), *merged):
        if type(m) is Linear and m.packed:
            m.plan = m.packed = None
