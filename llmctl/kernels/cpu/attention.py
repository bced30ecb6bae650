"""Paged decode attention and the K/V writes on the CPU, in C (csrc/cpu_paged_attention.c, and
csrc/cpu_paged_attention_dpbf16.c for bf16 on AVX512-BF16 or AMX tiles).

Owns: `write_kv` (new K/V rows into the paged caches, with `use_write_kv`; `write_kv_i8`
quantizing them into an int8 cache; `lookup_rows`, fp8 rows into and out of their codes),
`decode_kernel` (the
library function serving a decode call, from the dtypes, the CPU and `KernelConfig
.decode_attention`), `supports`, `check_decode_shapes` and `paged_decode_attention`, which reads
each sequence's blocks in place (no gather). The PyTorch reference is kernels/attention.py's.
"""

from __future__ import annotations

import functools

import torch

from llmctl.kernels.cpu.elementwise import heads_contiguous
from llmctl.kernels.cpu.features import has_amx, has_dpbf16
from llmctl.kernels.cpu.library import load

# Fewer tokens than this: two index_copy_ calls cost no more than the C call's fixed overhead
# (8 against 10 us at 1 token; 25 against 11 us at 64, 369 against 58 at 2048; bf16, 2 threads).
WRITE_KV_MIN_ROWS = 16
_GENERIC = {
    torch.float32: "paged_decode_f32",
    torch.bfloat16: "paged_decode_bf16",
    torch.float8_e4m3fn: "paged_decode_e4m3",  # an fp8 cache (kernels/kv_dtype.py), read as bytes
    torch.float8_e5m2: "paged_decode_e5m2",
    torch.int8: "paged_decode_i8",  # rows of int8 and a float32 scale (kernels/kv_dtype.py)
}
# bf16 query over an fp8 cache on `vdpbf16ps`: tiles widened to bf16 in scratch on the way
_DPBF16_FP8 = {
    torch.float8_e4m3fn: "paged_decode_dpbf16_e4m3",
    torch.float8_e5m2: "paged_decode_dpbf16_e5m2",
    torch.int8: "paged_decode_dpbf16_i8",
}
_BF16_QUERY = ("paged_decode_amx", "paged_decode_dpbf16", *_DPBF16_FP8.values())
SKIP_KERNEL = "paged_decode_dpbf16_skip"  # rows that leave out their first tokens (windows)


def _rows_of_heads(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """x [T, KVH, D] of the cache's dtype, heads and D, each token's heads contiguous."""
    return (
        x.dim() == 3
        and x.dtype is cache.dtype
        and x.shape[1:] == (cache.shape[0], cache.shape[2])
        and heads_contiguous(x)
    )


def _caches_and_slots(k_cache, v_cache, k, slots) -> bool:
    """What both C writes need of the caches and slots: CPU caches [KVH, slots, w] of one shape
    and dtype, contiguous; slots int64 [T], contiguous, one per row of k; the library built."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.dim() == 3
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.shape == k_cache.shape
        and v_cache.dtype is k_cache.dtype
        and k.shape[0] == slots.numel()
        and slots.dtype is torch.int64
        and slots.is_contiguous()
        and load("core") is not None
    )


def use_write_kv(k_cache, v_cache, k, v, slots) -> bool:
    """Whether `write_kv` should serve: at least WRITE_KV_MIN_ROWS tokens, CPU caches [KVH, slots,
    D] of one dtype, contiguous; k and v [T, KVH, D] with contiguous heads; slots int64 [T]."""
    return (
        slots.numel() >= WRITE_KV_MIN_ROWS
        and _caches_and_slots(k_cache, v_cache, k, slots)
        and _rows_of_heads(k, k_cache)
        and _rows_of_heads(v, k_cache)
        and v.shape[0] == k.shape[0]
    )


def use_write_kv_i8(k_cache, v_cache, k, v, slots) -> bool:
    """Whether `write_kv_i8` can quantize and write: CPU int8 caches [KVH, slots, D + 4] of one
    shape, contiguous; k and v [T, KVH, D] float32 or bf16 with contiguous heads; slots int64."""
    return (
        k_cache.dtype is torch.int8
        and _caches_and_slots(k_cache, v_cache, k, slots)
        and k.dtype in (torch.float32, torch.bfloat16)
        and v.dtype is k.dtype
        and k.dim() == v.dim() == 3
        and k.shape == v.shape
        and k.shape[1:] == (k_cache.shape[0], k_cache.shape[2] - 4)
        and heads_contiguous(k)
        and heads_contiguous(v)
    )


def write_kv_i8(k_cache, v_cache, k, v, slots) -> None:
    """k, v [T, KVH, D] quantized into int8 rows (kernels/kv_dtype.to_cache's codes and scales)
    at the flat slots [T] of the caches, in one C call. Call only where `use_write_kv_i8`."""
    t = k.shape[0]
    if t:
        kvh, nslots, w = k_cache.shape
        load("core").write_kv_i8(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), t, kvh, w - 4, nslots,
            int(k.dtype is torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip


def _rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, width, row stride) of x as rows of its trailing dims, which must be contiguous
    (a column slice of a wider output qualifies); None where x is not so."""
    if x.dim() == 0 or x.numel() == 0 or x.device.type != "cpu":
        return None
    if x.dim() == 1:
        return (1, x.shape[0], x.shape[0]) if x.stride(0) == 1 else None
    return (x.shape[0], x[0].numel(), x.stride(0)) if x[0].is_contiguous() else None


def lookup_rows(x: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """x (16-bit values or 8-bit codes) mapped through `table` into a new tensor of `dtype` (8 or
    16 bits the other way), in one C pass: kernels/kv_dtype.py's fp8 conversions. None where x's
    layout or the library does not allow it."""
    shape, lib = _rows(x), load("core")
    if shape is None or lib is None:
        return None
    rows, w, ld = shape
    out = torch.empty(x.shape, dtype=dtype)
    fn = lib.lut_narrow if x.element_size() == 2 else lib.lut_widen
    fn(x.data_ptr(), ld, rows, w, table.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def write_kv(k_cache, v_cache, k, v, slots) -> None:
    """k, v [T, KVH, D] into the flat slots [T] of the caches [KVH, slots, D], in one C call.
    Call only where `use_write_kv(...)`."""
    t = k.shape[0]
    if t:
        kvh, nslots, d = k_cache.shape
        load("core").write_kv(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), t, kvh, d, nslots, k_cache.element_size(),
            torch.get_num_threads(),
        )  # fmt: skip


@functools.cache
def dpbf16_available() -> bool:
    """Whether the AVX512-BF16 decode kernel runs here: the CPU's flags, and a compiler that had
    the intrinsics."""
    lib = load("core")
    return has_dpbf16() and lib is not None and bool(lib.paged_decode_dpbf16_built())


@functools.cache
def amx_available() -> bool:
    """Whether its AMX variant (`paged_decode_amx`) runs here: `amx_bf16` in the CPU's flags, the
    compiler had the intrinsics, Linux grants the tile state (asked once)."""
    if not dpbf16_available() or not has_amx():
        return False
    return bool(load("core").paged_decode_amx_available())


def decode_kernel(q_dtype: torch.dtype, cache_dtype: torch.dtype, choice: str = "auto") -> str:
    """The library function serving decode attention for a query and cache of these dtypes, by
    `KernelConfig.decode_attention` (`choice`): for bf16 query and cache, "paged_decode_amx" where
    AMX runs and the choice is auto (it takes the `vdpbf16ps` items itself for shapes its tiles
    do not fit), else "paged_decode_dpbf16" where AVX512-BF16 runs and the choice is not
    generic; otherwise the generic kernel of the cache's dtype (a float32 query keeps
    paged_decode_bf16, which does not round it to bf16). An fp8 cache: its `vdpbf16ps` kernel
    for a bf16 query where that runs and the choice is not generic (AMX has no fp8 variant),
    else its generic kernel."""
    if cache_dtype in _DPBF16_FP8:
        fast = q_dtype is torch.bfloat16 and choice != "generic" and dpbf16_available()
        return _DPBF16_FP8[cache_dtype] if fast else _GENERIC[cache_dtype]
    if q_dtype is torch.bfloat16 and cache_dtype is torch.bfloat16 and choice != "generic":
        if choice == "auto" and amx_available():
            return "paged_decode_amx"
        if dpbf16_available():
            return "paged_decode_dpbf16"
    return _GENERIC[cache_dtype]


def skips_served(q: torch.Tensor, k_cache: torch.Tensor, choice: str = "auto") -> bool:
    """Whether `paged_decode_attention(..., skips=...)` runs here: where a bf16 call would take the
    `vdpbf16ps` items (AMX's kernel takes them too, for shapes its tiles do not fit)."""
    kernel = decode_kernel(q.dtype, k_cache.dtype, choice)
    return kernel in ("paged_decode_amx", "paged_decode_dpbf16") and supports(q, k_cache)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention can serve these tensors: CPU, an fp32, bf16 or fp8 cache,
    D % 16 == 0."""
    return (
        q.device.type == "cpu"
        and k_cache.dtype in _GENERIC
        and q.shape[-1] % 16 == 0
        and load("core") is not None
    )


def check_decode_shapes(
    heads: int, d: int, kvh: int, max_blocks: int, block_size: int, max_len: int
) -> None:
    """Raises ValueError unless the decode kernels can trust these (they index by them): whole
    groups of query heads per KV head, D % 16 == 0, every context within its block table."""
    if heads % kvh or d % 16 or max_len > max_blocks * block_size:
        raise ValueError(
            f"paged_decode_attention: {heads} heads of {d} over {kvh} KV heads, max_len {max_len} "
            f"for {max_blocks} blocks of {block_size}"
        )


def paged_decode_attention(
    q: torch.Tensor,  # [B, heads, D]
    k_cache: torch.Tensor,  # [kv_heads, slots, D], float32, bfloat16 or fp8, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64, 1 <= len <= max_blocks * block_size
    scale: float,
    block_size: int,
    max_len: int,  # max(context_lens), known to the caller without a tensor read
    choice: str = "auto",  # KernelConfig.decode_attention
    out: torch.Tensor | None = None,  # [B, heads, D] contiguous, q's dtype: written where used
    skips: torch.Tensor | None = None,  # [B] int64: row b attends to [skips[b], context_lens[b])
) -> torch.Tensor:
    """The same contract as attention.decode_attention, without gathering K/V; returns [B, heads, D]
    in q's dtype (`out` where given and the kernel reads q as it is). Call only where
    `supports(q, k_cache)`, and with `skips` only where `skips_served(q, k_cache, choice)`."""
    b, heads, d = q.shape
    kvh, slots, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype):
        raise ValueError("paged_decode_attention needs contiguous K/V caches of one dtype")
    check_decode_shapes(heads, d, kvh, block_tables.shape[1], block_size, max_len)
    kernel = decode_kernel(q.dtype, k_cache.dtype, choice) if skips is None else SKIP_KERNEL
    bf16_query = kernel in _BF16_QUERY or kernel == SKIP_KERNEL
    qf = q.contiguous() if bf16_query else q.to(torch.float32).contiguous()
    tables, lens = _int64(block_tables), _int64(context_lens)
    if out is None or not bf16_query:
        out = torch.empty_like(qf)
    sk = None if skips is None else _int64(skips)  # held: the call reads its memory
    args = [] if sk is None else [sk.data_ptr()]
    failed = getattr(load("core"), kernel)(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), b, heads, kvh, d, slots, tables.shape[1], block_size, scale, max_len,
        torch.get_num_threads(), *args,
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_decode_attention: out of memory for its score buffers")
    return out if out.dtype is q.dtype else out.to(q.dtype)


def _int64(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64 (itself where it is: each tensor op costs about a microsecond, and
    this runs per layer per step)."""
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
