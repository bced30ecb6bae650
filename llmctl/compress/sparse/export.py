"""Writing a pruned model as an ordinary dense Hugging Face folder (zeros stored as zeros).

Owns: `save_dense_model` (safetensors shards with HF parameter names, written by
huggingface_hub's `save_torch_state_dict` above --max-shard-size, config.json with a
`sparsity_config` entry and without `auto_map`, tokenizer and generation files copied from the
source folder; the shared rules are in llmctl.runtime.output_dir) and `sparsity_config`, the
metadata dict. transformers ignores the extra config key and loads the
folder as a plain model; llmctl and other tools can read it to know the pattern.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmctl.compress.sparse.masks import SparsityPattern
from llmctl.runtime.output_dir import copy_side_files, output_config
from llmctl.runtime.shards import DEFAULT_MAX_SHARD_SIZE, save_sharded

_STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sparsity_config(
    pattern: SparsityPattern,
    method: str,
    layers: dict[str, float],
    ignore: list[str],
    global_sparsity: float,
) -> dict[str, Any]:
    """The `sparsity_config` entry of config.json.

    `format: dense` and `sparsity_structure` follow compressed-tensors' spelling of an uncompressed
    sparse checkpoint; `layers` maps every pruned linear to the fraction of zeros it holds.
    """
    return {
        "format": "dense",
        "sparsity_structure": pattern.label() if pattern.structured else "unstructured",
        "pattern": pattern.label(),
        "target_sparsity": round(pattern.sparsity, 6),
        "global_sparsity": round(global_sparsity, 6),
        "method": method,
        "ignore": list(ignore),
        "layers": {name: round(frac, 6) for name, frac in layers.items()},
        "producer": "llmctl sparsify",
    }


def stored_dtype(raw_config: dict[str, Any], fallback: torch.dtype) -> torch.dtype:
    """The dtype the source checkpoint declares (config `torch_dtype`/`dtype`), else `fallback`."""
    name = str(raw_config.get("torch_dtype") or raw_config.get("dtype") or "").replace("torch.", "")
    return _STORED_DTYPES.get(name, fallback)


def _state_dict(
    model: torch.nn.Module, tie_word_embeddings: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Parameters by HF name (buffers like RoPE tables are not weights), tied lm_head left out."""
    from llmctl.models.linears import export_state

    state = export_state(model)  # checkpoint names and layouts (a transformers model's too)
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: t.to("cpu", dtype).contiguous() for name, t in state.items()}


def save_dense_model(
    model: torch.nn.Module,
    raw_config: dict[str, Any],
    source_dir: Path | None,
    out_dir: Path,
    extra_config: dict[str, Any],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write `model` to `out_dir` as HF safetensors in the source checkpoint's dtype (shards of
    at most max_shard_size above it); returns out_dir."""
    first = next(model.parameters())
    dtype = stored_dtype(raw_config, first.dtype)
    tensors = _state_dict(model, bool(raw_config.get("tie_word_embeddings", False)), dtype)
    save_sharded(tensors, out_dir, max_shard_size)
    if source_dir is not None:
        copy_side_files(source_dir, out_dir)
    config = output_config(raw_config, extra_config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir
