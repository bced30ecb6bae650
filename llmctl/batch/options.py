"""What one run-batch job was given (`BatchOptions`), with run-batch's sampling defaults.

Owns: every option's default for run-batch (the command's flags default to None and only the
ones a user set reach here), the job's default `SamplingParams` and the fingerprint a resumed job
must match. Engine defaults are `EngineConfig`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.batch.uris import input_size, is_uri
from llmctl.engine.params import SamplingParams
from llmctl.engine.structured import StructuredOutputsParams, grammar_of
from llmctl.errors import RequestError, UsageError

# Where run-batch's sampling defaults differ from SamplingParams' (vLLM's): greedy, so that batch
# jobs are reproducible, and longer outputs. Every other sampling default is SamplingParams'.
BATCH_SAMPLING_DEFAULTS: dict[str, Any] = {"max_tokens": 128, "temperature": 0.0}
# --reorder: none (rows go to the engine in input order) or prefix (rows sharing a prompt prefix
# go together, within --reorder-window rows read ahead; llmctl.batch.loop).
REORDER_MODES = ("none", "prefix")
# SamplingParams fields newer than resumable state files: in the fingerprint only when set, so
# a job started before they existed still resumes.
LATER_SAMPLING_FIELDS = {
    "n": 1,
    "logprobs": None,
    "prompt_logprobs": None,
    "structured_outputs": None,
}


@dataclass(frozen=True)
class RayOptions:
    """`--ray`: where and how wide to run the job on Ray (llmctl.batch.ray)."""

    address: str | None = None  # None: start a local cluster for the job, and stop it after
    replicas: int = 1  # engines, one per Ray actor, each loading the model once
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    batch_rows: int = 16  # rows handed to a replica at a time


@dataclass
class BatchOptions:
    input: str
    output: str | None = None  # None: beside the input (stdout for stdin input); "-": stdout
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    model_impl: str = "auto"  # runtime/weights.py MODEL_IMPLS
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
    served_model_name: str | None = None  # the `model` of OpenAI output rows (default: the model's)
    # sampling defaults under the flags: none (run-batch's), vllm, auto (the model's file), a folder
    generation_config: str = "none"
    ray: RayOptions | None = None  # --ray; not in the fingerprint: the rows are the same
    backend: str = "llmctl"  # or "vllm" (llmctl.batch.backends)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM EngineArgs passed through
    # not in the fingerprint: the order rows are admitted in changes no row (greedy rows are
    # identical), so a job may resume with another choice
    reorder: str = "none"
    reorder_window: int | None = None  # rows read ahead for --reorder prefix; None: 4 x in flight
    # --lora-modules: adapter name -> PEFT folder (runtime/lora.py); rows pick one by name
    lora_modules: dict[str, str] = field(default_factory=dict)


def check_reorder(opts: BatchOptions) -> None:
    """--reorder and --reorder-window: a bad value or combination is a UsageError."""
    if opts.reorder not in REORDER_MODES:
        raise UsageError(
            f"--reorder must be one of {', '.join(REORDER_MODES)}, got {opts.reorder!r}"
        )
    if opts.reorder_window is not None:
        if opts.reorder == "none":
            raise UsageError("--reorder-window is for --reorder prefix")
        if opts.reorder_window < 1:
            raise UsageError(f"--reorder-window must be >= 1, got {opts.reorder_window}")
    if opts.reorder != "none" and opts.ray is not None:
        # each replica's loop sees --batch-rows rows at a time: nothing to group across
        raise UsageError("--reorder prefix is not available with --ray")


def check_lora(opts: BatchOptions) -> None:
    """--lora-modules: an empty adapter name is a UsageError (the folders are checked when
    their digests are taken, `fingerprint`)."""
    if not opts.lora_modules:
        return
    for name in opts.lora_modules:
        if not name.strip():
            raise UsageError("--lora-modules: an adapter name is empty")


def lora_engine_fields(opts: BatchOptions) -> dict[str, Any]:
    """EngineConfig fields for the job's adapters: on, with a slot for each unless --max-loras
    says fewer (rows of an adapter without a slot wait until one frees)."""
    if not opts.lora_modules:
        return {}
    return {"enable_lora": True, "max_loras": len(opts.lora_modules), **opts.engine}


def sampling_default(name: str) -> Any:
    """run-batch's default for the SamplingParams field `name` (for help text)."""
    if name in BATCH_SAMPLING_DEFAULTS:
        return BATCH_SAMPLING_DEFAULTS[name]
    return {f.name: f for f in dataclasses.fields(SamplingParams)}[name].default


def default_sampling(
    opts: BatchOptions, generation: dict[str, Any] | None = None
) -> SamplingParams:
    """The job's sampling: what the user set over the `--generation-config` values
    (`generation`), over run-batch's defaults; a bad value: UsageError."""
    try:
        return SamplingParams(**{**BATCH_SAMPLING_DEFAULTS, **(generation or {}), **opts.sampling})
    except RequestError as e:
        where = "" if not generation else f" (with --generation-config {opts.generation_config})"
        raise UsageError(f"bad sampling option{where}: {e.message}") from None


def constraint_of(text: str | None, flag: str) -> StructuredOutputsParams | None:
    """A constraint flag's value (vLLM's structured_outputs object as JSON text, or @FILE holding
    it), checked: a wrong one fails the command, not every row."""
    if text is None:
        return None
    try:
        raw = Path(text[1:]).read_text() if text.startswith("@") else text
        params = StructuredOutputsParams.of(json.loads(raw), flag)
        grammar_of(params)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: {e}") from None
    except RequestError as e:
        raise UsageError(e.message) from None
    return params


def fingerprint(opts: BatchOptions, source_format: str, defaults: SamplingParams) -> dict:
    """The settings a resumed job must share with the session that started it."""
    from llmctl.runtime.lora import lora_digests  # torch: not for `llmctl --help`

    inp = opts.input
    size = None
    if is_uri(inp):
        size = input_size(inp)
    elif inp != "-":
        inp = str(Path(inp).resolve())
        size = os.path.getsize(inp)
    sampling = {
        f.name: getattr(defaults, f.name)
        for f in dataclasses.fields(defaults)
        if f.name not in LATER_SAMPLING_FIELDS
        or getattr(defaults, f.name) != LATER_SAMPLING_FIELDS[f.name]
    }
    if sampling.get("structured_outputs") is not None:  # as a user writes it (JSON)
        sampling["structured_outputs"] = sampling["structured_outputs"].to_dict()
    model = opts.model or "(demo model)"
    if opts.model and Path(opts.model).expanduser().is_dir():
        model = str(Path(opts.model).expanduser().resolve())  # ./m and m are the same model
    return {
        "model": model,
        # only when chosen, so that journals written before the option existed still resume
        **({"model_impl": opts.model_impl} if opts.model_impl != "auto" else {}),
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
        **({"served_model_name": opts.served_model_name} if opts.served_model_name else {}),
        **({"backend": opts.backend} if opts.backend != "llmctl" else {}),
        # only when given: each adapter by name and content (a changed adapter is another job)
        **({"lora_modules": lora_digests(opts.lora_modules)} if opts.lora_modules else {}),
    }
