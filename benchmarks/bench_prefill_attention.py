"""Causal prefill attention on the CPU in bf16: PyTorch's SDPA against llmctl's kernel in each mode
this CPU runs (kernels/cpu/prefill.py: AMX tiles, AVX512-BF16 registers), one chunk of one
sequence with no cached prefix, as chunk_attention calls it. Prints a table of milliseconds per call
(median of --repeats after a warm-up) and useful GFLOP/s (causal: half the score matrix).

    python benchmarks/bench_prefill_attention.py --threads 1 --lengths 128 512 700 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402

from llmctl.kernels.cpu import prefill as cpu_prefill  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64), "llama-3-8b": (32, 8, 128)}


def _sdpa(q, k, v, scale):
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _modes() -> list[str]:
    """The kernel modes this CPU runs."""
    return list(cpu_prefill.runnable_modes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 700, 2048])
    ap.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes, rows = _modes(), []
    for shape in args.shapes:
        heads, kvh, d = SHAPES[shape]
        for n in args.lengths:
            g = torch.Generator().manual_seed(n)
            q = torch.randn(n, heads, d, generator=g).bfloat16()
            k, v = (torch.randn(n, kvh, d, generator=g).bfloat16() for _ in range(2))
            flops = 4 * heads * d * n * (n + 1) / 2  # QK^T and PV over the causal half
            row = {
                "shape": shape,
                "tokens": n,
                "sdpa_ms": 1e3 * _time(lambda: _sdpa(q, k, v, d**-0.5), args.repeats),
            }
            for m in modes:
                fn = lambda: cpu_prefill.prefill_attention(q, k, v, 0, d**-0.5, m)  # noqa: E731
                row[f"{m}_ms"] = 1e3 * _time(fn, args.repeats)
            for key in [k for k in row if k.endswith("_ms")]:
                row[key.replace("_ms", "_gflops")] = flops / row[key] / 1e6
            rows.append(row)
            cols = "  ".join(
                f"{m} {row[f'{m}_ms']:8.3f} ms ({row['sdpa_ms'] / row[f'{m}_ms']:.2f}x)"
                for m in modes
            )
            print(f"{shape:14s} {n:5d} tokens  sdpa {row['sdpa_ms']:8.3f} ms  {cols}", flush=True)
    report = {"environment": environment(), "threads": args.threads, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
