"""The Ray driver's loop: the rows replicas return, written in the order they come back.

Owns: `RayLoop`, which writes each row's output line through the single-process loop's
`commits.Committer` (so commits, progress and `--max-errors` are that loop's), moves the resume
point over rows that come back in any order (`--unordered`), and turns a Ray failure into one
line (`_llmctl_cause`: the llmctl error a replica raised, e.g. its model failed to load).
"""

from __future__ import annotations

import re
from typing import Callable

from llmctl import errors
from llmctl.batch.commits import Checkpoint, Committer, ResumePoint
from llmctl.batch.loop import LoopSettings
from llmctl.batch.summary import BatchStats, Progress
from llmctl.errors import AbortedError, LlmctlError


class RayLoop:
    """Writes the rows replicas return, moves the resume point, commits and reports progress.

    The resume point (the first row not yet written, with its position) moves over a row once
    every row before it is written; rows written past it (--unordered) are `done_after` in the
    state, as in a single-process job, so a rerun serves every row exactly once."""

    def __init__(
        self,
        sink,
        stats: BatchStats,
        settings: LoopSettings,
        index: int,
        position: int,
        *,
        on_commit: Callable[[Checkpoint], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        rows_total: int | None = None,
    ):
        self.stats, self.settings = stats, settings
        self.committer = Committer(
            sink,
            stats,
            settings,
            self._resume_point,
            on_commit=on_commit,
            on_progress=on_progress,
            rows_total=rows_total,
        )
        self._next = (index, position)
        self._ahead: dict[int, tuple[int, tuple[int, int]]] = {}  # index_from -> (index, next)
        self._read_position = position
        self._busy = False  # True while one row's bookkeeping is half-updated: no commit then

    def run(self, batches, committed: Callable[[], int]) -> BatchStats:
        """Write every row of `batches` (Arrow tables of `ray.processor.Replica` results); a Ray
        failure becomes one line saying how many rows are committed (`committed()`)."""
        c = self.committer
        c.start()
        try:
            for batch in batches:
                for row in batch.to_pylist():
                    self._busy = True
                    self._take(row)
                    self._busy = False
                    c.check_errors()
                c.maybe_commit()
        except (AbortedError, KeyboardInterrupt, OSError):
            if not self._busy:
                c.safe_commit()
            raise
        except Exception as e:  # a Ray failure: keep what was written, one line
            if not self._busy:
                c.safe_commit()
            cause = _llmctl_cause(e)
            if cause is not None:
                raise cause from None
            first = (str(e).strip().splitlines() or [""])[-1]
            raise LlmctlError(
                f"the Ray job failed ({type(e).__name__}: {first}); {committed()} rows are "
                f"committed, rerun the same command to continue"
            ) from None
        c.finish()
        return self.stats

    def _take(self, row: dict) -> None:
        self.stats.spec_proposed += row["spec_proposed"]
        self.stats.spec_accepted += row["spec_accepted"]
        if not row["done"]:
            self.committer.write(
                row["data"], row["prompt_tokens"], row["completion_tokens"], row["error_code"],
                row["ttft"], row["tpot"], row["structured"],
            )  # fmt: skip
        nxt = (row["index"] + 1, row["end_position"])
        self._read_position = max(self._read_position, row["end_position"])
        if row["index_from"] != self._next[0]:
            if self.settings.ordered:
                raise RuntimeError(f"Ray returned row {row['index']} out of input order")
            self._ahead[row["index_from"]] = (row["index"], nxt)
            return
        self._next = nxt
        while self._next[0] in self._ahead:
            self._next = self._ahead.pop(self._next[0])[1]
        self.committer.progress()

    def _resume_point(self) -> ResumePoint:
        done_after = sorted(index for index, _ in self._ahead.values())
        return ResumePoint(self._next[0], self._next[1], done_after, self._read_position)


_REMOTE_ERROR = re.compile(r"llmctl\.errors\.(\w+): (.+)")


def _llmctl_cause(e: BaseException) -> LlmctlError | None:
    """The llmctl error a Ray error carries (e.g. a replica's model failed to load), if any: an
    actor that died in `__init__` only keeps its error's text, so the text is read back."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, LlmctlError):
            return e
        found = _REMOTE_ERROR.search(str(e))
        kind = getattr(errors, found.group(1), None) if found else None
        if isinstance(kind, type) and issubclass(kind, LlmctlError):
            return kind(found.group(2).strip())
        e = getattr(e, "cause", None) or e.__cause__
    return None
