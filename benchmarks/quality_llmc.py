"""llm-compressor's GPTQ as one configuration of bench_quant_quality.py (`llmc[:key=value,...]`).

Runs benchmarks/llmc_worker.py with the Python of llm-compressor's own virtual environment
(LLMC_PYTHON, default /work/venvs/llmc/bin/python; see bench_quant.py's docstring to create it)
on the same calibration token ids, then loads the compressed-tensors folder it saved with
llmctl's loader and scores it on the same held-out ids. Keys: observer (llm-compressor's name,
e.g. mse; default its min/max), actorder (static, group, weight or none; default none, as
llmctl's GPTQ), sym (0/1, default 1), dampening (default 0.01, as llmctl's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("llmc_worker.py")
OUT = Path(os.environ.get("LLMCTL_BENCH_CACHE", "/tmp/llmctl-bench")) / "quality-llmc"


def llmc_python() -> str:
    return os.environ.get("LLMC_PYTHON", "/work/venvs/llmc/bin/python")


def run_llmc(
    model_dir: Path, calib: torch.Tensor, held: torch.Tensor, kw: dict, bits: int, group, seq_len
) -> tuple[float, float, float, float]:
    """(held-out perplexity, seconds of the worker's oneshot, nan, nan): the last two (calibration
    error, codes at the edge) are llmctl's own measurements, not available here."""
    from llmctl.runtime.evaluate import perplexity
    from llmctl.runtime.loader import load_runtime

    python = llmc_python()
    if not Path(python).exists():
        raise SystemExit(f"LLMC_PYTHON {python} not found: create llm-compressor's venv first")
    actorder = kw.get("actorder", "none")
    out = OUT / model_dir.name  # one folder per model: --jobs runs models side by side
    shutil.rmtree(out, ignore_errors=True)
    spec = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "output": str(out),
        "input_ids": calib.tolist(),
        "bits": bits,
        "group_size": group,
        "threads": torch.get_num_threads(),
        "dampening": float(kw.get("dampening", 0.01)),
        "actorder": None if actorder == "none" else actorder,
        "symmetric": bool(kw.get("sym", True)),
        "observer": kw.get("observer"),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    t0 = time.perf_counter()
    res = subprocess.run([python, str(WORKER), f.name], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    out.with_name(out.name + ".log").write_text(res.stderr)  # llm-compressor's own log
    result = next(
        (json.loads(x[7:]) for x in res.stdout.splitlines() if x.startswith("RESULT ")), None
    )
    if result is None or "error" in result:
        detail = result["error"] if result else res.stderr[-2000:]
        raise RuntimeError(f"llm-compressor worker failed: {detail}")
    model = load_runtime(str(out), dtype="float32", device="cpu").model
    ppl = perplexity(model, held, seq_len).perplexity
    return ppl, result.get("oneshot_s", time.perf_counter() - t0), float("nan"), float("nan")
