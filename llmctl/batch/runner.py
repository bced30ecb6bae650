"""One `run-batch` invocation end to end, minus the terminal: checks, resume, sinks, finishing.

Owns: `BatchOptions` (everything the command was given), `run_batch` and its order of work:
1. check every option and path (the output must not be the input, nor any file we write; its
   folder must exist and be writable; the default output lies beside the input), open the input;
2. lock an existing output, read its state and decide between a fresh start, a resume (input and
   output prefixes re-hashed and compared with the state) and a refusal, all before any write;
3. load the model through a callback; until it has loaded nothing is created or changed on disk;
4. drive a `BatchJob`, committing state; convert a Parquet journal at the end and record the
   finished output's size and hash, which a rerun verifies before it says "already complete".
The command passes a `BatchUI` for messages and progress; nothing here imports Typer or Rich.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol

from llmctl.batch.digests import (
    FileHasher,
    NotVerifiedYet,
    PrefixChanged,
    StreamHasher,
    hash_file_prefix,
    new_hasher,
    parquet_hasher,
)
from llmctl.batch.inputs import MAX_LINE_BYTES, open_input
from llmctl.batch.job import BatchJob, Checkpoint, JobSettings
from llmctl.batch.journal import (
    STATE_VERSION,
    JobState,
    fingerprint_mismatch,
    journal_path,
    load_state,
    save_state,
    state_path,
    temp_path,
)
from llmctl.batch.outputs import (
    FileSink,
    RowResult,
    StdoutSink,
    encode_record,
    journal_to_parquet,
    open_locked,
    openai_record,
    simple_record,
)
from llmctl.batch.rows import InputRow
from llmctl.batch.summary import BatchStats, Progress
from llmctl.engine.config import EngineConfig
from llmctl.engine.params import SamplingParams
from llmctl.errors import LlmctlError, RequestError, UsageError

OVERWRITE = "pass --overwrite to start over"


class BatchInterrupted(LlmctlError):
    """Ctrl-C or SIGTERM: committed rows are kept and a rerun of the same command continues."""

    exit_code = 130


class StdoutClosed(LlmctlError):
    """`-o - | head`: the reader went away. Ends quietly with 141 (128 + SIGPIPE), as `cat` or
    `grep` do, so `set -o pipefail` scripts see what they see for any Unix filter."""

    exit_code = 141


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
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields (job defaults)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    max_in_flight: int | None = None  # default: 2 x max_num_seqs
    commit_rows: int = 256
    commit_interval_s: float = 2.0
    summary_json: str | None = None  # checked here, written by the command


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
    output: str = "-"  # the file written, or "-" for stdout


def default_sampling(opts: BatchOptions) -> SamplingParams:
    try:
        return SamplingParams(**opts.sampling)
    except RequestError as e:
        raise UsageError(f"bad sampling option: {e.message}") from None


def default_output(input_path: str, source_format: str) -> Path:
    """prompts.jsonl -> prompts.out.jsonl; a Parquet input -> NAME.out.parquet, beside the input."""
    p = Path(input_path)
    return p.with_name(p.stem + (".out.parquet" if source_format == "parquet" else ".out.jsonl"))


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
    }


# -- checks before any work ---------------------------------------------------------------------


def _engine_config(opts: BatchOptions) -> EngineConfig:
    return EngineConfig(**opts.engine)  # raises UsageError for a bad value


def _check_source_options(opts: BatchOptions, source_format: str) -> None:
    if source_format == "parquet":
        return
    for flag, value, default in (
        ("--prompt-column", opts.prompt_column, "prompt"),
        ("--id-column", opts.id_column, None),
        ("--messages-column", opts.messages_column, None),
    ):
        if value != default:
            raise UsageError(
                f"{flag} is for Parquet input; this input is {source_format} "
                f"(its rows name their fields: id, prompt, messages, ...)"
            )


def _written_paths(out: Path, parquet: bool) -> list[Path]:
    """Every file a job on `out` writes or replaces."""
    state = state_path(out)
    paths = [out, state, temp_path(state)]
    if parquet:
        paths += [journal_path(out), temp_path(out)]
    return paths


def _file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the input file, or of stdin when it is a file; None when unknown."""
    try:
        st = os.fstat(sys.stdin.fileno()) if path == "-" else os.stat(path)
    except (OSError, ValueError, AttributeError):
        return None
    return st.st_dev, st.st_ino


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): the same name is the same file
        return os.path.realpath(a) == os.path.realpath(b)


def _refuse_input_overwrite(input_path: str, paths: list[Path]) -> None:
    """The hard link, symlink or other name under which a file we write is the input."""
    ident = _file_id(input_path)
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if ident is not None and (st.st_dev, st.st_ino) == ident:
            raise UsageError(
                f"refusing to write {p}: it is the input file (the same file under "
                f"another name or through a link); choose another output"
            )


def _writable(path: Path) -> bool:
    """Whether path can be created or replaced (the folder) and written (an existing file)."""
    folder_ok = os.access(path.parent, os.W_OK | os.X_OK)
    return folder_ok and (not path.exists() or os.access(path, os.W_OK))


def _check_output(opts: BatchOptions, out: Path, parquet: bool) -> None:
    if out.is_dir():
        raise UsageError(f"output {out} is a folder; pass a file path")
    if out.is_symlink() and not out.exists():
        raise UsageError(f"output {out} is a link to a missing file; pass a file path")
    if out.exists() and not out.is_file():
        raise UsageError(
            f"output {out} is not a regular file (run-batch keeps resume state beside "
            f"its output); to discard the rows, use -o - > {out}"
        )
    if not out.parent.is_dir():
        raise UsageError(f"output folder {out.parent} does not exist")
    if not _writable(out):
        raise UsageError(f"cannot write {out}: permission denied")
    _refuse_input_overwrite(opts.input, _written_paths(out, parquet))


def _check_summary_path(opts: BatchOptions, out: Path | None, parquet: bool) -> None:
    if opts.summary_json is None:
        return
    path = Path(opts.summary_json)
    if path.is_dir():
        raise UsageError(f"--summary-json {path} is a folder; pass a file path")
    if not path.parent.is_dir():
        raise UsageError(f"--summary-json: folder {path.parent} does not exist")
    if not _writable(path):
        raise UsageError(f"--summary-json: cannot write {path}: permission denied")
    _refuse_input_overwrite(opts.input, [path])
    if out is not None and any(_same_file(path, p) for p in _written_paths(out, parquet)):
        raise UsageError(f"--summary-json {path} is one of the job's own files; choose another")


# -- the invocation -----------------------------------------------------------------------------


def run_batch(
    opts: BatchOptions, load_runtime: Callable[..., Any], ui: BatchUI | None = None
) -> BatchResult:
    """Serve every row of opts.input into the output, resuming a previous run of the same job."""
    ui = ui or _SilentUI()
    defaults = default_sampling(opts)
    engine_config = _engine_config(opts)
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
        _check_source_options(opts, source.format)
        out = None
        if to_file:
            out = (
                Path(opts.output)
                if opts.output is not None
                else default_output(opts.input, source.format)
            )
        parquet = out is not None and out.suffix.lower() == ".parquet"
        if out is not None:
            _check_output(opts, out, parquet)
        if parquet and source.format == "openai":
            raise UsageError(
                "OpenAI batch input is answered in the OpenAI batch output shape "
                "(JSONL); use an output path ending in .jsonl"
            )
        _check_summary_path(opts, out, parquet)
        if out is None:
            runtime, engine = _load_model(opts, engine_config, load_runtime, ui)
            no_state = JobState(fingerprint={}, created=int(time.time()))
            job = _Job(opts, source, None, no_state, defaults, engine_config, ui)
            return BatchResult(job.drive(StdoutSink(), runtime, engine))
        return _run_to_file(
            opts, source, stream, out, parquet, defaults, engine_config, load_runtime, ui
        )
    finally:
        source.close()


def _load_model(
    opts: BatchOptions, engine_config: EngineConfig, load_runtime: Callable[..., Any], ui: BatchUI
):
    runtime = load_runtime(opts.model, dtype=opts.dtype, device=opts.device)
    engine = runtime.start_engine(engine_config)
    asked, got = engine_config.max_model_len, getattr(engine, "max_model_len", None)
    if asked is not None and isinstance(got, int) and got < asked:
        ui.info(f"--max-model-len {asked} is above the model's context length; capped to {got}")
    kv = getattr(engine, "kv_cache_bytes", None)
    if kv is not None:
        from llmctl.engine.config import format_bytes

        blocks, bs = getattr(engine, "num_kv_blocks", None), engine_config.block_size
        layout = f", {blocks} blocks of {bs} tokens ({blocks * bs} tokens)" if blocks else ""
        ui.info(f"KV cache: {format_bytes(kv)}{layout}")
    return runtime, engine


def _run_to_file(
    opts: BatchOptions,
    source,
    stream: StreamHasher | None,
    out: Path,
    parquet: bool,
    defaults: SamplingParams,
    engine_config: EngineConfig,
    load_runtime: Callable[..., Any],
    ui: BatchUI,
) -> BatchResult:
    target = journal_path(out) if parquet else out  # the file rows are appended to
    # An existing output is locked at once, so a second job on it fails before loading a model;
    # a new one is created only once the model has loaded.
    held: BinaryIO | None = open_locked(target, create=False) if target.exists() else None
    try:
        fp = fingerprint(opts, source.format, defaults)
        plan = _plan(opts, out, target, parquet, fp, source, stream, ui)
        if plan.state.complete:
            ui.info(
                f"{out} is already complete ({plan.state.stats.get('rows', 0)} rows); "
                f"pass --overwrite to run again"
            )
            stats = BatchStats.from_state(plan.state.stats)
            return BatchResult(stats, already_complete=True, output=str(out))
        runtime, engine = _load_model(opts, engine_config, load_runtime, ui)
        if held is None:
            held = open_locked(target, create=True)
        sink = FileSink(held, target, plan.state.output_bytes, plan.output_hasher)
        held = None  # the sink owns (and closes) it now
    finally:
        if held is not None:
            held.close()
    job = _Job(opts, source, out, plan.state, defaults, engine_config, ui, plan.input_hasher)
    try:
        job.save_now(sink)  # at once: the sink may just have cut the output back
        if parquet and opts.overwrite and out.exists():
            out.unlink()  # the finished Parquet output of the run being replaced
        stats = job.drive(sink, runtime, engine)
        job.finish(sink, parquet)
    finally:
        sink.close()  # held (and locked) until the output is final
    return BatchResult(stats, output=str(out))


# -- resume decisions ---------------------------------------------------------------------------


@dataclass
class _Plan:
    state: JobState
    input_hasher: Any = None  # FileHasher or StreamHasher: digest_at(position)
    output_hasher: Any = None  # hash of the sink file's first state.output_bytes bytes


def _input_hasher(opts: BatchOptions, source_format: str, stream: StreamHasher | None):
    if stream is not None:
        return stream
    if source_format == "parquet":
        return parquet_hasher(Path(opts.input))
    return FileHasher(Path(opts.input))


def _plan(
    opts: BatchOptions,
    out: Path,
    target: Path,
    parquet: bool,
    fp: dict,
    source,
    stream: StreamHasher | None,
    ui: BatchUI,
) -> _Plan:
    """What to continue from; a fresh state when nothing was committed. Refuses unsafe reruns."""
    state = None if opts.overwrite else load_state(state_path(out))
    if (
        state is not None
        and not state.complete
        and state.stats.get("rows", 0) == 0
        and state.output_bytes == 0
    ):
        state = None  # nothing was committed (e.g. the model failed to load): start afresh
    if state is None:
        foreign = out.exists() and out.stat().st_size > 0 and not state_path(out).exists()
        if foreign and not opts.overwrite:
            raise UsageError(
                f"{out} exists and has no run-batch state beside it; pass --overwrite to replace it"
            )
        hasher = _input_hasher(opts, source.format, stream)
        fresh = JobState(
            fingerprint=fp,
            created=int(time.time()),
            input_hash={"position": 0, "blake2b": hasher.digest_at(0)},
        )
        return _Plan(fresh, hasher, new_hasher())
    diff = fingerprint_mismatch(state.fingerprint, fp)
    if diff is not None:
        raise UsageError(
            f"cannot resume {out}: {diff}; rerun with the same settings, or {OVERWRITE}"
        )
    if state.complete:
        _verify_finished(out, parquet, state)
        return _Plan(state)
    if state.output_bytes > 0 and not target.exists():
        raise UsageError(f"cannot resume {out}: its partial output is gone; {OVERWRITE}")
    if state.legacy:
        ui.info(
            f"{state_path(out)} is from an older llmctl: the input and output contents "
            f"cannot be checked, only their sizes; resuming"
        )
        state.version = STATE_VERSION
    return _Plan(
        state, _verify_input(opts, out, source.format, stream, state), _verify_output(target, state)
    )


def _verify_input(
    opts: BatchOptions, out: Path, source_format: str, stream: StreamHasher | None, state: JobState
):
    """The input hasher, after checking the input starts with the bytes the job consumed."""
    hasher = _input_hasher(opts, source_format, stream)
    if state.input_hash is None:
        return hasher
    position, digest = state.input_hash["position"], state.input_hash["blake2b"]
    if stream is not None:
        stream.expect(position, digest)  # checked as the stream is read again (before any commit)
        return stream
    try:
        same = hasher.digest_at(position) == digest
    except PrefixChanged:
        same = False
    if not same:
        raise UsageError(
            f"cannot resume {out}: the input changed since the job started (the rows "
            f"already served are not the same); rerun with that input, or {OVERWRITE}"
        )
    return hasher


def _verify_output(target: Path, state: JobState):
    """The hash of the sink file's committed prefix, after checking it against the state."""
    size = target.stat().st_size if target.exists() else 0
    if size < state.output_bytes:
        raise UsageError(
            f"cannot resume: {target} is shorter ({size} bytes) than its state file "
            f"says ({state.output_bytes}); it was changed by hand: {OVERWRITE}"
        )
    hasher = hash_file_prefix(target, state.output_bytes)
    if state.output_blake2b is not None and hasher.hexdigest() != state.output_blake2b:
        raise UsageError(
            f"cannot resume: the first {state.output_bytes} bytes of {target} (the "
            f"rows committed) were changed since; {OVERWRITE}"
        )
    return hasher


def _verify_finished(out: Path, parquet: bool, state: JobState) -> None:
    """A finished output must still be the file the job finished."""
    again = "pass --overwrite to run the job again"
    if not out.is_file():
        raise UsageError(f"{out} is gone although its job finished; {again}")
    size = out.stat().st_size
    want = state.final_bytes
    if want is None and not parquet:  # a legacy state: a JSONL output is its committed bytes
        want = state.output_bytes
    if want is not None and size != want:
        raise UsageError(
            f"{out} was changed since its job finished ({size} bytes, was {want}); {again}"
        )
    if (
        state.final_blake2b is not None
        and hash_file_prefix(out, size).hexdigest() != state.final_blake2b
    ):
        raise UsageError(
            f"{out} was changed since its job finished (same size, other bytes); {again}"
        )


# -- driving ------------------------------------------------------------------------------------


def _record_format(opts: BatchOptions, source_format: str, model_name: str, created: int):
    if source_format == "openai":

        def fmt(row: InputRow, r: RowResult) -> bytes:
            return encode_record(openai_record(row, r, model_name, created, opts.include_token_ids))
    else:

        def fmt(row: InputRow, r: RowResult) -> bytes:
            return encode_record(simple_record(row, r, opts.include_token_ids))

    return fmt


class _Job:
    """The session's state commits and the job loop, with interruptions and write failures turned
    into one-line errors. `state` only ever holds what is on disk."""

    def __init__(
        self,
        opts: BatchOptions,
        source,
        out: Path | None,
        state: JobState,
        defaults: SamplingParams,
        engine_config: EngineConfig,
        ui: BatchUI,
        input_hasher=None,
    ):
        self.opts, self.source, self.out, self.state = opts, source, out, state
        self.defaults, self.engine_config, self.ui = defaults, engine_config, ui
        self.input_hasher = input_hasher

    def _committed_rows(self) -> int:
        return self.state.stats.get("rows", 0)

    def _save(self, **changes: Any) -> None:
        """Save the state with changes; only a saved state becomes self.state."""
        new = dataclasses.replace(self.state, **changes)
        save_state(state_path(self.out), new)
        self.state = new

    def save_now(self, sink: FileSink) -> None:
        with self._write_errors():
            self._save(output_bytes=sink.bytes, output_blake2b=sink.digest())

    def _on_commit(self, sink: FileSink) -> Callable[[Checkpoint], None]:
        def on_commit(c: Checkpoint) -> None:
            # The input hash covers every row written: up to the watermark, or past the rows
            # written ahead of it (--unordered). It never moves back.
            prev = (self.state.input_hash or {}).get("position", 0)
            position = max(prev, c.read_position if c.done_after else c.next_position)
            try:
                digest = self.input_hasher.digest_at(position)
            except NotVerifiedYet:
                return  # a resumed stdin not yet checked: keep the last commit (safe, only older)
            self._save(
                next_index=c.next_index,
                next_position=c.next_position,
                done_after=c.done_after,
                output_bytes=c.output_bytes,
                output_blake2b=sink.digest(),
                stats=c.stats.to_state(),
                input_hash={"position": position, "blake2b": digest},
            )

        return on_commit

    def drive(self, sink, runtime, engine) -> BatchStats:
        opts, state = self.opts, self.state
        model_name = getattr(runtime, "model_name", None) or opts.model or "llmctl-demo"
        max_in_flight = opts.max_in_flight or 2 * self.engine_config.max_num_seqs
        settings = JobSettings(
            max_in_flight=max_in_flight,
            window=4 * max_in_flight,
            ordered=opts.ordered,
            max_errors=opts.max_errors,
            commit_rows=opts.commit_rows,
            commit_interval_s=opts.commit_interval_s,
        )
        stats = BatchStats.from_state(state.stats)
        stats.input_format = self.source.format  # said in the summary: detection may have chosen it
        rows_total = self.source.count_rows()
        fmt = _record_format(opts, self.source.format, model_name, state.created)
        rows = self.source.rows(state.next_index, state.next_position)
        job = BatchJob(
            engine,
            runtime,
            rows,
            sink,
            fmt,
            self.defaults,
            settings,
            stats=stats,
            start_index=state.next_index,
            start_position=state.next_position,
            done_after=state.done_after,
            on_commit=None if self.out is None else self._on_commit(sink),
            on_progress=self.ui.progress,
            rows_total=rows_total,
        )
        if stats.rows:
            self.ui.info(f"resuming {self.out}: {stats.rows} rows already written")
        self.ui.start(rows_total, stats.rows)
        try:
            with self._write_errors(lambda: job.stats.rows):
                return job.run()
        finally:
            self.ui.stop()

    def finish(self, sink: FileSink, parquet: bool) -> None:
        """Convert a Parquet journal, then mark the job complete with the final output's hash."""
        out = self.out
        with self._write_errors(finishing=True):
            if parquet:
                journal_to_parquet(journal_path(out), out, self.opts.include_token_ids)
                size = out.stat().st_size
                final = hash_file_prefix(out, size).hexdigest()
            else:
                size, final = sink.bytes, sink.digest()
            self._save(complete=True, final_bytes=size, final_blake2b=final)
            if parquet:
                journal_path(out).unlink()

    def _write_errors(self, rows_written: Callable[[], int] | None = None, finishing: bool = False):
        return _WriteErrors(self, rows_written, finishing)


class _WriteErrors:
    """Turns an interruption, a closed stdout or a failed write into the one-line error for it."""

    def __init__(self, job: _Job, rows_written: Callable[[], int] | None, finishing: bool):
        self.job, self.rows_written, self.finishing = job, rows_written, finishing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            return False
        job, out = self.job, self.job.out
        rows = self.rows_written() if self.rows_written is not None else job._committed_rows()
        if issubclass(kind, (BrokenPipeError, KeyboardInterrupt, OSError)):
            job.ui.stop()  # before the message, so it is not drawn over
        if issubclass(kind, BrokenPipeError) and out is None:
            # no second BrokenPipeError when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            job.ui.info(f"stdout was closed after {rows} rows; stopping")
            raise StdoutClosed("") from None
        if issubclass(kind, KeyboardInterrupt):
            if out is None:
                raise BatchInterrupted(
                    f"interrupted after {rows} rows (no resume with -o -)"
                ) from None
            if self.finishing:
                raise BatchInterrupted(
                    f"interrupted while finishing {out}; rerun the same command to finish it"
                ) from None
            raise BatchInterrupted(
                f"interrupted: {job._committed_rows()} rows are safely in "
                f"{out}; rerun the same command to continue"
            ) from None
        if issubclass(kind, OSError):
            raise _write_error(error, out, job._committed_rows(), rows) from None
        return False


def _write_error(e: OSError, out: Path | None, committed: int, written: int) -> LlmctlError:
    if out is None:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return LlmctlError(f"disk full after {written} rows written to stdout")
        return LlmctlError(f"cannot write stdout: {e.strerror or e}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return LlmctlError(
            f"disk full after {committed} committed rows; free space and rerun to resume"
        )
    return LlmctlError(
        f"cannot write {out}: {e.strerror or e}; the {committed} rows committed "
        f"before are kept, rerun to continue"
    )
