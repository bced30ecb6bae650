"""One `run-batch` invocation end to end, minus the terminal: checks, resume, sinks, finishing.

Owns: `run_batch`, the command's entry, and its order of work:
1. check every option and path (`batch.checks`), open the input;
2. lock an existing output, read its state and decide between a fresh start, a resume and a
   refusal (`batch.resume`), all before any write;
3. load the model (`batch.backends.load_engine`: llmctl's engine through a callback, or vLLM's),
   or under `--ray` connect to the cluster whose replicas load it (`batch.ray`); until then
   nothing is created or changed on disk;
4. drive a session (`batch.session.JobSession`, or `batch.ray.session.RayJobSession`), committing
   state; it converts a Parquet journal at the end and records the finished output's size and
   hash, which a rerun verifies.
The command passes a `BatchUI` for messages and progress; nothing here imports Typer or Rich.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from llmctl.batch.backends import check_backend, load_engine
from llmctl.batch.checks import (
    check_output,
    check_report_path,
    check_source_options,
    default_output,
)
from llmctl.batch.digests import StreamHasher
from llmctl.batch.inputs import MAX_LINE_BYTES, open_input
from llmctl.batch.journal import JobState, journal_path
from llmctl.batch.options import (
    BatchOptions,
    check_lora,
    check_reorder,
    default_sampling,
    fingerprint,
    lora_engine_fields,
)
from llmctl.batch.outputs import FileSink, StdoutSink, open_locked
from llmctl.batch.resume import Target, plan
from llmctl.batch.session import (  # noqa: F401  (BatchInterrupted, StdoutClosed: public here)
    BatchInterrupted,
    BatchUI,
    JobSession,
    SilentUI,
    StdoutClosed,
)
from llmctl.batch.summary import BatchStats
from llmctl.engine.config import EngineConfig
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
    check_lora(opts)
    # raises UsageError for a bad value
    engine_config = EngineConfig(**(lora_engine_fields(opts) or opts.engine))
    check_backend(opts.backend, opts.engine, opts.engine_args)
    check_reorder(opts)
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
            runtime, engine = _start(opts, engine_config, load_runtime, ui)
            no_state = JobState(fingerprint={}, created=int(time.time()))
            session = _session(opts)(opts, source, None, no_state, defaults, engine_config, ui)
            return BatchResult(session.drive(StdoutSink(), runtime, engine))
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
    from llmctl.batch.ray.session import RayJobSession

    return RayJobSession


def _start(
    opts: BatchOptions, engine_config: EngineConfig, load_runtime: Callable[..., Any], ui: BatchUI
) -> tuple[Any, Any]:
    """What the session drives: (runtime, engine) loaded here, or under --ray (the cluster, None):
    each replica loads the model itself, with the same `load_engine`."""
    if opts.ray is not None:
        from llmctl.batch.ray.cluster import connect

        return connect(opts, load_runtime, ui), None
    return load_engine(opts, engine_config, load_runtime, ui)


def _run_to_file(
    session: JobSession,
    stream: StreamHasher | None,
    target: Target,
    load_runtime: Callable[..., Any],
) -> BatchResult:
    """`session` comes with a blank state: the plan gives it one (fresh or resumed) before any
    write."""
    opts, out, ui = session.opts, target.out, session.ui
    # An existing output is locked at once, so a second job on it fails before loading a model;
    # a new one is created only once the model has loaded.
    held: BinaryIO | None = open_locked(target.sink, create=False) if target.sink.exists() else None
    try:
        fp = fingerprint(opts, session.source.format, session.defaults)
        p = plan(opts.input, opts.overwrite, target, fp, session.source.format, stream, ui.info)
        if p.state.complete:
            ui.info(
                f"{out} is already complete ({p.state.stats.get('rows', 0)} rows); "
                f"pass --overwrite to run again"
            )
            stats = BatchStats.from_state(p.state.stats)
            return BatchResult(stats, already_complete=True, output=str(out))
        runtime, engine = _start(opts, session.engine_config, load_runtime, ui)
        if held is None:
            held = open_locked(target.sink, create=True)
        sink = FileSink(held, target.sink, p.state.output_bytes, p.output_hasher)
        held = None  # the sink owns (and closes) it now
    finally:
        if held is not None:
            held.close()
    session.state, session.input_hasher = p.state, p.input_hasher
    try:
        session.save_now(sink)  # at once: the sink may just have cut the output back
        if target.parquet and opts.overwrite and out.exists():
            out.unlink()  # the finished Parquet output of the run being replaced
        stats = session.drive(sink, runtime, engine)
        session.finish(sink, target.parquet)
    finally:
        sink.close()  # held (and locked) until the output is final
    return BatchResult(stats, output=str(out))
