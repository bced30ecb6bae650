"""The registry of quantized checkpoint formats: which layout writes and reads which folder.

Owns: `FORMATS`, `write_quantized` / `read_quantized` (dispatch on the format name or on
config.json's `quantization_config`) and `detect_format`. The layouts are in ct.py, awq.py and
gptq.py; what they share is in packing.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmctl.errors import ModelLoadError, UsageError
from llmctl.runtime import tensors as tensor_io
from llmctl.runtime.formats.awq import pack_awq, unpack_awq
from llmctl.runtime.formats.ct import pack_ct, require_package, unpack_ct
from llmctl.runtime.formats.gptq import pack_gptq, unpack_gptq
from llmctl.runtime.formats.packing import UnpackedLinear
from llmctl.runtime.formats.spec import QuantResult, QuantSpec
from llmctl.runtime.shards import DEFAULT_MAX_SHARD_SIZE, save_sharded

FORMATS = ("compressed-tensors", "awq", "gptq")
PACKERS = {"compressed-tensors": pack_ct, "awq": pack_awq, "gptq": pack_gptq}
UNPACKERS = {"compressed-tensors": unpack_ct, "awq": unpack_awq, "gptq": unpack_gptq}


def write_quantized(
    out_dir: Path,
    fmt: str,
    dense: dict[str, torch.Tensor],
    linears: dict[str, QuantResult],
    spec: QuantSpec,
    ignore: list[str],
    dtype: torch.dtype,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict:
    """Write the weights in `fmt` (one model.safetensors, or shards of at most max_shard_size
    and their index); returns the `quantization_config` for config.json.

    dense: every tensor that stays unquantized (name -> tensor); linears: module name (no
    ".weight") -> result; their biases, if any, are in `dense`.
    """
    pack = PACKERS.get(fmt)
    if pack is None:
        raise UsageError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    tensors = {k: v.contiguous() for k, v in dense.items()}
    qcfg = None
    for name, r in linears.items():
        packed, qcfg = pack(name, r, spec, ignore, dtype)
        tensors.update({k: v.contiguous() for k, v in packed.items()})
    save_sharded(tensors, out_dir, max_shard_size)
    return qcfg


def detect_format(quant_config: dict) -> str:
    method = quant_config.get("quant_method")
    if method in FORMATS:
        return method
    raise ModelLoadError(
        f"unsupported quantization_config quant_method {method!r}; supported: {', '.join(FORMATS)}"
    )


def read_quantized(
    path: str | Path,
) -> tuple[dict, dict[str, UnpackedLinear], dict[str, torch.Tensor]]:
    """Read a quantized folder: (quantization_config, module name -> UnpackedLinear, dense
    tensors)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if not qcfg:
        raise ModelLoadError(f"{path}: config.json has no quantization_config")
    fmt = detect_format(qcfg)
    if fmt == "compressed-tensors":
        require_package()  # before reading any weights
    tensors = tensor_io.read_tensors(path)  # through the safetensors index when there is one
    linears, dense = UNPACKERS[fmt](tensors, qcfg)
    return qcfg, linears, dense
