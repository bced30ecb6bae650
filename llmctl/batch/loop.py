"""The run-batch loop: feed the engine up to a bound, step it, reorder, write, commit.

Owns: `BatchLoop`, a plain-Python loop over an engine-like object (`add_request`, `step`,
`has_unfinished_requests`) and a tokenizer-like runtime (`encode`, `apply_chat_template`), so it
runs unchanged on a fake engine in tests, and its `LoopSettings`. It knows nothing of files, Typer
or Rich: rows come from an iterator, and finished rows go through a `commits.Committer` to a sink
(`write`, `commit`), with commits and progress as callbacks.

Memory bound: at most `window` rows are between the first row not yet written (the watermark)
and the last row read, so the reorder buffer, the set of rows written ahead of the watermark
(`--unordered`) and the requests in flight (<= `max_in_flight`) never grow with the input.

`--reorder prefix` (`LoopSettings.reorder`): rows are read ahead up to `window`, tokenized, and
wait in an `engine.prefix_order.PrefixQueue` (token ids only) that hands them to the engine with
rows sharing a prompt prefix one after another. Nothing else changes: rows are still written in
input order (the reorder buffer above), and a commit's resume point is still the watermark, so
rows read but not yet served are read again by a resumed job, never lost, never written twice.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from llmctl.batch.adapters import pick_adapter
from llmctl.batch.commits import Checkpoint, Committer, ResumePoint
from llmctl.batch.outputs import RowResult
from llmctl.batch.rows import InputRow
from llmctl.batch.summary import BatchStats, Progress
from llmctl.batch.tool_calls import tool_calls_of
from llmctl.engine.params import SamplingParams
from llmctl.engine.prefix_order import PrefixQueue
from llmctl.errors import AbortedError, RequestError


class EngineLike(Protocol):
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...
    def step(self) -> list[Any]: ...
    def has_unfinished_requests(self) -> bool: ...


class RuntimeLike(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> list[int]: ...


@dataclass(frozen=True)
class LoopSettings:
    max_in_flight: int = 512  # requests handed to the engine and not finished
    window: int = 2048  # rows read but not yet behind the watermark (bounds the reorder buffer)
    ordered: bool = True  # False: write rows as they finish (--unordered)
    max_errors: int | None = None  # abort once more than this many rows failed
    commit_rows: int = 256  # fsync + state save after this many written rows...
    commit_interval_s: float = 2.0  # ...or this many seconds, whichever first
    progress_interval_s: float = 0.2
    reorder: bool = False  # --reorder prefix: read ahead to `window`, admit in prefix order
    block_size: int = 16  # the prefix cache's block size: what reordered rows are grouped by
    adapters: tuple[str, ...] = ()  # --lora-modules names, which rows pick by model or lora
    base_names: tuple[str, ...] = ()  # names that pick the base model (batch/adapters.py)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.window < 1:
            raise ValueError("max_in_flight and window must be >= 1")


@dataclass
class Peaks:
    """High-water marks of the loop's buffers, for tests and diagnostics."""

    in_flight: int = 0
    window: int = 0
    reorder_buffer: int = 0
    written_ahead: int = 0
    rows_read: int = 0


@dataclass
class _Pending:
    """A finished row waiting for its turn in the output (ordered mode)."""

    data: bytes
    result: RowResult


class BatchLoop:
    """Serves `rows` on `engine` and writes each row's output line (`format_record`) to `sink`,
    in input order unless `settings.ordered` is False; `run` returns the totals."""

    def __init__(
        self,
        engine: EngineLike,
        runtime: RuntimeLike,
        rows: Iterator[InputRow],
        sink: Any,
        format_record: Callable[[InputRow, RowResult], bytes],
        defaults: SamplingParams,
        settings: LoopSettings = LoopSettings(),
        *,
        stats: BatchStats | None = None,
        start_index: int = 0,
        start_position: int = 0,
        done_after: list[int] | None = None,
        on_commit: Callable[[Checkpoint], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        rows_total: int | None = None,
    ):
        self.engine, self.runtime, self.sink = engine, runtime, sink
        self._rows = rows
        self._format = format_record
        # field by field (asdict would turn a default constraint into a dict)
        self._defaults = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
        self.settings = settings
        self.stats = stats if stats is not None else BatchStats()
        self._base_spec = (self.stats.spec_proposed, self.stats.spec_accepted)
        self._base_prefix = (self.stats.prefix_hit_tokens, self.stats.prefix_query_tokens)
        self._resume_done = set(done_after or ())
        self.committer = Committer(
            sink,
            self.stats,
            settings,
            self._resume_point,
            on_commit=on_commit,
            on_progress=on_progress,
            rows_total=rows_total,
        )
        self._vocab_size = getattr(getattr(runtime, "config", None), "vocab_size", None)

        self._order: deque[int] = (
            deque()
        )  # rows read and not yet behind the watermark, in read order
        self._positions: dict[int, int] = {}  # row index -> input position, for rows in _order
        # request id -> (row, its params); the prompt is dropped after submission
        self._in_flight: dict[str, tuple[InputRow, SamplingParams]] = {}
        self._finished: dict[
            int, _Pending
        ] = {}  # ordered mode: finished rows waiting for earlier ones
        self._written: set[int] = set()  # rows written ahead of the watermark
        self._next_read = (start_index, start_position)  # resume point when _order is empty
        self._exhausted = False
        # --reorder prefix: rows read and tokenized, waiting for the engine (ids, not prompts)
        self._queue = PrefixQueue(settings.block_size) if settings.reorder else None
        self._busy = False  # True while one row's bookkeeping is half-updated: no commit then
        self.peaks = Peaks()

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> BatchStats:
        """Serve every row; returns the totals. Commits before re-raising any interruption."""
        c = self.committer
        c.start()
        try:
            while True:
                admitted = self._admit()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._count_engine()
                    for out in outputs:
                        self._finish(out)
                    c.maybe_commit()
                    c.progress()  # also while no row finishes (a timed progress line)
                elif self._exhausted and not self._in_flight:
                    break
                elif not admitted:
                    raise RuntimeError(
                        "run-batch loop made no progress (engine idle with requests in flight)"
                    )
        except AbortedError:
            raise  # committed by check_errors before raising
        except BaseException:
            # Ctrl-C can land anywhere; commit only when the bookkeeping is not half-updated
            # (otherwise the previous commit stays the resume point and the rows after it are
            # served again).
            if not self._busy:
                self._count_engine()  # the engine may have counted some before a step raised
                c.safe_commit()
            raise
        c.finish()
        return self.stats

    def _admit(self) -> int:
        """Read and submit rows while the in-flight and window bounds allow (reordering: read to
        the window, then submit from the queue); returns rows read plus rows submitted from it."""
        s, n = self.settings, 0
        reorder = self._queue is not None
        while (
            not self._exhausted
            and (reorder or len(self._in_flight) < s.max_in_flight)
            and len(self._order) < s.window
        ):
            row = next(self._rows, None)
            if row is None:
                self._exhausted = True
                break
            n += 1
            self._busy = True
            self.peaks.rows_read += 1
            self._order.append(row.index)
            self._positions[row.index] = row.position
            self._next_read = (row.index + 1, row.end_position)
            self.peaks.window = max(self.peaks.window, len(self._order))
            if row.index in self._resume_done:  # written by an earlier session (--unordered)
                self._resume_done.discard(row.index)
                self._written.add(row.index)
                self._advance()
            else:
                self._submit(row)
            self._busy = False
            self.committer.check_errors()
        return n + (self._release() if reorder else 0)

    def _release(self) -> int:
        """Hand queued rows to the engine, in prefix order, while the in-flight bound allows."""
        n = 0
        while self._queue and len(self._in_flight) < self.settings.max_in_flight:
            self._busy = True
            _, ids, (row, params) = self._queue.pop()
            self._send(row, ids, params)
            self._busy = False
            self.committer.check_errors()
            n += 1
        return n

    def _submit(self, row: InputRow) -> None:
        s = self.settings
        if row.error is not None:
            self._complete(row, RowResult.failed(row.error))
            return
        try:
            row.lora = pick_adapter(row.model, row.lora, s.adapters, s.base_names)
            ids = self._tokenize(row)
            params = self._params(row)
        except RequestError as e:
            self._complete(row, RowResult.failed(e))
            return
        if self._queue is not None:
            # the queue keeps the ids; the row, only what the output needs
            row.prompt = row.messages = row.prompt_token_ids = row.tools = None
            self._queue.push(row.index, ids, (row, params))
        else:
            self._send(row, ids, params)

    def _send(self, row: InputRow, ids: list[int], params: SamplingParams) -> None:
        rid = str(row.index)
        try:
            lora = {"lora": row.lora} if row.lora else {}  # engines without adapters take none
            self.engine.add_request(rid, ids, params, **lora)
        except RequestError as e:
            self._complete(row, RowResult.failed(e, prompt_tokens=len(ids)))
            return
        # keep only what the output needs
        row.prompt = row.messages = row.prompt_token_ids = row.tools = None
        self._in_flight[rid] = (row, params)
        self.peaks.in_flight = max(self.peaks.in_flight, len(self._in_flight))

    def _tokenize(self, row: InputRow) -> list[int]:
        try:
            if row.prompt_token_ids is not None:
                ids = row.prompt_token_ids
                if self._vocab_size is not None and max(ids) >= self._vocab_size:
                    raise RequestError(
                        "invalid_token_id",
                        f"token id {max(ids)} is outside the vocabulary (size {self._vocab_size})",
                    )
            elif row.tools:  # rendered by the model's chat template, as transformers does
                ids = list(self.runtime.apply_chat_template(row.messages, tools=row.tools))
            elif row.messages is not None:
                ids = list(self.runtime.apply_chat_template(row.messages))
            else:
                ids = list(self.runtime.encode(row.prompt))
        except RequestError:
            raise
        except Exception as e:  # a tokenizer failing on one row must not stop the job
            raise RequestError("tokenization_failed", f"{type(e).__name__}: {e}") from None
        if not ids:
            raise RequestError("empty_prompt", "the prompt encodes to no tokens")
        return ids

    def _params(self, row: InputRow) -> SamplingParams:
        """Job defaults overridden by the row; `--seed S` gives row i the seed S + i."""
        values = dict(self._defaults)
        values.update(row.overrides)
        if "seed" not in row.overrides and self._defaults.get("seed") is not None:
            values["seed"] = self._defaults["seed"] + row.index
        for name, v in row.overrides.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise RequestError("invalid_parameter", f"{name} must be a finite number, got {v}")
        if not isinstance(values.get("ignore_eos"), bool):
            raise RequestError(
                "invalid_parameter",
                f"ignore_eos must be true or false, got {values['ignore_eos']!r}",
            )
        try:
            return SamplingParams(**values)
        except (TypeError, ValueError) as e:
            raise RequestError("invalid_parameter", str(e)) from None

    def _finish(self, out: Any) -> None:
        self._busy = True
        row, params = self._in_flight.pop(out.request_id, (None, None))
        if row is None:
            raise RuntimeError(f"engine returned unknown request {out.request_id!r}")
        result = RowResult.of(out, params, self.runtime.decode)
        if row.tool_choice not in (None, "none"):  # the calls in each completion's text
            fmt = getattr(self.runtime, "tool_call_format", None)
            result.tools = [tool_calls_of(c.text, row.tool_choice, fmt) for c in result.outputs]
        self._complete(row, result)
        self._busy = False
        self.committer.check_errors()

    # -- ordering and writing -------------------------------------------------------------------

    def _complete(self, row: InputRow, result: RowResult) -> None:
        data = self._format(row, result)
        if self.settings.ordered:
            self._finished[row.index] = _Pending(data, result)
            self.peaks.reorder_buffer = max(self.peaks.reorder_buffer, len(self._finished))
        else:
            self._written.add(row.index)
            self.peaks.written_ahead = max(self.peaks.written_ahead, len(self._written))
            self._write(data, result)
        self._advance()

    def _advance(self) -> None:
        """Move the watermark past written rows, writing buffered rows whose turn has come."""
        while self._order:
            index = self._order[0]
            if index in self._written:
                self._written.discard(index)
            elif index in self._finished:
                pending = self._finished.pop(index)
                self._write(pending.data, pending.result)
            else:
                break
            self._order.popleft()
            del self._positions[index]

    def _write(self, data: bytes, result: RowResult) -> None:
        r = result
        self.committer.write(
            data, r.prompt_tokens, r.completion_tokens, r.error_code, r.ttft, r.tpot, r.structured
        )
        self.committer.progress()

    # -- what a commit holds --------------------------------------------------------------------

    def _resume_point(self) -> ResumePoint:
        """The first row not yet written; rows written past it (--unordered) are done_after."""
        if self._order:
            nxt = (self._order[0], self._positions[self._order[0]])
        else:
            nxt = self._next_read
        return ResumePoint(nxt[0], nxt[1], sorted(self._written), self._next_read[1])

    def _count_engine(self) -> None:
        """The speculative-decoding and prefix-cache counts: the engine's (they change only in
        `step`) after those of earlier sessions. Brought up to date before every commit."""
        engine_stats = getattr(self.engine, "stats", None)
        if engine_stats is not None and hasattr(engine_stats, "spec_proposed"):
            self.stats.spec_proposed = self._base_spec[0] + engine_stats.spec_proposed
            self.stats.spec_accepted = self._base_spec[1] + engine_stats.spec_accepted
        bm = getattr(self.engine, "block_manager", None)
        if bm is not None and hasattr(bm, "prefix_hits"):
            self.stats.prefix_hit_tokens = self._base_prefix[0] + bm.prefix_hits
            self.stats.prefix_query_tokens = self._base_prefix[1] + bm.prefix_queries


__all__ = ["BatchLoop", "EngineLike", "LoopSettings", "Peaks", "RuntimeLike"]
