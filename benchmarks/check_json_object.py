"""`json_object` rows on a real chat model, llmctl against vLLM (issue 37): how many of the same
rows end as one complete JSON object, per prompt phrasing and repetition penalty, greedy.

Run it once with llmctl's Python and once with vLLM's (the same script; `--engine` picks the
`LLM` class, both take vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(
json_object=True))`):

    python benchmarks/check_json_object.py --model $TMPDIR/smollm2-135m-instruct \
        --out benchmarks/results/json_object_llmctl.json
    /work/venvs/vllm/bin/python benchmarks/check_json_object.py --engine vllm \
        --model $TMPDIR/smollm2-135m-instruct --out benchmarks/results/json_object_vllm.json

What the rows measure is the model: both engines enforce the grammar, so a row either ends as a
valid object or is cut off by `max_tokens` while the model repeats itself (llmctl reports such a
row `structured_output_incomplete`). Prints one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import TEXTS  # noqa: E402

# name -> (system message or None, the user message with {t} for the text)
PHRASINGS = {
    "describe": (None, "Describe as a JSON object: {t}"),
    "flat": (None, "Extract the key facts of this text as a flat JSON object: {t}"),
    "keys": (None, "Return a JSON object whose keys are the facts in this text: {t}"),
    "system": ("Reply with one flat JSON object of the facts in the user's text.", "{t}"),
}


def messages(phrasing: tuple, text: str) -> list[dict]:
    system, user = phrasing
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": user.format(t=text)}]


def engine(name: str, model: str):
    """(llm, SamplingParams, StructuredOutputsParams) of llmctl or vLLM."""
    if name == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048)
        return llm, SamplingParams, StructuredOutputsParams
    from llmctl import LLM, SamplingParams, StructuredOutputsParams

    return LLM(model=model, dtype="bfloat16"), SamplingParams, StructuredOutputsParams


def complete(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=["llmctl", "vllm"], default="llmctl")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--penalties", default="1.0,1.1")
    p.add_argument("--out")
    args = p.parse_args()
    llm, SP, SOP = engine(args.engine, args.model)
    cells = []
    for penalty in [float(x) for x in args.penalties.split(",")]:
        for name, phrase in PHRASINGS.items():
            sp = SP(temperature=0, max_tokens=args.max_tokens, repetition_penalty=penalty,
                    structured_outputs=SOP(json_object=True))  # fmt: skip
            outs = llm.chat([messages(phrase, t) for t in TEXTS], sp)
            texts = [o.outputs[0].text for o in outs]
            cell = {"phrasing": name, "repetition_penalty": penalty, "rows": len(texts),
                    "complete": sum(map(complete, texts)),
                    "tokens": [len(o.outputs[0].token_ids) for o in outs]}  # fmt: skip
            print(f"{args.engine} {name:9s} penalty {penalty}: {cell['complete']}/{cell['rows']} "
                  f"complete, tokens {cell['tokens']}", flush=True)  # fmt: skip
            cells.append(cell)
    result = {"engine": args.engine, "model": args.model, "max_tokens": args.max_tokens}
    result["cells"] = cells
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
