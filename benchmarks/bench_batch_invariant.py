"""run-batch on the embedded demo model with and without batch-invariant arithmetic (issue 20).

Two workloads of 64 rows: "decode" (short prompts, 32 new tokens each) and "prefill" (prompts of
several hundred tokens, 4 new tokens each); for each dtype and workload, runs the default engine
and `batch_invariant=True` in turn, `--reps` times, and reports the best rate of each: prompt and
output tokens per CPU-second of this process (less sensitive to other load on the machine than
wall time) and run-batch's own output tokens/s. One thread by default. `--device cuda` measures
the Triton kernels' cost (benchmarks/gpu_check.sh): there read output tokens/s, as CPU-seconds
mostly count kernel launches.

    python benchmarks/bench_batch_invariant.py --dtypes float32,bfloat16 --json out.json

The engine field is set directly on the job's options (the CLI flag is wired in
commands/run_batch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LINE = "O Romeo, Romeo, wherefore art thou Romeo? "


def write_rows(path: Path, workload: str) -> None:
    with path.open("w") as f:
        for i in range(64):
            if workload == "decode":
                row = {"prompt": f"ROMEO {i}: " + LINE * (1 + i % 5), "max_tokens": 32}
            else:
                row = {"prompt": f"ROMEO {i}: " + LINE * (20 + i % 7), "max_tokens": 4}
            f.write(json.dumps({**row, "ignore_eos": True}) + "\n")


def run_once(inp: Path, out: Path, dtype: str, invariant: bool, device: str = "cpu") -> dict:
    import llmctl.batch.runner as runner
    from llmctl.cli import main

    plain = runner.run_batch

    def run_batch(opts, *a, **k):
        opts.engine["batch_invariant"] = invariant
        return plain(opts, *a, **k)

    summary = out.with_suffix(".summary.json")
    runner.run_batch = run_batch
    try:
        cpu0 = time.process_time()
        args = ["run-batch", str(inp), "-o", str(out), "--overwrite", "--dtype", dtype]
        args += ["--device", device, "--max-num-seqs", "16", "--report-json", str(summary), "-q"]
        if main(args) != 0:
            raise SystemExit(f"run-batch failed ({dtype}, invariant={invariant})")
        cpu = time.process_time() - cpu0
    finally:
        runner.run_batch = plain
    s = json.loads(summary.read_text())
    return {
        "tokens_per_cpu_s": (s["prompt_tokens"] + s["output_tokens"]) / cpu,
        "output_tokens_per_s": s["output_tokens_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="decode,prefill")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cuda: the Triton kernels' cost")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch

    torch.set_num_threads(a.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in a.workloads.split(","):
            inp = Path(tmp) / f"{workload}.jsonl"
            write_rows(inp, workload)
            for dtype in a.dtypes.split(","):
                runs: dict[bool, list[dict]] = {False: [], True: []}
                # builds the C kernels (or compiles the Triton ones)
                run_once(inp, Path(tmp) / "warm.jsonl", dtype, False, a.device)
                for _ in range(a.reps):
                    for inv in (False, True):
                        out = Path(tmp) / "out.jsonl"
                        runs[inv].append(run_once(inp, out, dtype, inv, a.device))
                best = {inv: {k: max(r[k] for r in rs) for k in rs[0]} for inv, rs in runs.items()}
                cost = 1 - best[True]["tokens_per_cpu_s"] / best[False]["tokens_per_cpu_s"]
                row = dict(
                    workload=workload,
                    dtype=dtype,
                    default=best[False],
                    invariant=best[True],
                    cost=round(cost, 3),
                )
                results.append(row)
                print(json.dumps(row))
    if a.json:
        a.json.write_text(json.dumps({"threads": a.threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
