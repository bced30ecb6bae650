"""Native CPU kernels: C sources beside this file, compiled on first use with the system C compiler
and called through ctypes on tensors' data pointers.

Owns: building (once per set of sources, compiler and CPU; cached under ~/.cache/llmctl/kernels or
$LLMCTL_CACHE_DIR), loading, and the tensor-level wrappers `paged_decode_attention` (bf16 on the
AVX512-BF16 kernel where the CPU has it, see `use_decode_dpbf16`), `write_kv` (new K/V rows into
the paged caches, with `use_write_kv`), `rms_norm`, `silu_mul` and `linear` (with `use_linear`,
the rule for when it beats F.linear). Everything here is optional: with no
compiler, a failed build, or LLMCTL_NATIVE_KERNELS=0, `library()` is None and the callers use the
plain-PyTorch references (attention.py, F.linear), which the tests compare against.
No torch headers are involved, so a build takes about a second and needs only `cc`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from llmctl.kernels import cpu_bf16

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_paged_attention.c",
        "cpu_paged_attention_dpbf16.c",
        "cpu_linear.c",
        "cpu_norm.c",
        "cpu_act.c",
        "cpu_argmax.c",
    )
)
# included by the sources: part of the cache key
HEADERS = tuple(
    Path(__file__).with_name(n) for n in ("cpu_vec.h", "cpu_exp512.h", "cpu_amx.h", "cpu_bf16x16.h")
)
# -ffast-math at compile time only: it lets the reductions vectorise and expf use the vector libm;
# not at link time, where it would add crtfastmath and flush denormals for the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]


def enabled() -> bool:
    return os.environ.get("LLMCTL_NATIVE_KERNELS", "1") not in ("0", "false", "no")


def _cpu_fingerprint() -> str:
    """-march=native code is only valid on CPUs with the same instruction sets."""
    flags = cpu_bf16.cpu_flags()
    return "flags: " + " ".join(sorted(flags)) if flags else platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("LLMCTL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmctl"
    )
    return Path(root) / "kernels"


def build(sources: tuple[Path, ...] = SOURCES, out_dir: Path | None = None) -> Path:
    """Compile `sources` into one shared library (or reuse the cached one); returns its path.
    Raises RuntimeError naming the compiler's complaint."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    texts = [s.read_text() for s in (*sources, *HEADERS)]
    key = hashlib.sha256(
        "\0".join(
            [
                *texts,
                version,
                *COMPILE_FLAGS,
                *LINK_FLAGS,
                *LIBS,
                platform.machine(),
                _cpu_fingerprint(),
            ]
        ).encode()
    ).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    target = out_dir / f"llmctl_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objs, lib = [str(Path(tmp) / f"{i}.o") for i in range(len(sources))], Path(tmp) / "k.so"
        cmds = [[cc, *COMPILE_FLAGS, "-c", str(src), "-o", obj] for src, obj in zip(sources, objs)]
        for cmd in [*cmds, [cc, *LINK_FLAGS, *objs, "-o", str(lib), *LIBS]]:
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: concurrent processes may build the same key
    return target


def load(source: Path, what: str) -> ctypes.CDLL | None:
    """`source` built as its own small library (`build`) and loaded; None, warned once per caller's
    cache, where the build or the load fails (`what` names the kernel in the warning)."""
    try:
        return ctypes.CDLL(str(build((source,))))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"{what} unavailable: {e}", RuntimeWarning, stacklevel=3)
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; None when disabled or the build fails (warned
    once)."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(
            f"native CPU kernels unavailable, using the PyTorch reference: {e}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    args = (
        [ctypes.c_void_p] * 6
        + [ctypes.c_int] * 4
        + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    )
    for name in (
        "paged_decode_f32",
        "paged_decode_bf16",
        "paged_decode_dpbf16",
        "paged_decode_amx",
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.paged_decode_amx_available.restype = ctypes.c_int
    lib.linear.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.linear.restype = None
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.rms_norm.restype = None
    lib.silu_mul.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.silu_mul.restype = None
    # The fused element-wise kernels of cpu_fused.py.
    lib.silu_and_mul.argtypes = lib.silu_mul.argtypes
    lib.silu_and_mul.restype = None
    lib.add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + lib.rms_norm.argtypes[3:]
    lib.add_rms_norm.restype = None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    # (k, ldk, v, ldv, k_cache, v_cache, slots, T, KVH, D, nslots, esize, threads)
    lib.write_kv.argtypes = [ptr, i64] * 2 + [ptr] * 3 + [i64, i32, i32, i64, i32, i32]
    lib.write_kv.restype = None
    lib.argmax_rows.argtypes = [ptr, i64, i64, i64, i32, ptr, i32]
    lib.argmax_rows.restype = None
    lib.argmax_rows_built.restype = ctypes.c_int
    return lib


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [T, heads, D] with each token's heads contiguous (tokens any stride apart, as in a column
    slice of the merged q/k/v projection's output)."""
    return x.stride(2) == 1 and (x.stride(1) == x.shape[2] or x.shape[1] == 1)


def _rows_of_heads(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """x [T, KVH, D] of the cache's dtype, heads and D, each token's heads contiguous."""
    return (
        x.dim() == 3
        and x.dtype is cache.dtype
        and x.shape[1:] == (cache.shape[0], cache.shape[2])
        and heads_contiguous(x)
    )


# Fewer tokens than this: two index_copy_ calls cost no more than the C call's fixed overhead
# (8 against 10 us at 1 token; 25 against 11 us at 64, 369 against 58 at 2048; bf16, 2 threads).
WRITE_KV_MIN_ROWS = 16


def use_write_kv(k_cache, v_cache, k, v, slots) -> bool:
    """Whether `write_kv` should serve: at least WRITE_KV_MIN_ROWS tokens, CPU caches [KVH, slots,
    D] of one dtype, contiguous; k and v [T, KVH, D] with contiguous heads; slots int64 [T]."""
    return (
        slots.numel() >= WRITE_KV_MIN_ROWS
        and k_cache.device.type == "cpu"
        and k_cache.dim() == 3
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.shape == k_cache.shape
        and v_cache.dtype is k_cache.dtype
        and _rows_of_heads(k, k_cache)
        and _rows_of_heads(v, k_cache)
        and k.shape[0] == v.shape[0] == slots.numel()
        and slots.dtype is torch.int64
        and slots.is_contiguous()
        and library() is not None
    )


def write_kv(k_cache, v_cache, k, v, slots) -> None:
    """k, v [T, KVH, D] into the flat slots [T] of the caches [KVH, slots, D], in one C call.
    Call only where `use_write_kv(...)`."""
    t = k.shape[0]
    if t:
        kvh, nslots, d = k_cache.shape
        library().write_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            t,
            kvh,
            d,
            nslots,
            k_cache.element_size(),
            torch.get_num_threads(),
        )


_KERNELS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


@functools.cache
def decode_dpbf16_available() -> bool:
    """Whether the AVX512-BF16 decode kernel (cpu_paged_attention_dpbf16.c) runs here: the CPU's
    flags, and a compiler that had the intrinsics."""
    from llmctl.kernels.cpu_dpbf16 import cpu_has_dpbf16  # it imports this module

    lib = library()
    return cpu_has_dpbf16() and lib is not None and bool(lib.paged_decode_dpbf16_built())


@functools.cache
def decode_amx_available() -> bool:
    """Whether the AMX variant of that kernel (`paged_decode_amx`) runs here: `amx_bf16` in the
    CPU's flags, the compiler had the intrinsics, Linux grants the tile state (asked once)."""
    from llmctl.kernels.cpu_amx import cpu_has_amx  # it imports this module

    if not decode_dpbf16_available() or not cpu_has_amx():
        return False
    return bool(library().paged_decode_amx_available())


def decode_bf16_kernel() -> str:
    """The library function serving bf16 decode attention where `use_decode_dpbf16` holds:
    "paged_decode_amx" where AMX runs (unless LLMCTL_DECODE_AMX=0; it takes the `vdpbf16ps`
    items itself for shapes its tiles do not fit), else "paged_decode_dpbf16"."""
    off = os.environ.get("LLMCTL_DECODE_AMX", "1") in ("0", "false", "no")
    return "paged_decode_amx" if not off and decode_amx_available() else "paged_decode_dpbf16"


def use_decode_dpbf16(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """bf16 query and cache where the kernel runs, unless LLMCTL_DECODE_DPBF16=0. A float32 query
    keeps paged_decode_bf16, which does not round it to bf16."""
    if q.dtype is not torch.bfloat16 or k_cache.dtype is not torch.bfloat16:
        return False
    if os.environ.get("LLMCTL_DECODE_DPBF16", "1") in ("0", "false", "no"):
        return False
    return decode_dpbf16_available()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention can serve these tensors: CPU, fp32/bf16 cache,
    D % 16 == 0."""
    return (
        q.device.type == "cpu"
        and k_cache.dtype in _KERNELS
        and q.shape[-1] % 16 == 0
        and library() is not None
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
    k_cache: torch.Tensor,  # [kv_heads, slots, D], float32 or bfloat16, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64, 1 <= len <= max_blocks * block_size
    scale: float,
    block_size: int,
    max_len: int,  # max(context_lens), known to the caller without a tensor read
    dpbf16: bool | None = None,  # the AVX512-BF16 kernel; None: where use_decode_dpbf16 says
) -> torch.Tensor:
    """The same contract as attention.decode_attention, without gathering K/V; returns [B, heads, D]
    in q's dtype. Call only where `supports(q, k_cache)` (and `use_decode_dpbf16` for dpbf16)."""
    b, heads, d = q.shape
    kvh, slots, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype):
        raise ValueError("paged_decode_attention needs contiguous K/V caches of one dtype")
    check_decode_shapes(heads, d, kvh, block_tables.shape[1], block_size, max_len)
    if dpbf16 is None:
        dpbf16 = use_decode_dpbf16(q, k_cache)
    qf = q.contiguous() if dpbf16 else q.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(qf)
    fn = getattr(library(), decode_bf16_kernel() if dpbf16 else _KERNELS[k_cache.dtype])
    failed = fn(
        qf.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        heads,
        kvh,
        d,
        slots,
        tables.shape[1],
        block_size,
        scale,
        max_len,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("paged_decode_attention: out of memory for its score buffers")
    return out.to(q.dtype)


_LINEAR = (torch.float32, torch.bfloat16)
# float32: rows per thread up to which the kernel beat F.linear (MKL) on every SmolLM2-135M and
# Qwen2.5-0.5B decoder shape, weights cold in cache (1 thread: 1.1-2.2x at 1-16 rows, 0.8-1.0x at
# 32-64; 2 threads: 1.3-3x up to 32 rows). bfloat16, on a CPU without native bf16 (where F.linear's
# bf16 path is a slow fallback, 3-4x slower at any row count): up to the same count; above it
# cpu_bf16.upcast_linear (float32 BLAS on widened slabs) measured 1.2-2.2x the kernel at 32-2048
# rows, 1 thread. With native bf16 (AVX512-BF16, AMX) F.linear serves every bf16 row count.
LINEAR_ROWS_PER_THREAD = 16


def linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` can compute x @ weight^T at all, whatever the row count: inference on the
    CPU, a plain float32/bfloat16 weight [N, K] of x's dtype, K % 8 == 0, the kernels built. Each
    output element is then one dot product in a fixed order (8 lanes along K, summed by `hsum`),
    whatever the rows, tiles and threads (batch-invariant mode relies on it)."""
    dtype = weight.dtype
    if x.dtype is not dtype or dtype not in _LINEAR or not x.is_cpu:
        return False
    if type(weight) not in cpu_bf16.PLAIN or weight.dim() != 2 or weight.shape[1] % 8:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return library() is not None


def use_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` should serve x @ weight^T: inference on the CPU, a plain float32/bfloat16
    weight (not a quantized or sparse tensor subclass) matching x's dtype, K % 8 == 0, few rows,
    and for bfloat16 a CPU without native bf16. (Called per layer per step: cheapest tests
    first.)"""
    dtype = weight.dtype
    if (
        x.dtype is not dtype
        or dtype not in _LINEAR
        or not x.is_cpu
        or type(weight) not in cpu_bf16.PLAIN
    ):
        return False
    if weight.dim() != 2 or weight.shape[1] % 8:
        return False
    if x.numel() > weight.shape[1] * LINEAR_ROWS_PER_THREAD * torch.get_num_threads():
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if dtype is torch.bfloat16 and cpu_bf16.native_bf16():
        return False
    return library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K] float32 or bfloat16 (contiguous), on
    the CPU; returns [..., N] in x's dtype. Call only where `use_linear(x, weight)`."""
    # Each tensor op here costs about a microsecond and this runs ~200 times per decode step, so
    # conversions and copies happen only where needed.
    n, k = weight.shape
    xf = x if x.dim() == 2 else x.reshape(-1, k)
    if xf.dtype is not torch.float32:
        xf = xf.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if bias is not None:
        bias = bias.detach().float().contiguous()
    m = xf.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        library().linear(
            xf.data_ptr(),
            k,
            w.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            int(w.dtype is torch.bfloat16),
            torch.get_num_threads(),
        )
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], n)
    return out if x.dtype is torch.float32 else out.to(x.dtype)


def use_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` should serve RMSNorm: inference on the CPU, x and weight both float32 or
    both bfloat16, the last dimension a multiple of 8."""
    if x.dtype is not weight.dtype or x.dtype not in _LINEAR or not x.is_cpu or x.shape[-1] % 8:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., K] with weight [K], float32 or bfloat16 (Hugging Face's arithmetic, see
    cpu_norm.c). Call only where `use_rms_norm(x, weight)`."""
    k = x.shape[-1]
    xc = x if x.is_contiguous() else x.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty_like(xc)
    rows = xc.numel() // k if k else 0
    if rows:
        library().rms_norm(
            xc.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            rows,
            k,
            eps,
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    return out


def use_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` can serve: inference on the CPU, gate and up of one float32/bfloat16
    dtype and shape, contiguous."""
    if gate.dtype is not up.dtype or gate.dtype not in _LINEAR or not gate.is_cpu:
        return False
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return False
    return library() is not None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., F], written into gate (see cpu_act.c), one row at a
    time. Call only where `use_silu_mul(gate, up)`."""
    f = gate.shape[-1]
    rows = gate.numel() // f if f else 0
    if rows:
        library().silu_mul(
            gate.data_ptr(),
            up.data_ptr(),
            rows,
            f,
            int(gate.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
    return gate


def use_argmax(x: torch.Tensor) -> bool:
    """x [rows, 1 <= n < 2^31] float32 or bfloat16 on the CPU, each row contiguous; the kernels
    built with AVX-512 (without it torch.max measured faster than a scalar loop)."""
    return (
        x.dtype in _LINEAR
        and x.device.type == "cpu"
        and x.dim() == 2
        and 0 < x.shape[1] < 2**31
        and x.stride(1) == 1
        and library() is not None
        and _argmax_built()
    )


@functools.cache
def _argmax_built() -> bool:
    """cpu_argmax.c was compiled with AVX-512 (fixed by the CPU and compiler: asked once). Call
    only where library() is not None."""
    return library().argmax_rows_built() == 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's first index of its maximum, or of its first NaN (cpu_argmax.c;
    torch.max(dim=-1)'s indices). Call only where `use_argmax(x)`."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        library().argmax_rows(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.stride(0),
            int(x.dtype is torch.bfloat16),
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out
