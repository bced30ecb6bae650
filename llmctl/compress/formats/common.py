"""Format dispatch and the shared types of quantized checkpoints.

Owns: `UnpackedLinear`, `write_quantized` / `read_quantized` (dispatch on the format name or on
config.json's `quantization_config`), and bit-packing helpers used by the AWQ and GPTQ layouts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmctl.compress.quant.spec import QuantResult, QuantSpec, dequantize
from llmctl.errors import ModelLoadError, UsageError

FORMATS = ("compressed-tensors", "awq", "gptq")


@dataclass
class UnpackedLinear:
    """One quantized linear as stored: codes int32 [out, in] in [0, 2^bits), scales float32
    [out, groups], zeros int32 [out, groups], g_idx int32 [in] (group of each input column)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int
    group_size: int
    bias: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.g_idx)

    @classmethod
    def from_result(cls, r: QuantResult, bias: torch.Tensor | None = None) -> "UnpackedLinear":
        return cls(r.codes, r.scales, r.zeros, r.group_index(), r.spec.bits, r.spec.group_size, bias)


def to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same bits (two's complement wrap)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack along dim 1: values int [R, C] -> int32 [R, C * bits / 32]; field i of word j holds
    column j * per + order[i] (order defaults to 0..per-1, i.e. sequential)."""
    per = 32 // bits
    R, C = values.shape
    if C % per:
        raise UsageError(f"cannot pack {C} values in int32 words of {per}")
    order = order or list(range(per))
    v = values.to(torch.int64).reshape(R, C // per, per)[:, :, order] & ((1 << bits) - 1)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    return to_int32((v << shifts).sum(dim=-1))


def unpack_rows(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 [R, W] -> int32 [R, W * 32 / bits]."""
    per = 32 // bits
    order = order or list(range(per))
    shifts = torch.arange(per, dtype=torch.int64) * bits
    fields = (packed.to(torch.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)  # [R, W, per] field i
    out = torch.empty_like(fields)
    out[:, :, order] = fields  # field i holds column order[i]
    return out.reshape(packed.shape[0], -1).to(torch.int32)


def write_quantized(
    out_dir: Path,
    fmt: str,
    dense: dict[str, torch.Tensor],
    linears: dict[str, QuantResult],
    spec: QuantSpec,
    ignore: list[str],
    dtype: torch.dtype,
) -> dict:
    """Write model.safetensors in `fmt`; returns the `quantization_config` for config.json.

    dense: every tensor that stays unquantized (name -> tensor); linears: module name (no
    ".weight") -> result; their biases, if any, are in `dense`.
    """
    from llmctl.compress.output_dir import save_safetensors

    if fmt == "compressed-tensors":
        from llmctl.compress.formats.ct import pack_ct as pack
    elif fmt == "awq":
        from llmctl.compress.formats.awq import pack_awq as pack
    elif fmt == "gptq":
        from llmctl.compress.formats.gptq import pack_gptq as pack
    else:
        raise UsageError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    tensors = {k: v.contiguous() for k, v in dense.items()}
    qcfg = None
    for name, r in linears.items():
        packed, qcfg = pack(name, r, spec, ignore, dtype)
        tensors.update({k: v.contiguous() for k, v in packed.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return qcfg


def detect_format(quant_config: dict) -> str:
    method = quant_config.get("quant_method")
    if method in FORMATS:
        return method
    raise ModelLoadError(f"unsupported quantization_config quant_method {method!r}; supported: {', '.join(FORMATS)}")


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in folder `path`."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def read_quantized(path: str | Path) -> tuple[dict, dict[str, UnpackedLinear], dict[str, torch.Tensor]]:
    """Read a quantized folder: (quantization_config, module name -> UnpackedLinear, dense tensors)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if not qcfg:
        raise ModelLoadError(f"{path}: config.json has no quantization_config")
    fmt = detect_format(qcfg)
    if fmt == "compressed-tensors":
        from llmctl.compress.formats.ct import require_package, unpack_ct as unpack

        require_package()  # before reading any weights
    elif fmt == "awq":
        from llmctl.compress.formats.awq import unpack_awq as unpack
    else:
        from llmctl.compress.formats.gptq import unpack_gptq as unpack
    linears, dense = unpack(load_tensors(path), qcfg)
    return qcfg, linears, dense
