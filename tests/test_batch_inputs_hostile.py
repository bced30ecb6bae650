"""Hostile input rows: each is that row's error (or is read as meant), the rows around it served."""

from __future__ import annotations

import io
import json

import pytest

from llmctl.batch.inputs import DETECT_LINES, MAX_LINE_BYTES, JsonlSource, open_input
from llmctl.batch.loop import BatchLoop
from llmctl.batch.outputs import RowResult, encode_record, openai_record, simple_record
from llmctl.batch.rows import BOM, parse_line, parse_simple
from llmctl.batch.summary import BatchStats
from llmctl.engine.params import SamplingParams
from llmctl.errors import RequestError, UsageError
from tests.fakes import FakeEngine, FakeRuntime

HUGE = b"9" * 5000  # more digits than Python converts: json.loads raises ValueError
DEEP = b"[" * 100_000 + b"]" * 100_000


def _rows(data: bytes, fmt: str = "jsonl", **kw):
    return list(JsonlSource(io.BytesIO(data), fmt, seekable=True, **kw).rows())


def _codes(rows) -> list:
    return [r.error.code if r.error else None for r in rows]


class _Sink:
    def __init__(self):
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.append(data)

    def commit(self) -> int:
        return 0


def _serve(rows) -> list[dict]:
    """Run rows through `BatchLoop` on the fake engine; the output records."""
    engine, sink = FakeEngine(), _Sink()
    BatchLoop(
        engine,
        FakeRuntime(engine),
        iter(rows),
        sink,
        lambda row, r: encode_record(simple_record(row, r)),
        SamplingParams(max_tokens=2),
    ).run()
    return [json.loads(line) for line in sink.lines]


# -- any exception reading one row is that row's error ------------------------------------------


def test_huge_integers_and_deep_nesting_are_error_rows_and_the_rows_around_are_served():
    data = b"\n".join(
        [
            b'{"prompt": "first"}',
            b'{"prompt": ' + HUGE + b'}',
            b'{"prompt": "x", "max_tokens": ' + HUGE + b'}',
            DEEP,
            b'{"prompt": "x", "stop": ' + DEEP + b'}',
            b'{"prompt": "last"}',
            b"",
        ]
    )
    rows = _rows(data)
    assert _codes(rows) == [None] + ["invalid_json"] * 4 + [None]
    assert "more than 4300 digits" in rows[1].error.message
    assert "nested too deeply" in rows[3].error.message
    out = _serve(rows)
    assert [r["id"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert out[0]["text"] and out[-1]["text"] and out[0]["error"] is None


def test_an_unexpected_exception_while_parsing_a_row_is_that_rows_error():
    def broken(obj, index, start, end):
        raise KeyError("surprise")

    row = parse_line(broken, b'{"prompt": "x"}', 4, 10, 26)
    assert row.error.code == "invalid_row" and "KeyError" in row.error.message
    assert (row.index, row.position, row.end_position, row.id) == (4, 10, 26, 5)


def test_nested_values_in_sampling_fields_get_short_messages():
    deep = "[" * 500 + "]" * 500
    lines = [f'{{"prompt": "x", "{k}": {deep}}}' for k in ("max_tokens", "ignore_eos")]
    lines += [
        '{"prompt": "x", "stop": {"a": 1}}',
        '{"prompt": "x", "seed": "' + "9" * 10_000 + '"}',
    ]
    data = "\n".join(lines).encode()
    out = _serve(_rows(data))
    assert [r["error"]["code"] for r in out] == ["invalid_parameter"] * 4
    assert out[0]["error"]["message"] == "max_tokens must be a number, got array"
    assert out[2]["error"]["message"] == "stop must be a string or an array of strings, got object"
    assert len(out[3]["error"]["message"]) < 100  # the value is shown cut, not 10,000 digits


# -- byte-order marks and format detection ----------------------------------------------------


OPENAI_LINE = json.dumps(
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "ROMEO:"}}
).encode()


@pytest.mark.parametrize("line,fmt", [(b'{"prompt": "hi"}', "jsonl"), (OPENAI_LINE, "openai")])
@pytest.mark.parametrize("from_stdin", [False, True])
def test_a_utf8_bom_is_skipped_in_files_and_on_stdin(tmp_path, line, fmt, from_stdin):
    data = BOM + line + b"\n" + BOM + line.replace(b'"a"', b'"b"') + b"\n"  # twice: concatenated
    if from_stdin:
        src = open_input("-", stdin=io.BytesIO(data))
    else:
        (tmp_path / "in.jsonl").write_bytes(data)
        src = open_input(str(tmp_path / "in.jsonl"))
    assert src.format == fmt
    rows = list(src.rows())
    assert _codes(rows) == [None, None] and rows[1].position == len(BOM) + len(line) + 1
    assert (rows[0].prompt or rows[0].custom_id) is not None
    src.close()


def _open(path, from_stdin: bool):
    if from_stdin:
        return open_input("-", stdin=io.BytesIO(path.read_bytes()))
    return open_input(str(path))


@pytest.mark.parametrize("from_stdin", [False, True])
def test_utf16_input_is_refused_with_one_line(tmp_path, from_stdin):
    data = '{"prompt": "hi"}\n'.encode("utf-16")
    (tmp_path / "in.jsonl").write_bytes(data)
    with pytest.raises(UsageError, match="UTF-16"):
        _open(tmp_path / "in.jsonl", from_stdin)


@pytest.mark.parametrize("from_stdin", [False, True])
def test_an_openai_batch_with_a_bad_first_line_is_still_an_openai_batch(tmp_path, from_stdin):
    good = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"p{i}"},
            }
        ).encode()
        for i in range(3)
    ]
    data = b"\n".join([OPENAI_LINE[:30], b"", b"[1, 2]", *good, b""])  # truncated, blank, array
    (tmp_path / "in.jsonl").write_bytes(data)
    src = _open(tmp_path / "in.jsonl", from_stdin)
    assert src.format == "openai"
    rows = list(src.rows())  # nothing detection read is lost
    assert _codes(rows) == ["invalid_json", "invalid_row", None, None, None]
    assert [r.custom_id for r in rows[2:]] == ["r0", "r1", "r2"]


def test_detection_looks_only_a_bounded_way_ahead():
    data = b"{bad\n" * (DETECT_LINES + 1) + OPENAI_LINE + b"\n"
    src = open_input("-", stdin=io.BytesIO(data))
    assert src.format == "jsonl" and len(list(src.rows())) == DETECT_LINES + 2


def test_an_overlong_first_line_on_stdin_stays_one_row():
    long_line = b'{"prompt": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}\n'
    src = open_input("-", stdin=io.BytesIO(long_line + b'{"prompt": "next"}\n'))
    rows = list(src.rows())
    assert _codes(rows) == ["row_too_long", None] and rows[1].prompt == "next"
    assert rows[1].index == 1 and rows[1].position == len(long_line)


def test_the_summary_says_which_format_was_read():
    stats = BatchStats(input_format="openai")
    assert stats.summary()["input_format"] == "openai"
    assert BatchStats.from_state(stats.to_state()).input_format == "openai"


# -- text that is not text ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        b'{"prompt": "ab\\ud800"}',
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud83d"}]}]}',
        b'{"prompt": "x", "stop": "\\ud800"}',
        b'{"prompt": "x", "stop": ["ok", "\\udc00"]}',
    ],
)
def test_a_lone_surrogate_is_invalid_text(line):
    (row,) = _rows(line + b"\n")
    assert row.error.code == "invalid_text" and "lone surrogate" in row.error.message
    assert _rows(b'{"prompt": "pair \\ud83d\\ude00 ok"}\n')[0].prompt == "pair \U0001f600 ok"


# -- OpenAI batch: ids, prompt lists, unsupported fields, the error shape -----------------------


def _req(cid: str, **body) -> bytes:
    url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode()


def test_a_duplicate_custom_id_is_an_error_row_also_after_a_resume():
    long_id = "L" * 500
    lines = [
        _req("a", prompt="1"),
        _req(long_id, prompt="2"),
        _req("b", prompt="3"),
        _req("a", prompt="4"),
        _req(long_id, prompt="5"),
        b"",
        _req("b", prompt="6"),
    ]
    data = b"\n".join(lines) + b"\n"
    rows = _rows(data, "openai")
    assert _codes(rows) == [
        None,
        None,
        None,
        "duplicate_custom_id",
        "duplicate_custom_id",
        "duplicate_custom_id",
    ]
    assert rows[3].custom_id == "a" and "already used" in rows[3].error.message
    resume = rows[2]  # a session that committed rows 0-1 resumes: the ids before still count
    for seekable in (True, False):
        src = JsonlSource(io.BytesIO(data), "openai", seekable=seekable)
        again = list(src.rows(resume.index, resume.position))
        assert _codes(again) == _codes(rows[2:]) and [r.index for r in again] == [2, 3, 4, 6]


@pytest.mark.parametrize(
    "prompt,message",
    [
        (["a", "b"], "list of 2 strings"),
        ([[1, 2], [3]], "list of 2 prompts"),
        ({"text": "x"}, "must be a string, a list of token ids"),
    ],
)
def test_openai_prompt_lists_are_refused_for_what_they_are(prompt, message):
    (row,) = _rows(_req("x", prompt=prompt) + b"\n", "openai")
    assert message in row.error.message
    ok = _rows(_req("s", prompt=["one"]) + b"\n" + _req("t", prompt=[[5, 6]]) + b"\n", "openai")
    assert (ok[0].prompt, ok[1].prompt_token_ids) == ("one", [5, 6])


@pytest.mark.parametrize(
    "field,value",
    [
        ("stream", True),
        ("tools", [{"type": "function"}]),
        ("logit_bias", {"5": 1}),
        ("echo", True),
        ("best_of", 2),
        ("suffix", "x"),
        ("guided_whitespace_pattern", " "),
        ("frobnicate", 1),
    ],
)
def test_an_unsupported_body_field_is_refused_naming_it(field, value):
    (row,) = _rows(_req("x", prompt="hi", **{field: value}) + b"\n", "openai")
    assert row.error.code == "unsupported_parameter" and row.error.param == field
    assert row.error.message.startswith(f"body.{field}=")


def test_neutral_and_harmless_body_fields_are_accepted():
    body = dict(
        prompt="hi",
        stream=False,
        n=1,
        logprobs=False,
        tools=[],
        echo=False,
        user="u",
        model="m",
        response_format={"type": "text"},
        max_completion_tokens=3,
        seed=None,
    )
    (row,) = _rows(_req("x", **body) + b"\n", "openai")
    assert row.error is None and row.overrides == {"max_tokens": 3, "n": 1}
    (chat,) = _rows(
        _req("c", messages=[{"role": "user", "content": "hi"}], prompt="no") + b"\n", "openai"
    )
    assert chat.error.param == "prompt"  # a chat body has no prompt field


def test_simple_rows_refuse_generation_features_but_keep_their_own_columns():
    rows = _rows(
        b'{"prompt": "a", "stream": true}\n{"prompt": "b", "echo": true}\n'
        b'{"prompt": "c", "source": "wiki", "n": 2, "max_completion_tokens": 4}\n'
    )
    assert _codes(rows) == ["unsupported_parameter", "unsupported_parameter", None]
    assert rows[2].overrides == {"max_tokens": 4, "n": 2}


def test_a_failed_openai_row_has_the_shape_openai_writes():
    row = parse_simple({"prompt": "x"}, 0, 0, 1)
    row.custom_id, row.endpoint = "q", "completions"
    error = RequestError(
        "unsupported_parameter", "body.stream=True is not supported", param="stream"
    )
    rec = openai_record(row, RowResult.failed(error), "m", 7)
    assert rec["error"] is None and rec["custom_id"] == "q"
    assert rec["response"]["status_code"] == 400
    assert rec["response"]["body"]["error"] == {
        "message": error.message,
        "type": "invalid_request_error",
        "param": "stream",
        "code": "unsupported_parameter",
    }


def test_a_custom_id_with_a_lone_surrogate_is_answered_not_a_crash():
    line = b'{"custom_id": "a\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
    (row,) = _rows(line, "openai")
    rec = openai_record(row, RowResult("ok", "length", 1, 2), "m", 7)  # found by the fuzz test
    assert rec["custom_id"] == "a\ud800" and rec["id"].startswith("batch_req_")
    assert json.loads(encode_record(rec))["custom_id"] == "a\ud800"


# -- neighbours: sampling values and Parquet columns --------------------------------------------


def test_out_of_range_seeds_and_huge_stop_lists_are_refused():
    with pytest.raises(RequestError, match="seed must be between"):
        SamplingParams(seed=10**30)  # torch's manual_seed raised inside the engine: job died
    with pytest.raises(RequestError, match="at most 64"):
        SamplingParams(stop=["x"] * 20_000)  # each is searched after every token
    assert SamplingParams(seed=-(1 << 63)).seed == -(1 << 63)
    out = _serve(_rows(b'{"prompt": "a", "seed": 1' + b"0" * 30 + b'}\n{"prompt": "b"}\n'))
    assert out[0]["error"]["code"] == "invalid_parameter" and out[1]["error"] is None


def _write_parquet(path, columns, row_group_size=100):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)


def test_parquet_float_columns_of_whole_numbers_and_wrong_types(tmp_path):
    import pyarrow as pa

    path = tmp_path / "in.parquet"
    _write_parquet(
        path,
        {
            "prompt": ["a", "b", "c"],
            "max_tokens": [3.0, float("nan"), 2.5],
            "seed": pa.array([1.0, None, 2.0]),
            "key": pa.array([7.0, None, 8.5]),
        },
    )
    rows = list(open_input(str(path), id_column="key").rows())
    assert rows[0].overrides == {"max_tokens": 3, "seed": 1}  # pandas' int-with-nulls columns
    assert [r.id for r in rows] == [7, 2, 3] and rows[2].error.code == "invalid_id"
    out = _serve(rows)
    assert [r["error"]["code"] if r["error"] else None for r in out] == [
        None,
        "invalid_parameter",
        "invalid_id",
    ]
    _write_parquet(path, {"prompt": [[1, 2], None]})
    assert _codes(open_input(str(path)).rows()) == ["invalid_type", "missing_prompt"]


def test_an_unreadable_parquet_row_group_is_error_rows_and_the_others_are_read(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "in.parquet"
    _write_parquet(
        path, {"prompt": [f"prompt number {i} " * 20 for i in range(30)]}, row_group_size=10
    )
    column = pq.ParquetFile(str(path)).metadata.row_group(1).column(0)
    raw = bytearray(path.read_bytes())
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    raw[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(raw))
    rows = list(open_input(str(path)).rows())
    assert [r.index for r in rows] == list(range(30))
    assert _codes(rows) == [None] * 10 + ["invalid_row"] * 10 + [None] * 10
    assert "row group 1" in rows[10].error.message
    assert rows[20].prompt.startswith("prompt number 20")
    assert [r.index for r in open_input(str(path)).rows(15, 15)] == list(range(15, 30))
