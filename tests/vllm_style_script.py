"""A vLLM-style offline script, run unchanged against vLLM and llmctl (tests/test_vllm_compat.py).

Usage: python vllm_style_script.py vllm|llmctl MODEL OUT.json. Only the module that provides
`LLM` and `SamplingParams` differs; everything below is plain vLLM API use.
"""

from __future__ import annotations

import importlib
import json
import sys


def logprob_values(positions):
    """[{token id: logprob}] per position, JSON-ready (None stays None)."""
    if positions is None:
        return None
    return [None if p is None else {str(t): lp.logprob for t, lp in p.items()} for p in positions]


def record(out) -> dict:
    return {
        "prompt_token_ids": list(out.prompt_token_ids),
        "prompt_logprobs": logprob_values(out.prompt_logprobs),
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "logprobs": logprob_values(c.logprobs),
            }
            for c in out.outputs
        ],
    }


def main(backend: str, model: str, out_path: str) -> None:
    api = importlib.import_module(backend)
    LLM, SamplingParams = api.LLM, api.SamplingParams
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        seed=0,
    )
    greedy = SamplingParams(
        temperature=0.0, top_k=-1, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )
    prompts = ["ROMEO:", {"prompt_token_ids": [61, 62, 63, 64, 27]}, {"prompt": "JULIET:"}]
    results = llm.generate(prompts, sampling_params=greedy, use_tqdm=False)
    several = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=4, stop=["\n\n"])
    results += llm.generate("First Citizen:", several, use_tqdm=False)
    conversation = [{"role": "user", "content": "Who art thou?"}]
    results += llm.chat(conversation, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump([record(r) for r in results], f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
