"""Speculative decoding on the CPU through llmctl's engine: a distilled draft model and n-gram
prompt lookup, each against plain decoding, greedy, on tinyshakespeare-5m (6 layers).

1. One request at a time (prompts of held-out tinyshakespeare.txt): decode tokens/s after the first
   token, TTFT, acceptance rate and speedup of a draft (benchmarks/make_draft.py, built and cached
   under /tmp/llmctl-bench when missing) for each K in --ks.
2. N-gram lookup on a copy workload (a passage twice, then its first words again), K in --ngram-ks.
3. Crossover: aggregate output tokens/s at each batch size in --batch-sizes, speculation always on
   (speculative_max_batch=None), K = --crossover-k; the crossover is the first batch size at which
   speculation is no faster than plain decoding.
Greedy outputs with and without speculation must be identical (asserted): exactly in float32; in
bfloat16 a request may diverge only at a near-tie of the target (see GreedyCheck): verification
tokens attend as decode rows, but their linears run K+1 rows per sequence, which a batch's row
count can send to another kernel than a one-token decode step's.

    nice -n 19 python benchmarks/bench_speculative.py --dtype bfloat16 --threads 1 --json
    spec-bf16.json nice -n 19 python benchmarks/bench_speculative.py --dtype float32 --threads 1
    --json spec-fp32.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from common import environment
from make_draft import TARGET, TEXT, ensure_draft

from llmctl.engine.config import AUTO_SPEC_MAX_BATCH, EngineConfig
from llmctl.engine.params import SamplingParams
from llmctl.runtime.loader import load_runtime
from llmctl.runtime.weights import load_model


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def held_out_text() -> str:
    text = TEXT.read_text()
    return text[int(0.9 * len(text)) :]  # make_draft trains on the first 90%


def text_prompts(rt, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` tokens from seeded offsets of the held-out text."""
    ids = rt.encode(held_out_text())
    g = torch.Generator().manual_seed(seed)
    return [
        ids[s : s + length] for s in torch.randint(0, len(ids) - length, (n,), generator=g).tolist()
    ]


def copy_prompts(rt, n: int, chars: int, words: int = 3, seed: int = 1) -> list[list[int]]:
    """n prompts 'P\\n\\nP\\n\\n' + the first `words` words of P, P a held-out passage of whole
    lines."""
    text = held_out_text()
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in torch.randint(0, len(text) - 2 * chars, (n,), generator=g).tolist():
        start = text.index("\n", s) + 1
        passage = text[start : text.index("\n", start + chars)]
        out.append(rt.encode(f"{passage}\n\n{passage}\n\n" + " ".join(passage.split(" ")[:words])))
    return out


class Engines:
    """One runtime per (method, K), loaded on first use; prefix caching off so repeats recompute."""

    def __init__(self, args, draft: Path):
        self.args, self.draft, self.cache = args, draft, {}
        self.runtime = None  # the target's runtime of the latest load (tokenizer for prompts)

    def __call__(self, method: str | None, k: int = 4):
        if (method, k) not in self.cache:
            cfg = EngineConfig(
                speculative=method,
                draft_model=str(self.draft) if method == "draft" else None,
                num_speculative_tokens=k,
                speculative_max_batch=None,
                enable_prefix_caching=False,
                max_num_seqs=max(self.args.batch_sizes),
            )
            self.runtime = load_runtime(self.args.target, dtype=self.args.dtype, device="cpu")
            engine = self.runtime.start_engine(cfg)
            generate(engine, [[5, 6, 7, 8]], 8)  # warm-up
            self.cache[method, k] = engine
        return self.cache[method, k]


def generate(engine, prompts: list[list[int]], max_tokens: int):
    """All prompts at once, greedy; returns (outputs in order, wall seconds)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))], time.perf_counter() - t0


def spec_stats(before, after) -> dict:
    proposed, accepted = (
        after.spec_proposed - before.spec_proposed,
        after.spec_accepted - before.spec_accepted,
    )
    return {
        "spec_proposed": proposed,
        "spec_accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "tokens_per_step": (after.output_tokens - before.output_tokens)
        / max(1, after.steps - before.steps),
    }


def single(engine, prompts, max_tokens: int, repeats: int):
    """One request at a time. Returns (medians over repeats, output token ids of the last
    repeat)."""
    before = copy.copy(engine.stats)
    rates, ttfts = [], []
    for _ in range(repeats):
        outs = [generate(engine, [p], max_tokens)[0][0] for p in prompts]
        rates.append(
            sum(len(o.output_token_ids) - 1 for o in outs)
            / sum(o.finish_time - o.first_token_time for o in outs)
        )
        ttfts += [o.ttft for o in outs]
    res = {
        "decode_tok_s": statistics.median(rates),
        "ttft_ms": 1e3 * statistics.median(ttfts),
        **spec_stats(before, engine.stats),
    }
    return res, [o.output_token_ids for o in outs]


def batched(engine, prompts, max_tokens: int, repeats: int):
    """All prompts as one batch. Returns (median aggregate output tokens/s, output token ids)."""
    before = copy.copy(engine.stats)
    rates = []
    for _ in range(repeats):
        outs, dt = generate(engine, prompts, max_tokens)
        rates.append(sum(len(o.output_token_ids) for o in outs) / dt)
    return {"output_tok_s": statistics.median(rates), **spec_stats(before, engine.stats)}, [
        o.output_token_ids for o in outs
    ]


class GreedyCheck:
    """Greedy outputs with speculation against plain decoding. float32: identical. bfloat16: a
    request may diverge only where the target's two candidates are a near-tie (float32 logits within
    --tie-tol), since verifying K+1 positions in one chunk rounds differently from one-token decode
    steps."""

    def __init__(self, args):
        self.args, self.ref, self.results = args, None, {}

    def gap(self, prompt: list[int], want: list[int], got: list[int]) -> float:
        if self.ref is None:
            self.ref = load_model(Path(self.args.target), "float32", "cpu")[0]
        j = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
        with torch.inference_mode():
            logits = self.ref.forward_dense(torch.tensor([prompt + want[:j]]))[0, -1]
        return abs(float(logits[want[j]] - logits[got[j]]))

    def __call__(self, name: str, prompts, got, want) -> None:
        gaps = [round(self.gap(p, w, g), 5) for p, w, g in zip(prompts, want, got) if w != g]
        exact = self.args.dtype == "float32"
        ok = not gaps if exact else all(x <= self.args.tie_tol for x in gaps)
        self.results[name] = {
            "requests": len(got),
            "identical": len(got) - len(gaps),
            "divergence_fp32_logit_gaps": gaps,
        }
        why = "" if not gaps else f"; the others diverge at near-ties, float32 logit gaps {gaps}"
        print(
            f"  greedy check ({name}): {len(got) - len(gaps)}/{len(got)} identical to plain "
            f"decoding{why}",
            flush=True,
        )
        assert ok, (
            f"{name}: speculative greedy output differs from plain decoding beyond a near-tie: "
            f"{gaps}"
        )


def single_section(engines, method: str, ks, prompts, args, check) -> dict:
    base, want = single(engines(None), prompts, args.max_tokens, args.repeats)
    rows = {"off": base}
    print(
        f"  {'off':>10}  decode {base['decode_tok_s']:7.1f} tok/s  TTFT {base['ttft_ms']:6.1f} ms",
        flush=True,
    )
    for k in ks:
        res, got = single(engines(method, k), prompts, args.max_tokens, args.repeats)
        res["speedup"] = res["decode_tok_s"] / base["decode_tok_s"]
        rows[f"{method}_k{k}"] = res
        print(
            f"  {method + ' K=' + str(k):>10}  decode {res['decode_tok_s']:7.1f} tok/s  TTFT "
            f"{res['ttft_ms']:6.1f} ms  "
            f"acceptance {res['acceptance_rate']:.3f} "
            f"({res['spec_accepted']}/{res['spec_proposed']})  "
            f"tokens/step {res['tokens_per_step']:.2f}  speedup {res['speedup']:.2f}x",
            flush=True,
        )
        check(f"single {method} K={k}", prompts, got, want)
    return rows


def crossover_section(engines, workloads: dict, args, check) -> dict:
    """workloads: method -> prompts. Aggregate tok/s per batch size, off against each method."""
    k, out = args.crossover_k, {}
    for method, prompts in workloads.items():
        rows = []
        for b in args.batch_sizes:
            off, want = batched(engines(None), prompts[:b], args.max_tokens, args.repeats)
            spec, got = batched(engines(method, k), prompts[:b], args.max_tokens, args.repeats)
            check(f"batch {b} {method} K={k}", prompts[:b], got, want)
            rows.append(
                {
                    "batch": b,
                    "off_tok_s": off["output_tok_s"],
                    "spec_tok_s": spec["output_tok_s"],
                    "speedup": spec["output_tok_s"] / off["output_tok_s"],
                    "acceptance_rate": spec["acceptance_rate"],
                }
            )
        out[method] = {"k": k, "rows": rows, **crossover(rows)}
    print_crossover(out)
    return out


def crossover(rows: list[dict]) -> dict:
    """First batch size where speculation is no faster, and the largest one below it where it
    pays."""
    slow = next((r["batch"] for r in rows if r["speedup"] <= 1.0), None)
    pays = [r["batch"] for r in rows if slow is None or r["batch"] < slow]
    return {"crossover_batch": slow, "pays_up_to_batch": max(pays, default=0)}


def print_crossover(out: dict) -> None:
    for method, res in out.items():
        print(f"\n  {method} K={res['k']}: aggregate output tokens/s")
        print(f"  {'batch':>5} {'off':>9} {method:>9} {'speedup':>8} {'accept':>7}")
        for r in res["rows"]:
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            print(
                f"  {r['batch']:>5} {r['off_tok_s']:9.1f} {r['spec_tok_s']:9.1f} "
                f"{r['speedup']:7.2f}x {acc:>7}"
            )
        print(
            f"  {method}: speculation pays up to batch {res['pays_up_to_batch']} (0: not even "
            "alone); "
            f"crossover (first batch where it does not) {res['crossover_batch']}",
            flush=True,
        )
    auto = {m: r["pays_up_to_batch"] for m, r in out.items()}
    print(
        f"\n  measured AUTO_SPEC_MAX_BATCH (largest batch where speculation pays): {auto}; "
        f"llmctl/engine/config.py has {AUTO_SPEC_MAX_BATCH}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default=str(TARGET))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--draft",
        default=None,
        help="draft model folder; default: make_draft's, built when missing",
    )
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per text prompt")
    ap.add_argument(
        "--copy-chars", type=int, default=200, help="characters of the passage in copy prompts"
    )
    ap.add_argument(
        "--num-prompts", type=int, default=4, help="requests per single-request measurement"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="measurements per point; the median is reported"
    )
    ap.add_argument("--ks", type=ints, default=[2, 4, 6], help="K for the draft model")
    ap.add_argument("--ngram-ks", type=ints, default=[2, 4])
    ap.add_argument("--batch-sizes", type=ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--crossover-k", type=int, default=4)
    ap.add_argument(
        "--tie-tol",
        type=float,
        default=0.1,
        help="bfloat16 only: largest float32 logit gap at which a greedy divergence counts as a "
        "tie",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft = Path(args.draft) if args.draft else ensure_draft(args.draft_layers)
    draft_info = (
        json.loads((draft / "draft_report.json").read_text())
        if (draft / "draft_report.json").is_file()
        else {}
    )
    engines = Engines(args, draft)
    engines(None)
    rt = engines.runtime
    n = max(args.num_prompts, max(args.batch_sizes))
    texts, copies = text_prompts(rt, n, args.prompt_len), copy_prompts(rt, n, args.copy_chars)
    report = {
        "environment": environment(),
        "args": vars(args),
        "draft": str(draft),
        "draft_agreement": {
            k: draft_info.get(k)
            for k in ("before", "after", "steps", "train_seconds", "train_cpu_seconds")
        },
        "auto_spec_max_batch_now": AUTO_SPEC_MAX_BATCH,
    }
    check = GreedyCheck(args)
    print(f"target {args.target} ({args.dtype}, {args.threads} threads), draft {draft}", flush=True)
    print(
        f"\n1. one request at a time, draft model, {args.max_tokens} new tokens, "
        f"{args.num_prompts} prompts",
        flush=True,
    )
    report["single_draft"] = single_section(
        engines, "draft", args.ks, texts[: args.num_prompts], args, check
    )
    print("\n2. one request at a time, n-gram lookup on copy prompts", flush=True)
    report["single_ngram_copy"] = single_section(
        engines, "ngram", args.ngram_ks, copies[: args.num_prompts], args, check
    )
    print(
        "\n3. crossover (draft on text prompts, n-gram on copy prompts), "
        "speculative_max_batch=None",
        flush=True,
    )
    report["crossover"] = crossover_section(engines, {"draft": texts, "ngram": copies}, args, check)
    report["greedy_check"] = check.results
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
