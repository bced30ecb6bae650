"""What structured outputs cost (issue 37): a JSON-schema extraction job constrained, against the
same rows unconstrained generating the same number of tokens, on a real chat model.

Each constrained row's output length is recorded; the unconstrained leg gives every row exactly
that many tokens (max_tokens = the length, ignore_eos), so both legs compute the same tokens
through the same engine and the ratio of output tokens per second is what the grammar costs
(masks, matcher updates, the end check). Legs alternate in one process after a warm-up. Also
reported: how many rows ended valid, and the compile time of each distinct schema (grammar plus
matcher, cold).

    python benchmarks/bench_structured.py --model $TMPDIR/smollm2-135m-instruct --rows 64 \
        --repeats 3 --out benchmarks/results/structured_zen4.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import environment

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "product": {"type": "string", "maxLength": 40},
            "price": {"type": "number", "minimum": 0},
            "currency": {"enum": ["EUR", "USD", "GBP"]},
        },
        "required": ["product", "price", "currency"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "topics": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "maxItems": 3,
            },
        },
        "required": ["sentiment", "topics"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
            "authors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 40},
                "maxItems": 4,
            },
        },
        "required": ["title", "year", "authors"],
        "additionalProperties": False,
    },
]
TEXTS = [
    "Maria Lopez, 34, moved to Valencia last spring.",
    "The ACME blender costs 89.99 EUR at the store on Main Street.",
    "I loved the battery life but the camera and the screen are poor.",
    "'Deep Learning' by Goodfellow, Bengio and Courville came out in 2016.",
    "John Smith is 61 and lives in Leeds.",
    "A pair of running shoes: 120 USD.",
    "Terrible support, slow shipping, never again.",
    "Darwin's 'On the Origin of Species' was published in 1859.",
]


def rows(n: int) -> list[tuple[list[dict], dict]]:
    out = []
    for i in range(n):
        schema, text = SCHEMAS[i % 4], TEXTS[(i + i // 4) % len(TEXTS)]
        ask = f"Extract the fields of this JSON schema from the text.\nSchema: {json.dumps(schema)}"
        out.append(([{"role": "user", "content": f"{ask}\nText: {text} ({i})"}], schema))
    return out


def compile_times(llm) -> list[float]:
    """Milliseconds per distinct schema, cold: the grammar and one matcher over the tokenizer."""
    from llmctl.engine.grammar import Grammars
    from llmctl.engine.params import SamplingParams
    from llmctl.engine.sequence import Sequence

    grammars = Grammars(
        llm.runtime.tokenizer, llm.runtime.config.vocab_size, llm.engine.eos_token_ids
    )
    grammars.tokenizer  # built once per engine, not per schema
    times = []
    for schema in SCHEMAS:
        seq = Sequence("x", [1], SamplingParams(structured_outputs={"json": schema}), 8)
        t0 = time.perf_counter()
        grammars.start(seq)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from llmctl import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16")
    work = rows(args.rows)
    messages = [m for m, _ in work]
    constrained = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs={"json": s})
        for _, s in work
    ]
    llm.chat(messages[:4], constrained[:4], use_tqdm=False)  # warm-up: both paths, kernels
    first = llm.chat(messages, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in first]
    statuses = [o.outputs[0].structured_output for o in first]
    free = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    legs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    tokens: dict[str, list[int]] = {"constrained": [], "unconstrained": []}
    for _ in range(args.repeats):
        for name, params in (("constrained", constrained), ("unconstrained", free)):
            t0 = time.perf_counter()
            outs = llm.chat(messages, params, use_tqdm=False)
            legs[name].append(time.perf_counter() - t0)
            # bf16 greedy may take another path once the prompts hit the prefix cache, so the
            # constrained leg's lengths can move a little: compare output tokens per second
            tokens[name].append(sum(len(o.outputs[0].token_ids) for o in outs))
    rate = {k: [n / t for n, t in zip(tokens[k], legs[k])] for k in legs}
    ratios = [c / u for c, u in zip(rate["constrained"], rate["unconstrained"])]
    result = {
        "environment": environment(),
        "model": args.model,
        "rows": args.rows,
        "threads": torch.get_num_threads(),
        "output_tokens": sum(lengths),
        "valid": statuses.count("valid"),
        "incomplete": statuses.count("incomplete"),
        "invalid": statuses.count("invalid"),
        "seconds": legs,
        "tokens": tokens,
        "constrained_over_unconstrained_tokens_per_s": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4),
        "compile_ms_per_schema": [round(t, 2) for t in compile_times(llm)],
        "example": first[0].outputs[0].text,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
