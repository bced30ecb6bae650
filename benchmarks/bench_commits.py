"""llmctl at two commits on issue 19's workload, alternated in fresh processes, optionally on an
emulated AVX2-only CPU: does a later commit run the engine slower than an earlier one?

Each leg is `LLM.generate` (after a warm-up, the engine's own clock, as bench_vs_vllm.py's engine
leg) in a fresh process whose `import llmctl` is that commit's tree (`git archive` into a temporary
folder); the legs take turns, A B A B ..., so the host's drift hits both. Reported: each leg's
seconds, their medians and the paired ratios base / head (above 1: head is faster).

`--emulate-avx2` runs every leg as on a CPU without AVX-512 and AMX, for checking the AVX2 path
on a machine that has them (no AVX2-only machine at hand): a copy of /proc/cpuinfo without the
`avx512*` and `amx*` flags bind-mounted over it in the leg's own mount namespace (`unshare -m`,
needs root), the native kernels compiled for x86-64-v3 (AVX2, FMA) through a `CC` wrapper, and
PyTorch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`,
`MKL_ENABLE_INSTRUCTIONS=AVX2`), each leg with its own kernel and autotune cache. What it cannot
emulate: the memory system and core of a real AVX2 CPU, and PyTorch's choice of oneDNN for bf16
matmuls (made from CPUID, so bf16 `F.linear` runs oneDNN capped at AVX2 here, where an AVX2 CPU
takes PyTorch's own fallback). So its ratios say whether llmctl's AVX2 code got slower between the
commits, not what an AVX2 CPU measures.

    python benchmarks/bench_commits.py --base bdbff4f --head HEAD --dtype bfloat16 \\
        --emulate-avx2 --repeats 3 --json benchmarks/results/commits_avx2_bf16.json

`--base-env`/`--head-env NAME=VALUE` set a variable in that side's legs only, e.g. one commit with
and without a kernel (`--base HEAD --head HEAD --head-env LLMCTL_KERNELS=decode_program=0`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MARK = "BENCH_COMMITS_SECONDS="
HIDDEN = re.compile(r" (avx512\w*|amx\w*)")  # flags an AVX2-only CPU lacks


def leg(spec_path: str) -> None:
    """One timed run in this process (cwd: the commit's tree, first on sys.path)."""
    import time

    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    import llmctl
    from llmctl import LLM, SamplingParams

    tree = Path.cwd().resolve()
    if tree not in Path(llmctl.__file__).resolve().parents:
        raise SystemExit(f"imported {llmctl.__file__}, not the tree in {tree}")
    llm = LLM(spec["model"], dtype=spec["dtype"], device="cpu")
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in spec["outs"]]
    llm.generate([spec["prompts"][0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    results = llm.generate(spec["prompts"], params)
    seconds = time.perf_counter() - t0
    if sum(len(r.output_token_ids) for r in results) != sum(spec["outs"]):
        raise SystemExit("wrong number of output tokens")
    print(f"{MARK}{seconds:.4f}", flush=True)


def export(rev: str, out: Path) -> Path:
    """The commit's files (not the working tree) in the new folder `out`."""
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def avx2_environment(work: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of an emulated AVX2-only CPU (module docstring)."""
    fake = work / "cpuinfo"
    fake.write_text(HIDDEN.sub("", Path("/proc/cpuinfo").read_text()))
    cc = work / "cc"
    cc.write_text(
        '#!/bin/sh\nfor a; do shift; case "$a" in -march=native) '
        'set -- "$@" -march=x86-64-v3 -mtune=native;; *) set -- "$@" "$a";; esac; done\n'
        'exec gcc "$@"\n'
    )
    cc.chmod(0o755)
    mount = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", mount, str(fake)]
    env = {
        "CC": str(cc),
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    return prefix, env


def run_leg(tree: Path, spec: Path, prefix: list[str], env: dict[str, str], cache: Path) -> float:
    cmd = [*prefix, sys.executable, str(HERE / "bench_commits.py"), "--leg", str(spec)]
    full = {**os.environ, **env, "PYTHONPATH": str(tree), "LLMCTL_CACHE_DIR": str(cache)}
    res = subprocess.run(cmd, cwd=tree, env=full, capture_output=True, text=True)
    found = [line for line in res.stdout.splitlines() if line.startswith(MARK)]
    if res.returncode or not found:
        raise RuntimeError(f"leg in {tree} exited {res.returncode}: {res.stderr[-2000:]}")
    return float(found[-1][len(MARK) :])


def _pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leg", help=argparse.SUPPRESS)
    ap.add_argument("--base", default="bdbff4f", help="the earlier commit")
    ap.add_argument("--head", default="HEAD", help="the later commit")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--emulate-avx2", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--head-env", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    if args.leg:
        return leg(args.leg)
    sys.path.insert(0, str(HERE))
    from common import random_model_folder, workload

    prompts, outs = workload(args.num_prompts, (16, 700), (32, 200), vocab=49152, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"base": export(args.base, work / "base"), "head": export(args.head, work / "head")}
        spec = work / "spec.json"
        model = str(random_model_folder("smollm2-135m"))
        spec.write_text(json.dumps({"model": model, "prompts": prompts, "outs": outs,
                                    "dtype": args.dtype, "threads": args.threads}))  # fmt: skip
        prefix, env = avx2_environment(work) if args.emulate_avx2 else ([], {})
        seconds: dict[str, list[float]] = {"base": [], "head": []}
        side_env = {"base": _pairs(args.base_env), "head": _pairs(args.head_env)}
        for i in range(args.repeats):
            for name, tree in trees.items():
                s = run_leg(tree, spec, prefix, {**env, **side_env[name]}, work / f"cache-{name}")
                seconds[name].append(s)
                print(f"repeat {i + 1} {name}: {s:.2f} s", flush=True)
    paired = [b / h for b, h in zip(seconds["base"], seconds["head"])]
    result = {
        "base": args.base,
        "head": args.head,
        "head_commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", args.head],
            capture_output=True,
            text=True,
        ).stdout.strip(),  # fmt: skip
        "dtype": args.dtype,
        "threads": args.threads,
        "emulate_avx2": args.emulate_avx2,
        "env": {"base": args.base_env, "head": args.head_env},
        "seconds": seconds,
        "median_seconds": {k: statistics.median(v) for k, v in seconds.items()},
        "paired_base_over_head": paired,
        "base_over_head": statistics.median(seconds["base"]) / statistics.median(seconds["head"]),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
