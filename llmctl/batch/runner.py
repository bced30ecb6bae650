"""One `run-batch` invocation end to end, minus the terminal: checks, resume, sinks, finishing.

Owns: `run_batch` and its order of work:
1. check every option and path (`batch.checks`), open the input;
2. lock an existing output, read its state and decide between a fresh start, a resume and a
   refusal (`batch.resume`), all before any write;
3. load the model (`batch.backends`: llmctl's engine through a callback, or vLLM's); until it
   has loaded nothing is created or changed on disk;
4. drive a session (`batch.driver`), committing state; it converts a Parquet journal at the end
   and records the finished output's size and hash, which a rerun verifies.
The command passes a `BatchUI` for messages and progress; nothing here imports Typer or Rich.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from llmctl.batch.backends import check_backend, load_backend_runtime
from llmctl.batch.checks import (
    check_output,
    check_report_path,
    check_source_options,
    default_output,
)
from llmctl.batch.digests import StreamHasher
from llmctl.batch.driver import (  # noqa: F401  (BatchInterrupted, StdoutClosed: public here)
    BatchInterrupted,
    BatchUI,
    JobSession,
    SilentUI,
    StdoutClosed,
)
from llmctl.batch.inputs import MAX_LINE_BYTES, open_input
from llmctl.batch.journal import JobState, journal_path
from llmctl.batch.options import BatchOptions, default_sampling, fingerprint
from llmctl.batch.outputs import FileSink, StdoutSink, open_locked
from llmctl.batch.resume import Target, plan
from llmctl.batch.summary import BatchStats
from llmctl.engine.config import EngineConfig, format_bytes
from llmctl.errors import UsageError

__all__ = ["BatchInterrupted", "BatchOptions", "BatchResult", "StdoutClosed", "run_batch"]


@dataclass
class BatchResult:
    stats: BatchStats
    already_complete: bool = False
    output: str = "-"  # the file written, or "-" for stdout


def _output_target(opts: BatchOptions, source_format: str) -> Target | None:
    """The job's output file (checked), or None when rows go to stdout."""
    if opts.output == "-" or (opts.output is None and opts.input == "-"):
        return None
    out = (
        Path(opts.output) if opts.output is not None else default_output(opts.input, source_format)
    )
    parquet = out.suffix.lower() == ".parquet"
    check_output(opts.input, out, parquet)
    if parquet and source_format == "openai":
        raise UsageError(
            "OpenAI batch input is answered in the OpenAI batch output shape "
            "(JSONL); use an output path ending in .jsonl"
        )
    return Target(out, journal_path(out) if parquet else out, parquet)


def run_batch(
    opts: BatchOptions, load_runtime: Callable[..., Any], ui: BatchUI | None = None
) -> BatchResult:
    """Serve every row of opts.input into the output, resuming a previous run of the same job."""
    ui = ui or SilentUI()
    defaults = default_sampling(opts, _generation_defaults(opts, ui))
    engine_config = EngineConfig(**opts.engine)  # raises UsageError for a bad value
    check_backend(opts.backend, opts.engine, opts.engine_args)
    to_file = opts.output != "-" and not (opts.output is None and opts.input == "-")
    stream = None
    if opts.input == "-" and to_file:
        stream = StreamHasher(sys.stdin.buffer, MAX_LINE_BYTES)
    source = open_input(
        opts.input,
        opts.input_format,
        opts.prompt_column,
        opts.id_column,
        opts.messages_column,
        stdin=stream,
    )
    try:
        check_source_options(
            source.format, opts.prompt_column, opts.id_column, opts.messages_column
        )
        target = _output_target(opts, source.format)
        out = None if target is None else target.out
        check_report_path(opts.input, opts.report_json, out, target is not None and target.parquet)
        if target is None:
            runtime, engine = _load_model(opts, engine_config, load_runtime, ui)
            no_state = JobState(fingerprint={}, created=int(time.time()))
            job = _session(opts)(opts, source, None, no_state, defaults, engine_config, ui)
            return BatchResult(job.drive(StdoutSink(), runtime, engine))
        unplanned = JobState(fingerprint={}, created=0)  # replaced by the plan before any save
        return _run_to_file(
            _session(opts)(opts, source, target.out, unplanned, defaults, engine_config, ui),
            stream,
            target,
            load_runtime,
        )
    finally:
        source.close()


def _generation_defaults(opts: BatchOptions, ui: BatchUI) -> dict[str, Any]:
    """The sampling defaults --generation-config sets (said on stderr, as vLLM warns)."""
    from llmctl.runtime.generation_config import generation_defaults
    from llmctl.runtime.resolve import resolve_model_path

    mode = opts.generation_config
    path = resolve_model_path(opts.model) if mode == "auto" else None
    values = generation_defaults(mode, path)
    if values:
        given = ", ".join(f"{k}={v}" for k, v in values.items() if k not in opts.sampling)
        ui.info(f"--generation-config {mode}: sampling defaults {given or '(all set by flags)'}")
    return values


def _session(opts: BatchOptions) -> type[JobSession]:
    if opts.ray is None:
        return JobSession
    from llmctl.batch.ray_job import RayJobSession

    return RayJobSession


def _load_model(
    opts: BatchOptions, engine_config: EngineConfig, load_runtime: Callable[..., Any], ui: BatchUI
):
    if opts.ray is not None:  # Ray replicas load the model (through this function); here, Ray
        from llmctl.batch.ray_job import connect

        return connect(opts, load_runtime, ui), None
    runtime = load_backend_runtime(opts, load_runtime)
    engine = runtime.start_engine(engine_config)
    warm_up = getattr(engine, "warm_up", None)  # our engine: one-time costs before the job clock
    if warm_up is not None:
        warm_up()
    if engine_config.gpu_memory_utilization is not None:
        if not str(getattr(runtime, "device", "cpu")).startswith("cuda"):
            ui.info(
                "--gpu-memory-utilization is for CUDA and ignored on the CPU; the KV cache is "
                "sized by --kv-cache-memory"
            )
        elif engine_config.kv_cache_memory is not None:
            ui.info("--gpu-memory-utilization is ignored: --kv-cache-memory sets the KV cache")
    asked, got = engine_config.max_model_len, getattr(engine, "max_model_len", None)
    if asked is not None and isinstance(got, int) and got < asked:
        ui.info(f"--max-model-len {asked} is above the model's context length; capped to {got}")
    kv = getattr(engine, "kv_cache_bytes", None)
    if kv is not None:
        blocks, bs = getattr(engine, "num_kv_blocks", None), engine_config.block_size
        layout = f", {blocks} blocks of {bs} tokens ({blocks * bs} tokens)" if blocks else ""
        ui.info(f"KV cache: {format_bytes(kv)}{layout}")
    return runtime, engine


def _run_to_file(
    job: JobSession,
    stream: StreamHasher | None,
    target: Target,
    load_runtime: Callable[..., Any],
) -> BatchResult:
    """`job` comes with a blank state: the plan gives it one (fresh or resumed) before any write."""
    opts, out, ui = job.opts, target.out, job.ui
    # An existing output is locked at once, so a second job on it fails before loading a model;
    # a new one is created only once the model has loaded.
    held: BinaryIO | None = open_locked(target.sink, create=False) if target.sink.exists() else None
    try:
        fp = fingerprint(opts, job.source.format, job.defaults)
        p = plan(opts.input, opts.overwrite, target, fp, job.source.format, stream, ui.info)
        if p.state.complete:
            ui.info(
                f"{out} is already complete ({p.state.stats.get('rows', 0)} rows); "
                f"pass --overwrite to run again"
            )
            stats = BatchStats.from_state(p.state.stats)
            return BatchResult(stats, already_complete=True, output=str(out))
        runtime, engine = _load_model(opts, job.engine_config, load_runtime, ui)
        if held is None:
            held = open_locked(target.sink, create=True)
        sink = FileSink(held, target.sink, p.state.output_bytes, p.output_hasher)
        held = None  # the sink owns (and closes) it now
    finally:
        if held is not None:
            held.close()
    job.state, job.input_hasher = p.state, p.input_hasher
    try:
        job.save_now(sink)  # at once: the sink may just have cut the output back
        if target.parquet and opts.overwrite and out.exists():
            out.unlink()  # the finished Parquet output of the run being replaced
        stats = job.drive(sink, runtime, engine)
        job.finish(sink, target.parquet)
    finally:
        sink.close()  # held (and locked) until the output is final
    return BatchResult(stats, output=str(out))
