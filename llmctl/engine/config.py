"""Engine settings chosen once per run (`EngineConfig`), and memory-size parsing.

Owns: the scheduler and KV-cache knobs shared by run-batch, profile and the Python API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from llmctl.errors import UsageError
from llmctl.kernels.config import KV_CACHE_DTYPES, KernelConfig
from llmctl.kernels.config import from_env as kernels_from_env

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "tb": 1000**4,
}


def parse_bytes(text: str) -> int:
    """'4GiB' -> 4294967296; '512MB' -> 512000000; plain integers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(
            f"cannot read memory size {text!r}; use a number with a unit such as 4GiB or 512MB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


DEFAULT_KV_CAP = 2 * 1024**3

# `--speculative auto` speculates only while at most this many sequences run. Where speculation
# pays by batch size is measured by benchmarks/bench_speculative.py (BENCHMARKS.md, "Crossover"):
# the measured crossover is not monotonic in batch size, so this is a conservative choice to
# revisit with that benchmark on the user's machine, not a derived constant.
AUTO_SPEC_MAX_BATCH = 2

SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")


def speculative_settings(
    mode: str, draft: str | None, num_tokens: int | None, max_batch: int | None
) -> dict:
    """EngineConfig fields for the --speculative/--draft/... options of the commands (a None
    value: EngineConfig's default, for the caller to drop)."""
    if mode not in SPECULATIVE_MODES:
        raise UsageError(
            f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}"
        )
    if mode == "off" and draft:
        mode = "draft"  # --draft alone asks for it
    if mode == "off":
        return {}
    if mode == "auto":
        method, max_batch = ("draft" if draft else "ngram"), (max_batch or AUTO_SPEC_MAX_BATCH)
    else:
        method = mode
    if method == "ngram" and draft:
        raise UsageError("--draft is for --speculative draft or auto, not ngram")
    return dict(
        speculative=method,
        draft_model=draft,
        num_speculative_tokens=num_tokens,
        speculative_max_batch=max_batch,
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # Bytes for K and V of all layers; None: what max_num_seqs full-length sequences need, at most
    # 2 GiB.
    kv_cache_memory: int | None = None
    # The caches' dtype, vLLM's --kv-cache-dtype (kernels/kv_dtype.py): "auto" is the model's;
    # fp8 (e4m3) and fp8_e5m2 store one byte per value, so the same memory holds twice the tokens.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int | None = None  # for unseeded sampled requests; None: fresh randomness each run
    speculative: str | None = None  # None, "ngram" (prompt lookup) or "draft" (needs draft_model)
    draft_model: str | None = None  # folder of a smaller model with the same tokenizer
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3  # n-gram proposer: longest and shortest suffix looked up
    prompt_lookup_min: int = 1
    speculative_max_batch: int | None = (
        None  # speculate only while at most this many run; None: always
    )
    cuda_graphs: bool = (
        True  # on CUDA with Triton: decode-only steps replay captured graphs (cuda_graphs.py)
    )
    # Every row's tokens independent of its batch-mates and of prompt chunking (issue 20): fixed
    # reduction orders in the linear, attention and norm kernels (engine/model_runner.py).
    batch_invariant: bool = False
    # CUDA, without kv_cache_memory: the KV cache takes what this fraction of the GPU's memory
    # leaves after the weights and an activation reserve (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float | None = None
    log_stats_interval_s: float = 10.0  # the engine's INFO statistics line, at most this often
    # CPU: time the linear kernels when the engine starts and use the fastest per row count
    # (cached per CPU and shape; kernels/cpu/linear/autotune.py); off: the static rules. The
    # --no-autotune flag's field: False here turns `kernels.autotune` off.
    autotune: bool = True
    # LoRA adapters (engine/lora.py): the projections wrapped when the engine starts (None: every
    # one an adapter may target), the most adapters resident at once, the largest rank served.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_targets: tuple[str, ...] | None = None
    # Every kernel choice (kernels/config.py); made without one, from LLMCTL_KERNELS, read here.
    kernels: KernelConfig = field(default_factory=kernels_from_env)

    def __post_init__(self) -> None:
        if not self.autotune and self.kernels.autotune:
            object.__setattr__(self, "kernels", replace(self.kernels, autotune=False))
        if self.block_size < 1:
            raise UsageError(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise UsageError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise UsageError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.speculative not in (None, "ngram", "draft"):
            raise UsageError(f"unknown speculative method {self.speculative!r}; use ngram or draft")
        if self.speculative == "draft" and not self.draft_model:
            raise UsageError("speculative decoding with a draft needs --draft MODEL")
        if self.num_speculative_tokens < 1:
            raise UsageError(
                f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise UsageError("--kv-cache-memory must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UsageError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise UsageError(
                f"n-gram lookup needs 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise UsageError("--max-loras and --max-lora-rank must be >= 1")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {util}")


def defaults() -> EngineConfig:
    """Every default, made without reading the environment: for the numbers other modules quote
    (at import time, where a bad LLMCTL_KERNELS must not fail before the command can say so in
    one line). An engine's own config reads LLMCTL_KERNELS where it is made."""
    return EngineConfig(kernels=KernelConfig())
