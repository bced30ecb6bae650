"""Acceptance benchmark of `llmctl distill` (issue 15), on the CPU.

Teacher ../shared/models/tinyshakespeare-5m (6 layers); two 2-layer students taken from its layers
(--student-layers 2, first and last kept), trained for the same steps on the first 90% of
../shared/data/tinyshakespeare.txt (split by characters, as benchmarks/make_draft.py does): one with
the default loss, one with cross-entropy only (--alpha-ce 1). Held-out perplexity on the last 10%
(runtime.evaluate, non-overlapping windows of --seq-len, through distill's --eval-data) for both
and for the teacher; training tokens/s of each run. Then each student as --draft for the teacher
(the engine run-batch uses, greedy, one request at a time, prompts from the held-out text): greedy
outputs must equal those without a draft (asserted), acceptance rate and decode speedup, beside
the n-gram proposer.

    nice -n 19 python benchmarks/bench_distill.py --steps 150 --json benchmarks/results/distill.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from bench_speculative import Engines, single, text_prompts
from common import environment
from make_draft import TARGET, TEXT

from llmctl.cli import main


def split_text(folder: Path) -> tuple[Path, Path]:
    text = TEXT.read_text()
    cut = int(0.9 * len(text))
    train, held = folder / "train.txt", folder / "held.txt"
    train.write_text(text[:cut])
    held.write_text(text[cut:])
    return train, held


def distill(out: Path, train: Path, held: Path, args, *extra: str) -> dict:
    report = out.parent / f"{out.name}.json"
    argv = [
        "distill", "--teacher", str(TARGET), "-o", str(out), "--data", str(train),
        "--eval-data", str(held), "--student-layers", "2", "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
        "--dtype", "float32", "--device", "cpu", "-q", "--report-json", str(report), *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    assert main(argv) == 0, argv
    r = json.loads(report.read_text())
    e = r["final_eval"]
    print(
        f"  {out.name}: held-out ppl {e['perplexity']:.3f} (teacher "
        f"{e['teacher_perplexity']:.3f}), KL {e['kl_teacher_student']:.4f}, "
        f"{r['tokens_per_s']:.0f} tok/s, {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return {
        "command": "llmctl " + " ".join(argv),
        "final_eval": r["final_eval"],
        "tokens_per_s": r["tokens_per_s"],
        "wall_time_s": r["wall_time_s"],
        "final_loss": r["final_loss"],
        "loss_every_10_steps": [h["loss"] for h in r["history"][::10]],
    }


def speculative(students: dict[str, Path], args) -> dict:
    """Single-request decode with each student as draft, and with n-gram lookup, against no
    speculation."""
    spec_args = argparse.Namespace(target=str(TARGET), dtype="float32", batch_sizes=[1])
    rt_engines = {name: Engines(spec_args, path) for name, path in students.items()}
    first = next(iter(rt_engines.values()))
    prompts = text_prompts(_runtime(), args.prompts, 32)
    base, want = single(first(None), prompts, args.max_tokens, args.repeats)
    rows = {"off": base}
    for name, engines in [("ngram", first)] + list(rt_engines.items()):
        method = "ngram" if name == "ngram" else "draft"
        res, got = single(engines(method, args.k), prompts, args.max_tokens, args.repeats)
        assert got == want, f"{name}: greedy output with speculation differs from plain decoding"
        res["speedup"] = res["decode_tok_s"] / base["decode_tok_s"]
        res["greedy_identical"] = True
        rows[name] = res
        print(
            f"  {name:>12}: acceptance {res['acceptance_rate'] or 0:.3f}, decode "
            f"{res['decode_tok_s']:.1f} tok/s "
            f"({res['speedup']:.2f}x of {base['decode_tok_s']:.1f})",
            flush=True,
        )
    return rows


def _runtime():
    from llmctl.runtime.loader import load_runtime

    return load_runtime(str(TARGET), dtype="float32", device="cpu")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="single-request prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    p.add_argument("--extra", default="", help="extra distill flags for the default-loss run")
    p.add_argument("--skip-spec", action="store_true")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def run() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        folder = Path(tmp)
        train, held = split_text(folder)
        print(f"distill: {args.steps} steps x {args.batch_size} x {args.seq_len}", flush=True)
        runs = {
            "distilled": distill(folder / "distilled", train, held, args, *args.extra.split()),
            "ce_only": distill(folder / "ce_only", train, held, args, "--alpha-ce", "1"),
        }
        teacher_ppl = runs["distilled"]["final_eval"]["teacher_perplexity"]
        ppl = {k: r["final_eval"]["perplexity"] for k, r in runs.items()}
        better = ppl["distilled"] < ppl["ce_only"]
        print(f"  distilled below CE-only: {better}", flush=True)
        spec = None
        if not args.skip_spec:
            spec = speculative({k: folder / k for k in runs}, args)
    doc = {
        "benchmark": "bench_distill",
        "teacher": str(TARGET),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "teacher_heldout_perplexity": teacher_ppl,
        "runs": runs,
        "distilled_below_ce_only": better,
        "speculative_single_request": spec,
        "environment": environment(),
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    run()
