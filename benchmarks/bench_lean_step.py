"""One engine step replayed in one process: the lean path (models/step.py) against the module path,
alternated in blocks so that a shared host's drift hits both.

A decode step of `--rows` one-token decodes is captured from a real generation (SmolLM2-135M shape,
random weights, bf16, the engine's own metadata and caches) and replayed: blocks of 10 steps, the
two paths taking turns (A B, B A, ...). Reported: each path's median milliseconds a step and the
median of the paired block ratios lean / module (below 1: the lean path is faster). Run it from
the tree to measure (its `llmctl` is imported); a tree from before the lean path, with
`decode_program` in its place, is measured the same way.

    python benchmarks/bench_lean_step.py --rows 2 --blocks 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the tree measured, before any installed llmctl
sys.path.insert(1, str(Path(__file__).resolve().parent))


def capture(llm, rows: int):
    """(input_ids, positions, meta, kv_caches) of the first step of `rows` decodes alone."""
    import torch

    from llmctl import SamplingParams

    model, seen = llm.runtime.model, []
    forward = type(model).forward

    def grab(self, ids, pos, meta, kv):
        if meta.num_decodes == ids.shape[0] == rows and not seen:
            seen.append((ids.clone(), pos.clone(), meta, kv))
        return forward(self, ids, pos, meta, kv)

    type(model).forward = grab
    prompts = [[int(t) for t in torch.randint(3, 1000, (100,))] for _ in range(rows)]
    try:
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        type(model).forward = forward
    return seen[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from common import random_model_folder

    from llmctl import LLM

    llm = LLM(str(random_model_folder("smollm2-135m")), dtype="bfloat16", device="cpu")
    model, step = llm.runtime.model, capture(llm, args.rows)
    attr = "lean" if hasattr(model, "lean") else "decode_program"
    fast, times = getattr(model, attr), {"lean": [], "module": []}
    with torch.no_grad():
        for b in range(args.blocks):
            order = [("lean", fast), ("module", None)]
            for name, value in order if b % 2 else order[::-1]:
                setattr(model, attr, value)
                t0 = time.perf_counter()
                for _ in range(10):
                    model(*step)
                times[name].append((time.perf_counter() - t0) / 10 * 1e3)
    setattr(model, attr, fast)
    ratios = [a / b for a, b in zip(times["lean"], times["module"])]
    print(
        f"{Path.cwd().name} ({attr}) rows={args.rows} threads={args.threads} pid={os.getpid()}: "
        f"lean {statistics.median(times['lean']):.2f} ms, module "
        f"{statistics.median(times['module']):.2f} ms a step; paired lean / module "
        f"{statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
