"""Weights from a folder of safetensors into our model, dense or quantized.

Owns: `load_model` and the choice of model implementation (`MODEL_IMPLS`, vLLM's
`--model-impl`): our own model code where it runs the config (build the model on the meta device,
then its dense weights through tensors.assign_dense or a quantized folder through
formats/load.py; RoPE buffers; the 2:4 path of runtime/semi_structured.py where it is faster), or
transformers' modeling code for the rest (models/transformers_backend.py), loaded by transformers
from safetensors only, never with code from the model folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.config import ModelConfig
from llmctl.runtime.formats.load import load_quantized
from llmctl.runtime.resolve import resolve_device, resolve_dtype
from llmctl.runtime.tensors import assign_dense, iter_tensors

MODEL_IMPLS = ("auto", "llmctl", "transformers")


def load_model(path: Path, dtype: str = "auto", device: str = "cpu", impl: str = "auto"):
    """The model for `path` with its safetensors weights, by `impl` (auto: our own code where it
    runs the config, else transformers'). Returns (model, config)."""
    import torch

    from llmctl.models.llama import LlamaForCausalLM, checkpoint_tensors

    config = ModelConfig.from_file(path / "config.json")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    if choose_impl(config, impl) == "transformers":
        return _load_transformers(path, config, torch_dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quant = config.raw.get("quantization_config")
    if quant is not None:
        model = load_quantized(model, path, config, quant, torch_dtype, device)
    else:
        tensors = checkpoint_tensors(config, iter_tensors(path))
        assign_dense(model, tensors, config, torch_dtype, device, path)
    _materialise_buffers(model, config, device)
    model = model.eval().requires_grad_(False)
    if quant is None:
        _accelerate_2of4(model, config)
    return model, config


def choose_impl(config: ModelConfig, impl: str = "auto") -> str:
    """ "llmctl" or "transformers" for `config` under --model-impl `impl`."""
    if impl not in MODEL_IMPLS:
        raise UsageError(f"unknown --model-impl {impl!r}; use {', '.join(MODEL_IMPLS)}")
    if impl == "llmctl" and not config.native:
        raise ModelLoadError(f"--model-impl llmctl: {config.not_native}")
    if impl == "auto":
        # a quantized phi3 holds its fused projections quantized as one: transformers' layout
        fused = config.fused_checkpoint and config.raw.get("quantization_config") is not None
        return "llmctl" if config.native and not fused else "transformers"
    return impl


def _load_transformers(path: Path, config: ModelConfig, torch_dtype, device: str):
    """transformers' model for `path` (safetensors only, no remote code), wrapped to serve on the
    paged KV cache."""
    from transformers import AutoModelForCausalLM

    from llmctl.models import transformers_backend as backend

    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (llmctl never loads pickles)")
    from transformers.utils import logging as hf_logging

    backend.register()
    quantized = config.raw.get("quantization_config") is not None
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if quantized:  # its report would list the packed tensors and the linears they replace
        hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars amid our own progress output
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            use_safetensors=True,
            trust_remote_code=False,
            attn_implementation=backend.IMPLEMENTATION,
            **({"config": _unquantized_config(path)} if quantized else {}),
        )
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"transformers cannot load {path}: {first}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if quantized:
        _swap_quantized(hf, path, torch_dtype)
    hf = hf.to(device).eval().requires_grad_(False)
    model = backend.TransformersCausalLM.wrap(hf, config)
    return model, model.config


def _unquantized_config(path: Path):
    """The folder's transformers config without `quantization_config`: transformers then loads
    the dense tensors and leaves the quantized linears' weights freshly initialised (warning about
    the packed tensors it does not know), and `_swap_quantized` replaces those linears."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    return hf_config


def _swap_quantized(hf, path: Path, torch_dtype) -> None:
    """The quantized linears of a checkpoint llmctl (or another tool) wrote, as our packed
    QuantLinear modules by name: the same swap as our own model's (formats/load.py), rather than
    transformers' compressed-tensors quantizer, so every format llmctl reads runs on the CPU too.

    Experts quantized one by one (`experts.E.gate_proj`, as `llmctl quantize` and llm-compressor
    write them) have nothing to load into the fused experts transformers built: those modules
    become per-expert linears first (models/unfused_experts.py, the forward `quantize`
    calibrated), and checkpoint names are mapped to module names (mixtral's block_sparse_moe is
    transformers' mlp)."""
    from llmctl.runtime.formats.load import swap_in
    from llmctl.runtime.formats.registry import read_quantized

    _, linears, _ = read_quantized(path)
    if any(_PER_EXPERT.search(name) for name in linears):
        linears = _by_module_name(hf, linears)
    swap_in(hf, linears, path, torch_dtype, "cpu")


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def _by_module_name(hf, linears: dict) -> dict:
    """`linears` (by checkpoint name) by the name of the module each replaces, once the experts
    are unfused."""
    from torch import nn

    from llmctl.models.linears import checkpoint_names
    from llmctl.models.unfused_experts import unfuse_experts

    unfuse_experts(hf)
    modules = [n for n, m in hf.named_modules() if isinstance(m, nn.Linear)]
    module_of = {spelled: n for n, spelled in checkpoint_names(hf, modules).items()}
    return {module_of.get(name, name): u for name, u in linears.items()}


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
    """Every RoPE table of the model (built on the meta device), computed on `device`."""
    from llmctl.models.rope import RotaryEmbedding

    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            fresh = RotaryEmbedding(m.config, m.max_positions).to(device)
            m.cos, m.sin = fresh.cos, fresh.sin
