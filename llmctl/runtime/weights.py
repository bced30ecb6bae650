"""Weights from a folder of safetensors into our model, dense or quantized.

Owns: `load_model` (build the model on the meta device, then its dense weights through
tensors.assign_dense or a quantized folder through formats/load.py; RoPE buffers; the 2:4 path
of runtime/semi_structured.py where it is faster).
"""

from __future__ import annotations

from pathlib import Path

from llmctl.models.config import ModelConfig
from llmctl.runtime.formats.load import load_quantized
from llmctl.runtime.resolve import resolve_device, resolve_dtype
from llmctl.runtime.tensors import assign_dense, iter_tensors


def load_model(path: Path, dtype: str = "auto", device: str = "cpu"):
    """Build our model for `path` and copy its safetensors weights in. Returns (model, config)."""
    import torch

    from llmctl.models.llama import LlamaForCausalLM

    config = ModelConfig.from_file(path / "config.json")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quant = config.raw.get("quantization_config")
    if quant is not None:
        model = load_quantized(model, path, config, quant, torch_dtype, device)
    else:
        assign_dense(model, iter_tensors(path), config, torch_dtype, device, path)
    _materialise_buffers(model, config, device)
    model = model.eval().requires_grad_(False)
    if quant is None:
        _accelerate_2of4(model, config)
    return model, config


def _accelerate_2of4(model, config: ModelConfig) -> None:
    """A 2:4 checkpoint from `llmctl sparsify` (config.json `sparsity_config.pattern == "2:4"`): on
    an Ampere+ GPU, swap its pruned linears to semi-structured sparse where timed faster; elsewhere
    they stay dense. The per-linear decisions are kept on `model.semi_structured` for reports and
    tests."""
    meta = config.raw.get("sparsity_config") or {}
    if meta.get("pattern") != "2:4":
        return
    from llmctl.runtime import semi_structured as ss

    model.semi_structured = ss.accelerate_from_config(
        model, config.raw, timer=ss.time_dense_vs_sparse
    )


def _materialise_buffers(model, config: ModelConfig, device: str) -> None:
    from llmctl.models.rope import RotaryEmbedding

    rotary = RotaryEmbedding(config).to(device)
    model.rotary.cos, model.rotary.sin = rotary.cos, rotary.sin
