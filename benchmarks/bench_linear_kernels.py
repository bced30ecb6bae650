"""GFLOP/s of every linear-kernel candidate (kernels/cpu/linear) per row bucket, on the decoder and
vocabulary shapes of real models, with the autotuner's choice per bucket; one table per CPU kind,
headed by its model name and the flags that decide the kernels (avx2, avx512f, avx512_bf16,
amx_bf16).

Each measurement cycles over several copies of the weight (at least 64 MiB in all, so weights come
from memory as in a forward pass) and keeps the fastest of --reps passes (the machine may be
shared). Candidates: torch (F.linear in the weight's dtype: oneDNN/MKL, AMX where present), native
(cpu_linear.c), dpbf16 (cpu_linear_dpbf16.c, AVX512-BF16 only), upcast (bf16 widened to float32
BLAS), packed (oneDNN-packed weight).

    python benchmarks/bench_linear_kernels.py --models smollm2-135m,qwen2.5-0.5b \\
        --dtypes bfloat16 --rows 1,8,32,128,512 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import SHARED, environment  # noqa: E402
from llmctl.kernels.cpu.features import fingerprint  # noqa: E402
from llmctl.kernels.cpu.linear import autotune, c_kernels, dispatch, torch_kernels  # noqa: E402

PASS_FLOPS = 2e9  # at most this much work per timed pass (beyond one call)
KEY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def shapes(config_name: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of each distinct linear of the model: q, k/v, o, gate/up, down, lm_head."""
    c = json.loads((SHARED / "configs" / f"{config_name}.json").read_text())
    h, f = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = [("q", q, h), ("k/v", kv, h), ("o", h, q), ("gate/up", f, h), ("down", h, f)]
    out.append(("lm_head", c["vocab_size"], h))
    seen, unique = set(), []
    for name, n, k in out:
        if (n, k) not in seen:
            seen.add((n, k))
            unique.append((name, n, k))
    return unique


def time_candidate(cand, x, weights, packs, reps: int) -> float:
    """Fastest seconds per call over `reps` passes through every weight copy."""

    def one_pass():
        for i, w in enumerate(weights):
            cand.run(x, w, None, packs[i] if packs else None)

    one_pass()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        one_pass()
        best = min(best, (time.perf_counter() - t) / len(weights))
    return best


def static_choice(x: torch.Tensor, w: torch.Tensor) -> str:
    """What models/layers.Linear runs without a plan (--no-autotune): the "before" column."""
    if dispatch.use_native(x, w):
        return "native"
    return "upcast" if torch_kernels.use_upcast(x, w) else "torch"


def bench_shape(n: int, k: int, dtype, rows: list[int], reps: int) -> list[dict]:
    copies = max(1, min(16, (64 << 20) // (n * k * dtype.itemsize)))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
    cands = [c for c in autotune.CANDIDATES if c.applies(weights[0])]
    # per packing candidate: its copy of each weight, as the kernel receives it ({name: copy})
    packs = {c.name: [{c.name: c.pack(w)} for w in weights] for c in cands if c.packs}
    results = []
    for m in rows:
        x = torch.randn(m, k, generator=g).to(dtype)
        # Many rows are compute-bound: fewer copies keep a pass near PASS_FLOPS.
        used = max(1, min(copies, int(PASS_FLOPS / (2 * m * n * k))))
        times = {}
        for c in cands:
            if c.packs and any(p[c.name] is None for p in packs[c.name]):
                continue
            pk = packs[c.name][:used] if c.packs else None
            times[c.name] = time_candidate(c, x, weights[:used], pk, reps)
        gflops = {name: 2 * m * n * k / t / 1e9 for name, t in times.items()}
        choice, static = autotune.choose(times), static_choice(x, weights[0])
        results.append({"rows": m, "gflops": gflops, "choice": choice, "static": static})
    return results


def cpu_kind() -> dict:
    flags = set(fingerprint().split(":", 1)[-1].split())
    return {**environment(), "flags": [f for f in KEY_FLAGS if f in flags]}


def table(model: str, dtype: str, name: str, n: int, k: int, results: list[dict]) -> str:
    names = [c.name for c in autotune.CANDIDATES if any(c.name in r["gflops"] for r in results)]
    lines = [
        f"\n{model} {name} [{n} x {k}] {dtype}: GFLOP/s",
        "| rows | " + " | ".join(names) + " | static rule | autotune | gain |",
        "| ---: |" + " ---: |" * len(names) + " --- | --- | ---: |",
    ]
    for r in results:
        cells = [f"{r['gflops'][c]:.1f}" if c in r["gflops"] else "-" for c in names]
        g = r["gflops"]
        gain = g[r["choice"]] / g[r["static"]] if r["static"] in g else float("nan")
        tail = f" | {r['static']} | {r['choice']} | {gain:.2f}x |"
        lines.append(f"| {r['rows']} | " + " | ".join(cells) + tail)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", default="1,8,32,128,512")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-lm-head", action="store_true", help="The widest shape takes longest.")
    ap.add_argument("--json", help="Also write every number here.")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kind = cpu_kind()
    print(f"CPU: {kind['cpu']}; flags: {' '.join(kind['flags']) or 'none of ' + str(KEY_FLAGS)}")
    dp = c_kernels.dpbf16_library() is not None
    print(f"threads {a.threads}, torch {kind['torch']}, dpbf16 kernel: {dp}")
    rows = [int(r) for r in a.rows.split(",")]
    record = {"cpu_kind": kind, "threads": a.threads, "results": []}
    for model in a.models.split(","):
        for dtype_name in a.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for name, n, k in shapes(model):
                if a.skip_lm_head and name == "lm_head":
                    continue
                with torch.inference_mode():
                    results = bench_shape(n, k, dtype, rows, a.reps)
                print(table(model, dtype_name, name, n, k, results), flush=True)
                record["results"].append(
                    {
                        "model": model,
                        "dtype": dtype_name,
                        "shape": name,
                        "n": n,
                        "k": k,
                        "buckets": results,
                    }
                )
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
