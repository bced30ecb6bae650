"""Quantized checkpoint formats: writers and readers for compressed-tensors `pack-quantized`,
AutoAWQ GEMM (`quant_method: awq`) and GPTQ v1 (`quant_method: gptq`).

Owns: the on-disk layouts only. Writers take integer codes/scales/zeros (`QuantResult`) and the
remaining dense tensors; readers return `UnpackedLinear` (codes, scales, zeros, g_idx) per
quantized linear plus the dense tensors, whichever tool wrote the file. load.py puts a quantized
folder into our model (packed `models.qlinear.QuantLinear` layers); the loader calls it.
"""

from llmctl.runtime.formats.packing import UnpackedLinear
from llmctl.runtime.formats.registry import FORMATS, detect_format, read_quantized, write_quantized

__all__ = ["FORMATS", "UnpackedLinear", "detect_format", "read_quantized", "write_quantized"]
