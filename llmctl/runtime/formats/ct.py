"""compressed-tensors `pack-quantized` layout, and `int-quantized` for W8A8, written and read with
the `compressed-tensors` package (vLLM and transformers load both).

W8A8 (`QuantSpec.int8_activations`): llm-compressor's W8A8 preset scheme (int8 weights symmetric
per channel, input activations int8 dynamic per token) in format int-quantized: name.weight int8
[out, in] and name.weight_scale [out, 1] (IntQuantizationCompressor); `unpack_int8` reads it,
ours or llm-compressor's, into UnpackedLinear with `int8_activations` set.

Per linear `name` [out, in], b in 2, 3, 4 or 8: name.weight_packed int32 [out, ceil(in * b / 32)]
(signed codes q - 2^(b-1) offset back to unsigned and packed densely, value j of a row at bit j * b,
3-bit values straddling words), name.weight_scale [out, groups] in the model dtype
(strategy `group`; `channel` has one group spanning the row),
name.weight_shape int [2], and for asymmetric runs name.weight_zero_point packed along dim 0.
The packing itself is the package's `PackedQuantizationCompressor.compress`, fed the dequantized
weight and our scales/zero points so it reproduces our integer codes.

`quantization_config` is what compressed-tensors' `ModelCompressor.update_config` writes.
Known limitation outside llmctl: transformers (5.24 with compressed-tensors 0.20) refuses
asymmetric pack-quantized files (a zero-point shape mismatch on its meta-device path; see
vllm-project/llm-compressor#1618); symmetric files load there, vLLM and llmctl load both, and
quantize warns (`consumer_note`) when it writes one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmctl.errors import ModelLoadError
from llmctl.runtime.formats.packing import UnpackedLinear
from llmctl.runtime.formats.spec import BITS, BITS_TEXT, QuantResult, QuantSpec

ASYMMETRIC_NOTE = (
    "asymmetric compressed-tensors output: vLLM and llmctl load it, transformers does not "
    "(packed weight_zero_point shapes, vllm-project/llm-compressor#1618); use --symmetric, or "
    "--format awq, for transformers"
)
INT_FORMAT = "int-quantized"  # W8A8: int8 weights stored one per byte, activations dynamic
MIN_VERSION = "0.15"  # the first release with compressors.pack_quantized (pyproject's lower bound)


def consumer_note(spec: QuantSpec) -> str | None:
    """The one-line warning for a compressed-tensors checkpoint some consumers cannot load."""
    return None if spec.symmetric else ASYMMETRIC_NOTE


def require_package(error: type[Exception] = ModelLoadError, hint: str = "") -> None:
    """Raise `error` (one line) unless the compressed-tensors modules used here import."""
    try:
        import compressed_tensors.compressors.pack_quantized  # noqa: F401
        import compressed_tensors.quantization  # noqa: F401
    except ImportError as e:
        raise error(
            f"the compressed-tensors format needs the compressed-tensors package >= "
            f"{MIN_VERSION}, which does not import here ({e}); "
            f"pip install 'compressed-tensors>={MIN_VERSION}'{hint}"
        ) from None


def _scheme(spec: QuantSpec):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    if spec.int8_activations:  # llm-compressor's W8A8 preset, as it writes it
        scheme = preset_name_to_scheme("W8A8", ["Linear"])
        scheme.format = INT_FORMAT
        return scheme
    if spec.group_size is None:  # per channel: one scale (and zero point) per output row
        args = QuantizationArgs(
            num_bits=spec.bits, type="int", symmetric=spec.symmetric, strategy="channel"
        )
    else:
        args = QuantizationArgs(
            num_bits=spec.bits,
            type="int",
            symmetric=spec.symmetric,
            strategy="group",
            group_size=spec.group_size,
        )
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def quantization_config(spec: QuantSpec, ignore: list[str]) -> dict:
    """The `quantization_config` entry as compressed-tensors' own ModelCompressor writes it
    (`update_config`: our scheme plus `quant_method`, `version` and its empty `sparsity_config`
    and `transform_config`), read back from the config.json it writes in a scratch folder."""
    import tempfile

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = _scheme(spec)
    cfg = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=scheme.format,
        quantization_status="compressed",
        ignore=sorted(set(["lm_head", *ignore])),
    )
    with tempfile.TemporaryDirectory(prefix="llmctl-ct-") as scratch:
        ModelCompressor(quantization_config=cfg).update_config(scratch)
        written = json.loads((Path(scratch) / "config.json").read_text())
    return written["quantization_config"]


def pack_ct(name: str, r: QuantResult, spec: QuantSpec, ignore: list[str], dtype: torch.dtype):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    scale = r.scales.to(dtype)
    state = {"weight": r.weight.to(torch.float32), "weight_scale": scale}
    if spec.int8_activations:  # int8 weight [out, in] and weight_scale [out, 1], unpacked
        from compressed_tensors.compressors import IntQuantizationCompressor

        compressed = IntQuantizationCompressor.compress(state, _scheme(spec))
        return {f"{name}.{k}": v for k, v in compressed.items()}, quantization_config(spec, ignore)
    if not spec.symmetric:
        state["weight_zero_point"] = (r.zeros - spec.sym_zero).to(torch.int8)  # signed zero point
    packed = PackedQuantizationCompressor.compress(state, _scheme(spec))
    return {f"{name}.{k}": v for k, v in packed.items()}, quantization_config(spec, ignore)


def unpack_ct(tensors: dict[str, torch.Tensor], qcfg: dict):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    cfg = QuantizationConfig.model_validate(qcfg)
    fmt = cfg.format
    groups = list(cfg.config_groups.values())
    if (
        fmt not in ("pack-quantized", "mixed-precision", INT_FORMAT)
        or len(groups) != 1
        or groups[0].weights is None
    ):
        raise ModelLoadError(
            f"compressed-tensors checkpoints in format {fmt!r} are not supported (pack-quantized "
            "or int-quantized only)"
        )
    w = groups[0].weights
    if fmt == INT_FORMAT or (fmt == "mixed-precision" and groups[0].format == INT_FORMAT):
        return unpack_int8(tensors, groups[0]), tensors
    if w.type != "int" or w.strategy not in ("group", "channel") or w.num_bits not in BITS:
        raise ModelLoadError(
            f"compressed-tensors weights {w.type} {w.num_bits}-bit {w.strategy} are not supported "
            f"(int {BITS_TEXT} bits, group or channel)"
        )
    b, offset = w.num_bits, 1 << (w.num_bits - 1)
    names = [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]
    linears = {}
    for n in names:
        shape = torch.Size(tensors.pop(f"{n}.weight_shape").tolist())
        codes = (
            unpack_from_int32(tensors.pop(f"{n}.weight_packed"), b, shape).to(torch.int32) + offset
        )
        scales = tensors.pop(f"{n}.weight_scale").float()
        out_f, in_f = shape
        gs = w.group_size if w.strategy == "group" else in_f
        zp = tensors.pop(f"{n}.weight_zero_point", None)
        if w.symmetric or zp is None:
            zeros = torch.full(scales.shape, offset, dtype=torch.int32)
        else:
            zeros = (
                unpack_from_int32(zp, b, torch.Size((out_f, scales.shape[1])), packed_dim=0).to(
                    torch.int32
                )
                + offset
            )
        g_idx = torch.arange(in_f, dtype=torch.int32) // gs
        linears[n] = UnpackedLinear(
            codes, scales, zeros, g_idx, b, gs, tensors.pop(f"{n}.bias", None)
        )
    return linears, tensors


def unpack_int8(tensors: dict[str, torch.Tensor], scheme) -> dict[str, UnpackedLinear]:
    """`int-quantized` linears (llm-compressor's W8A8 and W8A16 int8): name.weight int8
    [out, in] and name.weight_scale [out, 1], symmetric per channel; input_activations, when
    present, must be dynamic per token (then the layer quantizes them at run time)."""
    w, a = scheme.weights, scheme.input_activations
    if w.type != "int" or w.num_bits != 8 or w.strategy != "channel" or not w.symmetric:
        raise ModelLoadError(
            f"int-quantized weights {w.type} {w.num_bits}-bit {w.strategy} "
            f"{'symmetric' if w.symmetric else 'asymmetric'} are not supported "
            "(int 8-bit symmetric per channel)"
        )
    if a is not None and not (
        a.type == "int" and a.num_bits == 8 and a.dynamic is True and a.strategy == "token"
    ):
        raise ModelLoadError(
            f"int-quantized input activations {a.type} {a.num_bits}-bit {a.strategy} "
            f"(dynamic={a.dynamic}) are not supported (int 8-bit dynamic per token)"
        )
    names = [k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")]
    linears = {}
    for n in names:
        q = tensors.get(f"{n}.weight")
        if q is None or q.dtype != torch.int8:
            continue  # not a quantized linear (e.g. a weight_scale of some other module)
        tensors.pop(f"{n}.weight")
        out_f, in_f = q.shape
        scales = tensors.pop(f"{n}.weight_scale").float().reshape(out_f, 1)
        linears[n] = UnpackedLinear(
            q.to(torch.int32) + 128,  # codes in [1, 255] around the zero point 128
            scales,
            torch.full((out_f, 1), 128, dtype=torch.int32),
            torch.zeros(in_f, dtype=torch.int32),
            8,
            in_f,
            tensors.pop(f"{n}.bias", None),
            int8_activations=a is not None,
        )
    return linears
