"""One session of a run-batch job: its loop, its state commits and its failures.

Owns: `JobSession` (drives a `loop.BatchLoop` into a sink, saves the state at each commit,
converts a Parquet journal and records the finished output's size and hash), how rows are encoded
for the input's format, the names a row's `model` gives the base model (`base_names`; the LoRA
adapters' are `--lora-modules`'), the UI protocol the command implements (`BatchUI`), and the
one-line errors an interruption, a closed stdout or a failed write become (`BatchInterrupted` 130,
`StdoutClosed` 141, 1). The Ray session (`ray.session.RayJobSession`) is this one with its rows
served by Ray replicas.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any, Callable, Protocol

from llmctl.batch.commits import Checkpoint
from llmctl.batch.digests import NotVerifiedYet, hash_file_prefix
from llmctl.batch.journal import JobState, journal_path, save_state, state_path
from llmctl.batch.loop import BatchLoop, LoopSettings
from llmctl.batch.options import BatchOptions
from llmctl.batch.outputs import (
    FileSink,
    RowResult,
    encode_record,
    journal_to_parquet,
    openai_record,
    simple_record,
)
from llmctl.batch.rows import InputRow
from llmctl.batch.summary import BatchStats, Progress
from llmctl.engine.config import EngineConfig
from llmctl.engine.params import SamplingParams
from llmctl.errors import LlmctlError


class BatchInterrupted(LlmctlError):
    """Ctrl-C or SIGTERM: committed rows are kept and a rerun of the same command continues."""

    exit_code = 130


class StdoutClosed(LlmctlError):
    """`-o - | head`: the reader went away. Ends quietly with 141 (128 + SIGPIPE), as `cat` or
    `grep` do, so `set -o pipefail` scripts see what they see for any Unix filter."""

    exit_code = 141


class BatchUI(Protocol):
    def info(self, message: str) -> None: ...
    def start(self, rows_total: int | None, rows_done: int) -> None: ...
    def progress(self, p: Progress) -> None: ...
    def stop(self) -> None: ...


class SilentUI:
    def info(self, message: str) -> None: ...
    def start(self, rows_total: int | None, rows_done: int) -> None: ...
    def progress(self, p: Progress) -> None: ...
    def stop(self) -> None: ...


def base_names(opts: BatchOptions, model_name: str, runtime) -> tuple[str, ...]:
    """The names a row's `model` may give the base model: the served name, the model as given,
    its folder's name, the runtime's name for it."""
    given = opts.model or ""
    names = (model_name, given, Path(given).name, getattr(runtime, "model_name", None))
    return tuple(dict.fromkeys(n for n in names if n))


def record_format(opts: BatchOptions, source_format: str, model_name: str, created: int):
    """(input row, result) -> the encoded output line for the input's format."""
    if source_format == "openai":

        def fmt(row: InputRow, r: RowResult) -> bytes:
            return encode_record(openai_record(row, r, model_name, created, opts.include_token_ids))
    else:

        def fmt(row: InputRow, r: RowResult) -> bytes:
            return encode_record(simple_record(row, r, opts.include_token_ids))

    return fmt


@dataclasses.dataclass
class JobSession:
    """The session's state commits and its loop, with interruptions and write failures turned
    into one-line errors. `state` only ever holds what is on disk; `out` is None for stdout."""

    opts: BatchOptions
    source: Any  # an open input (llmctl.batch.inputs)
    out: Path | None
    state: JobState
    defaults: SamplingParams
    engine_config: EngineConfig
    ui: BatchUI
    input_hasher: Any = None

    def committed_rows(self) -> int:
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

    def _settings(self, base: tuple[str, ...] = ()) -> LoopSettings:
        opts = self.opts
        max_in_flight = opts.max_in_flight or 2 * self.engine_config.max_num_seqs
        reorder = opts.reorder == "prefix"
        return LoopSettings(
            max_in_flight=max_in_flight,
            # --reorder prefix groups the rows read ahead: --reorder-window of them when given
            window=(reorder and opts.reorder_window) or 4 * max_in_flight,
            ordered=opts.ordered,
            max_errors=opts.max_errors,
            commit_rows=opts.commit_rows,
            commit_interval_s=opts.commit_interval_s,
            reorder=reorder,
            block_size=self.engine_config.block_size,
            adapters=tuple(opts.lora_modules),
            base_names=base,
        )

    def drive(self, sink, runtime, engine) -> BatchStats:
        state = self.state
        model_name = (
            self.opts.served_model_name
            or getattr(runtime, "model_name", None)
            or self.opts.model
            or "llmctl-demo"
        )
        stats = BatchStats.from_state(state.stats)
        stats.input_format = self.source.format  # said in the summary: detection may have chosen it
        rows_total = self.source.count_rows()
        fmt = record_format(self.opts, self.source.format, model_name, state.created)
        rows = self.source.rows(state.next_index, state.next_position)
        loop = BatchLoop(
            engine,
            runtime,
            rows,
            sink,
            fmt,
            self.defaults,
            self._settings(base_names(self.opts, model_name, runtime)),
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
            with self._write_errors(lambda: loop.stats.rows):
                return loop.run()
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

    def __init__(
        self, session: JobSession, rows_written: Callable[[], int] | None, finishing: bool
    ):
        self.session, self.rows_written, self.finishing = session, rows_written, finishing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            return False
        session, out = self.session, self.session.out
        rows = self.rows_written() if self.rows_written is not None else session.committed_rows()
        if issubclass(kind, (BrokenPipeError, KeyboardInterrupt, OSError)):
            session.ui.stop()  # before the message, so it is not drawn over
        if issubclass(kind, BrokenPipeError) and out is None:
            # no second BrokenPipeError when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            session.ui.info(f"stdout was closed after {rows} rows; stopping")
            raise StdoutClosed("") from None
        if issubclass(kind, KeyboardInterrupt):
            raise _interrupted(out, rows, session.committed_rows(), self.finishing) from None
        if issubclass(kind, OSError):
            raise _write_error(error, out, session.committed_rows(), rows) from None
        return False


def _interrupted(out: Path | None, rows: int, committed: int, finishing: bool) -> LlmctlError:
    if out is None:
        return BatchInterrupted(f"interrupted after {rows} rows (no resume with -o -)")
    if finishing:
        return BatchInterrupted(
            f"interrupted while finishing {out}; rerun the same command to finish it"
        )
    return BatchInterrupted(
        f"interrupted: {committed} rows are safely in {out}; rerun the same command to continue"
    )


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
