"""What serving LoRA adapters costs (issue 37): a job mixing 4 adapters and base rows, against the
same rows on the base model alone (goal: >= 0.8x the base's output tokens per second).

Four PEFT adapters with random weights are made for the model (rank --rank, on every projection
for two of them, on attention or MLP only for the others); the rows cycle base, a1, a2, a3, a4.
Both legs generate exactly --max-tokens tokens a row (greedy, ignore_eos) through one engine
each, after a warm-up; legs alternate --repeats times. The ratio of output tokens per second is
what the adapters cost: each row's low-rank update (kernels/cpu/lora.py on the CPU). Wall-clock
and CPU-time rates are both reported, with each mixed leg's ratio to the base leg before it.

    python benchmarks/bench_lora.py --model ../shared/models/tinyshakespeare-5m --rows 64 \
        --max-tokens 32 --repeats 3 --out benchmarks/results/lora_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import environment

TARGETS = [
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ["q_proj", "v_proj"],
    ["gate_proj", "up_proj", "down_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
]


def make_adapters(model: str, folder: Path, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i, targets in enumerate(TARGETS):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        peft = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        peft.save_pretrained(str(folder / f"a{i}"))
        out.append(folder / f"a{i}")
    return out


def leg(llm, prompts, params, requests) -> tuple[float, int, float]:
    """(wall seconds, output tokens, this process's CPU seconds: on a shared host the CPU time
    of a one-thread run is less disturbed by the other jobs than the wall clock)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, lora_request=requests)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out")
    args = ap.parse_args()

    from llmctl import LLM, LoRARequest, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    paths = make_adapters(args.model, folder, args.rank)
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    g = torch.Generator().manual_seed(0)  # token ids: any model folder, tokenizer or not
    prompts = [
        torch.randint(5, 1000, (12 + i % 9,), generator=g).tolist() for i in range(args.rows)
    ]
    per_row = [None if i % 5 == 0 else requests[i % 5 - 1] for i in range(args.rows)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    kw = dict(dtype=args.dtype, device="cpu")
    base = LLM(args.model, **kw)
    mixed = LLM(args.model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **kw)
    leg(base, prompts[:4], params, None)  # warm-up: one-time costs out of the timings
    leg(mixed, prompts[:5], params, per_row[:5])
    runs: dict[str, list[float]] = {"base": [], "mixed": [], "base_cpu": [], "mixed_cpu": []}
    for _ in range(args.repeats):
        for name, llm, req in (("base", base, None), ("mixed", mixed, per_row)):
            s, n, cpu = leg(llm, prompts, params, req)
            runs[name].append(n / s)
            runs[name + "_cpu"].append(n / cpu)
    result = {
        "environment": environment(),
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "adapters": 4,
        "base_tok_s": [round(x, 1) for x in runs["base"]],
        "mixed_tok_s": [round(x, 1) for x in runs["mixed"]],
        "ratio_median": round(
            statistics.median(runs["mixed"]) / statistics.median(runs["base"]), 3
        ),
        # each mixed leg against the base leg just before it (the host's load drifts)
        "paired_ratios": [round(m / b, 3) for b, m in zip(runs["base"], runs["mixed"])],
        "base_cpu_tok_s": [round(x, 1) for x in runs["base_cpu"]],
        "mixed_cpu_tok_s": [round(x, 1) for x in runs["mixed_cpu"]],
        "paired_cpu_ratios": [round(m / b, 3) for b, m in zip(runs["base_cpu"], runs["mixed_cpu"])],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
