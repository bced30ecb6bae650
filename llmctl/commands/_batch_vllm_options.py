"""run-batch's vLLM spellings and its progress and logging flags: the option record `VllmFlags`.

Owns: the options a `vllm run-batch` command line brings (`-i/--input-file`,
`--kv-cache-memory-bytes`, `--kv-cache-dtype`, `--gpu-memory-utilization`, `--speculative-config`,
`--served-model-name`, `--generation-config`; `--output-file` and `--enable-prefix-caching` are
second names of `_batch_options`' own), `--progress`, `--log-interval`, `--log-level`/`-v`, and
their mapping to `BatchOptions` and `EngineConfig` fields (vllm_fields, kv_cache_memory,
speculative_fields, vllm_engine_fields). Where a vLLM spelling and ours say the same thing twice,
the job is refused rather than one silently winning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmctl.engine.config import defaults, parse_bytes, speculative_settings
from llmctl.engine.vllm_config import parse_vllm_bytes, speculative_from_vllm
from llmctl.errors import UsageError

PROGRESS_MODES = ("auto", "bar", "lines", "none")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_INTERVAL_S = defaults().log_stats_interval_s  # progress lines too


def _opt(*names: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, show_default=False, **kw)


@dataclass(frozen=True)
class VllmFlags:
    """vLLM's spellings, progress and logging."""

    input_file: Annotated[
        Optional[str],
        _opt("--input-file", "-i", help="vLLM's spelling of INPUT (give one of them)."),
    ] = None
    served_model_name: Annotated[
        Optional[str],
        _opt(
            "--served-model-name",
            help="The model field of OpenAI output rows (default: the model's folder or hub id; "
            "llmctl-demo for the demo model).",
        ),
    ] = None
    generation_config: Annotated[
        Optional[str],
        _opt(
            "--generation-config",
            help="Sampling defaults under the flags and rows: none (the default: run-batch's own, "
            "greedy, so that a batch job is reproducible and a resumed job equals one run), auto "
            "(vLLM's default: the model's generation_config.json temperature, top_p, top_k, min_p "
            "and penalties over vLLM's temperature 1), vllm (vLLM's defaults: temperature 1) or a "
            "folder holding a generation_config.json.",
        ),
    ] = None
    kv_cache_memory_bytes: Annotated[
        Optional[str],
        _opt(
            "--kv-cache-memory-bytes",
            help="vLLM's spelling of --kv-cache-memory, read as vLLM reads it: 4G = 4 GiB, "
            "4g = 4e9.",
        ),
    ] = None
    kv_cache_dtype: Annotated[
        Optional[str],
        _opt(
            "--kv-cache-dtype",
            help="The KV cache's dtype, as vLLM's: auto (the model's, the default), bfloat16, "
            "float16, float32, fp8 (= fp8_e4m3) or fp8_e5m2. fp8 stores one byte per value, so "
            "the same --kv-cache-memory holds twice the tokens of bf16 and decode attention reads "
            "half the bytes; no scales (vLLM's default), values saturate at the format's largest.",
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        Optional[float],
        _opt(
            "--gpu-memory-utilization",
            help="CUDA: the fraction of GPU memory this job may use; the KV cache takes what the "
            "weights and an activation reserve leave (default: --kv-cache-memory auto). Accepted "
            "and ignored on the CPU.",
        ),
    ] = None
    speculative_config: Annotated[
        Optional[str],
        _opt(
            "--speculative-config",
            help="vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
            '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": DIR}\', in place of '
            "--speculative, --draft and --num-speculative-tokens (prompt_lookup_min/max: 5 unless "
            "given, as in vLLM).",
        ),
    ] = None
    progress: Annotated[
        Optional[str],
        _opt(
            "--progress",
            help="auto (the default: a bar on a terminal, else lines), bar, lines (a plain line "
            "every --log-interval seconds: rows done/total, errors, output tok/s, ETA) or none.",
        ),
    ] = None
    log_interval: Annotated[
        Optional[float],
        _opt(
            "--log-interval",
            min=0.01,
            help=f"Seconds between progress lines and engine statistics lines (default: "
            f"{DEFAULT_LOG_INTERVAL_S:g}).",
        ),
    ] = None
    log_level: Annotated[
        Optional[str],
        _opt(
            "--log-level",
            help="What the engine logs on stderr: warning (the default), info (statistics every "
            "--log-interval: step time, queue, KV blocks, prefix-cache hit rate, preemptions), "
            "debug (every step) or error.",
        ),
    ] = None
    verbose: Annotated[
        int,
        typer.Option(
            "--verbose",
            "-v",
            count=True,
            show_default=False,
            help="-v: --log-level info; -vv: debug.",
        ),
    ] = 0


def input_of(input: str | None, a: VllmFlags) -> str:
    """INPUT, or vLLM's -i/--input-file: exactly one of them."""
    if input is not None and a.input_file is not None:
        raise UsageError("give the input once: INPUT or -i/--input-file, not both")
    if input is None and a.input_file is None:
        raise UsageError("no input: give INPUT (or -i/--input-file)")
    return input if input is not None else a.input_file


def vllm_fields(a: VllmFlags) -> dict[str, Any]:
    """The BatchOptions fields of the vLLM options that the user set."""
    mode = a.generation_config
    if mode is not None and not mode:
        raise UsageError("--generation-config needs auto, vllm, none or a folder")
    return {
        k: v
        for k, v in (("served_model_name", a.served_model_name), ("generation_config", mode))
        if v is not None
    }


def kv_cache_memory(ours: str | None, a: VllmFlags) -> int | None:
    """--kv-cache-memory (`ours`) or vLLM's --kv-cache-memory-bytes (None: auto)."""
    theirs = a.kv_cache_memory_bytes
    if ours is not None and theirs is not None:
        raise UsageError("give --kv-cache-memory or --kv-cache-memory-bytes, not both")
    if theirs is not None:
        return parse_vllm_bytes(theirs)
    return None if ours is None or ours == "auto" else parse_bytes(ours)


def speculative_fields(
    a: VllmFlags,
    speculative: str | None,
    draft: str | None,
    num_speculative_tokens: int | None,
    speculative_max_batch: int | None,
) -> dict[str, Any]:
    """EngineConfig's speculative fields, from --speculative-config or our own flags (the other
    arguments: --speculative, --draft, --num-speculative-tokens, --speculative-max-batch)."""
    if a.speculative_config is None:
        return speculative_settings(
            speculative or "off", draft, num_speculative_tokens, speculative_max_batch
        )
    ours = [
        f
        for f, v in (
            ("--speculative", speculative),
            ("--draft", draft),
            ("--num-speculative-tokens", num_speculative_tokens),
        )
        if v is not None
    ]
    if ours:
        raise UsageError(f"--speculative-config says what {', '.join(ours)} says; give one")
    fields = speculative_from_vllm(a.speculative_config)
    if speculative_max_batch is not None:
        fields["speculative_max_batch"] = speculative_max_batch
    return fields


def vllm_engine_fields(a: VllmFlags) -> dict[str, Any]:
    """EngineConfig fields of --kv-cache-dtype, --gpu-memory-utilization and --log-interval,
    when set."""
    fields = {}
    if a.kv_cache_dtype is not None:
        fields["kv_cache_dtype"] = a.kv_cache_dtype
    if a.gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = a.gpu_memory_utilization
    if a.log_interval is not None:
        fields["log_stats_interval_s"] = a.log_interval
    return fields


def progress_mode(a: VllmFlags) -> str:
    mode = a.progress or "auto"
    if mode not in PROGRESS_MODES:
        raise UsageError(f"--progress must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}")
    return mode


def log_level(a: VllmFlags) -> str:
    """--log-level, else -v (info) / -vv (debug), else warning."""
    if a.log_level is not None:
        level = a.log_level.lower()
        if level not in LOG_LEVELS:
            raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        return level
    return ("warning", "info", "debug")[min(a.verbose, 2)]
