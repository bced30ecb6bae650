"""Loading a quantized checkpoint into our model with packed `QuantLinear` layers.

W8A8 linears (compressed-tensors int-quantized with dynamic per-token activations) become
`Int8Linear` instead.

Owns: `load_quantized(model, path, config, quant, dtype, device)`, the hook
llmctl/runtime/loader.py calls when config.json has a `quantization_config` (any of the three
formats, whichever tool wrote it), and `swap_in`, the QuantLinear swap by module name it shares
with the transformers path (runtime/weights.py), which loads the rest through transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl.errors import ModelLoadError
from llmctl.models.qlinear import QuantLinear
from llmctl.models.qlinear_int8 import Int8Linear
from llmctl.runtime.formats.registry import read_quantized
from llmctl.runtime.tensors import assign_dense


def load_quantized(model, path: Path, config, quant: dict, dtype: torch.dtype, device: str):
    """Replace model's quantized nn.Linear modules (model built on the meta device) by QuantLinear
    and assign every other tensor; returns the model."""
    path = Path(path)
    _, linears, dense = read_quantized(path)
    swap_in(model, linears, path, dtype, device)
    # QuantLinear biases come with the quantized layer; everything else must be in `dense`
    dense_triples = ((path.name, name, t) for name, t in dense.items())
    assign_dense(model, dense_triples, config, dtype, device, path, skip_modules=frozenset(linears))
    return model


def _shape(module) -> tuple[int, int]:
    """(out, in) of an nn.Linear, or of a transformers Conv1D (weight [in, out], GPT-2)."""
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.nf, module.weight.shape[0]
    return module.out_features, module.in_features


def swap_in(model, linears: dict, path: Path, dtype: torch.dtype, device: str) -> None:
    """Put a QuantLinear in place of each named linear of `model` (by module name: our model, or
    a transformers model whose Conv1D computes the same x @ W^T as a linear)."""
    for name, u in linears.items():
        parent_name, child = name.rsplit(".", 1)
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(
                f"{path.name}: quantized tensor for unknown layer {name!r}"
            ) from None
        if _shape(old) != tuple(u.codes.shape):
            raise ModelLoadError(
                f"{name}: quantized shape {tuple(u.codes.shape)}, expected {_shape(old)}"
            )
        cls = Int8Linear if u.int8_activations else QuantLinear  # W8A8: int8 activations too
        setattr(model.get_submodule(parent_name), child, cls.from_unpacked(u, dtype, device))
