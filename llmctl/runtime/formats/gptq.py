"""GPTQ v1 layout (`quant_method: gptq`, AutoGPTQ's `checkpoint_format: gptq`).

Per linear `name` [out, in], b bits (2, 3, 4 or 8), groups of g input columns; 2/4/8 bits hold
32 / b codes per int32 word, 3 bits hold 32 codes in 3 words (AutoGPTQ's layout, the dense one in
packing.py; in and out must then be multiples of 32):
  name.qweight  int32 [in * b / 32, out]  codes packed along the input dimension, low bits first
  name.qzeros   int32 [in / g, out * b / 32]  (zero - 1) packed along the output dimension (the
                v1 offset; readers add 1 back, so a zero of 0 is stored as all ones)
  name.scales   float16 [in / g, out]
  name.g_idx    int32 [in]  group of each input column
"""

from __future__ import annotations

import torch

from llmctl.errors import ModelLoadError, UsageError
from llmctl.runtime.formats.packing import UnpackedLinear, pack_multiple, pack_rows, unpack_rows
from llmctl.runtime.formats.spec import BITS, QuantResult, QuantSpec


def check_shape(name: str, out_f: int, in_f: int, bits: int) -> None:
    """Raise a one-line UsageError unless --format gptq can pack a [out_f, in_f] linear: qzeros
    pack the output dimension, qweight the input one (which groups already align for 2/4/8)."""
    per = pack_multiple(bits)
    for what, n in (("output", out_f), ("input", in_f)):
        if n % per:
            raise UsageError(
                f"{name}: {n} {what} features are not a multiple of {per}, which --format gptq "
                "needs" + (f" at {bits} bits" if 32 % bits else "")
            )


def pack_gptq(name: str, r: QuantResult, spec: QuantSpec, ignore: list[str], dtype: torch.dtype):
    b = spec.bits
    check_shape(name, *r.codes.shape, b)
    tensors = {
        f"{name}.qweight": pack_rows(r.codes, b).t().contiguous(),  # [in / per, out]
        f"{name}.qzeros": pack_rows((r.zeros.t() - 1) & spec.maxq, b),
        f"{name}.scales": r.scales.t().to(torch.float16),
        f"{name}.g_idx": r.group_index().to(torch.int32),
    }
    qcfg = {
        "quant_method": "gptq",
        "bits": b,
        "group_size": -1 if spec.group_size is None else spec.group_size,  # -1: per channel
        "desc_act": False,  # act-order uses static groups: g_idx is column // group_size
        "sym": spec.symmetric,
        "true_sequential": True,
        "checkpoint_format": "gptq",
    }
    return tensors, qcfg


def unpack_gptq(tensors: dict[str, torch.Tensor], qcfg: dict):
    b = int(qcfg.get("bits", 4))
    if b not in BITS:
        raise ModelLoadError(f"GPTQ checkpoints with bits={b} are not supported (2, 3, 4 or 8)")
    fmt = str(qcfg.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ checkpoint_format {fmt!r} is not supported")
    offset = 1 if fmt == "gptq" else 0
    maxq = (1 << b) - 1
    names = [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]
    linears = {}
    for n in names:
        codes = unpack_rows(tensors.pop(f"{n}.qweight").t().contiguous(), b)  # [out, in]
        zeros = ((unpack_rows(tensors.pop(f"{n}.qzeros"), b) + offset) & maxq).t().contiguous()
        scales = tensors.pop(f"{n}.scales").float().t().contiguous()
        in_f = codes.shape[1]
        g_idx = tensors.pop(f"{n}.g_idx", None)
        gs = int(qcfg.get("group_size", 128))
        gs = in_f if gs <= 0 else gs
        g_idx = (torch.arange(in_f) // gs if g_idx is None else g_idx).to(torch.int32)
        linears[n] = UnpackedLinear(
            codes, scales, zeros, g_idx, b, gs, tensors.pop(f"{n}.bias", None)
        )
    return linears, tensors
