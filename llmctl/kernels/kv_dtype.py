"""The KV cache's storage dtype (vLLM's `--kv-cache-dtype`, and int8): its names, its rows, and
K/V into and out of a quantized cache.

Owns: `cache_dtype` (a name and the model's dtype -> the torch dtype the caches are allocated
in), `row_width` (elements of one cached row of a head), `to_cache` (K/V rows as the cache stores
them), `write_rows` (torch's CPU `index_copy_` has no fp8 kernel: the write goes through uint8
views) and `widen` (gathered cache rows to the compute dtype, for the PyTorch paths; the C
kernels read the stored bytes themselves). A cache of another float dtype than the model's
(`--kv-cache-dtype float32` under a bf16 model) goes through the same functions.

fp8 (e4m3fn, e5m2): no scales, as vLLM's fp8 cache without calibrated k/v scales (its default,
1.0): values are stored as they are, saturated at the format's largest finite value (448 for
e4m3fn, 57344 for e5m2) rather than turned into NaN or inf.
int8: one float32 scale per (token, head), amax / 127, stored in the row's last 4 bytes: a row is
D int8 values then the scale's bytes ([..., D + 4] int8), so every gather, copy and block of the
cache carries its scales along. BENCHMARKS.md's KV38 runs give what each costs in quality: a scale
per (token, head) measured best for quality per byte.
"""

from __future__ import annotations

import functools

import torch

from llmctl.kernels.config import KV_CACHE_DTYPES
from llmctl.kernels.cpu import attention as cpu_attention

_NAMED = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
SCALE_BYTES = 4  # an int8 row's float32 scale
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_LARGEST = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_HALF = (torch.bfloat16, torch.float16)  # the 16-bit dtypes the C tables map from and to


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


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached row of one head: D, or D + SCALE_BYTES for int8."""
    return head_dim + SCALE_BYTES if dtype is torch.int8 else head_dim


def to_cache(x: torch.Tensor, dtype: torch.dtype, native: bool = False) -> torch.Tensor:
    """x [T, KVH, D] as the cache stores it: fp8 saturated at its largest finite value (torch's
    cast rounds to nearest even; it would make e5m2's overflow inf); int8 rounded to nearest
    even over amax / 127 per row, [T, KVH, D + 4] with the scale's bytes. `native`: a bf16 or
    fp16 x goes to fp8 through the C table lookup (the same codes), where the library loads."""
    if x.dtype is dtype:
        return x
    if native and dtype in FP8 and x.dtype in _HALF and (out := _lut(x, dtype, True)) is not None:
        return out
    if dtype is torch.int8:
        scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127.0  # [T, KVH, 1]
        q = (x.float() / scale).round().clamp(-127, 127).to(torch.int8)
        return torch.cat((q, scale.view(torch.int8)), dim=-1)
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


def widen(x: torch.Tensor, dtype: torch.dtype, native: bool = False) -> torch.Tensor:
    """Gathered cache rows [..., row_width] in the compute dtype [..., D] (x itself where it is
    in it already); int8 rows times their scales, in float32, then rounded once. `native`: fp8
    to bf16 or fp16 through the C table lookup (the same values), where the library loads."""
    if native and x.dtype in FP8 and dtype in _HALF and (out := _lut(x, dtype, False)) is not None:
        return out
    if x.dtype is torch.int8:
        d = x.shape[-1] - SCALE_BYTES
        scale = x[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return (x[..., :d].float() * scale).to(dtype)
    return x if x.dtype is dtype else x.to(dtype)


@functools.cache
def _table(half: torch.dtype, fp8: torch.dtype, narrow: bool) -> torch.Tensor:
    """torch's own casts, tabulated: every 16-bit pattern of `half` -> its saturated `fp8` code
    (uint8 [65536], indexed by the unsigned bits), or every fp8 code -> its `half` bits ([256])."""
    if narrow:
        every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(half)
        return to_cache(every, fp8).view(torch.uint8).contiguous()
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).to(half).contiguous()


def _lut(x: torch.Tensor, dtype: torch.dtype, narrow: bool) -> torch.Tensor | None:
    """x converted to `dtype` in one C pass over `_table`'s lookup (None: not applicable)."""
    table = _table(x.dtype, dtype, True) if narrow else _table(dtype, x.dtype, False)
    return cpu_attention.lookup_rows(x, table, dtype)
