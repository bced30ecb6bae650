"""`--reorder prefix` in the run-batch loop (`BatchLoop` on a fake engine): the engine gets rows
grouped by prompt prefix, the output keeps input order and equals an input-order run, the window
bounds what is read ahead, and an interrupted job resumes to the same output."""

from __future__ import annotations

import pytest

from llmctl.batch.commits import Checkpoint
from llmctl.batch.rows import InputRow
from llmctl.batch.summary import BatchStats
from llmctl.engine.prefix_order import prefix_order
from tests.fakes import FakeEngine
from tests.test_batch_loop import Interrupting as LoopInterrupting
from tests.test_batch_loop import MemorySink, make_job

PREFIXES = [
    "You are a pirate. Answer briefly. ",
    "Summarise the text that follows: ",
    "Q: ",
    "Translate into French, please: ",
    "Write a haiku about the sea. ",
]


def prompt(i: int, groups: int = 3) -> str:
    # rows i and i + groups share a prefix: sharing rows are never adjacent in the input
    return PREFIXES[i % groups] * 2 + f"row {i}"


def rows(n: int, start: int = 0, groups: int = 3):
    for i in range(start, n):
        yield InputRow(
            index=i,
            position=i,
            end_position=i + 1,
            id=i + 1,
            prompt=prompt(i, groups),
            overrides={"max_tokens": 1 + (i * 7) % 5},
        )


class Recording(FakeEngine):
    """Remembers the order requests arrive in."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.order: list[int] = []

    def add_request(self, request_id, prompt_token_ids, params):
        super().add_request(request_id, prompt_token_ids, params)
        self.order.append(int(request_id))


def test_rows_read_into_the_window_go_to_the_engine_in_prefix_order():
    n = 12
    engine = Recording(max_num_seqs=2)
    job, sink, _ = make_job(
        rows(n), engine=engine, max_in_flight=2, window=16, reorder=True, block_size=4
    )
    job.run()
    want = prefix_order([list(prompt(i).encode()) for i in range(n)], 4)
    assert engine.order == want == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]
    assert [r["id"] for r in sink.rows()] == list(range(1, n + 1))  # input order kept


@pytest.mark.parametrize("ordered", [True, False])
def test_the_output_equals_an_input_order_run(ordered):
    n = 90
    plain, plain_sink, plain_engine = make_job(
        rows(n), engine=Recording(max_num_seqs=4), max_in_flight=6, window=24, ordered=ordered
    )
    plain.run()
    job, sink, engine = make_job(
        rows(n),
        engine=Recording(max_num_seqs=4),
        max_in_flight=6,
        window=24,
        ordered=ordered,
        reorder=True,
        block_size=4,
    )
    job.run()
    assert plain_engine.order == list(range(n)) and engine.order != list(range(n))
    assert sorted(engine.order) == list(range(n))  # every row once
    if ordered:
        assert bytes(sink.data) == bytes(plain_sink.data)
    else:
        key = lambda r: r["id"]  # noqa: E731
        assert sorted(sink.rows(), key=key) == sorted(plain_sink.rows(), key=key)
    assert job.stats.rows == n and job.stats.output_tokens == plain.stats.output_tokens


def test_the_window_bounds_the_rows_read_ahead_and_the_reorder_buffer():
    n, window = 300, 10
    engine = Recording(max_num_seqs=4)
    job, sink, _ = make_job(
        rows(n, groups=5), engine=engine, max_in_flight=4, window=window, reorder=True
    )
    job.run()
    assert len(sink.rows()) == n
    assert job.peaks.window <= window and job.peaks.reorder_buffer <= window
    assert job.peaks.in_flight <= 4
    # grouped, but only within what the window holds: row 0's group does not reach row 295
    first_group = engine.order[: engine.order.index(1)]
    assert first_group[0] == 0 and all(i % 5 == 0 for i in first_group)
    assert max(first_group) < window


def test_rows_that_fail_before_the_engine_are_written_in_their_place():
    bad = [
        InputRow(index=0, position=0, end_position=1, id=1, prompt=""),  # encodes to nothing
        *list(rows(4, start=1)),
    ]
    job, sink, _ = make_job(iter(bad), max_in_flight=2, window=8, reorder=True, block_size=4)
    job.run()
    got = sink.rows()
    assert [r["id"] for r in got] == [1, 2, 3, 4]
    assert got[0]["error"]["code"] == "empty_prompt" and got[1]["error"] is None


class Interrupting(LoopInterrupting, Recording):
    """test_batch_loop's Ctrl-C at step `at`, over an engine that records its admissions."""


@pytest.mark.parametrize("ordered", [True, False])
def test_an_interrupted_reordered_job_resumes_to_the_same_output(ordered):
    n, kw = 60, dict(max_in_flight=6, window=18, ordered=ordered, reorder=True, block_size=4)
    full, full_sink, _ = make_job(rows(n), engine=Recording(max_num_seqs=4), **kw)
    full.run()
    commits: list[Checkpoint] = []
    sink = MemorySink()
    job, _, engine = make_job(
        rows(n),
        sink=sink,
        engine=Interrupting(at=17, max_num_seqs=4),
        commit_rows=5,
        on_commit=commits.append,
        **kw,
    )
    with pytest.raises(KeyboardInterrupt):
        job.run()
    cp = commits[-1]
    assert 0 < cp.stats.rows < n and cp.output_bytes == sink.committed
    # rows were served out of input order, yet the resume point is the first row not written
    assert engine.order[:10] != list(range(10))
    sink.data = sink.data[: cp.output_bytes]
    job2, _, _ = make_job(
        rows(n, start=cp.next_index),
        sink=sink,
        engine=Recording(max_num_seqs=4),
        stats=BatchStats.from_state(cp.stats.to_state()),
        start_index=cp.next_index,
        start_position=cp.next_position,
        done_after=cp.done_after,
        **kw,
    )
    stats = job2.run()
    got, want = sink.rows(), full_sink.rows()
    assert sorted(r["id"] for r in got) == list(range(1, n + 1))  # every row exactly once
    assert stats.rows == n
    if ordered:
        assert bytes(sink.data) == bytes(full_sink.data)
    else:
        key = lambda r: r["id"]  # noqa: E731
        assert sorted(got, key=key) == sorted(want, key=key)


def test_waiting_rows_hold_their_token_ids_only():
    job, _, engine = make_job(rows(8), max_in_flight=1, window=6, reorder=True, block_size=4)
    assert job._admit() == 6 + 1  # read to the window, one handed to the engine
    assert len(job._queue) == 5 and engine.num_unfinished_requests() == 1
    for _, ids, (row, _) in job._queue._waiting.values():
        assert row.prompt is None and row.messages is None and row.prompt_token_ids is None
        assert ids.itemsize == 8 and list(ids) == list(prompt(row.index).encode())
