"""Quantization quality (issue 17): held-out perplexity of RTN, GPTQ and AWQ against fp32.

Every run goes through the code `llmctl quantize` runs (llmctl.compress.driver.calibrate_layers
with the method objects of llmctl.compress.quant.layer_methods, on the decoder linears, in
float32 on the CPU), in process, on a fresh copy of the fp32 model, so the table costs one model
load per model. Scales are rounded to float32, the dtype `llmctl quantize` stores for a float32
checkpoint. Data: tinyshakespeare.txt tokenized with the model's tokenizer; calibration = 64
sequences of 256 tokens from the first 90% of the characters (the sequences `llmctl quantize --calib
<first 90%> --num-samples 64 --seq-len 256` draws), held-out = the last 10%, scored as
`llmctl eval --seq-len 256` scores it (windows of 256, stride 128).

A configuration is METHOD[:key=value,...]; keys are the keyword arguments of gptq_method,
rtn_method or AwqMethod (e.g. gptq:act_order=1, rtn:mse=0, awq:duo=1) plus `sym` (0/1,
the spec's symmetry; default: the method's, as QuantizeArgs.resolve picks it). Losses are
perplexity over fp32; ratios are to the RTN runs of the same bits and group: plain min/max RTN
(`rtn:mse=0`, the issue's baseline) and RTN's default (MSE ranges). Also reported per run: the
mean relative output error of the linears on their calibration inputs, and the fraction of codes
at either end of the range.

    python benchmarks/train_fixture.py   # the second model, /tmp/llmctl-bench/ts-llama-4l256
    python benchmarks/bench_quant_quality.py --json benchmarks/results/quant_quality.json
    python benchmarks/bench_quant_quality.py --bits 4 --groups 64 --configs rtn gptq:act_order=1
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED, environment  # noqa: E402
from quality_llmc import run_llmc  # noqa: E402

TEXT = SHARED / "data" / "tinyshakespeare.txt"
DEFAULT_MODELS = [
    SHARED / "models" / "tinyshakespeare-5m",
    Path("/tmp/llmctl-bench/ts-llama-4l256"),
]
DEFAULT_CONFIGS = ["rtn:mse=0", "rtn", "gptq", "awq"]
NOISE_PPL = 0.05  # perplexity: 8-bit runs land within 0.005 of fp32, i.e. noise
COMMANDS = [  # how benchmarks/results/quant_quality.json was made (q17b.json: see its args)
    "python benchmarks/train_fixture.py",
    "python benchmarks/bench_quant_quality.py --models MODEL --json m.json  (per model)",
    "python benchmarks/bench_quant_quality.py --merge m1.json m2.json --json OUT",
]


def parse_config(text: str) -> tuple[str, dict]:
    """Parse "gptq:act_order=0,mse=1" -> ("gptq", {"act_order": False, "mse": True}); numbers stay
    numbers."""
    method, _, rest = text.partition(":")
    kw: dict = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if v in ("0", "1"):
            kw[k] = bool(int(v))
        else:
            try:
                kw[k] = float(v) if "." in v else int(v)
            except ValueError:
                kw[k] = v  # a name, e.g. llmc:observer=mse
    return method, kw


def make_method(method: str, kw: dict, bits: int, group: int | None):
    from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method, rtn_method
    from llmctl.runtime.formats.spec import QuantSpec

    kw = dict(kw)
    sym = kw.pop("sym", method != "awq")
    spec = QuantSpec(bits, group, bool(sym), torch.float32)
    factory = {"gptq": gptq_method, "rtn": rtn_method, "awq": AwqMethod}[method]
    return factory(spec, **kw)


def data(
    model_dir: Path, num_samples: int, seq_len: int, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration ids [num_samples, seq_len], held-out ids [n]) as `llmctl quantize` draws
    them from the training text with its first `offset` tokens dropped (another draw of
    windows from the same text)."""
    from llmctl.compress.calib_data import load_calibration
    from llmctl.models.config import ModelConfig
    from llmctl.runtime.tokenizer import load_tokenizer, read_generation_eos

    tok = load_tokenizer(model_dir)
    text = TEXT.read_text()
    cut = int(len(text) * 0.9)  # characters, as the fixture's train_report.json splits them
    train, held = list(tok.encode(text[:cut]))[offset:], list(tok.encode(text[cut:]))
    cache = Path("/tmp/llmctl-bench")
    cache.mkdir(parents=True, exist_ok=True)
    calib = cache / f"{model_dir.name}-calib{offset or ''}.jsonl"
    rest = cache / f"{model_dir.name}-held.jsonl"
    calib.write_text(json.dumps({"prompt_token_ids": train}) + "\n")
    rest.write_text(json.dumps({"prompt_token_ids": held}) + "\n")
    eos = read_generation_eos(model_dir, ModelConfig.from_file(model_dir / "config.json"))
    cs = load_calibration(
        calib,
        None,
        num_samples=num_samples,
        seq_len=seq_len,
        eval_data=rest,
        separator=eos[0] if eos else None,
    )
    return cs.input_ids, torch.tensor(held)


def run_one(rt, calib, held, method, seq_len: int) -> tuple[float, float, float, float]:
    """(held-out perplexity, seconds of calibration + quantization, mean relative output error of
    the linears on their calibration inputs, fraction of codes at 0 or 2^bits - 1) of one
    configuration."""
    from llmctl.compress.driver import calibrate_layers
    from llmctl.runtime.evaluate import perplexity

    model = copy.deepcopy(rt.model)
    t0 = time.perf_counter()
    records = calibrate_layers(model, calib, method, device="cpu").records
    dt = time.perf_counter() - t0
    err = sum(r.error for r in records.values()) / max(1, len(records))
    codes = [r.result.codes for r in records.values()]
    maxq = next(iter(records.values())).result.spec.maxq
    edge = sum(int(((c == 0) | (c == maxq)).sum()) for c in codes) / sum(c.numel() for c in codes)
    ppl = perplexity(model, held, seq_len).perplexity
    del model
    return ppl, dt, err, edge


def run_config(model_dir: Path, rt, calibs, held, fp: float, cfg: str, bits: int, g: str) -> dict:
    """One row of the table: configuration cfg at these bits and group ("channel" or a size),
    run once per calibration draw in `calibs` (the row holds the mean, and each draw's loss); a
    row with "error" where it failed (the run goes on)."""
    import math
    import statistics

    group = None if g == "channel" else int(g)
    method, kw = parse_config(cfg)
    runs = []
    for d, calib in enumerate(calibs):
        try:
            if method == "llmc":
                run = run_llmc(model_dir, calib, held, kw, bits, group, 256)
            else:
                run = run_one(rt, calib, held, make_method(method, kw, bits, group), 256)
        except Exception as e:  # recorded in the JSON, left out of the table
            print(f"{model_dir.name} {bits}b g{g} {cfg}: {type(e).__name__}: {e}", flush=True)
            return dict(bits=bits, group=g, config=cfg, error=f"{type(e).__name__}: {e}")
        ppl, dt, err, edge = run
        draw = f" draw {d}" if len(calibs) > 1 else ""
        print(
            f"{model_dir.name} {bits}b g{g} {cfg:28s} ppl {ppl:8.3f} {ppl - fp:+.3f} "
            f"calib err {err:.5f} edge {edge:.4f} ({dt:.0f}s){draw}",
            flush=True,
        )
        runs.append(run)
    ppl, dt, err, edge = (statistics.fmean(x) for x in zip(*runs))
    losses = [r[0] - fp for r in runs]
    return dict(
        bits=bits,
        group=g,
        config=cfg,
        ppl=ppl,
        dppl=ppl - fp,
        dppl_draws=losses,
        dppl_sd=statistics.stdev(losses) if len(losses) > 1 else None,
        dnll=math.log(ppl) - math.log(fp),
        seconds=round(dt, 2),
        calib_rel_err=err,
        codes_at_edge=edge,
    )


def bench_model(model_dir: Path, args) -> dict:
    torch.set_num_threads(args.threads)
    from llmctl.runtime.evaluate import perplexity
    from llmctl.runtime.loader import load_runtime

    rt = load_runtime(model_dir, dtype="float32", device="cpu")
    # draw d starts d / draws of a window into the text: other windows, the same spread
    offsets = [d * args.seq_len // args.draws for d in range(args.draws)]
    calibs = [data(model_dir, args.num_samples, args.seq_len, o)[0] for o in offsets]
    held = data(model_dir, args.num_samples, args.seq_len)[1]
    fp = perplexity(rt.model, held, args.seq_len).perplexity
    widths = {rt.config.hidden_size, rt.config.intermediate_size}
    widths.add(rt.config.num_heads * rt.config.head_dim)
    print(f"\n## {model_dir.name}: fp32 ppl {fp:.3f}, held-out tokens {held.numel()}", flush=True)
    rows = []
    for bits in args.bits:
        for g in args.groups:
            group = None if g == "channel" else int(g)
            if group is not None and any(w % group for w in widths):
                print(f"{bits} bits, group {g}: does not divide widths {sorted(widths)}; skipped")
                continue
            for cfg in args.configs:
                rows.append(run_config(model_dir, rt, calibs, held, fp, cfg, bits, g))
    return {"model": str(model_dir), "fp32_ppl": fp, "heldout_tokens": held.numel(), "rows": rows}


def add_ratios(rows: list[dict], baselines: list[str]) -> None:
    """r["ratio_to"][b]: each loss (perplexity over fp32) over baseline b's at the same bits and
    group; None where b did not run or lost less than NOISE_PPL (a ratio to noise means
    nothing)."""
    for r in rows:
        if "error" in r:
            continue
        r.pop("ratio_to_rtn", None)  # the single ratio older runs wrote
        r["ratio_to"] = {}
        for b in baselines:
            base = [
                x["dppl"]
                for x in rows
                if "error" not in x
                and (x["bits"], x["group"], x["config"]) == (r["bits"], r["group"], b)
            ]
            ok = base and base[0] > NOISE_PPL
            r["ratio_to"][b] = r["dppl"] / base[0] if ok else None


def markdown(results: list[dict], baselines: list[str]) -> str:
    lines = []
    for res in results:
        add_ratios(res["rows"], baselines)
        lines += [
            f"\n{Path(res['model']).name}: fp32 perplexity {res['fp32_ppl']:.3f}\n",
            "| bits | group | method | ppl | loss over fp32 | "
            + " | ".join(f"ratio to {b}" for b in baselines)
            + " |",
            "| --- " * (5 + len(baselines)) + "|",
        ]
        for r in res["rows"]:
            if "error" in r:
                continue
            ratios = [r["ratio_to"][b] for b in baselines]
            cells = " | ".join("" if x is None else f"{x:.2f}x" for x in ratios)
            sd = f" (sd {r['dppl_sd']:.3f})" if r.get("dppl_sd") is not None else ""
            lines.append(
                f"| {r['bits']} | {r['group']} | {r['config']} | {r['ppl']:.3f} "
                f"| {r['dppl']:+.3f}{sd} | {cells} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", type=Path, default=DEFAULT_MODELS)
    p.add_argument("--bits", nargs="+", type=int, default=[4, 8])
    p.add_argument("--groups", nargs="+", default=["32", "64", "128", "channel"])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument(
        "--baselines", nargs="+", default=["rtn:mse=0", "rtn"], help="configurations ratios are to"
    )
    p.add_argument("--merge", nargs="+", type=Path, help="combine these --json files instead")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--draws", type=int, default=1, help="calibration draws per row (mean and sd reported)"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--jobs", type=int, default=1, help="models benchmarked side by side")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.merge:  # one entry per model: runs of one model from several files are joined
        merged: dict[str, dict] = {}
        for f in args.merge:
            for res in json.loads(f.read_text())["results"]:
                merged.setdefault(res["model"], {**res, "rows": []})["rows"] += res["rows"]
        results = list(merged.values())
    else:
        models = [m for m in args.models if (m / "config.json").exists()]
        if args.jobs > 1:  # one process per model, each with --threads threads
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
                results = list(pool.map(bench_model, models, [args] * len(models)))
        else:
            results = [bench_model(m, args) for m in models]
    table = markdown(results, args.baselines)
    print(table)
    if args.json:
        out = {
            "environment": environment(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "commands": COMMANDS,
            "merged_runs": [json.loads(f.read_text())["args"] for f in args.merge or []],
            "results": results,
            "markdown": table,
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
