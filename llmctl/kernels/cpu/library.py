"""Building and loading the C libraries of csrc/, every function's ctypes signature in one table.

Owns: `LIBRARIES` (each library's sources and the signatures of the functions callers use),
`HEADERS` (every header the sources include: part of every build's key), `build` (compile, or
reuse the copy cached under llmctl's cache folder, keyed by the sources, headers, compiler, flags
and CPU) and `load` (build, load and declare the signatures; None, warned once, where the compiler
is missing or the build fails). No torch headers are involved, so a build takes about a second and
needs only `cc`. Whether a library may be used at all is the caller's `KernelConfig.native`.
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

from llmctl.cache_dir import cache_root
from llmctl.kernels.cpu.features import fingerprint

CSRC = Path(__file__).with_name("csrc")
# included by the sources: part of every build's key
HEADERS = tuple(CSRC / n for n in ("cpu_vec.h", "cpu_exp512.h", "cpu_amx.h", "cpu_bf16x16.h"))
# -ffast-math at compile time only: it lets the reductions vectorise and expf use the vector libm;
# not at link time, where it would add crtfastmath and flush denormals for the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
INT = ctypes.c_int
# (q, k_cache, v_cache, tables, lens, out, B, heads, KVH, D, slots, max_blocks, block_size, scale,
#  max_len, threads) -> failed
_DECODE = ([P] * 6 + [I32] * 4 + [I64, I32, I32, F32, I64, I32], INT)
_RMS_NORM = [P] * 3 + [I64, I64, F32, I32, I32]  # (x, w, out, rows, K, eps, bf16, threads)
_SILU = [P] * 2 + [I64] * 2 + [I32] * 2  # (a, b, rows, F, bf16, threads)
# every paged decode kernel (kernels/cpu/attention.py): by cache dtype, generic and vdpbf16ps
_DECODE_KERNELS = (
    "paged_decode_f32", "paged_decode_bf16", "paged_decode_e4m3", "paged_decode_e5m2",
    "paged_decode_i8", "paged_decode_dpbf16", "paged_decode_dpbf16_e4m3",
    "paged_decode_dpbf16_e5m2", "paged_decode_dpbf16_i8", "paged_decode_amx",
)  # fmt: skip


def _core_signatures() -> dict[str, tuple[list, object]]:
    """The core library's functions (decode attention, K/V writes and conversions, linears,
    norms, activations, argmax): {function: (argtypes, restype)}."""
    return {
        **dict.fromkeys(_DECODE_KERNELS, _DECODE),
        "paged_decode_dpbf16_built": ([], INT),
        "paged_decode_dpbf16_skip": (_DECODE[0] + [P], INT),  # ..., skips [B] int64
        "paged_decode_amx_available": ([], INT),
        # (x, ldx, w, bias, out, M, N, K, w_bf16, threads)
        "linear": ([P, I64, P, P, P, I64, I64, I64, I32, I32], None),
        "rms_norm": (_RMS_NORM, None),
        "add_rms_norm": ([P] + _RMS_NORM, None),  # (x, r, w, out, ...): x += r first
        "silu_mul": (_SILU, None),
        "silu_and_mul": (_SILU, None),
        # (k, ldk, v, ldv, k_cache, v_cache, slots, T, KVH, D, nslots, esize, threads)
        "write_kv": ([P, I64, P, I64, P, P, P, I64, I32, I32, I64, I32, I32], None),
        # (k, ldk, v, ldv, k_cache, v_cache, slots, T, KVH, D, nslots, bf16, threads)
        "write_kv_i8": ([P, I64, P, I64, P, P, P, I64, I32, I32, I64, I32, I32], None),
        # (x, ld, rows, w, table, out, threads): fp8 codes from and to 16-bit values
        "lut_narrow": ([P, I64, I64, I64, P, P, I32], None),
        "lut_widen": ([P, I64, I64, I64, P, P, I32], None),
        # (x, rows, n, ld, bf16, out, threads)
        "argmax_rows": ([P, I64, I64, I64, I32, P, I32], None),
        "argmax_rows_built": ([], INT),
        # (x, rows, n, ld, bf16, mask, words, threads)
        "mask_rows": ([P, I64, I64, I64, I32, P, I64, I32], None),
    }


@functools.cache
def _signatures() -> dict[str, dict[str, tuple[list, object]]]:
    """library name -> {function: (argtypes, restype)}."""
    return {
        "core": _core_signatures(),
        "linear_dpbf16": {
            "linear_dpbf16_built": ([], INT),
            # (x, ldx, w, bias, out, M, N, K, threads)
            "linear_dpbf16": ([P, I64, P, P, P, I64, I64, I64, I32], None),
        },
        "linear_amx": {
            "linear_amx_built": ([], INT),
            "linear_amx_available": ([], INT),
            "amx_pack_bf16": ([P, P, I64, I64], None),  # (w, out, N, K)
            # (x, ldx, packed, bias, out, ldo, M, N, K, threads) -> failed
            "linear_amx_bf16": ([P, I64, P, P, P, I64, I64, I64, I64, I32], INT),
        },
        "rope": {
            # (q, ldq, k, ldk, q_out, k_out, rows, heads, kv_heads, D, cos, sin, positions, threads)
            "rope_bf16": ([P, I64, P, I64, P, P, I64, I32, I32, I32, P, P, P, I32], None),
        },
        "prefill": {
            "prefill_amx_available": ([], INT),
            "prefill_dpbf16_available": ([], INT),
            # (q, k, v, out, Tq, nc, heads, KVH, D, 6 strides, scale, threads, amx, window)
            "prefill_attention_bf16": (
                [P] * 4 + [I64] * 2 + [I32] * 3 + [I64] * 6 + [F32, I32, I32, I64],
                INT,
            ),
        },
        "lora": {
            # (x, ldx, y, ldy, a, bt, row_slot, ranks, T, K, N, R, bf16, threads) -> failed
            "lora_apply": ([P, I64, P, I64, P, P, P, P, I64, I64, I64, I64, I32, I32], INT),
        },
        "linear_int8": {
            # (x, ldx, bf16, M, K, q, scale, threads)
            "quant_rows_int8": ([P, I64, I32, I64, I64, P, P, I32], None),
            # (x, M, K, w, N, out, threads) -> failed: the exact int8 GEMM (AVX2 vpmaddwd)
            "gemm_int8_exact": ([P, I64, I64, P, I64, P, I32], INT),
            "gemm_int8_exact_built": ([], INT),
            # (acc, M, N, xs, ws, out, bf16, threads)
            "rescale_int32": ([P, I64, I64, P, P, P, I32, I32], None),
        },
    }


LIBRARIES: dict[str, tuple[str, ...]] = {
    "core": (
        "cpu_paged_attention.c",
        "cpu_paged_attention_dpbf16.c",
        "cpu_linear.c",
        "cpu_norm.c",
        "cpu_act.c",
        "cpu_argmax.c",
    ),
    "linear_dpbf16": ("cpu_linear_dpbf16.c",),
    "linear_amx": ("cpu_linear_amx.c",),
    "rope": ("cpu_rope.c",),
    "prefill": ("cpu_prefill_attention.c",),
    "lora": ("cpu_lora.c",),
    "linear_int8": ("cpu_linear_int8.c",),
}


def sources(name: str) -> tuple[Path, ...]:
    return tuple(CSRC / n for n in LIBRARIES[name])


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return cc


def _key(cc: str, srcs: tuple[Path, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    texts = [s.read_text() for s in (*srcs, *HEADERS)]
    parts = [*texts, version, *COMPILE_FLAGS, *LINK_FLAGS, *LIBS, platform.machine(), fingerprint()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build(srcs: tuple[Path, ...], out_dir: Path | None = None) -> Path:
    """Compile `srcs` into one shared library (or reuse the cached one); returns its path.
    Raises RuntimeError naming the compiler's complaint."""
    cc = _compiler()
    out_dir = out_dir or cache_root() / "kernels"
    target = out_dir / f"llmctl_kernels-{_key(cc, srcs)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objs, lib = [str(Path(tmp) / f"{i}.o") for i in range(len(srcs))], Path(tmp) / "k.so"
        cmds = [[cc, *COMPILE_FLAGS, "-c", str(src), "-o", obj] for src, obj in zip(srcs, objs)]
        for cmd in [*cmds, [cc, *LINK_FLAGS, *objs, "-o", str(lib), *LIBS]]:
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-500:]}")
        os.replace(lib, target)  # atomic: concurrent processes may build the same key
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """Library `name` of LIBRARIES built, loaded and its signatures declared; None, warned once,
    where the build or the load fails (the callers keep their PyTorch paths)."""
    try:
        lib = ctypes.CDLL(str(build(sources(name))))
    except (RuntimeError, OSError) as e:
        warnings.warn(
            f"native CPU kernels ({name}) unavailable, using the PyTorch reference: {e}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for fn_name, (argtypes, restype) in _signatures()[name].items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
