"""Does vLLM's CPU build load and generate with a W8A8 folder? Run with the Python of a venv that
has vLLM (issue 38, run W8A): prints the quantization method vLLM chose and greedy continuations,
and with --compare FOLDER the same prompts through that (unquantized) model for agreement.

    VLLM_CPU_KVCACHE_SPACE=1 /work/venvs/vllm/bin/python benchmarks/check_vllm_w8a8.py \
        /tmp/w8/smol-gptq --compare /tmp/smollm2-135m-instruct
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea:",
    "ROMEO: What light through yonder window",
    "def fibonacci(n):",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def generate(model: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3)
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        print(json.dumps({"model": model, "prompt": p, "text": o.outputs[0].text}), flush=True)
    return [list(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":  # vLLM starts worker processes: everything under the main guard
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    got = generate(sys.argv[1])
    if "--compare" in sys.argv:
        ref = generate(sys.argv[sys.argv.index("--compare") + 1])
        same = [common_prefix(a, b) for a, b in zip(got, ref)]
        print("RESULT " + json.dumps({"common_prefix_tokens": same, "of": 16}))
