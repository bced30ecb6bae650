"""Where the time goes, llmctl against vLLM's CPU build, phase by phase (issue 19).

Each phase (prefill-only: prompts with 1 output token; decode-only: short prompts, many output
tokens) runs in a fresh process per engine, alternated, with the engine in that process (vLLM
with VLLM_ENABLE_V1_MULTIPROCESSING=0), so both the wall clock and the process's CPU time are
measured: on a shared machine the CPU seconds of a 1-thread run are the steadier figure. With
--profile, a torch.profiler table of each engine's top operators (self CPU time) is kept.

    VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/bench_phases.py --threads 1 \\
        --repeats 2 --profile --json benchmarks/results/phases_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = {  # name: (prompts, prompt length, output tokens), the phase split
    "prefill": (32, 512, 1),
    "decode": (64, 16, 128),
}


def _profile_table(prof, rows: int = 15) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return [
        {"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events
    ]


def _generate(engine: str, spec: dict):
    """A callable running spec's workload once (after a warm-up), and its engine's object."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=spec["model"],
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=spec["max_model_len"],
            max_num_seqs=256,
            enable_prefix_caching=False,
            kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        )
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        params = [
            SamplingParams(
                max_tokens=o, min_tokens=o, temperature=0, ignore_eos=True, detokenize=False
            )
            for o in spec["outputs"]
        ]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
        return lambda: llm.generate(prompts, params, use_tqdm=False)
    from llmctl import LLM, SamplingParams

    llm = LLM(
        spec["model"],
        dtype="bfloat16",
        device="cpu",
        max_num_seqs=256,
        enable_prefix_caching=False,
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
    )
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in spec["outputs"]]
    llm.generate([spec["prompts"][0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))
    return lambda: llm.generate(spec["prompts"], params)


def worker(engine: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    import torch

    torch.set_num_threads(spec["threads"])
    run = _generate(engine, spec)
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    result = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    if spec.get("profile"):
        from torch.profiler import profile

        with profile() as prof:
            run()
        result["top_ops"] = _profile_table(prof)
    print("RESULT " + json.dumps(result), flush=True)


def _run(engine: str, spec: dict, python: str, script: str = __file__) -> dict:
    """`script --worker ENGINE SPEC` with `python` in its own process; its RESULT line."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    if (
        engine == "llmctl_sdpa"
    ):  # llmctl with PyTorch's SDPA for prefill attention (the AMX kernel off)
        env["LLMCTL_KERNELS"] = "prefill_attention=sdpa"
    cmd = [python, script, "--worker", engine, f.name]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{engine} run failed:\n{res.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--engines", default="vllm,llmctl", help="of vllm, llmctl, llmctl_sdpa")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import environment, random_model_folder, workload

    folder = random_model_folder(args.config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    pythons = {"vllm": os.environ.get("VLLM_PYTHON", "/work/venvs/vllm/bin/python")}
    report = {"environment": environment(), "config": args.config, "threads": args.threads}
    for name in args.phases.split(","):
        n, length, out = PHASES[name]
        prompts, outs = workload(n, (length, length), (out, out), vocab=vocab, seed=11)
        spec = {
            "model": str(folder),
            "prompts": prompts,
            "outputs": outs,
            "threads": args.threads,
            "max_model_len": length + out + 16,
            "profile": args.profile,
        }
        runs = report[name] = {e: [] for e in args.engines.split(",")}
        for _ in range(args.repeats):
            for engine, results in runs.items():
                results.append(_run(engine, spec, pythons.get(engine, sys.executable)))
                print(name, engine, json.dumps(results[-1]), flush=True)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
