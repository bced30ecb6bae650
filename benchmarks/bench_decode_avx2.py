"""Decode attention per KV cache dtype as a CPU without AVX-512 runs it, emulated on this one.

llmctl's C library is built with -march=haswell (AVX2, FMA, F16C) into a fresh cache folder and
the AVX-512 and AMX flags are hidden from llmctl's feature checks, so the generic kernels serve,
compiled as on an AVX2-only CPU; PyTorch's own kernels keep this CPU's instructions (only ours
change). float32 and bf16 queries over float32, bf16, fp8 (e4m3) and int8 caches; the workload
of bench_decode_attention.py (batch 64, contexts 16-900, SmolLM2-135M's heads, K/V cycled over
160 MiB of layers); median of --calls calls, the legs taking turns. --native keeps this CPU's
build and flags, for comparison in the same session.

    python benchmarks/bench_decode_avx2.py --threads 2
    AVX2_TORCH=1 python benchmarks/bench_decode_avx2.py --llmctl run-batch ...  # the CLI, emulated
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def emulate_avx2() -> None:
    """Before torch is imported and any kernel loads: AVX2 code in a fresh cache folder, AVX-512
    and AMX flags hidden from llmctl; with `AVX2_TORCH=1` PyTorch's ATen and oneDNN kernels
    capped at AVX2 too (their own switches), for whole-engine runs."""
    os.environ["LLMCTL_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmctl-avx2-")
    if os.environ.get("AVX2_TORCH") == "1":
        os.environ["ATEN_CPU_CAPABILITY"], os.environ["ONEDNN_MAX_CPU_ISA"] = "avx2", "AVX2"
    import llmctl.kernels.cpu.features as features
    import llmctl.kernels.cpu.library as library

    flags = frozenset(f for f in features.cpu_flags() if not f.startswith(("avx512", "amx")))
    features.cpu_flags = lambda: flags
    library.COMPILE_FLAGS = [*library.COMPILE_FLAGS, "-march=haswell"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=21)
    ap.add_argument("--native", action="store_true", help="this CPU's own build and flags")
    args = ap.parse_args()
    if not args.native:
        emulate_avx2()
    import torch
    from bench_decode_attention import BS, make_layers

    from llmctl.kernels.cpu import attention as ca
    from llmctl.kernels.kv_dtype import cache_dtype, to_cache

    torch.set_num_threads(args.threads)
    lens = torch.randint(16, 901, (64,), generator=torch.Generator().manual_seed(1))
    q, layers, tables, _ = make_layers(9, 3, 64, lens.tolist(), 160)
    caches = {}
    for name in ("float32", "bfloat16", "fp8", "int8"):
        dt = cache_dtype(name, torch.bfloat16)
        caches[name] = [(to_cache(k, dt), to_cache(v, dt)) for k, v in layers]
    legs = [(qd, c) for qd in (torch.float32, torch.bfloat16) for c in caches]
    times: dict = {leg: [] for leg in legs}
    for i in range(args.calls + 2):  # two warm-up calls
        for j, (qd, c) in enumerate(legs):
            k, v = caches[c][(i * len(legs) + j) % len(caches[c])]
            qq = q.to(qd)
            t0 = time.perf_counter()
            ca.paged_decode_attention(qq, k, v, tables, lens, 0.125, BS, int(lens.max()))
            times[(qd, c)].append(time.perf_counter() - t0)
    print(f"{'AVX2 emulated' if not args.native else 'native'}, {args.threads} threads")
    base = statistics.median(times[(torch.float32, "float32")][2:])
    for (qd, c), t in times.items():
        ms = statistics.median(t[2:])
        kernel = ca.decode_kernel(qd, caches[c][0][0].dtype)
        print(f"query {str(qd)[6:]:9} cache {c:9} {kernel:26} {ms * 1e3:7.3f} ms "
              f"{base / ms:5.2f}x the float32 cache")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--llmctl"]:  # `... --llmctl ARGS`: the llmctl CLI, emulated
        emulate_avx2()
        from llmctl.cli import main as cli

        sys.exit(cli(sys.argv[2:]))
    main()
