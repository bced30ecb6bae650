"""What this CPU executes: the flags of /proc/cpuinfo, read once per process, and what follows.

Owns: `cpu_flags`, `native_bf16` (bf16 dot-product units: PyTorch's bf16 matmul is fast),
`has_dpbf16` (AVX512-BF16 with the AVX-512 subsets our kernels load with), `has_amx` (AMX-BF16
tiles beside AVX512-BF16; Linux's permission for the tile state is each kernel's own probe) and
`fingerprint` (what -march=native code and timing caches are keyed by).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

DPBF16_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
AMX_FLAGS = ("amx_bf16", "amx_tile")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first CPU in /proc/cpuinfo; empty where there is none (not Linux: unknown,
    so no kernel that needs a flag is used)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def native_bf16() -> bool:
    """The CPU has bf16 dot-product instructions, so PyTorch's (oneDNN's) bf16 matmul is fast;
    where the flags are unknown widening is correct either way."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@functools.cache
def has_dpbf16() -> bool:
    """The CPU executes AVX512-BF16 (and the AVX-512 subsets the kernels' loads need)."""
    return set(DPBF16_FLAGS) <= cpu_flags()


@functools.cache
def has_amx() -> bool:
    """The CPU executes AMX-BF16 tiles and AVX512-BF16 (which the AMX kernels use beside them)."""
    return has_dpbf16() and set(AMX_FLAGS) <= cpu_flags()


def fingerprint() -> str:
    """-march=native code is only valid on CPUs with the same instruction sets."""
    flags = cpu_flags()
    return "flags: " + " ".join(sorted(flags)) if flags else platform.processor()
