"""Offline throughput: llmctl's engine against transformers `generate` with static padded batches.

Workload (issue 2): prompts of 32-512 random tokens, 64-256 output tokens each (ignore_eos), on a
randomly initialised model of a shared/configs shape in bf16 (--dtype float32 on CPUs without
native bf16, where bf16 matmuls run several times slower than fp32). Both run in this process, same
threads, on the same device (--device cpu, the default, or cuda). Also the shared-prefix workload: a
common 400-token system prompt, prefill time with prefix caching on against off.

    python benchmarks/bench_throughput.py --config smollm2-135m --num-prompts 256 --threads 2
    python benchmarks/bench_throughput.py --config path/to/config.json --device cuda
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from common import environment, measure_machine, random_model_folder, workload


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def model_folder(config: str) -> Path:
    """random_model_folder for a shared/configs NAME, or for a path to a config.json (cached by
    content)."""
    path = Path(config)
    if not (config.endswith(".json") and path.is_file()):
        return random_model_folder(config)
    import transformers

    text = path.read_text()
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    out = (
        Path(os.environ.get("LLMCTL_BENCH_CACHE", "/tmp/llmctl-bench"))
        / f"{path.stem}-{key}-bfloat16-0"
    )
    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads(text)
    cfg.pop("torch_dtype", None)
    hf_config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).save_pretrained(
        out, safe_serialization=True
    )
    return out


def run_llmctl(
    folder, prompts, outs, device: str = "cpu", dtype: str = "bfloat16", **engine_kwargs
) -> dict:
    from llmctl import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, device=device, **engine_kwargs)
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    _sync(device)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.output_token_ids) for r in results)
    ttft = sorted(r.ttft for r in results)
    return {
        "seconds": dt,
        "output_tokens": n_out,
        "output_tok_s": n_out / dt,
        "ttft_p50_s": ttft[len(ttft) // 2],
        "steps": llm.engine.stats.steps,
        "preemptions": llm.engine.scheduler.num_preemptions,
    }


def run_transformers(
    folder, prompts, outs, batch_size: int, device: str = "cpu", dtype: str = "bfloat16"
) -> dict:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
        .to(device)
        .eval()
    )
    model.generation_config.eos_token_id = None
    pad = 0
    if device != "cpu":  # warm-up (CUDA context, kernels), as run_llmctl does
        with torch.inference_mode():
            warm = torch.tensor([prompts[0][:16]], device=device)
            model.generate(
                warm,
                attention_mask=torch.ones_like(warm),
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=pad,
            )
    _sync(device)
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i : i + batch_size], outs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor(
            [[pad] * (width - len(p)) + p for p in batch], device=device
        )  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(want),
                min_new_tokens=max(want),
                do_sample=False,
                pad_token_id=pad,
            )
        n_out += sum(want)  # only the tokens each request asked for count
    _sync(device)
    dt = time.perf_counter() - t0
    return {
        "seconds": dt,
        "output_tokens": n_out,
        "output_tok_s": n_out / dt,
        "batch_size": batch_size,
    }


def shared_prefix(folder, n: int, vocab: int, device: str = "cpu", dtype: str = "bfloat16") -> dict:
    """Prefill time of n prompts = 400-token common prefix + 16-48 own tokens, one output token
    each."""
    from llmctl import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    system = torch.randint(10, vocab, (400,), generator=g).tolist()
    prompts = [
        system
        + torch.randint(
            10, vocab, (int(torch.randint(16, 49, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    res = {}
    for caching in (False, True):
        llm = LLM(str(folder), dtype=dtype, device=device, enable_prefix_caching=caching)
        llm.generate([system[:8]], SamplingParams(max_tokens=1))
        _sync(device)
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        _sync(device)
        res["on" if caching else "off"] = time.perf_counter() - t0
    res["speedup"] = res["off"] / res["on"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default="smollm2-135m", help="a shared/configs name, or a path to a config.json"
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where both engines run (default: cpu)",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--prefix-prompts", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    folder = model_folder(args.config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts, outs = workload(args.num_prompts, vocab=vocab)
    # machine: this CPU's peaks (skipped with --device cuda, where they say nothing about the run)
    report = {
        "environment": environment(),
        "machine": measure_machine(args.dtype) if args.device == "cpu" else None,
        "config": args.config,
        "device": args.device,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "prompt_tokens": sum(map(len, prompts)),
        "requested_output_tokens": sum(outs),
    }
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    report["llmctl"] = run_llmctl(
        folder,
        prompts,
        outs,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=4 * 1024**3,
    )
    print(json.dumps(report["llmctl"]), flush=True)
    if not args.skip_transformers:
        report["transformers"] = run_transformers(
            folder, prompts, outs, args.hf_batch_size, args.device, args.dtype
        )
        report["speedup_vs_transformers"] = (
            report["llmctl"]["output_tok_s"] / report["transformers"]["output_tok_s"]
        )
        print(json.dumps(report["transformers"]), flush=True)
    if args.prefix_prompts:
        report["shared_prefix_prefill"] = shared_prefix(
            folder, args.prefix_prompts, vocab, args.device, args.dtype
        )
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
