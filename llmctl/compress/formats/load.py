"""Loading a quantized checkpoint into our model with packed `QuantLinear` layers.

Owns: `load_quantized(model, path, config, quant, dtype, device)`, the hook
llmctl/runtime/loader.py calls when config.json has a `quantization_config` (any of the three
formats, whichever tool wrote it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmctl.compress.formats.common import read_quantized
from llmctl.compress.qlinear import QuantLinear
from llmctl.errors import ModelLoadError


def load_quantized(model, path: Path, config, quant: dict, dtype: torch.dtype, device: str):
    """Replace model's quantized nn.Linear modules (model built on the meta device) by QuantLinear
    and assign every other tensor; returns the model."""
    path = Path(path)
    _, linears, dense = read_quantized(path)
    for name, u in linears.items():
        parent_name, child = name.rsplit(".", 1)
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(f"{path.name}: quantized tensor for unknown layer {name!r}") from None
        if (old.out_features, old.in_features) != tuple(u.codes.shape):
            raise ModelLoadError(
                f"{name}: quantized shape {tuple(u.codes.shape)}, expected {(old.out_features, old.in_features)}"
            )
        setattr(model.get_submodule(parent_name), child, QuantLinear.from_unpacked(u, dtype, device))
    # QuantLinear biases come with the quantized layer; everything else must be in `dense`
    params = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in linears}
    loaded = {}
    for name, t in dense.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in params:
            raise ModelLoadError(f"{path.name}: unexpected tensor {name!r}")
        if tuple(t.shape) != tuple(params[name].shape):
            raise ModelLoadError(f"{path.name}: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
        loaded[name] = t.to(device=device, dtype=dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        loaded.pop("lm_head.weight", None)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{path}: weights missing for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
