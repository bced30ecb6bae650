"""Milliseconds per call and effective GB/s (K/V bytes read) of the CPU paged decode attention
kernel on a bf16 cache: the generic kernel (paged_decode_bf16, cpu_paged_attention.c) against the
AVX512-BF16 one (paged_decode_dpbf16, cpu_paged_attention_dpbf16.c; skipped where the CPU lacks it);
with --cache bf16,fp8,fp8_e5m2 also on fp8 caches (issue 38: paged_decode_e4m3/_e5m2 and their
vdpbf16ps variants), the speedup always against the first variant (generic on bf16).

Workload: batch 64, context lengths drawn uniformly from 16-900, blocks of 16 scattered at random
over the cache, SmolLM2-135M (9 heads, 3 KV heads, D 64) and Qwen2.5-0.5B (14, 2, 64) head shapes.
Each call reads another layer's cache (as many layers as make --mib of K/V, so the cache comes
from memory as in a forward pass, not from the last call's L3); median of --calls calls.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_attention.py --threads 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from llmctl.kernels.cpu import attention as cpu_attention  # noqa: E402
from llmctl.kernels.kv_dtype import cache_dtype, to_cache  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}
BS = 16


def make_layers(heads, kvh, d, lens, mib, seed=0):
    """Caches of as many layers as make `mib` MiB of K/V in all, with one shared block table of
    scattered blocks: (q, [(k, v)], tables, bytes of K/V one call reads)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n], used = perm[used : used + n], used + n
    layer_bytes = 2 * kvh * num_blocks * BS * d * 2
    layers = [
        tuple(torch.randn(kvh, num_blocks * BS, d, generator=g).bfloat16() for _ in range(2))
        for _ in range(max(1, mib * 2**20 // layer_bytes))
    ]
    q = torch.randn(len(lens), heads, d, generator=g).bfloat16()
    return q, layers, tables, 2 * kvh * sum(lens) * d * 2


def time_calls(q, caches, tables, lens, max_len, kernels, calls) -> list[float]:
    """Median seconds of one call per (cache name, kernel choice), each call on the next layer's
    cache; the kernels take turns call by call, so load from other processes hits both alike."""
    times = [[] for _ in kernels]
    for i in range(calls + 2):  # two warm-up calls
        for j, (cache, dp) in enumerate(kernels):
            layers = caches[cache]
            k, v = layers[(i * len(kernels) + j) % len(layers)]
            t0 = time.perf_counter()
            cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.125, BS, max_len, dp)
            times[j].append(time.perf_counter() - t0)
    return [statistics.median(t[2:]) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--mib", type=int, default=160, help="K/V of all layers cycled through")
    ap.add_argument("--cache", default="bf16", help="cache dtypes: bf16, fp8, fp8_e5m2")
    args = ap.parse_args()
    lens = torch.randint(16, 901, (64,), generator=torch.Generator().manual_seed(1))
    max_len = int(lens.max())
    names = args.cache.split(",")
    kernels = [
        (c, k) for c in names for k in ["generic"] + ["dpbf16"] * cpu_attention.dpbf16_available()
    ]
    print(f"batch 64, contexts 16-900 (mean {lens.float().mean():.0f}), blocks of {BS}, bf16")
    head = ("shape", "threads", "cache", "kernel", "ms", "GB/s", "speedup")
    print(f"{head[0]:14} " + " ".join(f"{h:>{w}}" for h, w in zip(head[1:], (7, 9, 7, 8, 6, 7))))
    for name, (heads, kvh, d) in SHAPES.items():
        q, layers, tables, nbytes = make_layers(heads, kvh, d, lens.tolist(), args.mib)
        caches = {"bf16": layers}
        for c in names[names[0] == "bf16" :]:
            dt = cache_dtype(c, torch.bfloat16)
            caches[c] = [(to_cache(k, dt), to_cache(v, dt)) for k, v in layers]
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            times = time_calls(q, caches, tables, lens, max_len, kernels, args.calls)
            for (c, dp), t in zip(kernels, times):
                read = nbytes // (2 if caches[c][0][0].element_size() == 1 else 1)
                print(
                    f"{name:14} {threads:>7} {c:>9} {dp:>7} {t * 1e3:8.3f} "
                    f"{read / t / 1e9:6.1f} {times[0] / t:6.2f}x"
                )


if __name__ == "__main__":
    main()
