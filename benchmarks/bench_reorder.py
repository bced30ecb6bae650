"""`llmctl run-batch --reorder prefix` against input order on a shared-prefix workload (issue 38).

The workload: PREFIXES distinct long prefixes (a system prompt or a document, random tokens),
each shared by ROWS_PER_PREFIX rows that add a short distinct suffix and ask for a few tokens,
shuffled so that rows sharing a prefix lie far apart (the mean gap between consecutive sharers is
reported). The KV cache holds only a few of the distinct prompts at once (--kv-cache-memory):
the regime where prefix grouping matters, a deployment with more distinct documents than its
KV cache holds, scaled down to a 135M model on two cores. With a cache that holds every prefix
the input order already hits nearly everything (said by --kv-cache-memory 2GiB).

Each round runs the `llmctl run-batch` command twice in fresh processes, input order and
`--reorder prefix`, the pair's order alternating between rounds (the host is shared: the ratio
of a pair is taken under the same load). Reported per run: the job's own seconds (after the model
has loaded), the prefix-cache hit rate from the summary; per pair, the ratio; and whether the
outputs are byte-identical.

    python benchmarks/bench_reorder.py --rounds 3 --out benchmarks/results/reorder_smollm2_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, random_model_folder  # noqa: E402


def shared_prefix_rows(args) -> tuple[list[dict], float]:
    """The shuffled rows, and the mean distance (in rows) between consecutive sharers."""
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(10, args.vocab) for _ in range(args.prefix_tokens)]
        for _ in range(args.prefixes)
    ]
    rows = []
    for k, p in enumerate(prefixes):
        for j in range(args.rows_per_prefix):
            suffix = [rng.randrange(10, args.vocab) for _ in range(rng.randint(16, 32))]
            rows.append({"group": k, "prompt_token_ids": p + suffix, "max_tokens": args.max_tokens})
    rng.shuffle(rows)
    last, gaps = {}, []
    for i, r in enumerate(rows):
        g = r.pop("group")
        if g in last:
            gaps.append(i - last[g])
        last[g] = i
        r["id"] = i
    return rows, statistics.mean(gaps)


def run_batch(folder: Path, inp: Path, out: Path, reorder: bool, args) -> dict:
    """One `llmctl run-batch` in a fresh process; its summary's job seconds and prefix cache."""
    report = out.with_suffix(".report.json")
    cmd = [sys.executable, "-m", "llmctl.cli", "run-batch", str(inp), "-o", str(out)]
    cmd += ["--model", str(folder), "--dtype", "bfloat16", "--device", "cpu", "--ignore-eos"]
    cmd += ["--kv-cache-memory", args.kv_cache_memory, "--overwrite", "-q"]
    cmd += ["--report-json", str(report)]
    if reorder:
        cmd += ["--reorder", "prefix"]
        cmd += ["--reorder-window", str(args.reorder_window)] if args.reorder_window else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"run-batch exited {res.returncode}: {res.stderr[-2000:]}")
    s = json.loads(report.read_text())
    return {
        "job_seconds": s["elapsed_s"],
        "seconds_including_load": round(wall, 3),
        "prefix_cache_hit_rate": s["prefix_cache"]["hit_rate"],
        "prompt_tokens": s["prompt_tokens"],
        "output_tokens": s["output_tokens"],
        "errors": s["errors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--rows-per-prefix", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="40MiB")
    ap.add_argument("--reorder-window", type=int, help="run-batch's (default: its own)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()

    folder = random_model_folder(args.config)
    rows, gap = shared_prefix_rows(args)
    runs = {"input_order": [], "reorder_prefix": []}
    pairs, identical = [], []
    with tempfile.TemporaryDirectory() as d:
        inp = Path(d) / "in.jsonl"
        inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for i in range(args.rounds):
            got = {}
            for reorder in (False, True) if i % 2 == 0 else (True, False):
                out = Path(d) / f"out-{int(reorder)}.jsonl"
                got[reorder] = run_batch(folder, inp, out, reorder, args)
                runs["reorder_prefix" if reorder else "input_order"].append(got[reorder])
                print(json.dumps({"round": i, "reorder": reorder, **got[reorder]}), flush=True)
            pairs.append(got[False]["job_seconds"] / got[True]["job_seconds"])
            a, b = (Path(d) / f"out-{k}.jsonl" for k in (0, 1))
            identical.append(a.read_bytes() == b.read_bytes())
    report = {
        "benchmark": "bench_reorder",
        "command": "python " + " ".join(sys.argv),
        "environment": environment(),
        "workload": {
            "rows": len(rows),
            "prefixes": args.prefixes,
            "rows_per_prefix": args.rows_per_prefix,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": "16-32",
            "max_tokens": args.max_tokens,
            "mean_gap_between_sharers": round(gap, 1),
            "kv_cache_memory": args.kv_cache_memory,
            "reorder_window": args.reorder_window,
            "model": f"{args.config} random weights, bf16",
        },
        "runs": runs,
        "pair_ratios": [round(r, 3) for r in pairs],
        "median_ratio": round(statistics.median(pairs), 3),
        "outputs_identical": identical,
    }
    print(json.dumps({k: report[k] for k in ("pair_ratios", "median_ratio", "outputs_identical")}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
