"""Writing a model's weights as safetensors shards with huggingface_hub's own writer.

Owns: `DEFAULT_MAX_SHARD_SIZE`, `parse_shard_size` (the `--max-shard-size` rule: "5GB", "500MB",
"2KB" or a byte count) and `save_sharded`: `save_torch_state_dict` (model.safetensors when
everything fits in one shard, else model-0000i-of-0000n.safetensors and
model.safetensors.index.json), stale weight files of an earlier write removed first, and the file
modes a plain file would get (safetensors writes 0600). tensors.py reads what this writes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmctl.errors import UsageError

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's and transformers' default
SHARD_SIZE_RULE = 'a size such as "5GB", "500MB" or "2KB" (decimal units), or a byte count'
INDEX_FILE = "model.safetensors.index.json"


def parse_shard_size(value: object) -> int:
    """--max-shard-size in bytes; a one-line UsageError for anything else than a positive size."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(value).strip().upper().replace(" ", "")
    try:
        size = int(text) if re.fullmatch(r"\d+", text) else parse_size_to_int(text)
    except ValueError:
        size = 0
    if isinstance(value, bool) or size <= 0:
        raise UsageError(f"--max-shard-size takes {SHARD_SIZE_RULE}; got {value!r}")
    return size


def save_sharded(
    tensors: dict, out_dir: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> list[Path]:
    """Write `tensors` (name -> CPU tensor, no two sharing storage) into `out_dir`; returns the
    weight files written. One-line UsageError for a bad size; OSError for I/O failures."""
    from huggingface_hub import save_torch_state_dict
    from safetensors import SafetensorError

    from llmctl.runtime.tensors import as_os_error, file_mode

    size = parse_shard_size(max_shard_size)
    # save_torch_state_dict refuses a view of a larger storage (packed words cut from a padded
    # buffer, a row slice): such tensors are written from a copy of their own
    tensors = {k: v if _owns_storage(v) else v.clone() for k, v in tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()
    try:
        save_torch_state_dict(tensors, out_dir, max_shard_size=size, metadata={"format": "pt"})
    except SafetensorError as e:
        raise as_os_error(e, out_dir) from None
    written = sorted(out_dir.glob("model*.safetensors*"))
    mode = file_mode()
    for path in written:
        os.chmod(path, mode)
    return [p for p in written if p.name != INDEX_FILE]


def _owns_storage(t) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
