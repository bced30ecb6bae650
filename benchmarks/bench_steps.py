"""Where an engine step's time goes, llmctl against vLLM's CPU build, by component (issue 19).

Each engine runs one workload in its own process (vLLM in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)
with timers wrapped around its step's parts: scheduler, input and attention-metadata building,
the model forward split into linears, attention and the rest, the logits projection, the sampler,
and the output bookkeeping (detokenizing and stop checks included). vLLM's forward is one
part: its model runs compiled (torch.compile), where Python wrappers inside it are not called.
Times are exclusive (a part nested in another counts once, in the innermost), wall-clock, summed
over the run after a warm-up.

    VLLM_PYTHON=/work/venvs/vllm/bin/python python benchmarks/bench_steps.py --threads 2 \\
        --workload decode --json /tmp/steps.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

WORKLOADS = {  # name: (prompts, prompt range, output range)
    "decode": (64, (16, 16), (128, 128)),
    "mixed": (24, (16, 700), (32, 200)),  # a slice of the mixed workload
    "issue": (96, (16, 700), (32, 200)),  # the whole mixed workload
}

# (module, class, method, component) per engine; the first entry is the whole step.
PARTS = {
    "llmctl": [
        ("llmctl.engine.llm_engine", "LLMEngine", "step", "bookkeeping"),
        ("llmctl.engine.scheduler", "Scheduler", "schedule", "scheduler"),
        ("llmctl.engine.model_runner", "ModelRunner", "_step_inputs", "inputs+metadata"),
        ("llmctl.engine.model_runner", "ModelRunner", "_tensors", "inputs+metadata"),
        ("llmctl.models.llama", "LlamaForCausalLM", "forward", "forward: rest"),
        ("llmctl.models.layers", "Linear", "forward", "forward: linears"),
        ("llmctl.kernels.attention", None, "paged_attention", "forward: attention"),
        ("llmctl.models.llama", "LlamaForCausalLM", "compute_logits", "logits"),
        ("llmctl.engine.sampler", "Sampler", "__call__", "sampler"),
        ("llmctl.engine.llm_engine", "LLMEngine", "_append", "bookkeeping"),
    ],
    "vllm": [
        ("vllm.v1.engine.llm_engine", "LLMEngine", "step", "bookkeeping"),
        ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "scheduler"),
        ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "scheduler"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", "inputs+metadata"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "inputs+metadata"),
        (
            "vllm.v1.worker.gpu_model_runner",
            "GPUModelRunner",
            "_build_attention_metadata",
            "inputs+metadata",
        ),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "forward"),
        ("vllm.model_executor.layers.logits_processor", "LogitsProcessor", "forward", "logits"),
        ("vllm.v1.sample.sampler", "Sampler", "forward", "sampler"),
        ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs", "bookkeeping"),
    ],
}


class Timers:
    """Exclusive wall time per component: a call's time minus that of the timed calls inside it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._stack: list[float] = []  # per open call: time spent in its timed children
        self.on = False

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                inner = self._stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + total - inner
                self.calls[name] = self.calls.get(name, 0) + 1
                if self._stack:
                    self._stack[-1] += total

        return timed


def install(engine: str, timers: Timers) -> None:
    for mod, cls, meth, name in PARTS[engine]:
        module = importlib.import_module(mod)
        owner = getattr(module, cls) if cls else module
        setattr(owner, meth, timers.wrap(getattr(owner, meth), name))
        if cls is None and engine == "llmctl":  # the model imports the name itself
            import llmctl.models.layers as layers

            layers.paged_attention = getattr(owner, meth)


def _generate(engine: str, spec: dict):
    """bench_phases' runner of the workload (vLLM or llmctl, bf16, prefix caching off)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_phases import _generate as generate

    return generate(engine, spec)


def worker(engine: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch.set_num_threads(spec["threads"])
    timers = Timers()
    run = _generate(engine, spec)
    install(engine, timers)
    run()  # warm-up: the same workload once
    timers.on = True
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    timers.on = False
    parts = {k: round(v, 3) for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
    result = {"seconds": round(wall, 3), "parts": parts, "calls": timers.calls}
    print("RESULT " + json.dumps(result), flush=True)


def _run(engine: str, spec: dict, python: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_phases import _run as run

    return run(engine, spec, python, __file__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="decode", choices=sorted(WORKLOADS))
    ap.add_argument("--engines", default="vllm,llmctl")
    ap.add_argument("--kv-cache-dtype", default="auto", help="both engines' KV cache dtype")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import random_model_folder, workload

    folder = random_model_folder(args.config)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    n, prompt_range, output_range = WORKLOADS[args.workload]
    prompts, outs = workload(n, prompt_range, output_range, vocab=vocab, seed=11)
    spec = {
        "model": str(folder),
        "prompts": prompts,
        "outputs": outs,
        "threads": args.threads,
        "max_model_len": prompt_range[1] + output_range[1] + 16,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    pythons = {"vllm": os.environ.get("VLLM_PYTHON", "/work/venvs/vllm/bin/python")}
    report = {
        "config": args.config,
        "threads": args.threads,
        "workload": args.workload,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    for engine in args.engines.split(","):
        report[engine] = _run(engine, spec, pythons.get(engine, sys.executable))
        print(engine, json.dumps(report[engine]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
