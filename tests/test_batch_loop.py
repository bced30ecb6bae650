"""The run-batch loop (`BatchLoop`) on a fake engine: ordering, bad rows, --max-errors, resume,
memory bounds."""

from __future__ import annotations

import json

import pytest

from llmctl.batch.commits import Checkpoint
from llmctl.batch.inputs import JsonlSource
from llmctl.batch.loop import BatchLoop, LoopSettings
from llmctl.batch.outputs import encode_record, simple_record
from llmctl.batch.rows import InputRow
from llmctl.batch.summary import BatchStats
from llmctl.engine.params import SamplingParams
from llmctl.errors import AbortedError
from tests.fakes import FakeEngine, FakeRuntime


class MemorySink:
    """Collects bytes; `commit` remembers the committed size, like FileSink."""

    def __init__(self):
        self.data = bytearray()
        self.committed = 0

    @property
    def bytes(self):
        return len(self.data)

    def write(self, b: bytes) -> None:
        self.data += b

    def commit(self) -> int:
        self.committed = len(self.data)
        return self.committed

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in bytes(self.data).splitlines()]


def gen_rows(n: int, start: int = 0, max_tokens=lambda i: 1 + (i * 7) % 5):
    for i in range(start, n):
        yield InputRow(
            index=i,
            position=i,
            end_position=i + 1,
            id=i + 1,
            prompt=f"row {i}",
            overrides={"max_tokens": max_tokens(i)},
        )


def fmt(row, result):
    return encode_record(simple_record(row, result))


def make_job(rows, sink=None, engine=None, **settings):
    engine = engine or FakeEngine(max_num_seqs=4)
    sink = sink if sink is not None else MemorySink()
    kw = {
        k: settings.pop(k)
        for k in list(settings)
        if k in ("stats", "start_index", "start_position", "done_after", "on_commit", "on_progress")
    }
    job = BatchLoop(
        engine,
        FakeRuntime(engine),
        rows,
        sink,
        fmt,
        SamplingParams(max_tokens=3, temperature=0.0),
        LoopSettings(**settings),
        **kw,
    )
    return job, sink, engine


def test_ordered_output_follows_input_order_though_rows_finish_out_of_order():
    job, sink, _ = make_job(gen_rows(40), max_in_flight=8, window=32)
    stats = job.run()
    ids = [r["id"] for r in sink.rows()]
    assert ids == list(range(1, 41))
    assert stats.rows == 40 and stats.errors == 0
    assert job.peaks.reorder_buffer > 1  # something did finish early and wait for its turn
    # per-row max_tokens overrides the default of 3
    assert [r["usage"]["completion_tokens"] for r in sink.rows()] == [
        1 + (i * 7) % 5 for i in range(40)
    ]


def test_unordered_writes_rows_as_they_finish():
    job, sink, _ = make_job(gen_rows(40), max_in_flight=8, window=32, ordered=False)
    job.run()
    ids = [r["id"] for r in sink.rows()]
    assert sorted(ids) == list(range(1, 41))
    assert ids != list(range(1, 41))
    ordered_job, ordered_sink, _ = make_job(gen_rows(40), max_in_flight=8, window=32)
    ordered_job.run()
    by_id = {r["id"]: r for r in ordered_sink.rows()}
    assert all(by_id[r["id"]] == r for r in sink.rows())  # same content, other order


def test_bad_rows_and_engine_refusals_become_error_rows():
    rows = [
        InputRow(index=0, position=0, end_position=1, id=1, prompt="fine"),
        InputRow(
            index=1, position=1, end_position=2, id=2, prompt="x" * 100
        ),  # longer than the context
        InputRow(
            index=2, position=2, end_position=3, id=3, prompt="ok", overrides={"temperature": "hot"}
        ),
        InputRow(
            index=3, position=3, end_position=4, id=4, prompt_token_ids=[1, 999]
        ),  # outside vocab 256
        InputRow(
            index=4, position=4, end_position=5, id=5, messages=[{"role": "user", "content": "hi"}]
        ),
        InputRow(
            index=5, position=5, end_position=6, id=6, prompt="ok", overrides={"ignore_eos": "yes"}
        ),
    ]
    job, sink, _ = make_job(iter(rows), engine=FakeEngine(max_model_len=50))
    stats = job.run()
    out = sink.rows()
    codes = [r["error"]["code"] if r["error"] else None for r in out]
    assert codes == [
        None,
        "prompt_too_long",
        "invalid_parameter",
        "invalid_token_id",
        None,
        "invalid_parameter",
    ]
    assert out[1]["usage"]["prompt_tokens"] == 100  # known even though it could not be served
    assert out[4]["text"] and out[0]["text"]
    assert stats.errors == 4 and stats.errors_by_code == {
        "prompt_too_long": 1,
        "invalid_parameter": 2,
        "invalid_token_id": 1,
    }


def test_max_errors_aborts_after_committing_written_rows():
    def rows():
        for i in range(100):
            bad = i % 10 == 9
            yield InputRow(
                index=i,
                position=i,
                end_position=i + 1,
                id=i + 1,
                prompt="" if bad else "p",
                overrides={"max_tokens": "many"} if bad else {},
            )

    commits: list[Checkpoint] = []
    job, sink, _ = make_job(
        rows(), max_in_flight=4, window=8, max_errors=2, on_commit=commits.append
    )
    with pytest.raises(AbortedError) as e:
        job.run()
    assert "3 failed rows" in str(e.value)
    assert job.stats.errors == 3
    assert (
        commits[-1].output_bytes == sink.bytes == sink.committed
    )  # everything written is committed
    out = sink.rows()
    assert out[-1]["error"]["code"] == "empty_prompt" and out[-1]["id"] == 30
    assert [r["id"] for r in out] == list(range(1, 31))


def test_seed_option_gives_each_row_its_own_reproducible_seed():
    seen = {}

    class Recording(FakeEngine):
        def add_request(self, rid, ids, params):
            seen[rid] = params.seed
            super().add_request(rid, ids, params)

    rows = [
        InputRow(
            index=i,
            position=i,
            end_position=i + 1,
            id=i,
            prompt="p",
            overrides={"seed": 99} if i == 2 else {},
        )
        for i in range(4)
    ]
    engine = Recording()
    job = BatchLoop(
        engine,
        FakeRuntime(engine),
        iter(rows),
        MemorySink(),
        fmt,
        SamplingParams(max_tokens=2, temperature=0.7, seed=10),
    )
    job.run()
    assert seen == {"0": 10, "1": 11, "2": 99, "3": 13}


class Interrupting(FakeEngine):
    """Raises KeyboardInterrupt at step `at`, as a Ctrl-C would."""

    def __init__(self, at: int, **kw):
        super().__init__(**kw)
        self.at = at

    def step(self):
        if self.steps == self.at:
            raise KeyboardInterrupt
        return super().step()


@pytest.mark.parametrize("ordered", [True, False])
def test_interrupted_job_resumed_from_its_checkpoint_equals_an_uninterrupted_one(ordered):
    n = 60
    full, full_sink, _ = make_job(gen_rows(n), max_in_flight=6, window=12, ordered=ordered)
    full.run()

    commits: list[Checkpoint] = []
    sink = MemorySink()
    job, _, _ = make_job(
        gen_rows(n),
        sink=sink,
        engine=Interrupting(at=17, max_num_seqs=4),
        max_in_flight=6,
        window=12,
        ordered=ordered,
        commit_rows=5,
        on_commit=commits.append,
    )
    with pytest.raises(KeyboardInterrupt):
        job.run()
    cp = commits[-1]
    assert 0 < cp.stats.rows < n and cp.output_bytes == sink.committed
    if not ordered:
        assert all(i > cp.next_index for i in cp.done_after)
    # resume: cut back to the committed size, read again from the checkpoint's row
    sink.data = sink.data[: cp.output_bytes]
    job2, _, _ = make_job(
        gen_rows(n, start=cp.next_index),
        sink=sink,
        max_in_flight=6,
        window=12,
        ordered=ordered,
        stats=BatchStats.from_state(cp.stats.to_state()),
        start_index=cp.next_index,
        start_position=cp.next_position,
        done_after=cp.done_after,
    )
    stats = job2.run()
    got, want = sink.rows(), full_sink.rows()
    assert sorted(r["id"] for r in got) == list(range(1, n + 1))  # every row exactly once
    assert stats.rows == n and stats.output_tokens == sum(
        r["usage"]["completion_tokens"] for r in want
    )
    if ordered:
        assert bytes(sink.data) == bytes(full_sink.data)
    else:
        assert sorted(got, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])


class CountingRows:
    """A lazily generated input that records how many rows have been pulled."""

    def __init__(self, n, slow_first: int = 0):
        self.n, self.pulled, self.slow_first = n, 0, slow_first

    def __iter__(self):
        for i in range(self.n):
            self.pulled += 1
            mt = self.slow_first if (i == 0 and self.slow_first) else 1 + i % 3
            yield InputRow(
                index=i,
                position=i,
                end_position=i + 1,
                id=i + 1,
                prompt_token_ids=[i % 200 + 1],
                overrides={"max_tokens": mt},
            )


class CountingSink(MemorySink):
    """Keeps only a count (so the test itself stays small) and checks reader lag on every write."""

    def __init__(self, source: CountingRows, window: int):
        super().__init__()
        self.source, self.window, self.lines, self.max_lag = source, window, 0, 0

    def write(self, b: bytes) -> None:
        self.lines += 1
        self.max_lag = max(self.max_lag, self.source.pulled - self.lines)


@pytest.mark.parametrize("ordered", [True, False])
def test_memory_stays_bounded_whatever_the_input_length(ordered):
    """Buffers are bounded by settings, not by the number of rows: compare a 10x longer input."""
    peaks = []
    for n in (3_000, 30_000):
        src = CountingRows(n)
        sink = CountingSink(src, window=64)
        engine = FakeEngine(max_num_seqs=8)
        job = BatchLoop(
            engine,
            FakeRuntime(engine),
            iter(src),
            sink,
            fmt,
            SamplingParams(max_tokens=2, temperature=0.0),
            LoopSettings(max_in_flight=16, window=64, ordered=ordered),
        )
        job.run()
        assert sink.lines == n
        assert job.peaks.in_flight <= 16 and engine.max_unfinished <= 16
        assert (
            job.peaks.window <= 64
            and job.peaks.reorder_buffer <= 64
            and job.peaks.written_ahead <= 64
        )
        assert (
            sink.max_lag <= 64
        )  # the input is never read more than `window` rows ahead of the output
        assert not job._order and not job._finished and not job._written and not job._in_flight
        peaks.append((job.peaks.in_flight, job.peaks.window, engine.max_unfinished))
    assert peaks[0] == peaks[1]


def test_a_slow_first_row_stalls_reading_instead_of_buffering_everything():
    src = CountingRows(5_000, slow_first=400)  # row 0 takes 400 steps; the others 1-3
    sink = CountingSink(src, window=50)
    engine = FakeEngine(max_num_seqs=8)
    job = BatchLoop(
        engine,
        FakeRuntime(engine),
        iter(src),
        sink,
        fmt,
        SamplingParams(max_tokens=2, temperature=0.0),
        LoopSettings(max_in_flight=10, window=50, ordered=True),
    )
    job.run()
    assert sink.lines == 5_000
    assert job.peaks.reorder_buffer == 50  # filled up to the window behind the slow row, no further
    assert sink.max_lag <= 50


def test_jsonl_source_feeds_the_job_lazily(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "max_tokens": 1}) + "\n" for i in range(500))
    )
    with open(path, "rb") as f:
        src = JsonlSource(f, "jsonl", seekable=True)
        job, sink, _ = make_job(src.rows(), max_in_flight=4, window=16)
        job.run()
    assert [r["id"] for r in sink.rows()] == list(range(1, 501))
    assert job.peaks.rows_read == 500 and job.peaks.window <= 16


class InterruptingSink(MemorySink):
    """A Ctrl-C landing just after a row's bytes were written, before the loop's bookkeeping."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.writes = at, 0

    def write(self, b: bytes) -> None:
        super().write(b)
        self.writes += 1
        if self.writes == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("ordered", [True, False])
def test_interrupt_in_the_middle_of_a_row_keeps_the_last_consistent_commit(ordered):
    n = 50
    full, full_sink, _ = make_job(gen_rows(n), max_in_flight=6, window=12, ordered=ordered)
    full.run()
    commits: list[Checkpoint] = []
    sink = InterruptingSink(at=23)
    job, _, _ = make_job(
        gen_rows(n),
        sink=sink,
        max_in_flight=6,
        window=12,
        ordered=ordered,
        commit_rows=4,
        on_commit=commits.append,
    )
    with pytest.raises(KeyboardInterrupt):
        job.run()
    cp = commits[-1]
    assert cp.stats.rows < 23 and cp.output_bytes < len(
        sink.data
    )  # the half-done row was not committed
    rest = MemorySink()
    rest.data = sink.data[: cp.output_bytes]
    job2, _, _ = make_job(
        gen_rows(n, start=cp.next_index),
        sink=rest,
        max_in_flight=6,
        window=12,
        ordered=ordered,
        stats=BatchStats.from_state(cp.stats.to_state()),
        start_index=cp.next_index,
        start_position=cp.next_position,
        done_after=cp.done_after,
    )
    job2.run()
    assert sorted(r["id"] for r in rest.rows()) == list(range(1, n + 1))
    assert sorted(rest.rows(), key=lambda r: r["id"]) == sorted(
        full_sink.rows(), key=lambda r: r["id"]
    )


def test_traced_memory_does_not_grow_with_the_input():
    """Python-heap peak for a 20,000-row job stays that of a 2,000-row job (a leak per row would
    show)."""
    import tracemalloc

    peaks = []
    for n in (2_000, 20_000):
        src = CountingRows(n)
        sink = CountingSink(src, window=64)
        engine = FakeEngine(max_num_seqs=8)
        job = BatchLoop(
            engine,
            FakeRuntime(engine),
            iter(src),
            sink,
            fmt,
            SamplingParams(max_tokens=2, temperature=0.0),
            LoopSettings(max_in_flight=16, window=64),
        )
        tracemalloc.start()
        job.run()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert sink.lines == n
    assert peaks[1] < 1.5 * peaks[0] + 64 * 1024, peaks  # a 10x longer input: about the same peak
