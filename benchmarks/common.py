"""Helpers shared by the benchmark scripts: random-weight models of real shapes, workloads, machine
peaks."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def random_model_folder(
    config_name: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """Save (once, cached under /tmp) a randomly initialised HF model with the shape of
    benchmarks/configs/NAME.json or shared/configs/NAME.json (benchmarks/configs: shapes of other
    families, for issue 36: gemma-3-270m, the published config; qwen3-moe-tiny, Qwen3-MoE's
    layout scaled down to fit two cores)."""
    import transformers

    out = (
        Path(os.environ.get("LLMCTL_BENCH_CACHE", "/tmp/llmctl-bench"))
        / f"{config_name}-{str(dtype)[6:]}-{seed}"
    )
    if (out / "model.safetensors").exists():
        return out
    own = Path(__file__).resolve().parent / "configs" / f"{config_name}.json"
    cfg = json.loads(
        (own if own.exists() else SHARED / "configs" / f"{config_name}.json").read_text()
    )
    cfg.pop("torch_dtype", None)
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def workload(
    n: int, prompt_range=(32, 512), output_range=(64, 256), vocab: int = 49152, seed: int = 0
):
    """n random-token prompts and output lengths, uniformly drawn from the ranges (inclusive)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (n,), generator=g).tolist()
    outs = torch.randint(output_range[0], output_range[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lens]
    return prompts, outs


def _matmul_gflops(dtype: torch.dtype, seconds: float) -> float:
    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.randn(1024, 1024, dtype=dtype)
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - t0) / 1e9


def measure_machine(dtype: str = "bfloat16", seconds: float = 1.0) -> dict:
    """This machine's matmul peak in `dtype` (GFLOP/s) and memory read bandwidth (GB/s), measured
    now.

    The peak is what torch reaches on a 1024x1024 @ 1024x1024 matmul. (1024, not 2048: on CPUs
    without native bf16 one 2048 bf16 matmul takes seconds.) For a 16-bit dtype the float32 peak is
    measured too, and `compute_peak_gflops` is the larger: on a CPU without bf16 units every engine
    does bf16 math on the float32 FMA units, so that is the ceiling MFU is quoted against there.
    """
    flops = _matmul_gflops(getattr(torch, dtype), seconds)
    fp32 = flops if dtype == "float32" else _matmul_gflops(torch.float32, seconds)
    return {
        "matmul_dtype": dtype,
        "matmul_gflops": flops,
        "float32_matmul_gflops": fp32,
        "compute_peak_gflops": max(flops, fp32),
        "memory_read_gbs": memory_read_gbs(seconds),
    }


def memory_read_gbs(seconds: float = 1.0) -> float:
    """GB/s of summing a 256 MiB float32 tensor (far beyond the caches) on torch's threads."""
    x = torch.ones(256 * 1024**2 // 4, dtype=torch.float32)
    x.sum()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x.sum()
        n += 1
    return x.numel() * 4 * n / (time.perf_counter() - t0) / 1e9


# The flags that decide which kernels run: the machine kind of every number.
KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def environment() -> dict:
    cpu, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cpu_flags": [f for f in KIND_FLAGS if f in flags],
        "date": time.strftime("%Y-%m-%d"),
    }


def workload_flops(folder: Path, prompts, outs) -> float:
    """Useful forward FLOPs of a workload: the decoder's linears on every prompt and output token,
    attention (Q.K^T and P.V) over each token's context, and lm_head only where a token is sampled
    (one per output token), which is what an engine that skips prompt logits computes."""
    from llmctl.models.config import ModelConfig
    from llmctl.profiling.estimate import linear_shapes

    c = ModelConfig.from_file(Path(folder) / "config.json")
    per_token = 2 * c.num_layers * sum(o * i for o, i in linear_shapes(c))
    attn_per_ctx = 4 * c.num_layers * c.q_size  # FLOPs per (query token, key token) pair
    total = 0.0
    for p, o in zip(prompts, outs):
        n = len(p) + o - 1  # tokens that go through the decoder (the last sampled one never does)
        total += (
            per_token * n + attn_per_ctx * n * (n + 1) / 2 + 2 * c.vocab_size * c.hidden_size * o
        )
    return total


def decode_bytes_per_token(folder: Path, dtype: str, context: int) -> int:
    """Bytes one batch-1 decode step must read: every weight (embeddings once: one row is read from
    the embedding table, lm_head reads it all) plus the KV cache of `context` tokens."""
    from llmctl.models.config import ModelConfig
    from llmctl.profiling.estimate import kv_bytes_per_token, weight_bytes

    c = ModelConfig.from_file(Path(folder) / "config.json")
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    return weight_bytes(c, short).total + context * kv_bytes_per_token(c, short)
