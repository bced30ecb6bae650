"""W8A8 int8 linear kernels: dynamic per-token activation quantization, the int8 x int8 -> int32
products and the rescale, with the kernel chosen by measurement.

Owns: `quantize_rows` (x [M, K] float -> int8 codes [M, K] and one float32 scale per row,
symmetric: scale = max|x_row| / 127, codes in [-127, 127], as compressed-tensors' dynamic token
strategy and vLLM's CPU path compute them), `int_mm_reference` (the exact int32 products, what
every kernel is tested against), the candidates (`INT8_KERNELS`: `int_mm`, PyTorch's
`torch._int_mm`, oneDNN's u8s8 VNNI/AMX-INT8 GEMM on CPU, between PyTorch's quantize and rescale;
`int_mm_native`, the same GEMM between the one-pass C versions of them, csrc/cpu_linear_int8.c;
`int8_c`, our own exact int8 GEMM in C between them, for x86 CPUs without VNNI, where
torch._int_mm saturates (`int_mm_exact` probes it; the torch._int_mm kernels serve only where it
is exact); `dequant`, the weight dequantized to the compute dtype and a dense matmul of the
quantize-dequantized activations), `w8a8_linear` (one call) and `choose_kernel` (the candidates
that serve here timed on random data of the layer's shape at a row bucket; the fastest one serves
that bucket).
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

QMAX = 127
ROW_BUCKETS = (1, 16, 128, 512)  # rows timed by choose_kernel; a call uses the nearest at or below
# The C passes take PyTorch's thread count, as the other C kernels do: the library's libgomp is
# the one PyTorch loaded (same soname), so their OpenMP regions reuse its threads. Measured on a
# quiet 2-core Zen 4 (BENCHMARKS W8A, 2026-12-07): a 512-token W8A8 forward 0.517 s against 0.553 s
# on the calling thread alone. (An earlier measurement on a host loaded 2-5x over its cores had
# found forwards 3-30x slower with 2 threads: oversubscribed spinning threads, which hurt every
# OpenMP kernel there alike.)
TIMED_CALLS = 5  # rounds per measurement (the fastest counts: a shared host's noise)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], scales float32 [M, 1]) with x ~ codes * scales; an all-zero
    row gets scale 1 (codes 0) rather than a division by zero. The codes are round(x * (127 /
    amax)) (one division per row, as the C kernel computes them, so both give the same codes)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    some = amax > 0
    one = torch.ones_like(amax)
    qmax = torch.full_like(amax, QMAX)
    # tensor / tensor: correctly rounded divisions (ATen computes 127 / t as reciprocal(t) * 127)
    scale = torch.where(some, amax / qmax, one)
    inv = torch.where(some, qmax / torch.where(some, amax, one), one)
    codes = torch.round(xf * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def _native():
    from llmctl.kernels.cpu.library import load

    return load("linear_int8")


def quantize_rows_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in one C pass per row (csrc/cpu_linear_int8.c); x float32 or bfloat16 on the
    CPU with unit column stride."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    bf16 = int(x.dtype == torch.bfloat16)
    _native().quant_rows_int8(
        x.data_ptr(), x.stride(0), bf16, m, k, codes.data_ptr(), scale.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return codes, scale


def rescale_native(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype
) -> torch.Tensor:
    """_rescale in one C pass (float32 or bfloat16 out); acc int32 [M, N] contiguous."""
    m, n = acc.shape
    out = torch.empty(m, n, dtype=dtype)
    acc, xs, ws = acc.contiguous(), x_scale.contiguous(), w_scale.contiguous()
    bf16 = int(dtype == torch.bfloat16)
    _native().rescale_int32(
        acc.data_ptr(), m, n, xs.data_ptr(), ws.data_ptr(), out.data_ptr(), bf16,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def int_mm_reference(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact int32 products xq [M, K] int8 x wq [N, K] int8 -> [M, N] (int64 accumulation, which
    cannot overflow for any K a model has, narrowed)."""
    return (xq.to(torch.int64) @ wq.to(torch.int64).t()).to(torch.int32)


@functools.cache
def int_mm_exact(device: str = "cpu") -> bool:
    """Whether torch._int_mm's int32 sums are exact on this device, probed once per process on
    codes of +-127 and random ones against int_mm_reference. oneDNN's int8 GEMM on an x86 CPU
    without VNNI (AVX2 alone: Haswell to Skylake client, AMD Zen 2 and 3) adds pairs of u8 x s8
    products into int16 (vpmaddubsw), which saturates: with PyTorch capped at AVX2, sums came out
    wrong by up to 19,605 on quantized Gaussian rows (BENCHMARKS W8A-e). Where it is not exact,
    W8A8 layers take the exact C GEMM (`int8_c`) or `dequant`, whichever is faster."""
    if not hasattr(torch, "_int_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-QMAX, QMAX + 1, (32, 256), dtype=torch.int8, generator=gen)
    w = torch.randint(-QMAX, QMAX + 1, (64, 256), dtype=torch.int8, generator=gen)
    x[:8], x[8:16], w[:16], w[16:32] = QMAX, -QMAX, QMAX, -QMAX  # every sign pairing saturates
    try:
        got = torch._int_mm(x.to(device), w.to(device).t()).cpu()
    except RuntimeError:  # no int8 GEMM in this build or on this device
        return False
    exact = torch.equal(got, int_mm_reference(x, w))
    if not exact:
        warnings.warn(
            f"W8A8: PyTorch's int8 matrix multiply on this {device} saturates (an x86 CPU without"
            " VNNI), so int8 layers use llmctl's own exact int8 GEMM (AVX2) or dequantized"
            " weights: correct, and about as fast as the unquantized model (BENCHMARKS.md W8A-e)",
            RuntimeWarning,
            stacklevel=2,
        )
    return exact


def _int_mm_applies(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    """torch._int_mm can take these operands and sums them exactly here."""
    if xq.device.type == "cuda":  # cuBLASLt's int8 GEMM: more than 16 rows, widths of 8
        shapes = xq.shape[0] > 16 and xq.shape[1] % 8 == 0 and wq.shape[0] % 8 == 0
        return shapes and int_mm_exact(str(xq.device))
    return xq.device.type == "cpu" and int_mm_exact("cpu")


def int_mm(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [M, K] int8 x wq [N, K] int8 -> int32 [M, N] with torch._int_mm (B as the transposed
    view: measured as fast as a contiguous [K, N] copy on CPU)."""
    return torch._int_mm(xq.contiguous(), wq.t())


def _rescale(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype
) -> torch.Tensor:
    """int32 [M, N] * row scales [M, 1] * column scales [N] -> dtype."""
    return (acc.float() * x_scale * w_scale).to(dtype)


def _run_int_mm(x, wq, w_scale):
    xq, xs = quantize_rows(x)
    return _rescale(int_mm(xq, wq), xs, w_scale, x.dtype)


def _run_dequant(x, wq, w_scale):
    # the same activation rounding as the int8 path, in the compute dtype: the model's numerics
    # do not depend on which kernel serves a row count (up to float accumulation order)
    xq, xs = quantize_rows(x)
    dt = x.dtype
    w = wq.to(dt) * w_scale.to(dt)[:, None]
    return F.linear((xq.float() * xs).to(dt), w)


def _run_int_mm_native(x, wq, w_scale):
    xq, xs = quantize_rows_native(x)
    return rescale_native(int_mm(xq, wq), xs, w_scale, x.dtype)


def int_mm_c(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq [M, K] int8 x wq [N, K] int8 -> int32 [M, N], exact, in C (csrc/cpu_linear_int8.c:
    AVX2 vpmaddwd on int16-widened codes): the int8 GEMM where torch._int_mm saturates."""
    xq, wq = xq.contiguous(), wq.contiguous()
    (m, k), n = xq.shape, wq.shape[0]
    out = torch.empty(m, n, dtype=torch.int32)
    lib = _native()
    if lib.gemm_int8_exact(xq.data_ptr(), m, k, wq.data_ptr(), n, out.data_ptr(),
                           torch.get_num_threads()):  # fmt: skip
        raise MemoryError("gemm_int8_exact: out of memory for its int16 copy of the rows")
    return out


def _run_int8_c(x, wq, w_scale):
    xq, xs = quantize_rows_native(x)
    return rescale_native(int_mm_c(xq, wq), xs, w_scale, x.dtype)


def c_gemm_applies(x: torch.Tensor) -> bool:
    """The C int8 GEMM serves (with the C passes) where they do and it was built (AVX2)."""
    return native_applies(x) and _c_gemm_built()


@functools.cache
def _c_gemm_built() -> bool:  # asked once: w8a8_linear checks it per call
    return bool(_native().gemm_int8_exact_built())


def native_applies(x: torch.Tensor) -> bool:
    """The C passes serve float32 and bfloat16 rows on the CPU, where the library builds."""
    ok_dtype = x.dtype in (torch.float32, torch.bfloat16)
    return x.device.type == "cpu" and ok_dtype and _native() is not None


INT8_KERNELS: dict[str, Callable] = {
    "int_mm": _run_int_mm,
    "dequant": _run_dequant,
    "int_mm_native": _run_int_mm_native,
    "int8_c": _run_int8_c,
}


def w8a8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, kernel: str = "int_mm"
) -> torch.Tensor:
    """y [M, N] = Q(x) Q(W)^T for x [M, K] (float), wq [N, K] int8, w_scale float32 [N];
    a `kernel` that cannot serve here falls back (int_mm_native to int_mm; int_mm where
    torch._int_mm cannot take the shape or is not exact, and int8_c where it is not built, to
    dequant)."""
    if kernel == "int8_c" and not c_gemm_applies(x):
        kernel = "dequant"
    if kernel == "int_mm_native" and not native_applies(x):
        kernel = "int_mm"
    if kernel.startswith("int_mm") and not _int_mm_applies(x, wq):
        kernel = "dequant"
    return INT8_KERNELS[kernel](x, wq, w_scale)


def _serving(x: torch.Tensor, wq: torch.Tensor) -> list[str]:
    """The INT8_KERNELS that can serve x (float) by wq here, each exact where it is int8."""
    names = ["dequant"]
    if _int_mm_applies(x, wq):
        names += ["int_mm"] + ["int_mm_native"] * native_applies(x)
    return names + ["int8_c"] * c_gemm_applies(x)


def bucket(rows: int) -> int:
    """The timed bucket serving `rows`: the largest at or below it (at least the first)."""
    return max([b for b in ROW_BUCKETS if b <= rows] or [ROW_BUCKETS[0]])


def _time_all(fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """Seconds per call of each candidate: the fastest of TIMED_CALLS rounds, the candidates taken
    in turn within each round (on a shared host the load drifts: one block per candidate let the
    drift pick the kernel)."""
    for fn in fns.values():
        fn()  # warm (oneDNN builds its primitive on the first call)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(TIMED_CALLS):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=256)
def choose_kernel(n: int, k: int, rows: int, dtype: torch.dtype, device: str = "cpu") -> str:
    """The fastest of the INT8_KERNELS that serve here (`_serving`) for a weight [n, k] at `rows`
    rows of `dtype` activations, timed once per process and shape (a few milliseconds)."""
    gen = torch.Generator().manual_seed(0)
    wq = torch.randint(-QMAX, QMAX + 1, (n, k), dtype=torch.int8, generator=gen).to(device)
    ws = torch.rand(n, generator=gen).to(device) * 1e-2
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    names = _serving(x, wq)
    if names == ["dequant"]:
        return "dequant"
    try:
        times = _time_all({n: lambda f=INT8_KERNELS[n]: f(x, wq, ws) for n in names})
    except RuntimeError:  # an int8 GEMM this build or CPU lacks
        return "dequant"
    return min(times, key=times.get)
