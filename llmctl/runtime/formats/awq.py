"""AutoAWQ GEMM layout (`quant_method: awq`, `version: gemm`), 4-bit only.

Per linear `name` [out, in] with groups of g input columns:
  name.qweight  int32 [in, out / 8]   codes transposed, 8 output columns per word in AWQ_ORDER
  name.qzeros   int32 [in / g, out / 8] zero points, same packing
  name.scales   float16 [in / g, out]
Dequantization: (code - zero) * scale; zeros are stored as-is (no offset).
"""

from __future__ import annotations

import torch

from llmctl.errors import ModelLoadError, UsageError
from llmctl.runtime.formats.packing import UnpackedLinear, pack_rows, unpack_rows
from llmctl.runtime.formats.spec import QuantResult, QuantSpec

# field i of a word holds output column AWQ_ORDER[i] of its 8 (the interleave the GEMM kernel reads)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(name: str, r: QuantResult, spec: QuantSpec, ignore: list[str], dtype: torch.dtype):
    if spec.bits != 4:
        raise UsageError(
            "--format awq stores 4-bit weights only; use --bits 4 or --format compressed-tensors"
        )
    if spec.group_size is None:
        raise UsageError(
            "--format awq stores groups only; --group-size channel needs "
            "--format compressed-tensors or gptq"
        )
    if r.codes.shape[0] % 8:
        raise UsageError(
            f"{name}: {r.codes.shape[0]} output features are not a multiple of 8, which --format "
            "awq needs"
        )
    tensors = {
        f"{name}.qweight": pack_rows(r.codes.t(), 4, AWQ_ORDER),
        f"{name}.qzeros": pack_rows(r.zeros.t(), 4, AWQ_ORDER),
        f"{name}.scales": r.scales.t().to(torch.float16),
    }
    qcfg = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": spec.group_size,
        "zero_point": True,  # zeros always stored; symmetric runs store 8
        "version": "gemm",
        "modules_to_not_convert": [i for i in ignore if i != "lm_head"] or None,
    }
    return tensors, qcfg


def unpack_awq(tensors: dict[str, torch.Tensor], qcfg: dict):
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    gs = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ModelLoadError(
            f"AWQ checkpoints with bits={bits}, version={version!r} are not supported (4-bit GEMM "
            "only)"
        )
    names = [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]
    linears = {}
    for n in names:
        codes = unpack_rows(tensors.pop(f"{n}.qweight"), 4, AWQ_ORDER).t().contiguous()  # [out, in]
        zeros = (
            unpack_rows(tensors.pop(f"{n}.qzeros"), 4, AWQ_ORDER).t().contiguous()
        )  # [out, groups]
        scales = tensors.pop(f"{n}.scales").float().t().contiguous()
        g_idx = torch.arange(codes.shape[1], dtype=torch.int32) // gs
        linears[n] = UnpackedLinear(
            codes, scales, zeros, g_idx, 4, gs, tensors.pop(f"{n}.bias", None)
        )
    return linears, tensors
