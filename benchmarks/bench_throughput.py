"""Offline throughput: llmctl's engine against transformers `generate` with static padded batches.

Workload (issue 2): prompts of 32-512 random tokens, 64-256 output tokens each (ignore_eos), on a
randomly initialised model of a shared/configs shape in bf16. Both run in this process, same threads.
Also the shared-prefix workload: a common 400-token system prompt, prefill time with prefix caching
on against off.

    python benchmarks/bench_throughput.py --config smollm2-135m --num-prompts 256 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import environment, measure_machine, random_model_folder, workload


def run_llmctl(folder, prompts, outs, **engine_kwargs) -> dict:
    from llmctl import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", device="cpu", **engine_kwargs)
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.output_token_ids) for r in results)
    ttft = sorted(r.ttft for r in results)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
            "ttft_p50_s": ttft[len(ttft) // 2], "steps": llm.engine.stats.steps,
            "preemptions": llm.engine.scheduler.num_preemptions}


def run_transformers(folder, prompts, outs, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    pad = 0
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i:i + batch_size], outs[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(want), min_new_tokens=max(want),
                           do_sample=False, pad_token_id=pad)
        n_out += sum(want)  # only the tokens each request asked for count
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "batch_size": batch_size}


def shared_prefix(folder, n: int, vocab: int) -> dict:
    """Prefill time of n prompts = 400-token common prefix + 16-48 own tokens, one output token each."""
    from llmctl import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    system = torch.randint(10, vocab, (400,), generator=g).tolist()
    prompts = [system + torch.randint(10, vocab, (int(torch.randint(16, 49, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    res = {}
    for caching in (False, True):
        llm = LLM(str(folder), dtype="bfloat16", device="cpu", enable_prefix_caching=caching)
        llm.generate([system[:8]], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        res["on" if caching else "off"] = time.perf_counter() - t0
    res["speedup"] = res["off"] / res["on"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--prefix-prompts", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = random_model_folder(args.config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts, outs = workload(args.num_prompts, vocab=vocab)
    report = {"environment": environment(), "machine": measure_machine(), "config": args.config,
              "num_prompts": args.num_prompts, "prompt_tokens": sum(map(len, prompts)), "requested_output_tokens": sum(outs)}
    report["llmctl"] = run_llmctl(folder, prompts, outs, max_num_seqs=args.max_num_seqs, kv_cache_memory=4 * 1024**3)
    print(json.dumps(report["llmctl"]), flush=True)
    if not args.skip_transformers:
        report["transformers"] = run_transformers(folder, prompts, outs, args.hf_batch_size)
        report["speedup_vs_transformers"] = report["llmctl"]["output_tok_s"] / report["transformers"]["output_tok_s"]
        print(json.dumps(report["transformers"]), flush=True)
    if args.prefix_prompts:
        report["shared_prefix_prefill"] = shared_prefix(folder, args.prefix_prompts, vocab)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
