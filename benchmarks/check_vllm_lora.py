"""Checks that `run-batch --backend vllm` serves LoRA adapters as llmctl's own engine does (issue
37): two PEFT adapters with random non-zero weights on different target modules, rows of both
mixed with base rows in one job, greedy, float32, token ids compared row for row against
`--backend llmctl`. Also counts the adapter rows whose tokens differ from the base row of the same
prompt, so a backend that ignored the adapters would fail the check.

    python benchmarks/check_vllm_lora.py --vllm-python /work/venvs/vllm/bin/python \
        --json benchmarks/results/vllm_lora_check.json

Both runs are `python -m llmctl.cli run-batch` as a user runs it (vLLM's needs llmctl importable
in its environment: `pip install -e .` there, or this checkout on PYTHONPATH, which is what this
script sets). Prints one `RESULT {json}` line; exit 1 when a row differs.
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

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO.parent / "shared" / "models" / "tinyshakespeare-5m"
TARGETS = {"attn": ["q_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}
PROMPTS = ["ROMEO:\n", "JULIET:\nO", "KING RICHARD III:\n", "First Citizen:\nWe"]
PROMPTS.append("GLOUCESTER:\nNow")


def make_adapters(model: Path, folder: Path, rank: int, scale: float) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, targets) in enumerate(TARGETS.items()):
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        peft = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        peft.save_pretrained(str(folder / name))
        out[name] = folder / name
    return out


def rows() -> list[dict]:
    """Each prompt once per model (base, attn, mlp), interleaved so adapters share steps."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        for model in ("base", *TARGETS):
            row = {"id": f"{i}-{model}", "prompt": prompt}
            if model != "base":
                row["model"] = model
            out.append(row)
    return out


def run(python: str, backend: str, inp: Path, out: Path, adapters: dict, args) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [python, "-m", "llmctl.cli", "run-batch", str(inp), "-o", str(out), "-m", str(FIXTURE)]
    cmd += ["--backend", backend, "--dtype", "float32", "--max-tokens", str(args.max_tokens)]
    cmd += ["--include-token-ids", "--max-model-len", "256", "-q", "--overwrite"]
    cmd += ["--max-lora-rank", str(args.rank)]
    for name, path in adapters.items():
        cmd += ["--lora-modules", f"{name}={path}"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{backend} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "python"))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scale", type=float, default=0.3, help="std of the random LoRA weights")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmctl-vllm-lora-"))
    adapters = make_adapters(FIXTURE, work, args.rank, args.scale)
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    ours = run(sys.executable, "llmctl", inp, work / "ours.jsonl", adapters, args)
    theirs = run(args.vllm_python, "vllm", inp, work / "vllm.jsonl", adapters, args)
    ids = {r["id"]: r["token_ids"] for r in ours}
    same = sum(ids[r["id"]] == r["token_ids"] for r in theirs)
    changed = sum(ids[f"{i}-{m}"] != ids[f"{i}-base"] for i in range(len(PROMPTS)) for m in TARGETS)
    result = {"rows": len(ours), "same_tokens": same, "adapter_rows_unlike_base": changed,
              "adapter_rows": len(PROMPTS) * len(TARGETS), "rank": args.rank, "scale": args.scale,
              "differs": [r["id"] for r in theirs if ids[r["id"]] != r["token_ids"]]}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if same == len(ours) and changed == result["adapter_rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
