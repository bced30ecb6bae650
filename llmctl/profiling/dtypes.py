"""One spelling of floating-point dtypes in profiling code, records and output.

Owns: the canonical names (`float32`, `bfloat16`, `float16`, torch's) and the short spellings
accepted as input (`fp32`, `bf16`, `fp16`, `half`, `float`, `torch.bfloat16`), mapped onto them.
"""

from __future__ import annotations

from typing import Any

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def canonical_dtype(name: Any) -> str:
    """'bf16' -> 'bfloat16', torch.float16 -> 'float16'; other names (int4, fp8) lower-cased."""
    key = str(name).lower().removeprefix("torch.")
    return _ALIASES.get(key, key)
