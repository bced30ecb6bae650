"""run-batch totals: log-histogram percentiles, state round trip, the state file and output
shapes."""

from __future__ import annotations

import json
import math
import random

import pytest

from llmctl.batch.journal import JobState, fingerprint_mismatch, load_state, save_state, state_path
from llmctl.batch.outputs import (
    FileSink,
    RowResult,
    journal_to_parquet,
    open_locked,
    openai_record,
    simple_record,
)
from llmctl.batch.rows import InputRow
from llmctl.batch.summary import BatchStats, LogHistogram
from llmctl.errors import RequestError, UsageError


def exact_percentile(values, q):
    s = sorted(values)
    return s[max(1, math.ceil(q * len(s))) - 1]


def test_histogram_percentiles_within_one_percent_in_bounded_memory():
    rng = random.Random(0)
    values = [
        rng.lognormvariate(-4, 1.5) for _ in range(20_000)
    ]  # latencies around 18 ms, long tail
    h = LogHistogram()
    for v in values:
        h.add(v)
    for q in (0.5, 0.9, 0.99):
        assert h.percentile(q) == pytest.approx(exact_percentile(values, q), rel=0.011)
    assert len(h.counts) < 2000  # buckets, not samples
    assert LogHistogram().percentile(0.5) is None
    assert LogHistogram.from_state(h.to_state()).percentile(0.9) == h.percentile(0.9)


def test_stats_survive_the_state_file_and_summarise():
    st = BatchStats()
    st.add_row(10, 4, None, ttft=0.02, tpot=0.005)
    st.add_row(7, 0, "prompt_too_long")
    st.add_row(3, 2, None, ttft=0.04, tpot=0.006)
    st.elapsed_s = 2.0
    again = BatchStats.from_state(json.loads(json.dumps(st.to_state())))
    s = again.summary()
    assert (s["rows"], s["ok"], s["errors"], s["prompt_tokens"], s["output_tokens"]) == (
        3,
        2,
        1,
        20,
        6,
    )
    assert s["errors_by_code"] == {"prompt_too_long": 1}
    assert s["requests_per_s"] == 1.5 and s["output_tokens_per_s"] == 3.0
    assert s["ttft_s"]["p50"] == pytest.approx(0.02, rel=0.01) and s["ttft_s"][
        "p99"
    ] == pytest.approx(0.04, rel=0.01)


def test_state_file_is_replaced_atomically_and_checked(tmp_path):
    out = tmp_path / "out.jsonl"
    st = JobState(
        fingerprint={"model": "a", "sampling.temperature": 0.0},
        created=123,
        next_index=5,
        next_position=99,
        done_after=[7, 9],
        output_bytes=400,
        stats={"rows": 7},
    )
    save_state(state_path(out), st)
    assert not list(tmp_path.glob("*.tmp"))
    loaded = load_state(state_path(out))
    assert loaded.to_json() == st.to_json()
    assert (
        fingerprint_mismatch(st.fingerprint, {"model": "a", "sampling.temperature": 0.5})
        == "sampling.temperature was 0.0, now 0.5"
    )
    assert fingerprint_mismatch(st.fingerprint, dict(st.fingerprint)) is None
    state_path(out).write_text("{garbage")
    with pytest.raises(UsageError, match="--overwrite"):
        load_state(state_path(out))


def test_file_sink_cuts_back_to_the_committed_size_and_hashes_what_it_holds(tmp_path):
    import hashlib

    from llmctl.batch.digests import hash_file_prefix

    p = tmp_path / "o.jsonl"
    p.write_bytes(b'{"a":1}\n{"b":2}\n{"c":')
    sink = FileSink(
        open_locked(p, create=False), p, committed_bytes=8, hasher=hash_file_prefix(p, 8)
    )
    sink.write(b'{"d":4}\n')
    assert sink.commit() == 16
    sink.close()
    assert p.read_bytes() == b'{"a":1}\n{"d":4}\n'
    assert sink.digest() == hashlib.blake2b(p.read_bytes(), digest_size=32).hexdigest()
    with pytest.raises(UsageError, match="shorter"):
        FileSink(open_locked(p, create=False), p, committed_bytes=1000)
    with pytest.raises(UsageError, match="appeared"):
        open_locked(p, create=True)  # a new output must not exist yet


def test_output_shapes():
    row = InputRow(
        index=3, position=0, end_position=1, id="q", custom_id="q", endpoint="completions"
    )
    ok = RowResult(
        text="hi", finish_reason="stop", prompt_tokens=5, completion_tokens=2, token_ids=[1, 2]
    )
    assert simple_record(row, ok) == {
        "id": "q",
        "text": "hi",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        "error": None,
    }
    assert simple_record(row, ok, include_token_ids=True)["token_ids"] == [1, 2]
    bad = RowResult.failed(RequestError("prompt_too_long", "too long"), prompt_tokens=9)
    assert simple_record(row, bad)["error"] == {"code": "prompt_too_long", "message": "too long"}
    a = openai_record(row, ok, "m", 7)
    b = openai_record(
        InputRow(
            index=4, position=0, end_position=1, id="q", custom_id="q", endpoint="completions"
        ),
        ok,
        "m",
        7,
    )
    assert a["id"] != b["id"]  # same custom_id on another line: still distinct ids
    assert a == openai_record(row, ok, "m", 7)  # and deterministic
    assert (
        a["response"]["body"]["choices"][0]["text"] == "hi"
        and a["response"]["body"]["created"] == 7
    )


def test_journal_to_parquet(tmp_path):
    import pyarrow.parquet as pq

    journal = tmp_path / "j.jsonl"
    rows = [
        {
            "id": i,
            "text": f"t{i}",
            "finish_reason": "length",
            "usage": {"prompt_tokens": 1, "completion_tokens": 2},
            "error": None,
            "token_ids": [i],
        }
        for i in range(25)
    ]
    rows[3] = {
        "id": "x",
        "text": None,
        "finish_reason": None,
        "usage": {"prompt_tokens": 0, "completion_tokens": 0},
        "error": {"code": "invalid_json", "message": "m"},
        "token_ids": None,
    }
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.parquet"
    journal_to_parquet(journal, out, include_token_ids=True, chunk_rows=10)
    got = pq.read_table(str(out)).to_pylist()
    assert [r["id"] for r in got] == [str(r["id"]) for r in rows]
    assert got[3]["error"] == {"code": "invalid_json", "message": "m"} and got[4]["token_ids"] == [
        4
    ]
