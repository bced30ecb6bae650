"""`llmctl run-batch`: push a file of prompts through a model, resumably, with bounded memory.

Owns: the Typer options and the terminal (Rich progress bar and summary on stderr). The work is
in `llmctl.batch.runner` (resume, sinks) and `llmctl.batch.job` (the driver loop).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

import typer

from llmctl.commands._options import Device, Dtype, Model, Quiet
from llmctl.engine.config import AUTO_SPEC_MAX_BATCH, speculative_settings

EPILOG = """\b
Examples (in this order, from the project folder):
  llmctl run-batch examples/prompts.jsonl
  llmctl run-batch examples/prompts.jsonl -o out-short.jsonl --max-tokens 32
  head -2 examples/prompts.jsonl | llmctl run-batch - -q > out-head.jsonl
  llmctl run-batch examples/prompts.jsonl -o out.parquet --speculative ngram
  llmctl run-batch out.parquet --prompt-column text --id-column id

\b
Inputs: simple JSONL ({"id"?, "prompt" | "messages" | "prompt_token_ids", per-row max_tokens,
temperature, top_p, top_k, seed, stop, ...}), OpenAI Batch API JSONL (custom_id, method, url,
body; answered in the OpenAI batch output shape), or Parquet (read one row group at a time).
Output rows: id, text, finish_reason, usage, error (null or {code, message}); in input order
unless --unordered (Parquet output: ids as strings). A bad row becomes an error row; it never
stops the job. Default ids are line numbers (1-based; Parquet: row numbers); ids are not checked
for duplicates (an OpenAI batch's custom_ids are: a repeat is an error row).

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
Exit codes: 0 done; 1 write failure such as a full disk (committed rows are kept: rerun);
2 usage or input error; 3 aborted by --max-errors (written rows are kept); 130 interrupted
(resumable: rerun the same command); 141 stdout closed by its reader (`| head`), quietly, as
other Unix filters end.
"""

OUTPUT = typer.Option(
    None,
    "--output",
    "-o",
    show_default=False,
    help="Output JSONL (Parquet when it ends in .parquet); - writes stdout (no "
    "resume). Default: beside INPUT, its name with .out.jsonl (.out.parquet "
    "for Parquet input); stdout when INPUT is -.",
)
MAX_MODEL_LEN = typer.Option(
    None,
    "--max-model-len",
    min=1,
    show_default=False,
    help="Context length (default: the model's; a larger value is capped to it).",
)


class RichUI:
    """Progress bar and messages on stderr; everything silent with --quiet."""

    def __init__(self, quiet: bool):
        from rich.console import Console

        self.quiet = quiet
        self.console = Console(stderr=True)
        self._bar = None
        self._task = None

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def start(self, rows_total: int | None, rows_done: int) -> None:
        if self.quiet:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("run-batch"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[tps]} tok/s, {task.fields[errors]} errors"),
            console=self.console,
            transient=False,
        )
        self._task = self._bar.add_task(
            "rows", total=rows_total, completed=rows_done, tps="-", errors=0
        )
        self._bar.start()

    def progress(self, p) -> None:
        if self._bar is None:
            return
        tps = (
            f"{p.session_output_tokens / p.session_elapsed_s:,.0f}"
            if p.session_elapsed_s > 0
            else "-"
        )
        total = p.rows_total
        if p.finished:
            total = p.rows_done  # the line count behind rows_total includes blank lines
        elif total is not None:
            total = max(total, p.rows_done)
        self._bar.update(self._task, completed=p.rows_done, total=total, tps=tps, errors=p.errors)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def summary(self, s: dict) -> None:
        if self.quiet:
            return
        from rich.table import Table

        def ms(v):
            return "-" if v is None else f"{v * 1000:.3g} ms"

        t = Table(title="run-batch summary", show_header=False, title_justify="left")
        if s.get("input_format"):
            t.add_row("input format", s["input_format"])
        t.add_row("rows", f"{s['rows']:,} ({s['errors']:,} errors)")
        if s["errors_by_code"]:
            t.add_row(
                "errors by code", ", ".join(f"{k}: {v}" for k, v in s["errors_by_code"].items())
            )
        t.add_row("tokens", f"{s['prompt_tokens']:,} prompt, {s['output_tokens']:,} output")
        t.add_row(
            "throughput",
            f"{s['requests_per_s'] or 0:,.2f} requests/s, {s['output_tokens_per_s'] or 0:,.1f} output tokens/s",
        )
        for name in ("ttft_s", "tpot_s"):
            t.add_row(name[:4].upper(), "  ".join(f"{k} {ms(v)}" for k, v in s[name].items()))
        spec = s["speculative"]
        if spec["proposed_tokens"]:
            t.add_row(
                "speculative",
                f"{spec['accepted_tokens']:,} of {spec['proposed_tokens']:,} draft tokens accepted "
                f"({100 * spec['acceptance_rate']:.1f}%)",
            )
        t.add_row("elapsed", f"{s['elapsed_s']:.1f} s")
        self.console.print(t)
        self.info("output: " + ("stdout" if s["output"] == "-" else s["output"]))


def _load_runtime(model, dtype="auto", device="auto"):
    """Indirection so tests can serve a fake engine through the real command."""
    from llmctl.runtime.loader import load_runtime

    return load_runtime(model, dtype=dtype, device=device)


def _sigterm_as_interrupt():
    """Treat SIGTERM like Ctrl-C (commit, exit 130); returns the previous handler, or None."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (embedded use): leave signals alone
        return None


def register(app: typer.Typer) -> None:
    @app.command("run-batch", epilog=EPILOG, no_args_is_help=True)
    def run_batch(
        input: str = typer.Argument(
            ...,
            metavar="INPUT",
            help="JSONL or Parquet file of prompts; - reads stdin.",
            show_default=False,
        ),
        output: Optional[str] = OUTPUT,
        model: Optional[str] = Model,
        dtype: str = Dtype,
        device: str = Device,
        quiet: bool = Quiet,
        input_format: str = typer.Option(
            "auto", "--input-format", help="auto, jsonl, openai or parquet."
        ),
        prompt_column: str = typer.Option(
            "prompt", "--prompt-column", help="Parquet: column of text prompts."
        ),
        id_column: Optional[str] = typer.Option(
            None,
            "--id-column",
            help="Parquet: column of row ids (default: row number, 1-based).",
            show_default=False,
        ),
        messages_column: Optional[str] = typer.Option(
            None,
            "--messages-column",
            help="Parquet: column of chat messages (list of {role, content} or JSON text).",
            show_default=False,
        ),
        include_token_ids: bool = typer.Option(
            False, "--include-token-ids", help="Add the generated token ids to each row."
        ),
        unordered: bool = typer.Option(
            False, "--unordered", help="Write rows as they finish instead of in input order."
        ),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Discard an existing output and its resume state."
        ),
        max_errors: Optional[int] = typer.Option(
            None,
            "--max-errors",
            min=0,
            help="Abort (exit 3) once more than N rows failed.",
            show_default=False,
        ),
        summary_json: Optional[Path] = typer.Option(
            None, "--summary-json", help="Also write the summary as JSON here.", show_default=False
        ),
        max_tokens: int = typer.Option(
            128, "--max-tokens", min=1, help="Tokens to generate per row (a row's max_tokens wins)."
        ),
        temperature: float = typer.Option(
            0.0,
            "--temperature",
            min=0.0,
            help="0 = greedy (the default, reproducible); vLLM's default would be 1.0.",
        ),
        top_p: float = typer.Option(1.0, "--top-p"),
        top_k: Optional[int] = typer.Option(None, "--top-k", min=1, show_default=False),
        min_p: float = typer.Option(0.0, "--min-p"),
        seed: Optional[int] = typer.Option(
            None,
            "--seed",
            help="Row i samples with seed SEED+i (a row's seed wins).",
            show_default=False,
        ),
        stop: Optional[list[str]] = typer.Option(
            None, "--stop", help="Stop string; repeatable.", show_default=False
        ),
        repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
        presence_penalty: float = typer.Option(0.0, "--presence-penalty"),
        frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
        ignore_eos: bool = typer.Option(
            False, "--ignore-eos", help="Keep generating past end-of-sequence tokens."
        ),
        block_size: int = typer.Option(16, "--block-size", help="Tokens per KV-cache block."),
        kv_cache_memory: str = typer.Option(
            "auto",
            "--kv-cache-memory",
            help="Memory for the KV cache, e.g. 4GiB or 512MB; auto: what --max-num-seqs full-length sequences need, at most 2GiB.",
        ),
        no_prefix_caching: bool = typer.Option(
            False,
            "--no-prefix-caching",
            help="Do not share KV blocks between prompts with a common prefix.",
        ),
        max_num_batched_tokens: int = typer.Option(
            2048, "--max-num-batched-tokens", help="Token budget per engine step."
        ),
        max_num_seqs: int = typer.Option(
            256, "--max-num-seqs", help="Sequences decoded together at most."
        ),
        max_model_len: Optional[int] = MAX_MODEL_LEN,
        speculative: str = typer.Option(
            "off",
            "--speculative",
            help="off, ngram (prompt lookup), draft (needs --draft) or auto (draft when --draft is given, else ngram; only while at most --speculative-max-batch sequences run).",
        ),
        draft: Optional[str] = typer.Option(
            None,
            "--draft",
            help="Smaller model with the same tokenizer that proposes tokens (implies --speculative draft unless auto).",
            show_default=False,
        ),
        num_speculative_tokens: int = typer.Option(
            4, "--num-speculative-tokens", min=1, help="Tokens proposed per step."
        ),
        speculative_max_batch: Optional[int] = typer.Option(
            None,
            "--speculative-max-batch",
            min=1,
            help=f"Speculate only while at most N sequences run (default: {AUTO_SPEC_MAX_BATCH} with auto, no limit otherwise).",
            show_default=False,
        ),
        enforce_eager: bool = typer.Option(
            False,
            "--enforce-eager",
            help="CUDA: run every step eagerly instead of replaying decode steps as captured CUDA graphs.",
        ),
        max_in_flight: Optional[int] = typer.Option(
            None,
            "--max-in-flight",
            min=1,
            help="Rows handed to the engine at once (default 2 x --max-num-seqs); the reorder buffer holds at most 4x this.",
            show_default=False,
        ),
    ) -> None:
        """Generate a completion for every row of INPUT and write one output row per input row."""
        from llmctl.batch.runner import BatchOptions
        from llmctl.engine.config import parse_bytes

        opts = BatchOptions(
            input=input,
            output=output,
            model=model,
            dtype=dtype,
            device=device,
            input_format=input_format,
            prompt_column=prompt_column,
            id_column=id_column,
            messages_column=messages_column,
            include_token_ids=include_token_ids,
            ordered=not unordered,
            overwrite=overwrite,
            max_errors=max_errors,
            sampling=dict(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                seed=seed,
                stop=list(stop or []),
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                ignore_eos=ignore_eos,
            ),
            engine=dict(
                block_size=block_size,
                kv_cache_memory=None if kv_cache_memory == "auto" else parse_bytes(kv_cache_memory),
                enable_prefix_caching=not no_prefix_caching,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                cuda_graphs=not enforce_eager,
                **speculative_settings(
                    speculative, draft, num_speculative_tokens, speculative_max_batch
                ),
            ),
            max_in_flight=max_in_flight,
            summary_json=None if summary_json is None else str(summary_json),
        )
        _run(opts, quiet)


def _run(opts, quiet: bool) -> None:
    """Run the job with SIGTERM treated as Ctrl-C; then the summary (stderr, --summary-json)."""
    from llmctl.batch.runner import BatchInterrupted
    from llmctl.batch.runner import run_batch as run
    from llmctl.errors import AbortedError

    ui = RichUI(quiet)
    previous = _sigterm_as_interrupt()
    try:
        try:
            result = run(opts, _load_runtime, ui)
        except AbortedError as e:
            if opts.summary_json is not None and getattr(e, "stats", None) is not None:
                _write_summary(Path(opts.summary_json), e.stats.summary())
            raise
        except KeyboardInterrupt:  # before the job started (e.g. while loading the model)
            raise BatchInterrupted("interrupted before any row was served") from None
        summary = {**result.stats.summary(), "output": result.output}
        try:
            if opts.summary_json is not None:
                _write_summary(Path(opts.summary_json), summary)
            ui.summary(summary)
        except KeyboardInterrupt:  # the job is done: only its summary was cut short
            where = "stdout" if result.output == "-" else result.output
            raise BatchInterrupted(
                f"interrupted while writing the summary; the job is complete ({where})"
            ) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _write_summary(path: Path, summary: dict) -> None:
    from llmctl.errors import LlmctlError

    try:
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise LlmctlError(f"cannot write --summary-json {path}: {e.strerror or e}") from None
