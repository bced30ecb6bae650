"""Helpers shared by the benchmark scripts: random-weight models of real shapes, workloads, machine peaks."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def random_model_folder(config_name: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Save (once, cached under /tmp) a randomly initialised HF model with the shape of shared/configs/NAME."""
    import transformers

    out = Path(os.environ.get("LLMCTL_BENCH_CACHE", "/tmp/llmctl-bench")) / f"{config_name}-{str(dtype)[6:]}-{seed}"
    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((SHARED / "configs" / f"{config_name}.json").read_text())
    cfg.pop("torch_dtype", None)
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def workload(n: int, prompt_range=(32, 512), output_range=(64, 256), vocab: int = 49152, seed: int = 0):
    """n random-token prompts and output lengths, uniformly drawn from the ranges (inclusive)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (n,), generator=g).tolist()
    outs = torch.randint(output_range[0], output_range[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lens]
    return prompts, outs


def measure_machine(seconds: float = 1.0) -> dict:
    """This machine's bf16 matmul peak (GFLOP/s) and memory read bandwidth (GB/s), measured now."""
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    flops = 2 * 2048**3 * n / (time.perf_counter() - t0)
    x = torch.ones(256 * 1024**2 // 4, dtype=torch.float32)  # 256 MiB, far beyond the caches
    x.sum()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x.sum()
        n += 1
    bw = x.numel() * 4 * n / (time.perf_counter() - t0)
    return {"bf16_matmul_gflops": flops / 1e9, "memory_read_gbs": bw / 1e9}


def environment() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu, "date": time.strftime("%Y-%m-%d")}
