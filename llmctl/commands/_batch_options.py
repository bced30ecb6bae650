"""run-batch's options, declared once as `Annotated` aliases, and their mapping to `BatchOptions`.

Owns: every run-batch flag's name and help (flags default to None; the help quotes the default
that `BatchOptions`, `EngineConfig` or run-batch's sampling defaults own) and `batch_options`,
which passes on only the flags a user set.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Optional

import typer

from llmctl.batch.options import BatchOptions, sampling_default
from llmctl.commands import _batch_vllm_options as vllm
from llmctl.commands._options import NoAutotuneOpt as NoAutotuneOpt  # run-batch's, shared
from llmctl.commands._options import default_of, given
from llmctl.commands._output import report_json_of
from llmctl.engine.config import AUTO_SPEC_MAX_BATCH, EngineConfig


def _opt(*names: str, help: str, **kw: Any) -> Any:
    """A typer.Option without a shown default (the help text says it)."""
    return typer.Option(*names, help=help, show_default=False, **kw)


def _sampling(text: str, name: str) -> str:
    return f"{text} (default: {sampling_default(name)})."


def _engine(text: str, name: str) -> str:
    return text + default_of(EngineConfig, name) + "."


InputArg = Annotated[
    Optional[str],
    typer.Argument(
        metavar="INPUT",
        help="JSONL or Parquet file of prompts; - reads stdin (or -i/--input-file INPUT).",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    Optional[str],
    _opt(
        "--output",
        "-o",
        "--output-file",
        help="Output JSONL (Parquet when it ends in .parquet); - writes stdout (no resume). "
        "Default: beside INPUT, its name with .out.jsonl (.out.parquet for Parquet input); "
        "stdout when INPUT is -.",
    ),
]
InputFormatOpt = Annotated[
    Optional[str],
    _opt(
        "--input-format",
        help="auto, jsonl, openai or parquet" + default_of(BatchOptions, "input_format") + ".",
    ),
]
PromptColumnOpt = Annotated[
    Optional[str],
    _opt(
        "--prompt-column",
        help="Parquet: column of text prompts" + default_of(BatchOptions, "prompt_column") + ".",
    ),
]
IdColumnOpt = Annotated[
    Optional[str],
    _opt("--id-column", help="Parquet: column of row ids (default: row number, 1-based)."),
]
MessagesColumnOpt = Annotated[
    Optional[str],
    _opt(
        "--messages-column",
        help="Parquet: column of chat messages (list of {role, content} or JSON text).",
    ),
]
TokenIdsOpt = Annotated[
    bool, typer.Option("--include-token-ids", help="Add the generated token ids to each row.")
]
UnorderedOpt = Annotated[
    bool,
    typer.Option("--unordered", help="Write rows as they finish instead of in input order."),
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Discard an existing output and its resume state.")
]
MaxErrorsOpt = Annotated[
    Optional[int],
    _opt("--max-errors", min=0, help="Abort (exit 3) once more than N rows failed."),
]
SummaryJsonOpt = Annotated[
    Optional[Path], _opt("--summary-json", hidden=True, help="Old spelling of --report-json.")
]
MaxTokensOpt = Annotated[
    Optional[int],
    _opt(
        "--max-tokens",
        min=1,
        help=_sampling("Tokens to generate per row (a row's max_tokens wins)", "max_tokens"),
    ),
]
TemperatureOpt = Annotated[
    Optional[float],
    _opt(
        "--temperature",
        min=0.0,
        help=_sampling("0 = greedy (reproducible; vLLM's default would be 1.0)", "temperature"),
    ),
]
TopPOpt = Annotated[Optional[float], _opt("--top-p", help=_sampling("Nucleus mass", "top_p"))]
TopKOpt = Annotated[
    Optional[int],
    _opt("--top-k", min=-1, help="Keep the K likeliest tokens; -1 or 0: all (vLLM's convention)."),
]
MinPOpt = Annotated[
    Optional[float], _opt("--min-p", help=_sampling("Minimum probability", "min_p"))
]
SeedOpt = Annotated[
    Optional[int], _opt("--seed", help="Row i samples with seed SEED+i (a row's seed wins).")
]
StopOpt = Annotated[Optional[list[str]], _opt("--stop", help="Stop string; repeatable.")]
RepetitionOpt = Annotated[
    Optional[float],
    _opt("--repetition-penalty", help=_sampling("Repetition penalty", "repetition_penalty")),
]
PresenceOpt = Annotated[
    Optional[float],
    _opt("--presence-penalty", help=_sampling("Presence penalty", "presence_penalty")),
]
FrequencyOpt = Annotated[
    Optional[float],
    _opt("--frequency-penalty", help=_sampling("Frequency penalty", "frequency_penalty")),
]
LogprobsOpt = Annotated[
    Optional[int],
    _opt(
        "--logprobs",
        min=0,
        max=20,
        help="Per generated token, its log-probability and the K likeliest alternatives (a "
        "row's logprobs wins; OpenAI rows ask with logprobs / top_logprobs).",
    ),
]
PromptLogprobsOpt = Annotated[
    Optional[int],
    _opt(
        "--prompt-logprobs",
        min=0,
        max=20,
        help="Per prompt token after the first, its log-probability and K alternatives (for "
        "scoring a text; such rows take no prefix-cache hits).",
    ),
]
IgnoreEosOpt = Annotated[
    bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence tokens.")
]
BlockSizeOpt = Annotated[
    Optional[int],
    _opt("--block-size", help=_engine("Tokens per KV-cache block", "block_size")),
]
KvMemoryOpt = Annotated[
    Optional[str],
    _opt(
        "--kv-cache-memory",
        help="Memory for the KV cache, e.g. 4GiB or 512MB (default: auto: what --max-num-seqs "
        "full-length sequences need, at most 2GiB).",
    ),
]
PrefixCachingOpt = Annotated[
    Optional[bool],
    _opt(
        "--prefix-caching/--no-prefix-caching",
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Share KV blocks between prompts with a common prefix (default: on; vLLM's "
        "spelling: --enable-prefix-caching/--no-enable-prefix-caching).",
    ),
]
BatchedTokensOpt = Annotated[
    Optional[int],
    _opt(
        "--max-num-batched-tokens",
        help=_engine("Token budget per engine step", "max_num_batched_tokens"),
    ),
]
MaxSeqsOpt = Annotated[
    Optional[int],
    _opt(
        "--max-num-seqs",
        help=_engine("Sequences decoded together at most", "max_num_seqs"),
    ),
]
MaxModelLenOpt = Annotated[
    Optional[int],
    _opt(
        "--max-model-len",
        min=1,
        help="Context length (default: the model's; a larger value is capped to it).",
    ),
]
SpeculativeOpt = Annotated[
    Optional[str],
    _opt(
        "--speculative",
        help="off (the default), ngram (prompt lookup), draft (needs --draft) or auto (draft "
        "when --draft is given, else ngram; only while at most --speculative-max-batch "
        "sequences run).",
    ),
]
DraftOpt = Annotated[
    Optional[str],
    _opt(
        "--draft",
        help="Smaller model with the same tokenizer that proposes tokens (implies "
        "--speculative draft unless auto).",
    ),
]
SpecTokensOpt = Annotated[
    Optional[int],
    _opt(
        "--num-speculative-tokens",
        min=1,
        help=_engine("Tokens proposed per step", "num_speculative_tokens"),
    ),
]
SpecBatchOpt = Annotated[
    Optional[int],
    _opt(
        "--speculative-max-batch",
        min=1,
        help=f"Speculate only while at most N sequences run (default: {AUTO_SPEC_MAX_BATCH} "
        "with auto, no limit otherwise).",
    ),
]
EagerOpt = Annotated[
    bool,
    typer.Option(
        "--enforce-eager",
        help="CUDA: run every step eagerly instead of replaying decode steps as captured CUDA "
        "graphs.",
    ),
]
BatchInvariantOpt = Annotated[
    bool,
    typer.Option(
        "--batch-invariant",
        help="CPU, or CUDA with triton: every row's tokens bit-identical whatever shares its "
        "engine steps, however its prompt is chunked or its prefix cached (a resumed or split job "
        "equals one run); slower, see BENCHMARKS.md.",
    ),
]
InFlightOpt = Annotated[
    Optional[int],
    _opt(
        "--max-in-flight",
        min=1,
        help="Rows handed to the engine at once (default 2 x --max-num-seqs); the reorder "
        "buffer holds at most 4x this.",
    ),
]


def batch_options(a: SimpleNamespace) -> BatchOptions:
    """The command's flags as `BatchOptions`: only what the user set; the dataclasses fill in
    the rest."""
    sampling = given(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        stop=a.stop,
        repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        ignore_eos=a.ignore_eos or None,
        logprobs=a.logprobs,
        prompt_logprobs=a.prompt_logprobs,
    )
    return BatchOptions(
        input=vllm.input_of(a),
        **given(
            output=a.output,
            model=a.model,
            dtype=a.dtype,
            device=a.device,
            input_format=a.input_format,
            prompt_column=a.prompt_column,
            id_column=a.id_column,
            messages_column=a.messages_column,
            max_errors=a.max_errors,
            max_in_flight=a.max_in_flight,
        ),
        include_token_ids=a.include_token_ids,
        ordered=not a.unordered,
        overwrite=a.overwrite,
        sampling=sampling,
        engine=_engine_fields(a),
        report_json=report_json_of(
            a.report_json, a.summary_json, "--summary-json", "--report-json"
        ),
        **vllm.vllm_fields(a),
    )


def _engine_fields(a: SimpleNamespace) -> dict[str, Any]:
    """The EngineConfig fields the user set (--kv-cache-memory auto is EngineConfig's None)."""
    return given(
        block_size=a.block_size,
        kv_cache_memory=vllm.kv_cache_memory(a),
        enable_prefix_caching=a.prefix_caching,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        cuda_graphs=False if a.enforce_eager else None,
        batch_invariant=a.batch_invariant or None,
        autotune=False if a.no_autotune else None,
        **vllm.speculative_fields(a),
        **vllm.vllm_engine_fields(a),
    )
