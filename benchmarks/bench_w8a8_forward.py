"""Prefill forward of a W8A8 model against its bf16 base, in one process, alternated (issue 38,
run W8A): both models loaded (bf16 activations), then `--rounds` rounds of one full forward of a
`--tokens`-token prompt each, base and W8A8 in turn; prints each round's seconds and the paired
ratios. One process and alternation keep a shared host's drift out of the comparison more than
separate run-batch jobs do (bench_w8a8.py measures those).

    python benchmarks/bench_w8a8_forward.py /tmp/smollm2-135m-instruct /tmp/w8/smol-rtn
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmctl.runtime.loader import load_runtime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("w8a8")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    models = {n: load_runtime(p, dtype="bfloat16", device="cpu").model for n, p in
              (("bf16", a.base), ("w8a8", a.w8a8))}  # fmt: skip
    ids = torch.randint(0, 1000, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {n: [] for n in models}
    with torch.no_grad():
        for m in models.values():  # warm: kernel choices, oneDNN primitives
            m.forward_dense(ids)
        for r in range(a.rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for n in order:
                t = time.perf_counter()
                models[n].forward_dense(ids)
                times[n].append(time.perf_counter() - t)
    ratios = [b / w for b, w in zip(times["bf16"], times["w8a8"])]
    print(json.dumps({"tokens": a.tokens, "threads": a.threads, **times, "ratios": ratios}))
    print(
        f"bf16/w8a8 per round: median {statistics.median(ratios):.2f}, "
        f"min-time ratio {min(times['bf16']) / min(times['w8a8']):.2f}"
    )


if __name__ == "__main__":
    main()
