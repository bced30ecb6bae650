"""The two Ray Data stages of `run-batch --ray`: reading the input, and one engine per replica.

Owns: `read_rows` (a Ray Data task running run-batch's own reader from the resume point, so
detection, row-level errors and positions are those of a single-process job), the Arrow table of
rows between the stages (one JSON column per row: no pickle), and `Replica`, the callable class
`map_batches` runs in an actor pool. A replica loads the model once, through the same loader as
a single-process job (`backends.load_engine`), and serves each batch with a `BatchLoop` of its
own, so tokenization, sampling settings, error rows and the output line's bytes are the
single-process ones. It returns rows; it never writes a file (the driver, `ray.session`, is the
only writer).

Between the stages each row carries `index_from`/`position_from`: where the previous row the
reader met ends (blank lines in between belong to this row), which lets the driver move its
resume point over rows that come back in any order (`--unordered`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from llmctl.batch.backends import load_engine
from llmctl.batch.inputs import open_input
from llmctl.batch.loop import BatchLoop, LoopSettings
from llmctl.batch.options import BatchOptions
from llmctl.batch.outputs import RowResult
from llmctl.batch.rows import InputRow
from llmctl.batch.session import SilentUI, base_names, record_format
from llmctl.engine.config import EngineConfig
from llmctl.engine.params import SamplingParams
from llmctl.errors import RequestError


@dataclass(frozen=True)
class ReadSpec:
    """What the reading task needs: the input as the driver opened it, and where to resume."""

    input: str
    format: str  # as detected by the driver
    prompt_column: str
    id_column: str | None
    messages_column: str | None
    start_index: int
    start_position: int
    done_after: tuple[int, ...]  # --unordered rows an earlier session wrote past its watermark
    batch_rows: int


def _row_to_json(row: InputRow) -> str:
    d = dataclasses.asdict(dataclasses.replace(row, error=None))
    if row.error is not None:
        d["error"] = {"code": row.error.code, "message": row.error.message, "p": row.error.param}
    return json.dumps(d)  # ASCII: a lone surrogate in a prompt travels as its JSON escape


def row_from_json(text: str) -> InputRow:
    d = json.loads(text)
    e = d.pop("error")
    error = None if e is None else RequestError(e["code"], e["message"], param=e["p"])
    return InputRow(**d, error=error)


def rows_table(rows: list[tuple[InputRow, int, int, bool]]):
    import pyarrow as pa

    return pa.table(
        {
            "index": pa.array([r.index for r, *_ in rows], pa.int64()),
            "index_from": pa.array([i for _, i, _, _ in rows], pa.int64()),
            "position_from": pa.array([p for _, _, p, _ in rows], pa.int64()),
            "end_position": pa.array([r.end_position for r, *_ in rows], pa.int64()),
            "done": pa.array([d for *_, d in rows], pa.bool_()),
            "row": pa.array(["" if d else _row_to_json(r) for r, _, _, d in rows], pa.string()),
        }
    )


def read_rows(_seed: Any, spec: ReadSpec) -> Iterator[Any]:
    """Ray Data stage (one task): the input's rows from the resume point, `batch_rows` a table.

    Rows an earlier --unordered session already wrote pass through marked `done`, so the driver
    can move its resume point over them."""
    source = open_input(
        spec.input, spec.format, spec.prompt_column, spec.id_column, spec.messages_column
    )
    done = set(spec.done_after)
    prev = (spec.start_index, spec.start_position)
    chunk: list[tuple[InputRow, int, int, bool]] = []
    try:
        for row in source.rows(spec.start_index, spec.start_position):
            chunk.append((row, prev[0], prev[1], row.index in done))
            prev = (row.index + 1, row.end_position)
            if len(chunk) >= spec.batch_rows:
                yield rows_table(chunk)
                chunk = []
        if chunk:
            yield rows_table(chunk)
    finally:
        source.close()


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica is built from (sent to each actor once)."""

    opts: BatchOptions  # with ray=None: a replica loads the model as a single-process job does
    engine_config: EngineConfig
    defaults: SamplingParams
    source_format: str
    created: int  # the job's creation time (the OpenAI output's `created`)
    load_runtime: Callable[..., Any]


class _NullSink:
    def write(self, data: bytes) -> None: ...

    def commit(self) -> int:
        return 0


class Replica:
    """One engine in a Ray actor: loads the model once, then serves batches of rows."""

    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        self.runtime, self.engine = load_engine(
            spec.opts, spec.engine_config, spec.load_runtime, SilentUI()
        )
        name = getattr(self.runtime, "model_name", None) or spec.opts.model or "llmctl-demo"
        self._format = record_format(spec.opts, spec.source_format, name, spec.created)
        in_flight = spec.opts.max_in_flight or 2 * spec.engine_config.max_num_seqs
        self._settings = LoopSettings(
            max_in_flight=in_flight,
            window=4 * in_flight,
            ordered=False,
            commit_rows=1 << 62,
            commit_interval_s=float("inf"),
            adapters=tuple(spec.opts.lora_modules),  # registered by load_engine, as in one process
            base_names=base_names(spec.opts, name, self.runtime),
        )

    def __call__(self, batch: Any) -> Any:
        """Arrow table of rows (see `read_rows`) -> the same rows with their output lines."""
        done = batch.column("done").to_pylist()
        texts = batch.column("row").to_pylist()
        rows = [row_from_json(t) for t, d in zip(texts, done) if not d]
        results: dict[int, tuple[bytes, RowResult]] = {}

        def fmt(row: InputRow, result: RowResult) -> bytes:
            data = self._format(row, result)
            results[row.index] = (data, result)
            return data

        before = self._spec_counts()
        loop = BatchLoop(
            self.engine,
            self.runtime,
            iter(rows),
            _NullSink(),
            fmt,
            self.spec.defaults,
            self._settings,
        )
        loop.run()
        spec = tuple(a - b for a, b in zip(self._spec_counts(), before))
        return _results_table(batch, results, spec)

    def _spec_counts(self) -> tuple[int, int]:
        """Draft tokens the engine proposed and accepted so far (speculative decoding)."""
        stats = getattr(self.engine, "stats", None)
        if stats is None or not hasattr(stats, "spec_proposed"):
            return 0, 0
        return stats.spec_proposed, stats.spec_accepted


def _results_table(batch: Any, results: dict[int, tuple[bytes, RowResult]], spec=(0, 0)):
    """The batch's rows with their results; the batch's speculative counts ride on its first
    row (the driver adds them to the summary)."""
    import pyarrow as pa

    got = [results.get(i) for i in batch.column("index").to_pylist()]
    empty = RowResult(None, None, 0, 0)
    res = [r[1] if r is not None else empty for r in got]
    columns = {
        name: batch.column(name)
        for name in ("index", "index_from", "position_from", "end_position", "done")
    }
    columns.update(
        data=pa.array([b"" if r is None else r[0] for r in got], pa.binary()),
        prompt_tokens=pa.array([r.prompt_tokens for r in res], pa.int64()),
        completion_tokens=pa.array([r.completion_tokens for r in res], pa.int64()),
        error_code=pa.array([r.error_code for r in res], pa.string()),
        structured=pa.array([r.structured for r in res], pa.string()),
        ttft=pa.array([r.ttft for r in res], pa.float64()),
        tpot=pa.array([r.tpot for r in res], pa.float64()),
        spec_proposed=pa.array([spec[0], *[0] * (len(res) - 1)][: len(res)], pa.int64()),
        spec_accepted=pa.array([spec[1], *[0] * (len(res) - 1)][: len(res)], pa.int64()),
    )
    return pa.table(columns)
