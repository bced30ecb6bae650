"""run-batch's own options as option records, and their mapping to `BatchOptions`.

Owns: `JobFlags` (input, output, the job), `SamplingFlags` (every row's sampling defaults) and
`EngineFlags` (the engine): every such flag's name and help (flags default to None; the help
quotes the default that `BatchOptions`, `EngineConfig` or run-batch's sampling defaults own), and
`batch_options`, which passes on only the flags a user set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.batch.options import BatchOptions, constraint_of, sampling_default
from llmctl.commands import _batch_vllm_options as vllm
from llmctl.commands._options import (
    DeviceOpt,
    DtypeOpt,
    ModelImplOpt,
    ModelOpt,
    NoAutotuneOpt,
    QuietOpt,
    ReportJsonOpt,
    default_of,
    given,
)
from llmctl.commands._output import report_json_of
from llmctl.engine.config import AUTO_SPEC_MAX_BATCH, EngineConfig


def _opt(*names: str, help: str, **kw: Any) -> Any:
    """A typer.Option without a shown default (the help text says it)."""
    return typer.Option(*names, help=help, show_default=False, **kw)


def _sampling(text: str, name: str) -> str:
    return f"{text} (default: {sampling_default(name)})."


def _engine(text: str, name: str) -> str:
    return text + default_of(EngineConfig, name) + "."


@dataclass(frozen=True)
class JobFlags:
    """Input, output and the job's own options."""

    input: Annotated[
        Optional[str],
        typer.Argument(
            metavar="INPUT",
            help="JSONL or Parquet file of prompts; - reads stdin (or -i/--input-file INPUT).",
            show_default=False,
        ),
    ] = None
    output: Annotated[
        Optional[str],
        _opt(
            "--output",
            "-o",
            "--output-file",
            help="Output JSONL (Parquet when it ends in .parquet); - writes stdout (no resume). "
            "Default: beside INPUT, its name with .out.jsonl (.out.parquet for Parquet input); "
            "stdout when INPUT is -.",
        ),
    ] = None
    model: ModelOpt = None
    model_impl: ModelImplOpt = None
    dtype: DtypeOpt = None
    device: DeviceOpt = None
    quiet: QuietOpt = False
    input_format: Annotated[
        Optional[str],
        _opt(
            "--input-format",
            help="auto, jsonl, openai or parquet" + default_of(BatchOptions, "input_format") + ".",
        ),
    ] = None
    prompt_column: Annotated[
        Optional[str],
        _opt(
            "--prompt-column",
            help="Parquet: column of text prompts"
            + default_of(BatchOptions, "prompt_column")
            + ".",
        ),
    ] = None
    id_column: Annotated[
        Optional[str],
        _opt("--id-column", help="Parquet: column of row ids (default: row number, 1-based)."),
    ] = None
    messages_column: Annotated[
        Optional[str],
        _opt(
            "--messages-column",
            help="Parquet: column of chat messages (list of {role, content} or JSON text).",
        ),
    ] = None
    include_token_ids: Annotated[
        bool, typer.Option("--include-token-ids", help="Add the generated token ids to each row.")
    ] = False
    unordered: Annotated[
        bool,
        typer.Option("--unordered", help="Write rows as they finish instead of in input order."),
    ] = False
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Discard an existing output and its resume state.")
    ] = False
    max_errors: Annotated[
        Optional[int],
        _opt("--max-errors", min=0, help="Abort (exit 3) once more than N rows failed."),
    ] = None
    report_json: ReportJsonOpt = None
    summary_json: Annotated[
        Optional[Path], _opt("--summary-json", hidden=True, help="Old spelling of --report-json.")
    ] = None


@dataclass(frozen=True)
class SamplingFlags:
    """Sampling defaults for every row (a row's own fields win)."""

    max_tokens: Annotated[
        Optional[int],
        _opt(
            "--max-tokens",
            min=1,
            help=_sampling("Tokens to generate per row (a row's max_tokens wins)", "max_tokens"),
        ),
    ] = None
    temperature: Annotated[
        Optional[float],
        _opt(
            "--temperature",
            min=0.0,
            help=_sampling("0 = greedy (reproducible; vLLM's default would be 1.0)", "temperature"),
        ),
    ] = None
    top_p: Annotated[Optional[float], _opt("--top-p", help=_sampling("Nucleus mass", "top_p"))] = (
        None
    )
    top_k: Annotated[
        Optional[int],
        _opt(
            "--top-k", min=-1, help="Keep the K likeliest tokens; -1 or 0: all (vLLM's convention)."
        ),
    ] = None
    min_p: Annotated[
        Optional[float], _opt("--min-p", help=_sampling("Minimum probability", "min_p"))
    ] = None
    seed: Annotated[
        Optional[int], _opt("--seed", help="Row i samples with seed SEED+i (a row's seed wins).")
    ] = None
    stop: Annotated[Optional[list[str]], _opt("--stop", help="Stop string; repeatable.")] = None
    repetition_penalty: Annotated[
        Optional[float],
        _opt("--repetition-penalty", help=_sampling("Repetition penalty", "repetition_penalty")),
    ] = None
    presence_penalty: Annotated[
        Optional[float],
        _opt("--presence-penalty", help=_sampling("Presence penalty", "presence_penalty")),
    ] = None
    frequency_penalty: Annotated[
        Optional[float],
        _opt("--frequency-penalty", help=_sampling("Frequency penalty", "frequency_penalty")),
    ] = None
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence tokens.")
    ] = False
    logprobs: Annotated[
        Optional[int],
        _opt(
            "--logprobs",
            min=0,
            max=20,
            help="Per generated token, its log-probability and the K likeliest alternatives (a "
            "row's logprobs wins; OpenAI rows ask with logprobs / top_logprobs).",
        ),
    ] = None
    prompt_logprobs: Annotated[
        Optional[int],
        _opt(
            "--prompt-logprobs",
            min=0,
            max=20,
            help="Per prompt token after the first, its log-probability and K alternatives (for "
            "scoring a text; such rows take no prefix-cache hits).",
        ),
    ] = None
    structured_outputs: Annotated[
        Optional[str],
        _opt(
            "--structured-outputs",
            help="Constrain every row's output (a row's response_format, structured_outputs or "
            "guided_* wins): vLLM's object as JSON, or @FILE holding it, e.g. "
            '\'{"choice": ["positive", "negative"]}\', \'{"json": SCHEMA}\', '
            '\'{"regex": "[0-9]+"}\', \'{"json_object": true}\'.',
        ),
    ] = None


@dataclass(frozen=True)
class EngineFlags:
    """The engine's options."""

    block_size: Annotated[
        Optional[int],
        _opt("--block-size", help=_engine("Tokens per KV-cache block", "block_size")),
    ] = None
    kv_cache_memory: Annotated[
        Optional[str],
        _opt(
            "--kv-cache-memory",
            help="Memory for the KV cache, e.g. 4GiB or 512MB (default: auto: what --max-num-seqs "
            "full-length sequences need, at most 2GiB).",
        ),
    ] = None
    prefix_caching: Annotated[
        Optional[bool],
        _opt(
            "--prefix-caching/--no-prefix-caching",
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Share KV blocks between prompts with a common prefix (default: on; vLLM's "
            "spelling: --enable-prefix-caching/--no-enable-prefix-caching).",
        ),
    ] = None
    max_num_batched_tokens: Annotated[
        Optional[int],
        _opt(
            "--max-num-batched-tokens",
            help=_engine("Token budget per engine step", "max_num_batched_tokens"),
        ),
    ] = None
    max_num_seqs: Annotated[
        Optional[int],
        _opt(
            "--max-num-seqs",
            help=_engine("Sequences decoded together at most", "max_num_seqs"),
        ),
    ] = None
    max_model_len: Annotated[
        Optional[int],
        _opt(
            "--max-model-len",
            min=1,
            help="Context length (default: the model's; a larger value is capped to it).",
        ),
    ] = None
    speculative: Annotated[
        Optional[str],
        _opt(
            "--speculative",
            help="off (the default), ngram (prompt lookup), draft (needs --draft) or auto (draft "
            "when --draft is given, else ngram; only while at most --speculative-max-batch "
            "sequences run).",
        ),
    ] = None
    draft: Annotated[
        Optional[str],
        _opt(
            "--draft",
            help="Smaller model with the same tokenizer that proposes tokens (implies "
            "--speculative draft unless auto).",
        ),
    ] = None
    num_speculative_tokens: Annotated[
        Optional[int],
        _opt(
            "--num-speculative-tokens",
            min=1,
            help=_engine("Tokens proposed per step", "num_speculative_tokens"),
        ),
    ] = None
    speculative_max_batch: Annotated[
        Optional[int],
        _opt(
            "--speculative-max-batch",
            min=1,
            help=f"Speculate only while at most N sequences run (default: {AUTO_SPEC_MAX_BATCH} "
            "with auto, no limit otherwise).",
        ),
    ] = None
    enforce_eager: Annotated[
        bool,
        typer.Option(
            "--enforce-eager",
            help="CUDA: run every step eagerly instead of replaying decode steps as captured CUDA "
            "graphs.",
        ),
    ] = False
    batch_invariant: Annotated[
        bool,
        typer.Option(
            "--batch-invariant",
            help="CPU, or CUDA with triton: every row's tokens bit-identical whatever shares "
            "its engine steps, however its prompt is chunked or its prefix cached (a resumed or "
            "split job equals one run); slower, see BENCHMARKS.md.",
        ),
    ] = False
    no_autotune: NoAutotuneOpt = False
    max_in_flight: Annotated[
        Optional[int],
        _opt(
            "--max-in-flight",
            min=1,
            help="Rows handed to the engine at once (default 2 x --max-num-seqs); the reorder "
            "buffer holds at most 4x this (or --reorder-window).",
        ),
    ] = None


def batch_options(
    job: JobFlags, sampling: SamplingFlags, engine: EngineFlags, v: vllm.VllmFlags
) -> BatchOptions:
    """The command's flags as `BatchOptions`: only what the user set; the dataclasses fill in
    the rest."""
    return BatchOptions(
        input=vllm.input_of(job.input, v),
        **given(
            output=job.output,
            model=job.model,
            model_impl=job.model_impl,
            dtype=job.dtype,
            device=job.device,
            input_format=job.input_format,
            prompt_column=job.prompt_column,
            id_column=job.id_column,
            messages_column=job.messages_column,
            max_errors=job.max_errors,
            max_in_flight=engine.max_in_flight,
        ),
        include_token_ids=job.include_token_ids,
        ordered=not job.unordered,
        overwrite=job.overwrite,
        sampling=_sampling_fields(sampling),
        engine=_engine_fields(engine, v),
        report_json=report_json_of(
            job.report_json, job.summary_json, "--summary-json", "--report-json"
        ),
        **vllm.vllm_fields(v),
    )


def _sampling_fields(s: SamplingFlags) -> dict[str, Any]:
    """Every row's sampling defaults that the user set."""
    return given(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        stop=s.stop,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        ignore_eos=s.ignore_eos or None,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        structured_outputs=constraint_of(s.structured_outputs, "--structured-outputs"),
    )


def _engine_fields(e: EngineFlags, v: vllm.VllmFlags) -> dict[str, Any]:
    """The EngineConfig fields the user set (--kv-cache-memory auto is EngineConfig's None)."""
    speculative = (e.speculative, e.draft, e.num_speculative_tokens, e.speculative_max_batch)
    return given(
        block_size=e.block_size,
        kv_cache_memory=vllm.kv_cache_memory(e.kv_cache_memory, v),
        enable_prefix_caching=e.prefix_caching,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_num_seqs=e.max_num_seqs,
        max_model_len=e.max_model_len,
        cuda_graphs=False if e.enforce_eager else None,
        batch_invariant=e.batch_invariant or None,
        autotune=False if e.no_autotune else None,
        **vllm.speculative_fields(v, *speculative),
        **vllm.vllm_engine_fields(v),
    )
