"""`llmctl run-batch`: push a file of prompts through a model, resumably, with bounded memory.

Owns: the command (its help, its signal handling) and what it prints: the progress bar and
summary on stderr (`_batch_ui`), --report-json. Its options are seven option records
(`_records`): `JobFlags`, `SamplingFlags` and `EngineFlags` (`_batch_options`), `VllmFlags`,
`RayFlags`, `BackendFlags` and `ReorderFlags`, defaulting to None (`BatchOptions`, `EngineConfig`
and run-batch's sampling defaults own every default); the work is in `llmctl.batch.runner`.
"""

from __future__ import annotations

import dataclasses
import signal

import typer

from llmctl.batch.options import BatchOptions
from llmctl.commands import _backend_options as b
from llmctl.commands import _batch_options as o
from llmctl.commands import _batch_vllm_options as v
from llmctl.commands import _lora_options as lo
from llmctl.commands import _ray_options as ro
from llmctl.commands import _reorder_options as reo
from llmctl.commands._batch_ui import RichUI, engine_logging, make_ui
from llmctl.commands._output import emit_json
from llmctl.commands._records import record_command

__all__ = ["RichUI", "register"]

EPILOG = """\b
Examples (in this order, from the project folder):
  llmctl run-batch examples/prompts.jsonl --report-json s.json
  llmctl run-batch examples/prompts.jsonl -o out-short.jsonl --max-tokens 32
  head -2 examples/prompts.jsonl | llmctl run-batch - -q > out-head.jsonl
  llmctl run-batch examples/prompts.jsonl -o out.parquet --speculative ngram
  llmctl run-batch examples/prompts.jsonl -o grouped.jsonl --reorder prefix
  llmctl run-batch out.parquet --prompt-column text --id-column id

\b
Inputs: simple JSONL ({"id"?, "prompt" | "messages" | "prompt_token_ids", per-row max_tokens,
temperature, top_p, top_k, seed, stop, ...}), OpenAI Batch API JSONL (custom_id, method, url,
body; answered in the OpenAI batch output shape), or Parquet (read one row group at a time).
Output rows: id, text, finish_reason, usage, error (null or {code, message}); in input order
unless --unordered (Parquet output: ids as strings). A row with "logprobs": K (or --logprobs K)
adds logprobs, one {token, token_id, logprob, rank, top_logprobs} per generated token;
"prompt_logprobs": K adds prompt_logprobs (null first); "n": N adds outputs (N completions,
the first also in text; the prompt is prefilled once, completion i seeded from the row's seed).
A bad row becomes an error row; it never stops the job. Default ids are line numbers (1-based;
Parquet: row numbers); ids are not checked for duplicates (an OpenAI batch's custom_ids are: a
repeat is an error row).

\b
Sampling is greedy by default (--temperature 0) so that batch jobs are reproducible; with
--temperature > 0 pass --seed S (row i samples with seed S+i) to make a resumed run equal an
uninterrupted one.

\b
Output: without -o, INPUT's name with .out.jsonl (.out.parquet for Parquet input) beside it;
stdout when INPUT is -. The output must be a regular file other than the input.

\b
Resume: a file OUTPUT.llmctl-state.json is kept beside the output. After Ctrl-C, kill -9 or a
power loss, rerun the same command: it continues where it stopped, every row exactly once.
A rerun with another model, other sampling settings or a changed input (the rows already served
are hashed), or over an output changed since, is refused unless --overwrite; rerunning a
finished job checks its output is unchanged and prints the summary. Nothing is written before
the model has loaded. Two jobs on one output: the second is refused.

\b
Speculative decoding: --speculative ngram proposes tokens by looking the last few up in the
prompt (good when outputs copy from it); --draft MODEL lets a small model with the same tokenizer
propose them. Greedy outputs are identical with or without it. It pays for a few sequences at a
time, not a large batch: auto stops speculating while more than --speculative-max-batch run. The
summary reports the acceptance rate.

\b
Prefix-aware admission: --reorder prefix reads up to --reorder-window rows ahead (token ids
only) and hands rows whose prompts share leading KV blocks to the engine one after another, so
a shared system prompt or document is computed once while the prefix cache holds it. It pays
when sharing rows lie far apart and the KV cache cannot hold every distinct prefix at once (the
summary's prefix_cache hit_rate shows it). Output order, resume and the memory bound are those
of input order; greedy rows are the same.

\b
vLLM spellings (same meaning): -i/--input-file (INPUT), --output-file (-o), --model (-m),
--enable-prefix-caching/--no-enable-prefix-caching, --kv-cache-memory-bytes (4G = 4 GiB),
--gpu-memory-utilization (CUDA; ignored on the CPU), --speculative-config JSON (method ngram or
draft_model), --served-model-name, --generation-config. A top_k of -1 or 0 means no cut. A row's
sampling_params object (Ray Data LLM, vLLM) is read like the row's own fields; a Parquet
messages column is used when there is no prompt column. Our default stays greedy
(--generation-config none): --generation-config auto samples as vLLM would.

\b
Progress: a bar on a terminal; otherwise (Slurm, Kubernetes, CI logs) a line every
--log-interval seconds with rows done/total, errors, output tok/s and ETA (--progress).
-v / --log-level info adds engine statistics lines, -vv every engine step.

\b
Ray (pip install 'llmctl\\[ray]'): --ray runs the job on Ray Data, one engine per replica
(--replicas, each a Ray actor that loads the model once; --gpus-per-replica, --cpus-per-replica),
--batch-rows rows at a time, on a local cluster started for the job or on --ray-address.
Replicas return rows and this process alone writes them, so the output, its order, error rows,
the summary and resume are those of a single-process run (greedy rows are identical).

\b
vLLM: --backend vllm generates with vLLM's offline engine (pip install 'llmctl[vllm]') under the
same inputs, outputs and resume; --tensor-parallel-size, --pipeline-parallel-size and
--engine-args JSON go to vLLM. llmctl-only options (--batch-invariant, --speculative auto) are
refused there.

\b
Exit codes: 0 done; 1 write failure such as a full disk (committed rows are kept: rerun);
2 usage or input error; 3 aborted by --max-errors (written rows are kept); 130 interrupted
(resumable: rerun the same command); 141 stdout closed by its reader (`| head`), quietly, as
other Unix filters end.
"""


def register(app: typer.Typer) -> None:
    app.command("run-batch", epilog=EPILOG, no_args_is_help=True)(record_command(_command))


def _command(
    job: o.JobFlags,
    sampling: o.SamplingFlags,
    engine: o.EngineFlags,
    vllm: v.VllmFlags,
    ray: ro.RayFlags,
    backend: b.BackendFlags,
    reorder: reo.ReorderFlags,
    lora: lo.LoraFlags,
) -> None:
    """Generate a completion for every row of INPUT and write one output row per input row."""
    # The flags are read first (a bad one: UsageError before anything runs); the engine's log
    # lines go to stderr at --log-level.
    opts = o.batch_options(job, sampling, engine, vllm)
    opts = dataclasses.replace(opts, **b.backend_fields(backend), **reo.reorder_fields(reorder))
    opts.ray = ro.ray_options(ray)
    adapters = lo.lora_fields(lora)
    if adapters:
        opts.lora_modules = adapters["lora_modules"]
        opts.engine = {**opts.engine, **adapters["engine"]}
    interval = vllm.log_interval or v.DEFAULT_LOG_INTERVAL_S
    ui = make_ui(job.quiet, v.progress_mode(vllm), interval)
    with engine_logging(v.log_level(vllm)):
        _run(opts, ui)


def _load_runtime(model, dtype="auto", device="auto", model_impl="auto"):
    """Indirection so tests can serve a fake engine through the real command."""
    from llmctl.runtime.loader import load_runtime

    return load_runtime(model, dtype=dtype, device=device, model_impl=model_impl)


def _sigterm_as_interrupt():
    """Treat SIGTERM like Ctrl-C (commit, exit 130); returns the previous handler, or None."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (embedded use): leave signals alone
        return None


def _run(opts: BatchOptions, ui: RichUI) -> None:
    """Run the job with SIGTERM treated as Ctrl-C; then the summary (stderr, --report-json)."""
    from llmctl.batch.runner import BatchInterrupted
    from llmctl.batch.runner import run_batch as run
    from llmctl.errors import AbortedError

    previous = _sigterm_as_interrupt()
    try:
        try:
            result = run(opts, _load_runtime, ui)
        except AbortedError as e:
            if getattr(e, "stats", None) is not None:
                emit_json(opts.report_json, e.stats.summary())
            raise
        except KeyboardInterrupt:  # before the job started (e.g. while loading the model)
            raise BatchInterrupted("interrupted before any row was served") from None
        summary = {**result.stats.summary(), "output": result.output}
        try:
            emit_json(opts.report_json, summary)
            ui.summary(summary)
        except KeyboardInterrupt:  # the job is done: only its summary was cut short
            where = "stdout" if result.output == "-" else result.output
            raise BatchInterrupted(
                f"interrupted while writing the summary; the job is complete ({where})"
            ) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
