"""`llmctl distill --on-policy-fraction` and `--cache-teacher` against the default run (issue 15).

Same teacher, students, split and held-out evaluation as bench_distill.py (tinyshakespeare-5m,
--student-layers 2, first 90% / last 10% of tinyshakespeare.txt), few steps, on the CPU:
- held-out perplexity with --on-policy-fraction 0.5 against 0 (the default loss otherwise);
- training tokens/s with the teacher read from a --cache-teacher top-k cache against the live
  teacher (the cache's one-off teacher pass timed separately: it runs before training), and the
  CPU seconds of each whole run (setup, training, the held-out evaluation).

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/bench_distill_variants.py --steps 20 \\
        --threads 1 --json benchmarks/results/distill_variants.json
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import torch
from bench_distill import distill, split_text
from common import environment
from make_draft import TARGET


def timed(out: Path, train: Path, held: Path, args, *extra: str) -> dict:
    """bench_distill.distill plus the process's CPU seconds (user + system) for the run: on a
    shared host they move far less than wall time (the same run's tokens/s moved 20x here)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    result = distill(out, train, held, args, *extra)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result["cpu_s"] = cpu
    print(f"    {out.name}: {cpu:.1f} CPU s", flush=True)
    return result


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    return p.parse_args()


def run() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-distill-variants-") as tmp:
        folder = Path(tmp)
        train, held = split_text(folder)
        cache = folder / "teacher-cache.json"
        print(f"distill: {args.steps} steps x {args.batch_size} x {args.seq_len}", flush=True)
        runs = {
            "live": timed(folder / "live", train, held, args),
            "on_policy_0.5": timed(
                folder / "on_policy", train, held, args, "--on-policy-fraction", "0.5"
            ),
            "cache_build": timed(
                folder / "cache_build",
                train,
                held,
                args,
                "--cache-teacher",
                str(cache),
                "--cache-top-k",
                str(args.top_k),
            ),  # fmt: skip
            "cache_read": timed(
                folder / "cache_read",
                train,
                held,
                args,
                "--cache-teacher",
                str(cache),
                "--cache-top-k",
                str(args.top_k),
            ),  # fmt: skip
        }
        for name in ("on_policy_0.5", "cache_build", "cache_read"):
            report = json.loads((folder / f"{folder_name(name)}.json").read_text())
            runs[name]["on_policy_steps"] = report["on_policy_steps"]
            runs[name]["teacher_cache"] = report["teacher_cache"]
        cache_bytes = sum(p.stat().st_size for p in folder.glob("teacher-cache*"))
    doc = {
        "benchmark": "bench_distill_variants",
        "teacher": str(TARGET),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "runs": runs,
        "cache_bytes": cache_bytes,
        "environment": environment(),
    }
    print(
        json.dumps({k: (r["final_eval"]["perplexity"], r["tokens_per_s"]) for k, r in runs.items()})
    )
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


def folder_name(run_name: str) -> str:
    return {"on_policy_0.5": "on_policy"}.get(run_name, run_name)


if __name__ == "__main__":
    run()
