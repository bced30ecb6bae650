"""One `run-batch` invocation end to end, minus the terminal: resume decisions, sinks, finalisation.

Owns: `BatchOptions` (everything the command was given), `run_batch` (validate, open the input,
decide between a fresh start, a resume and a refusal, load the model through a callback, drive a
`BatchJob`, commit state, convert a Parquet journal at the end) and the settings fingerprint.
The command passes a `BatchUI` for messages and progress; nothing here imports Typer or Rich.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from llmctl.batch.inputs import InputRow, open_input
from llmctl.batch.job import BatchJob, Checkpoint, JobSettings
from llmctl.batch.journal import JobState, fingerprint_mismatch, journal_path, load_state, save_state, state_path
from llmctl.batch.outputs import (FileSink, RowResult, StdoutSink, encode_record, journal_to_parquet,
                                  openai_record, simple_record)
from llmctl.batch.summary import BatchStats, Progress
from llmctl.engine.params import SamplingParams
from llmctl.errors import LlmctlError, RequestError, UsageError


class BatchInterrupted(LlmctlError):
    """Ctrl-C or SIGTERM: committed rows are kept and a rerun of the same command continues."""

    exit_code = 130


@dataclass
class BatchOptions:
    input: str
    output: str
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
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields (job defaults)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    max_in_flight: int | None = None  # default: 2 x max_num_seqs
    commit_rows: int = 256
    commit_interval_s: float = 2.0


class BatchUI(Protocol):
    def info(self, message: str) -> None: ...
    def start(self, rows_total: int | None, rows_done: int) -> None: ...
    def progress(self, p: Progress) -> None: ...
    def stop(self) -> None: ...


class _SilentUI:
    def info(self, message: str) -> None: ...
    def start(self, rows_total: int | None, rows_done: int) -> None: ...
    def progress(self, p: Progress) -> None: ...
    def stop(self) -> None: ...


@dataclass
class BatchResult:
    stats: BatchStats
    already_complete: bool = False


def default_sampling(opts: BatchOptions) -> SamplingParams:
    try:
        return SamplingParams(**opts.sampling)
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
    return {"model": model, "dtype": opts.dtype, "input": inp, "input_bytes": size,
            "input_format": source_format, "prompt_column": opts.prompt_column, "id_column": opts.id_column,
            "messages_column": opts.messages_column, "include_token_ids": opts.include_token_ids,
            "ordered": opts.ordered, **{f"sampling.{k}": v for k, v in sampling.items()}}


def _check_paths(opts: BatchOptions) -> tuple[Path | None, bool]:
    """(output path or None for stdout, parquet output?)"""
    if opts.output == "-":
        return None, False
    out = Path(opts.output)
    if opts.input != "-" and Path(opts.input).resolve() == out.resolve():
        raise UsageError("the output must not be the input file")
    if not out.parent.is_dir():
        raise UsageError(f"output folder {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"output {out} is a folder; pass a file path")
    return out, out.suffix.lower() == ".parquet"


def _resume_state(out: Path, parquet: bool, fp: dict, overwrite: bool) -> JobState | None:
    """The state to continue from; None for a fresh start. Refuses unsafe reruns."""
    if overwrite:
        return None  # the old files are replaced once the output is locked (see _serve)
    state = load_state(state_path(out))
    if state is None:
        if out.exists() and out.stat().st_size > 0:
            raise UsageError(f"{out} exists and has no run-batch state beside it; pass --overwrite to replace it")
        return None
    diff = fingerprint_mismatch(state.fingerprint, fp)
    if diff is not None:
        raise UsageError(f"cannot resume {out}: {diff}; rerun with the same settings, or pass --overwrite to start over")
    if not state.complete and not (journal_path(out) if parquet else out).exists() and state.output_bytes > 0:
        raise UsageError(f"cannot resume {out}: its partial output is gone; pass --overwrite to start over")
    return state


def run_batch(opts: BatchOptions, load_runtime: Callable[..., Any], ui: BatchUI | None = None) -> BatchResult:
    """Serve every row of opts.input into opts.output, resuming a previous run of the same job."""
    ui = ui or _SilentUI()
    defaults = default_sampling(opts)
    out, parquet = _check_paths(opts)
    source = open_input(opts.input, opts.input_format, opts.prompt_column, opts.id_column, opts.messages_column)
    try:
        if parquet and source.format == "openai":
            raise UsageError("OpenAI batch input is answered in the OpenAI batch output shape (JSONL); "
                             "use an output path ending in .jsonl")
        fp = fingerprint(opts, source.format, defaults)
        state = None if out is None else _resume_state(out, parquet, fp, opts.overwrite)
        if state is not None and state.complete:
            ui.info(f"{out} is already complete ({state.stats.get('rows', 0)} rows); pass --overwrite to run again")
            return BatchResult(BatchStats.from_state(state.stats), already_complete=True)
        if state is None:
            state = JobState(fingerprint=fp, created=int(time.time()))
        return _serve(opts, source, out, parquet, state, defaults, load_runtime, ui)
    finally:
        source.close()


def _serve(opts, source, out: Path | None, parquet: bool, state: JobState, defaults: SamplingParams,
           load_runtime: Callable[..., Any], ui: BatchUI) -> BatchResult:
    # The output is opened (and locked) before the slow model load, so a second job on it fails fast.
    sink: Any = StdoutSink() if out is None else FileSink(journal_path(out) if parquet else out, state.output_bytes)
    try:
        if out is not None:
            save_state(state_path(out), state)  # at once: the sink may just have cut the output back
            if parquet and opts.overwrite and out.exists():
                out.unlink()  # a finished Parquet output of the run being replaced
        stats = _load_and_drive(opts, source, out, state, sink, defaults, load_runtime, ui)
        if out is not None:
            if parquet:
                journal_to_parquet(journal_path(out), out, opts.include_token_ids)
            state.complete = True
            save_state(state_path(out), state)
            if parquet:
                journal_path(out).unlink()
    finally:
        sink.close()  # held (and locked) until the output is final
    return BatchResult(stats)


def _load_and_drive(opts, source, out: Path | None, state: JobState, sink, defaults: SamplingParams,
                    load_runtime: Callable[..., Any], ui: BatchUI) -> BatchStats:
    from llmctl.engine.config import EngineConfig, format_bytes

    engine_config = EngineConfig(**opts.engine)
    runtime = load_runtime(opts.model, dtype=opts.dtype, device=opts.device)
    engine = runtime.start_engine(engine_config)
    kv = getattr(engine, "kv_cache_bytes", None)
    if kv is not None:
        blocks, bs = getattr(engine, "num_kv_blocks", None), engine_config.block_size
        ui.info(f"KV cache: {format_bytes(kv)}" + (f", {blocks} blocks of {bs} tokens ({blocks * bs} tokens)" if blocks else ""))
    model_name = getattr(runtime, "model_name", None) or opts.model or "llmctl-demo"

    if source.format == "openai":
        def fmt(row: InputRow, r: RowResult) -> bytes:
            return encode_record(openai_record(row, r, model_name, state.created, opts.include_token_ids))
    else:
        def fmt(row: InputRow, r: RowResult) -> bytes:
            return encode_record(simple_record(row, r, opts.include_token_ids))

    return _drive(opts, source, out, state, sink, engine, runtime, fmt, defaults, engine_config, ui)


def _state_saver(path: Path, state: JobState) -> Callable[[Checkpoint], None]:
    def on_commit(c: Checkpoint) -> None:
        state.next_index, state.next_position, state.done_after = c.next_index, c.next_position, c.done_after
        state.output_bytes, state.stats = c.output_bytes, c.stats.to_state()
        save_state(path, state)

    return on_commit


def _drive(opts, source, out: Path | None, state: JobState, sink, engine, runtime, fmt, defaults: SamplingParams,
           engine_config, ui: BatchUI) -> BatchStats:
    """Run the job loop; turn interruptions and write failures into one-line errors."""
    on_commit = None if out is None else _state_saver(state_path(out), state)
    max_in_flight = opts.max_in_flight or 2 * engine_config.max_num_seqs
    settings = JobSettings(max_in_flight=max_in_flight, window=4 * max_in_flight, ordered=opts.ordered,
                           max_errors=opts.max_errors, commit_rows=opts.commit_rows,
                           commit_interval_s=opts.commit_interval_s)
    stats = BatchStats.from_state(state.stats)
    stats.input_format = source.format  # said in the summary: detection may have chosen it
    rows_total = source.count_rows()
    job = BatchJob(engine, runtime, source.rows(state.next_index, state.next_position), sink, fmt, defaults, settings,
                   stats=stats, start_index=state.next_index, start_position=state.next_position,
                   done_after=state.done_after, on_commit=on_commit, on_progress=ui.progress,
                   rows_total=rows_total)
    if stats.rows:
        ui.info(f"resuming {out}: {stats.rows} rows already written")
    ui.start(rows_total, stats.rows)
    try:
        return job.run()
    except BrokenPipeError:  # `-o - | head`: the reader has gone
        ui.stop()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # no second BrokenPipeError when Python flushes stdout at exit
        raise BatchInterrupted(f"stdout was closed after {job.stats.rows} rows; stopping") from None
    except KeyboardInterrupt:
        ui.stop()  # before the message, so it is not drawn over
        if out is None:
            raise BatchInterrupted(f"interrupted after {job.stats.rows} rows (no resume with -o -)") from None
        raise BatchInterrupted(f"interrupted: {state.stats.get('rows', 0)} rows are safely in {out}; "
                               f"rerun the same command to continue") from None
    except OSError as e:  # disk full, output folder gone, ...
        ui.stop()
        if out is None:
            raise LlmctlError(f"cannot write stdout: {e.strerror or e}") from None
        raise LlmctlError(f"cannot write {out}: {e.strerror or e}; the {state.stats.get('rows', 0)} rows committed "
                          f"before are kept, rerun to continue") from None
    finally:
        ui.stop()
