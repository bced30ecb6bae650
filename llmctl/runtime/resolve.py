"""Which model and how to run it: a folder or hub id to a local folder, --dtype and --device.

Owns: `DEMO_MODEL_DIR`, `resolve_model_path` (local folder, a llama.cpp GGUF file converted once
into a cached folder by gguf.py, or a hub download when online), `resolve_dtype` and
`resolve_device`, and the dtype spellings they accept.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.config import ModelConfig
from llmctl.runtime.gguf import find_gguf, gguf_folder

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "demo-model"
DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None -> the embedded demo model; an existing folder -> itself; a `.gguf` file (or a folder
    holding one and no config.json) -> its converted folder in the cache; otherwise a hub id,
    when online."""
    if model is None or str(model) == "":
        return DEMO_MODEL_DIR
    path = Path(model).expanduser()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_folder(gguf_file)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise ModelLoadError(
            f"{path} is a file; pass the model folder that holds config.json, or a .gguf file"
        )
    text = str(model)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelLoadError(f"model folder {text!r} not found")
    return _download(text)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated: all the same advice
        raise ModelLoadError(
            f"cannot fetch {repo_id!r} from the hub ({type(e).__name__}); download it where the "
            "hub is "
            f"reachable and pass the local folder instead: --model /path/to/folder"
        ) from None


def resolve_dtype(dtype: str, config: ModelConfig, device: str):
    """--dtype to a torch dtype. auto: the checkpoint's dtype, except on the CPU, where half
    precision becomes bfloat16 (fast CPU half matmuls are rare), or float32 when the CPU has no bf16
    units (kernels/cpu/features.native_bf16: PyTorch's bf16 matmuls there run several times slower
    than float32)."""
    import torch

    from llmctl.kernels.cpu.features import native_bf16

    if dtype == "auto":
        wanted = DTYPE_NAMES.get(
            str(config.torch_dtype or "float32").replace("torch.", ""), "float32"
        )
        if wanted in ("float16", "bfloat16") and device == "cpu":
            wanted = "bfloat16" if native_bf16() else "float32"
        return getattr(torch, wanted)
    if dtype not in DTYPE_NAMES:
        raise UsageError(f"unknown --dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    return getattr(torch, DTYPE_NAMES[dtype])


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"unknown --device {device!r}; use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but no CUDA device is available")
    return device
