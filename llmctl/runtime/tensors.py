"""Tensors of a folder of safetensors, and the one path that puts dense tensors into our model.

Owns: `weight_files` (the safetensors index when present, else every *.safetensors; pickles are
refused), `iter_tensors` / `read_tensors`, `save_safetensors` (a file whose mode follows the umask,
not safetensors' 0600, and whose I/O failures are OSError), and `assign_dense`: copy dense tensors
into a model built on the meta device (checked names and shapes, tied embeddings, owned aligned
copies), shared by dense and quantized checkpoints.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

from llmctl.errors import ModelLoadError
from llmctl.models.config import ModelConfig


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shard {missing[0]} named in the index is missing")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ModelLoadError(
            f"{path} holds only pickle checkpoints (.bin/.pt); "
            "llmctl loads safetensors only, never pickle"
        )
    raise ModelLoadError(f"{path} has no .safetensors weights")


def iter_tensors(path: Path) -> Iterator[tuple[str, str, "torch.Tensor"]]:  # noqa: F821
    """(file name, tensor name, tensor) for every tensor of the folder's weight files."""
    from safetensors import safe_open

    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield file.name, name, f.get_tensor(name)


def read_tensors(path: Path) -> dict:
    """Every tensor of the folder's weight files, by name."""
    return {name: t for _, name, t in iter_tensors(path)}


def assign_dense(
    model,
    tensors: Iterable[tuple[str, str, "torch.Tensor"]],  # noqa: F821 (torch imported lazily)
    config: ModelConfig,
    dtype,
    device: str,
    where: Path,
    skip_modules: frozenset[str] = frozenset(),
) -> None:
    """Copy (file, name, tensor) triples into `model` (built on the meta device); every parameter
    not under a module in `skip_modules` must be given exactly once with its shape."""
    params = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in skip_modules}
    loaded = {}
    for file, name, t in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in params:
            raise ModelLoadError(
                f"{file}: unexpected tensor {name!r} for a {config.model_type} model"
            )
        if tuple(t.shape) != tuple(params[name].shape):
            raise ModelLoadError(
                f"{file}: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}"
            )
        # Always a copy: get_tensor may return a view of the memory-mapped file, which the file
        # could change under us, at the file's alignment (safetensors' header leaves data
        # 8-byte aligned; the CPU kernels measured slower on such weights than on 64).
        loaded[name] = t.to(device=device, dtype=dtype, copy=True)
    tied = config.tie_word_embeddings
    if tied:
        loaded.pop("lm_head.weight", None)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelLoadError(f"{where}: weights missing for {missing[0]}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def file_mode() -> int:
    """0666 minus the process umask (read without changing it, where /proc says it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file (which writes a 0600 temp file and renames it), then the mode a
    plain file would get; its I/O failures come back as OSError (for `writing`)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        raise as_os_error(e, path) from None
    os.chmod(path, file_mode())


def as_os_error(e: Exception, path: Path) -> OSError:
    """A SafetensorError as the OSError it wraps (its errno, e.g. ENOSPC, kept for `writing`)."""
    found = re.search(r"os error (\d+)", str(e))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, os.strerror(code), str(path))
