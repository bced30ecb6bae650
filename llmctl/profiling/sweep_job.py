"""`profile MODEL`: one measured sweep end to end, minus the terminal.

Owns: `SweepRequest` (every sweep option and its default), the KV sizing policy of a sweep (every
sequence of the largest batch fits in the cache at once, unless the user sized it), loading the
model, running the grid and assembling the versioned record (`report.sweep_record` plus the
model facts MBU/MFU were computed from). The command prints the record.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from llmctl.engine.config import EngineConfig, parse_bytes
from llmctl.errors import RequestError, UsageError
from llmctl.profiling import report
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.environment import environment
from llmctl.profiling.estimate import kv_bytes_per_sequence, num_parameters
from llmctl.profiling.machine import cached_peaks
from llmctl.profiling.sweep import SweepPoint, SweepSettings, grid, model_facts, run_sweep

PointProgress = Callable[[int, int, SweepPoint | None], None]  # (index, points, point or None)


@dataclass(frozen=True)
class SweepRequest:
    """The options of one sweep (the command passes the ones a user set)."""

    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_lens: tuple[int, ...] = (128, 512)
    gen_lens: tuple[int, ...] = (128,)
    repeat: int = 3
    warmup: int = 1
    dtype: str = "auto"
    device: str = "auto"  # resolved by the caller (auto: cuda when present)
    kv_cache_memory: str | None = None  # e.g. "4GiB"; None: what the largest point needs
    seed: int = 0
    plot: bool = False  # a PNG will be drawn: matplotlib must be there before the sweep
    autotune: bool = True  # EngineConfig.autotune: the CPU linear kernels chosen by timing


def int_list(text: str, option: str) -> tuple[int, ...]:
    """'1,8,32' -> (1, 8, 32); anything but comma-separated positive integers: UsageError."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{option} takes comma-separated positive integers, got {text!r}")
    return tuple(values)


def sweep_engine_config(
    config,
    kv_dtype: str,
    max_batch: int,
    longest: int,
    kv_cache_memory: str | None,
    seed: int,
    autotune: bool = True,
) -> EngineConfig:
    """Engine settings for a sweep: every sequence of the largest batch fits in the KV cache at once
    (unless --kv-cache-memory says otherwise) and may run concurrently."""
    block = EngineConfig().block_size
    need = max_batch * kv_bytes_per_sequence(config, longest + block, kv_dtype, block)
    return EngineConfig(
        kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory else need,
        max_num_seqs=max(max_batch, EngineConfig().max_num_seqs),
        seed=seed,
        autotune=autotune,
    )


def engine_info(engine, kv_cache_memory: str | None) -> dict[str, Any]:
    """The engine settings a sweep record states."""
    cfg = engine.engine_config
    return {
        "block_size": cfg.block_size,
        "num_kv_blocks": engine.num_kv_blocks,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "kv_cache_sizing": "--kv-cache-memory"
        if kv_cache_memory
        else "largest batch x (prompt + gen + 1 block)",
    }


def _started_engine(req: SweepRequest, target: str | None, load_runtime: Callable[..., Any]):
    """(runtime, engine, kv dtype) with the KV cache sized for the sweep."""
    longest = max(req.prompt_lens) + max(req.gen_lens)
    runtime = load_runtime(target, dtype=req.dtype, device=req.device)
    if longest > runtime.config.max_position_embeddings:
        raise UsageError(
            f"prompt + generation length {longest} exceeds the model's context "
            f"({runtime.config.max_position_embeddings} tokens)"
        )
    kv_dtype = canonical_dtype(runtime.dtype)
    config = sweep_engine_config(
        runtime.config,
        kv_dtype,
        max(req.batch_sizes),
        longest,
        req.kv_cache_memory,
        req.seed,
        req.autotune,
    )
    return runtime, runtime.start_engine(config), kv_dtype


def profile_sweep(
    req: SweepRequest,
    target: str | None,
    load_runtime: Callable[..., Any],
    progress: PointProgress | None = None,
) -> dict[str, Any]:
    """Load `target`, run every point of the grid and return the sweep record."""
    if req.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the sweep
        raise UsageError(
            "--plot needs matplotlib: pip install 'llmctl[plot]' (or pip install matplotlib)"
        )
    runtime, engine, kv_dtype = _started_engine(req, target, load_runtime)
    peaks = cached_peaks(req.device)
    settings = SweepSettings(
        points=grid(list(req.batch_sizes), list(req.prompt_lens), list(req.gen_lens)),
        repeat=req.repeat,
        warmup=req.warmup,
        seed=req.seed,
        vocab_size=runtime.config.vocab_size,
        device=req.device,
    )
    facts = model_facts(runtime.model, runtime.config, kv_dtype)
    try:
        points = run_sweep(engine, settings, facts, peaks, progress)
    except RequestError as e:
        raise UsageError(
            f"the engine refused a sweep request: {e.message} (raise --kv-cache-memory?)"
        ) from None
    record = report.sweep_record(
        model=runtime.model_name,
        environment=environment(req.device, canonical_dtype(runtime.dtype)),
        engine=engine_info(engine, req.kv_cache_memory),
        settings={
            "batch_sizes": list(req.batch_sizes),
            "prompt_lens": list(req.prompt_lens),
            "gen_lens": list(req.gen_lens),
            "repeat": req.repeat,
            "warmup": req.warmup,
            "seed": req.seed,
        },
        machine_peaks=peaks.to_dict() if peaks else None,
        points=points,
    )
    record["model_facts"] = {
        "num_parameters": num_parameters(runtime.config),
        "weight_bytes": facts.weight_bytes,
        "kv_bytes_per_token": facts.kv_bytes_per_token,
        "kv_dtype": kv_dtype,
    }
    return record
