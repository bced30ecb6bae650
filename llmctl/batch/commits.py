"""The output side of a run-batch loop: writing rows, commits, progress and `--max-errors`.

Owns: `Committer`, shared by the single-process loop (`loop.BatchLoop`) and the Ray driver's loop
(`ray.loop.RayLoop`): it writes each finished row's bytes to the sink and adds it to the totals,
commits (the sink's fsync, then a `Checkpoint` to the session's callback) every `commit_rows`
rows or `commit_interval_s` seconds, reports timed progress, and stops the job past
`--max-errors`. A loop gives it the resume point (`ResumePoint`): only the loop knows which rows
are behind the watermark; the committer knows when to commit and what a commit holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

from llmctl.batch.summary import BatchStats, Progress
from llmctl.errors import AbortedError


class CommitRules(Protocol):
    """The loop settings a committer reads (`loop.LoopSettings` has them)."""

    commit_rows: int  # commit after this many written rows...
    commit_interval_s: float  # ...or this many seconds, whichever first
    progress_interval_s: float
    max_errors: int | None  # abort once more than this many rows failed


class ResumePoint(NamedTuple):
    """Where a rerun starts: the first row not yet written (the watermark) and its position, the
    rows written past it (`--unordered`), and where the last row read ends."""

    next_index: int
    next_position: int
    done_after: list[int]
    read_position: int  # every row written lies before it


@dataclass(frozen=True)
class Checkpoint:
    """What is durable after a commit (see journal.JobState for the invariant)."""

    next_index: int
    next_position: int
    done_after: list[int]
    read_position: int
    output_bytes: int
    stats: BatchStats
    finished: bool


class Committer:
    """Writes rows to `sink` (`write`, `commit` -> bytes durable) and commits them; `resume_point`
    is asked at each commit and must only be asked between rows (the loop's bookkeeping whole)."""

    def __init__(
        self,
        sink: Any,
        stats: BatchStats,
        rules: CommitRules,
        resume_point: Callable[[], ResumePoint],
        *,
        on_commit: Callable[[Checkpoint], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        rows_total: int | None = None,
    ):
        self.sink, self.stats, self.rules = sink, stats, rules
        self._resume_point = resume_point
        self.on_commit, self.on_progress, self.rows_total = on_commit, on_progress, rows_total
        self._base_elapsed = stats.elapsed_s
        self._since_commit = 0
        self._session_output_tokens = 0
        self._t0 = self._last_commit = self._last_progress = time.perf_counter()

    def start(self) -> None:
        """The session's clock starts (its elapsed time adds to that of earlier sessions)."""
        self._t0 = self._last_commit = time.perf_counter()

    def write(
        self,
        data: bytes,
        prompt_tokens: int,
        completion_tokens: int,
        error_code: str | None,
        ttft: float | None,
        tpot: float | None,
        structured: str | None = None,
    ) -> None:
        """One row's output bytes, counted in the totals; durable at the next commit."""
        self.sink.write(data)
        self.stats.add_row(prompt_tokens, completion_tokens, error_code, ttft, tpot, structured)
        self._session_output_tokens += completion_tokens
        self._since_commit += 1

    def maybe_commit(self) -> None:
        """Commit after `commit_rows` rows or `commit_interval_s` seconds, whichever first."""
        rules = self.rules
        if self._since_commit and (
            self._since_commit >= rules.commit_rows
            or time.perf_counter() - self._last_commit >= rules.commit_interval_s
        ):
            self.commit()

    def commit(self, finished: bool = False) -> None:
        output_bytes = self.sink.commit()
        self.stats.elapsed_s = self._base_elapsed + (time.perf_counter() - self._t0)
        if self.on_commit is not None:
            point = self._resume_point()
            self.on_commit(
                Checkpoint(*point, output_bytes=output_bytes, stats=self.stats, finished=finished)
            )
        self._since_commit = 0
        self._last_commit = time.perf_counter()

    def safe_commit(self) -> None:
        """Commit on the way out of an interruption, keeping the interruption the error raised."""
        try:
            self.commit()
        except Exception:
            pass  # the previous commit stays valid; the original error is what matters

    def finish(self) -> None:
        """The last commit (the job is finished) and the last progress line."""
        self.commit(finished=True)
        self.progress(force=True, finished=True)

    def check_errors(self) -> None:
        """--max-errors: called between rows, when a commit is consistent."""
        limit = self.rules.max_errors
        if limit is not None and self.stats.errors > limit:
            self.commit()
            self.progress(force=True)
            error = AbortedError(
                f"stopped after {self.stats.errors} failed rows (--max-errors {limit}); "
                f"{self.stats.rows} rows are written and kept"
            )
            error.stats = self.stats  # for --report-json
            raise error

    def progress(self, force: bool = False, finished: bool = False) -> None:
        """A progress report, at most every `progress_interval_s` unless forced."""
        if self.on_progress is None:
            return
        now = time.perf_counter()
        if not force and now - self._last_progress < self.rules.progress_interval_s:
            return
        self._last_progress = now
        elapsed = now - self._t0
        self.on_progress(
            Progress.of(self.stats, self.rows_total, self._session_output_tokens, elapsed, finished)
        )


__all__ = ["Checkpoint", "CommitRules", "Committer", "ResumePoint"]
