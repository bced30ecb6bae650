"""Quantized checkpoint formats: writers and readers for compressed-tensors `pack-quantized`,
AutoAWQ GEMM (`quant_method: awq`) and GPTQ v1 (`quant_method: gptq`).

Owns: the on-disk layouts only. Writers take integer codes/scales/zeros (`QuantResult`) and the
remaining dense tensors; readers return `UnpackedLinear` (codes, scales, zeros, g_idx) per
quantized linear plus the dense tensors, whichever tool wrote the file.
"""

from llmctl.compress.formats.common import FORMATS, UnpackedLinear, detect_format, read_quantized, write_quantized



def load_quantized(model, path, config, quant, dtype, device):
    """Hook for llmctl/runtime/loader.py; see llmctl/compress/formats/load.py."""
    from llmctl.compress.formats.load import load_quantized as _load

    return _load(model, path, config, quant, dtype, device)


__all__ = ["FORMATS", "UnpackedLinear", "detect_format", "load_quantized", "read_quantized", "write_quantized"]
