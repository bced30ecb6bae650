"""The KV cache's dtype (issue 38): what an fp8 cache costs in quality and gains in speed against
the bf16 cache, in one run.

quality (the real SmolLM2-135M-Instruct, `python ../shared/tools/real_model.py`): greedy replies
to chat prompts under each cache dtype against the bf16 cache's (token agreement position by
position, and replies identical), and the mean KL(bf16 cache || other) of the next-token
distributions over held-out text (the last 10% of ../shared/data/tinyshakespeare.txt, in windows
of --window tokens, each one prompt whose logits are captured as the engine computes its prompt
logprobs), with each dtype's held-out perplexity. Also, simulated on the bf16 cache (K/V
rounded on write through kernels/kv_dtype.to_cache, the cache then holding the rounded values):
e4m3 with a scale per (token, head) (amax / 448) and int8 with one (amax / 127), for the choice
of scales.

speed (random SmolLM2-135M-shape weights, bf16): a decode-heavy workload through LLM.generate,
the dtypes alternated, --repeats times: once with the default KV memory (each dtype holds every
sequence) and once with --kv-cache-memory MiB, where the bf16 cache holds only part of the batch
and the fp8 cache twice as many tokens.

    python benchmarks/bench_kv_cache_dtype.py quality --model /tmp/smollm2-135m-instruct
    python benchmarks/bench_kv_cache_dtype.py speed --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import environment, random_model_folder, workload  # noqa: E402

from llmctl import LLM, SamplingParams  # noqa: E402
from llmctl.kernels.kv_dtype import to_cache as _REAL_TO_CACHE  # noqa: E402

DTYPES = ("auto", "fp8", "fp8_e5m2", "int8")
CHATS = [
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for sleeping better.",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short poem about the sea.",
    "How do I make a cup of tea?",
    "What are the main differences between cats and dogs as pets?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "List five fruits that are high in vitamin C.",
    "What should I pack for a weekend hiking trip?",
    "How does a bicycle stay upright?",
    "Write a friendly email inviting a colleague to lunch.",
    "What is photosynthesis?",
    "Give me a recipe for a simple pasta dish.",
    "What are some good habits for learning a new language?",
    "Explain the rules of chess briefly.",
]
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Position-by-position agreement of greedy replies, the replies identical, and the mean
    number of tokens before a reply first differs (a reply that differs once goes its own way)."""
    total = sum(map(len, base))
    same = sum(x == y for a, b in zip(base, other) for x, y in zip(a, b))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in
             zip(base, other)]  # fmt: skip
    return {
        "token_agreement": same / total,
        "identical_replies": sum(a == b for a, b in zip(base, other)),
        "replies": len(base),
        "mean_tokens_before_first_difference": statistics.mean(first),
    }


def _scaled(fmt: str):
    """A to_cache that rounds K/V [T, KVH, D] with a scale per (token, head) and back to the
    (bf16) cache's dtype: e4m3 over amax / 448, or int8 over amax / 127."""
    from llmctl.kernels import kv_dtype

    real = kv_dtype.to_cache

    def to_cache(x, dtype):
        if dtype in kv_dtype.FP8:
            return real(x, dtype)
        top = 448.0 if fmt == "e4m3" else 127.0
        scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
        y = x.float() / scale
        y = y.to(torch.float8_e4m3fn).float() if fmt == "e4m3" else y.round().clamp(-127, 127)
        return (y * scale).to(dtype)

    return to_cache


SIMULATED = {"sim_e4m3_per_token_head": "e4m3", "sim_int8_per_token_head": "int8"}


def _engine(model: str, kv: str, **kw) -> LLM:
    """An engine with cache dtype `kv`, or for a SIMULATED name the bf16 cache holding rounded
    values (the patch stays for the engine's life: the callers use one engine at a time)."""
    from llmctl.kernels import attention, attention_features

    fmt = SIMULATED.get(kv)
    for module in (attention, attention_features):
        module.to_cache = _scaled(fmt) if fmt else _REAL_TO_CACHE
    return LLM(model, dtype="bfloat16", kv_cache_dtype="auto" if fmt else kv, **kw)


def chat_replies(model: str, kv: str, max_tokens: int) -> list[list[int]]:
    """Greedy replies to CHATS, all in one batch; "alone": the bf16 cache, one chat at a time
    (other batch shapes: the bf16 engine's own noise floor, as it is not batch-invariant)."""
    llm = _engine(model, "auto" if kv == "alone" else kv)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    if kv == "alone":
        return [list(llm.chat([c], params)[0].outputs[0].token_ids) for c in chats]
    return [list(o.outputs[0].token_ids) for o in llm.chat(chats, params)]


def heldout_logits(model: str, kv: str, windows: list[list[int]]) -> list[torch.Tensor]:
    """Per window, the float32 next-token logits of every prompt position [n - 1, V], captured
    from the engine's prompt-logprob projection (the positions attend over the cache's K/V)."""
    llm = _engine(model, kv, enable_prefix_caching=False)
    runner, got = llm.engine.runner, []
    project = runner.project

    def keep(hidden):
        logits = project(hidden)
        got.append(logits.float().cpu())
        return logits

    runner.project = keep
    out = []
    for w in windows:
        got.clear()
        llm.generate([w], SamplingParams(max_tokens=1, prompt_logprobs=1))
        out.append(torch.cat(got))
    return out


def quality(args) -> dict:
    tok = LLM(args.model, dtype="bfloat16").get_tokenizer()
    text = SHAKESPEARE.read_text()
    ids = tok.encode(text[int(len(text) * 0.9) :])
    windows = [ids[i : i + args.window] for i in range(0, args.windows * args.window, args.window)]
    names = (*DTYPES, *SIMULATED)
    replies = {kv: chat_replies(args.model, kv, args.max_tokens) for kv in (*names, "alone")}
    logits = {kv: heldout_logits(args.model, kv, windows) for kv in names}
    report = {"bf16_alone": agreement(replies["auto"], replies["alone"])}
    for kv in names:
        kls, nll, n = [], 0.0, 0
        for base, other, w in zip(logits["auto"], logits[kv], windows):
            p, q = base.log_softmax(-1), other.log_softmax(-1)
            kls.append((p.exp() * (p - q)).sum(-1))
            targets = torch.tensor(w[1 : 1 + q.shape[0]])
            nll -= q[torch.arange(len(targets)), targets].sum().item()
            n += len(targets)
        report[kv] = {
            **agreement(replies["auto"], replies[kv]),
            "mean_kl": torch.cat(kls).mean().item(),
            "heldout_ppl": math.exp(nll / n),
            "heldout_tokens": n,
        }
    return report


def speed(args) -> dict:
    torch.set_num_threads(args.threads)
    folder = random_model_folder("smollm2-135m")
    prompts, outs = workload(
        args.num_prompts, tuple(args.prompt_range), output_range=tuple(args.output_range),
        vocab=49152,
    )  # fmt: skip
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    report = {"prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs)}
    for label, memory in (("default_kv", None), (f"kv_{args.kv_mib}mib", args.kv_mib << 20)):
        seconds: dict[str, list[float]] = {kv: [] for kv in ("auto", "fp8", "int8")}
        engines = {
            kv: LLM(str(folder), dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory=memory)
            for kv in seconds
        }
        for llm in engines.values():  # warm-up
            llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))
        for _ in range(args.repeats):
            for kv, llm in engines.items():
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                seconds[kv].append(time.perf_counter() - t0)
                print(label, kv, f"{seconds[kv][-1]:.1f} s", flush=True)
        report[label] = {
            "kv_cache_memory": memory,
            "seconds": seconds,
            "kv_tokens": {
                kv: e.engine.runner.num_blocks * e.engine.runner.block_size
                for kv, e in engines.items()
            },  # fmt: skip
            "preemptions": {kv: e.engine.scheduler.num_preemptions for kv, e in engines.items()},
            "paired_fp8_over_bf16": [b / f for b, f in zip(seconds["auto"], seconds["fp8"])],
            "median_fp8_over_bf16": statistics.median(seconds["auto"])
            / statistics.median(seconds["fp8"]),
        }
        del engines
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--model", default="/tmp/smollm2-135m-instruct")
    q.add_argument("--max-tokens", type=int, default=96)
    q.add_argument("--window", type=int, default=512)
    q.add_argument("--windows", type=int, default=8)
    s = sub.add_parser("speed")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--prompt-range", type=int, nargs=2, default=(200, 600))
    s.add_argument("--output-range", type=int, nargs=2, default=(300, 500))
    s.add_argument("--kv-mib", type=int, default=256, help="the constrained run's KV memory")
    s.add_argument("--dtype", default="bfloat16", help="the model's (auto cache: the same)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"environment": environment(), args.what: (quality if args.what == "quality"
                                                        else speed)(args)}  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
