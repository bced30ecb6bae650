"""What the transformers path costs: one model through llmctl's own model code and through
transformers' modeling code on llmctl's paged KV cache (`--model-impl`), issue 19's workload,
the legs alternated in fresh processes (native, transformers, native, ...) so the host's drift
hits both. Reported: each leg's seconds, the medians and the paired ratios native / transformers
(below 1: the transformers path is slower).

    python benchmarks/bench_model_impl.py --config smollm2-135m --repeats 3 \\
        --json benchmarks/results/model_impl_smollm2_bf16.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "BENCH_MODEL_IMPL="


def leg(impl: str, config: str, args) -> dict:
    """One timed LLM.generate in this process."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_throughput import run_llmctl
    from common import random_model_folder, workload

    torch.set_num_threads(args.threads)
    folder = random_model_folder(config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    # issue 19's workload: prompts of 16-700 tokens, 32-200 output tokens each
    prompts, outs = workload(args.num_prompts, (16, 700), output_range=(32, 200), vocab=vocab)
    return run_llmctl(folder, prompts, outs, dtype=args.dtype, max_num_seqs=256, model_impl=impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="smollm2-135m", help="a config under ../shared/configs")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--leg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.leg:
        print(MARK + json.dumps(leg(args.leg, args.config, args)), flush=True)
        return
    runs: dict[str, list[dict]] = {"llmctl": [], "transformers": []}
    for _ in range(args.repeats):
        for impl in runs:
            cmd = [sys.executable, __file__, "--leg", impl, *sys.argv[1:]]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[impl].append(json.loads(out.split(MARK)[-1].splitlines()[0]))
            print(impl, f"{runs[impl][-1]['seconds']:.2f} s", flush=True)
    seconds = {k: [r["seconds"] for r in v] for k, v in runs.items()}
    report = {
        "config": args.config,
        "dtype": args.dtype,
        "threads": args.threads,
        "num_prompts": args.num_prompts,
        "seconds": seconds,
        "medians": {k: statistics.median(v) for k, v in seconds.items()},
        "paired_native_over_transformers": [
            a / b for a, b in zip(seconds["llmctl"], seconds["transformers"])
        ],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
