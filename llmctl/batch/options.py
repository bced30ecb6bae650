"""What one run-batch job was given (`BatchOptions`), with run-batch's sampling defaults.

Owns: every option's default for run-batch (the command's flags default to None and only the
ones a user set reach here), the job's default `SamplingParams` and the fingerprint a resumed job
must match. Engine defaults are `EngineConfig`'s.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.engine.params import SamplingParams
from llmctl.errors import RequestError, UsageError

# Where run-batch's sampling defaults differ from SamplingParams' (vLLM's): greedy, so that batch
# jobs are reproducible, and longer outputs. Every other sampling default is SamplingParams'.
BATCH_SAMPLING_DEFAULTS: dict[str, Any] = {"max_tokens": 128, "temperature": 0.0}


@dataclass
class BatchOptions:
    input: str
    output: str | None = None  # None: beside the input (stdout for stdin input); "-": stdout
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    input_format: str = "auto"
    prompt_column: str = "prompt"
    id_column: str | None = None
    messages_column: str | None = None
    include_token_ids: bool = False
    ordered: bool = True
    overwrite: bool = False
    max_errors: int | None = None
    # SamplingParams fields the user set (job defaults; BATCH_SAMPLING_DEFAULTS fill the rest)
    sampling: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields the user set
    max_in_flight: int | None = None  # default: 2 x max_num_seqs
    commit_rows: int = 256
    commit_interval_s: float = 2.0
    report_json: str | None = None  # checked before the job, written by the command ('-': stdout)
    backend: str = "llmctl"  # or "vllm" (llmctl.batch.backends)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM EngineArgs passed through


def sampling_default(name: str) -> Any:
    """run-batch's default for the SamplingParams field `name` (for help text)."""
    if name in BATCH_SAMPLING_DEFAULTS:
        return BATCH_SAMPLING_DEFAULTS[name]
    return {f.name: f for f in dataclasses.fields(SamplingParams)}[name].default


def default_sampling(opts: BatchOptions) -> SamplingParams:
    """The job's sampling: what the user set over run-batch's defaults; a bad value: UsageError."""
    try:
        return SamplingParams(**{**BATCH_SAMPLING_DEFAULTS, **opts.sampling})
    except RequestError as e:
        raise UsageError(f"bad sampling option: {e.message}") from None


def fingerprint(opts: BatchOptions, source_format: str, defaults: SamplingParams) -> dict:
    """The settings a resumed job must share with the session that started it."""
    inp = opts.input
    size = None
    if inp != "-":
        inp = str(Path(inp).resolve())
        size = os.path.getsize(inp)
    sampling = dataclasses.asdict(defaults)
    model = opts.model or "(demo model)"
    if opts.model and Path(opts.model).expanduser().is_dir():
        model = str(Path(opts.model).expanduser().resolve())  # ./m and m are the same model
    return {
        "model": model,
        "dtype": opts.dtype,
        "input": inp,
        "input_bytes": size,
        "input_format": source_format,
        "prompt_column": opts.prompt_column,
        "id_column": opts.id_column,
        "messages_column": opts.messages_column,
        "include_token_ids": opts.include_token_ids,
        "ordered": opts.ordered,
        **{f"sampling.{k}": v for k, v in sampling.items()},
        # only when on, so that states written before the switch existed still resume
        **({"batch_invariant": True} if opts.engine.get("batch_invariant") else {}),
        **({"backend": opts.backend} if opts.backend != "llmctl" else {}),
    }
