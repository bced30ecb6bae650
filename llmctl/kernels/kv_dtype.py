"""The KV cache's storage dtype (vLLM's `--kv-cache-dtype`): its names, and K/V into and out of
an fp8 cache.

Owns: `cache_dtype` (a name and the model's dtype -> the
torch dtype the caches are allocated in), `is_fp8`, `to_cache` (K/V rows as an fp8 cache stores
them), `write_rows` (torch's CPU `index_copy_` has no fp8 kernel: the write goes through uint8
views) and `widen` (gathered cache rows to the compute dtype, for the PyTorch paths; the C
kernels read fp8 bytes themselves). A cache of another float dtype than the model's
(`--kv-cache-dtype float32` under a bf16 model) goes through the same two functions.

No scales: as vLLM's fp8 cache without calibrated k/v scales (its default, 1.0), values are
stored as they are, saturated at the format's largest finite value (448 for e4m3fn, 57344 for
e5m2) rather than turned into NaN or inf. e4m3fn keeps 3 mantissa bits over +-448, e5m2 2 bits
over a wider range; BENCHMARKS.md's KV38 runs give the quality each costs.
"""

from __future__ import annotations

import torch

from llmctl.kernels.config import KV_CACHE_DTYPES

_NAMED = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_LARGEST = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The caches' dtype for `--kv-cache-dtype name` ("auto": the model's). Raises ValueError
    naming the accepted values."""
    if name == "auto":
        return model_dtype
    if name not in _NAMED:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return _NAMED[name]


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return (t if isinstance(t, torch.dtype) else t.dtype) in FP8


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, KVH, D] in the cache's dtype: fp8 saturated at its largest finite value (torch's
    cast rounds to nearest even; it would make e5m2's overflow inf)."""
    if x.dtype is dtype:
        return x
    if dtype in FP8:
        top = _LARGEST[dtype]
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, KVH, D] into the flat slots [T] of cache [KVH, slots, D], converted to its dtype."""
    x = to_cache(x, cache.dtype).transpose(0, 1)
    if cache.dtype in FP8:  # same-size integer views: index_copy_ has no fp8 kernel on the CPU
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(1, slots, x)


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in the compute dtype (x itself where it is in it already)."""
    return x if x.dtype is dtype else x.to(dtype)
