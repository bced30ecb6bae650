"""Reading a PEFT LoRA adapter folder into an `engine.lora.Adapter` (plain tensors, no model).

Owns: `load_adapter(name, path)`: the folder's `adapter_config.json` and
`adapter_model.safetensors` (a pickled `adapter_model.bin` is refused, never unpickled), the
checks that refuse what the engine does not implement (DoRA, modules_to_save, biases, per-layer
or per-module ranks and alphas, layers_to_transform, embedding or parameter adapters) in one
line each, the scale (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora), and the
adapter's content hash (SHA-256 over its config and weights: what resume fingerprints and the
prefix cache key by). Any subset of the decoder's linear projections may be targeted.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from llmctl.engine.lora import TARGETS, Adapter
from llmctl.errors import UsageError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PICKLES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<module>.lora_A.weight

# config fields whose only implemented value is the neutral one (PEFT's defaults)
_NEUTRAL = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "bias": ("none",),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "lora_bias": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}, []),
    "fan_in_fan_out": (False, None),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
}


def _config(folder: Path, name: str) -> dict:
    where = f"LoRA adapter {name!r} ({folder})"
    if not (folder / CONFIG).is_file():
        raise UsageError(f"{where}: no {CONFIG}: not a PEFT adapter folder")
    if not (folder / WEIGHTS).is_file():
        pickled = [p for p in PICKLES if (folder / p).is_file()]
        if pickled:
            raise UsageError(
                f"{where}: {pickled[0]} is a pickle, which llmctl never loads (it can run code); "
                f"save the adapter with safe_serialization=True ({WEIGHTS})"
            )
        raise UsageError(f"{where}: no {WEIGHTS}")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{where}: {CONFIG} is not readable JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise UsageError(f"{where}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    for key, neutral in _NEUTRAL.items():
        if key in config and config[key] not in neutral:
            raise UsageError(
                f"{where}: {key}={config[key]!r} is not supported (llmctl serves plain LoRA on "
                f"the linear projections)"
            )
    return config


def _scale(config: dict, where: str) -> tuple[int, float]:
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise UsageError(f"{where}: r and lora_alpha must be a positive integer and a number")
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _pairs(tensors: dict[str, torch.Tensor], r: int, where: str) -> dict:
    """module name -> (A [r, in], B [out, r]) from PEFT's tensor names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        body = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        module, _, part = body.rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise UsageError(f"{where}: tensor {key} is not a LoRA A/B weight of a linear")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise UsageError(
                f"{where}: {module} is not one of the projections llmctl adapts "
                f"({', '.join(TARGETS)})"
            )
        pairs.setdefault(module, {})[part[0]] = t
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise UsageError(f"{where}: {module} has lora_A or lora_B but not both")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise UsageError(
                f"{where}: {module}'s A {list(a.shape)} / B {list(b.shape)} not rank {r}"
            )
        out[module] = (a.float().contiguous(), b.float().contiguous())
    if not out:
        raise UsageError(f"{where}: no LoRA weights in {WEIGHTS}")
    return out


def digest(folder: Path) -> str:
    """SHA-256 over the adapter's config and weights files (hex)."""
    h = hashlib.sha256()
    for file in (CONFIG, WEIGHTS):
        h.update(file.encode() + b"\0")
        with open(folder / file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def lora_digests(modules: dict[str, str]) -> dict[str, str]:
    """name -> content digest of each adapter folder (checked as `load_adapter` checks its
    config)."""
    out = {}
    for name, path in modules.items():
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise UsageError(f"LoRA adapter {name!r}: {folder} is not a folder")
        _config(folder, name)
        out[name] = digest(folder)
    return out


def load_adapter(name: str, path: str | Path) -> Adapter:
    """The adapter in the PEFT folder `path`, served under `name`; UsageError naming the
    problem where it is not one llmctl can serve."""
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UsageError(f"LoRA adapter {name!r}: {folder} is not a folder")
    config = _config(folder, name)
    where = f"LoRA adapter {name!r} ({folder})"
    rank, scale = _scale(config, where)
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except Exception as e:  # a damaged file: safetensors raises its own errors
        raise UsageError(f"{where}: {WEIGHTS} is not readable: {e}") from None
    return Adapter(name, str(folder), rank, scale, _pairs(tensors, rank, where), digest(folder))
