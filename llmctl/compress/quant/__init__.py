"""Weight-only quantization methods (RTN, GPTQ, AWQ) as pure functions on tensors.

Owns: the shared `QuantSpec`/`QuantResult` types (spec.py) and one module per method.
Convention everywhere: unsigned integer codes q in [0, 2^bits - 1], one scale s and one integer
zero point z per (output row, input group); the dequantized weight is (q - z) * s. Symmetric
quantization fixes z = 2^(bits-1), which makes (q - z) the signed code compressed-tensors stores.
"""

from llmctl.runtime.formats.spec import QuantResult, QuantSpec, check_group_size

__all__ = ["QuantResult", "QuantSpec", "check_group_size"]
