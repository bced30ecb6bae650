"""run-batch input readers: simple JSONL, OpenAI batch JSONL, Parquet, stdin; every kind of bad
row."""

from __future__ import annotations

import io
import json

import pytest

from llmctl.batch.inputs import JsonlSource, ParquetSource, open_input
from llmctl.errors import UsageError


def _source(data: bytes, fmt: str = "jsonl", seekable: bool = True, **kw) -> JsonlSource:
    return JsonlSource(io.BytesIO(data), fmt, seekable=seekable, **kw)


def test_simple_jsonl_rows_ids_and_overrides():
    data = b"".join(
        [
            b'{"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0.5, "stop": ["\\n"], '
            b'"seed": 3, "extra": 1}\n',
            b"\n",  # blank: skipped, keeps its line number
            b'{"id": "q7", "messages": '
            b'[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}\n',
            b'{"id": 42, "prompt_token_ids": [1, 2, 3]}',  # no final newline
        ]
    )
    rows = list(_source(data).rows())
    assert [r.index for r in rows] == [0, 2, 3]
    assert [r.id for r in rows] == [1, "q7", 42]
    assert rows[0].prompt == "ROMEO:" and rows[0].overrides == {
        "max_tokens": 5,
        "temperature": 0.5,
        "stop": ["\n"],
        "seed": 3,
    }
    assert rows[1].messages == [{"role": "user", "content": "hi"}]
    assert rows[2].prompt_token_ids == [1, 2, 3]
    assert all(r.error is None for r in rows)
    assert rows[2].end_position == len(data)
    # resuming at a row's position reads the same rows from there on
    again = list(_source(data).rows(rows[1].index, rows[1].position))
    assert [r.id for r in again] == ["q7", 42]


BAD_ROWS = [
    (b'{"prompt": "ok"', "invalid_json"),
    (b'{"prompt": "caf\xe9"}', "invalid_utf8"),
    (b'["prompt"]', "invalid_row"),
    (b'{"id": 3}', "missing_prompt"),
    (b'{"prompt": ""}', "empty_prompt"),
    (b'{"prompt": 12}', "invalid_type"),
    (b'{"prompt_token_ids": []}', "empty_prompt"),
    (b'{"prompt_token_ids": [1, "2"]}', "invalid_type"),
    (b'{"prompt_token_ids": [-1]}', "invalid_token_id"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "unknown_role"),
    (b'{"messages": [{"role": "user"}]}', "invalid_messages"),
    (b'{"messages": "hello"}', "invalid_messages"),
    (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "invalid_row"),
    (b'{"id": [1], "prompt": "a"}', "invalid_id"),
    (b'{"id": true, "prompt": "a"}', "invalid_id"),
]


@pytest.mark.parametrize("line,code", BAD_ROWS)
def test_every_kind_of_bad_row_becomes_a_structured_error(line, code):
    (row,) = list(_source(line + b"\n").rows())
    assert row.error is not None and row.error.code == code and row.error.message
    assert row.index == 0 and row.end_position == len(line) + 1


def test_a_file_mixing_good_and_bad_rows_reads_to_the_end():
    data = b"\n".join(line for line, _ in BAD_ROWS) + b'\n{"prompt": "last"}\n'
    rows = list(_source(data).rows())
    assert [r.error.code if r.error else None for r in rows] == [c for _, c in BAD_ROWS] + [None]
    assert [r.id for r in rows] == [1, 2, 3, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def test_an_overlong_line_is_skipped_without_being_kept():
    data = b'{"prompt": "' + b"x" * 5000 + b'"}\n{"prompt": "next"}\n'
    rows = list(_source(data, max_line_bytes=1000).rows())
    assert rows[0].error.code == "row_too_long" and rows[1].prompt == "next" and rows[1].index == 1


def test_openai_batch_requests():
    lines = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "x",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 7,
                "seed": 1,
            },
        },
        {
            "custom_id": "b",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "ROMEO:", "max_tokens": 4, "top_k": 5},
        },
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6]}},
        {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "e", "method": "GET", "url": "/v1/completions", "body": {}},
        {"custom_id": "f", "method": "POST", "url": "/v1/completions", "body": {"echo": True}},
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
        {
            "custom_id": "h",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "bot", "content": "x"}]},
        },
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    src = open_input("-", stdin=io.BytesIO(data))
    assert src.format == "openai"
    rows = list(src.rows())
    assert (
        rows[0].endpoint == "chat"
        and rows[0].custom_id == "a"
        and rows[0].overrides == {"max_tokens": 7, "seed": 1}
    )
    assert (
        rows[1].endpoint == "completions"
        and rows[1].prompt == "ROMEO:"
        and rows[1].overrides == {"max_tokens": 4, "top_k": 5}
    )
    assert rows[2].prompt_token_ids == [5, 6]
    codes = [r.error.code if r.error else None for r in rows]
    assert codes == [
        None,
        None,
        None,
        "unsupported_url",
        "invalid_method",
        "unsupported_parameter",
        "invalid_custom_id",
        "unknown_role",
    ]


def test_format_detection_and_stdin_with_leading_blank_lines():
    simple = b'\n\n{"prompt": "a"}\n{"prompt": "b"}\n'
    src = open_input("-", stdin=io.BytesIO(simple))
    assert src.format == "jsonl"
    rows = list(src.rows())
    assert [(r.index, r.prompt) for r in rows] == [(2, "a"), (3, "b")]
    # a pipe cannot seek: resuming reads past the committed rows instead
    src = open_input("-", stdin=io.BytesIO(simple))
    assert [r.prompt for r in src.rows(3, 999)] == ["b"]


def test_open_input_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        open_input(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UsageError, match="folder"):
        open_input(str(tmp_path))
    with pytest.raises(UsageError, match="input-format"):
        open_input("-", fmt="csv")
    with pytest.raises(UsageError, match="stdin"):
        open_input("-", fmt="parquet")


def _write_parquet(path, table_dict, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table_dict), str(path), row_group_size=row_group_size)


def test_parquet_rows_by_row_group_and_resume(tmp_path):
    path = tmp_path / "in.parquet"
    n = 23
    _write_parquet(
        path,
        {
            "text": [f"p{i}" if i != 4 else None for i in range(n)],
            "key": [f"k{i}" for i in range(n)],
            "max_tokens": [i % 3 + 1 for i in range(n)],
        },
        row_group_size=5,
    )
    src = open_input(str(path), prompt_column="text", id_column="key")
    assert isinstance(src, ParquetSource) and src.count_rows() == n
    rows = list(src.rows())
    assert [r.id for r in rows] == [f"k{i}" for i in range(n)]
    assert rows[4].error.code == "missing_prompt"
    assert rows[7].prompt == "p7" and rows[7].overrides == {"max_tokens": 2}
    for start in (0, 4, 5, 12, 22):  # inside and at the edges of row groups
        assert [r.index for r in src.rows(start, start)] == list(range(start, n))
    assert list(src.rows(n, n)) == []


def test_parquet_messages_column_as_structs_or_json_text(tmp_path):
    path = tmp_path / "chat.parquet"
    msgs = [[{"role": "user", "content": "hi"}], [{"role": "alien", "content": "x"}]]
    _write_parquet(path, {"m": msgs, "j": [json.dumps(m) for m in msgs]}, row_group_size=1)
    rows = list(open_input(str(path), messages_column="m").rows())
    assert rows[0].messages == [{"role": "user", "content": "hi"}] and rows[0].id == 1
    assert rows[1].error.code == "unknown_role"
    rows = list(open_input(str(path), messages_column="j").rows())
    assert (
        rows[0].messages == [{"role": "user", "content": "hi"}]
        and rows[1].error.code == "unknown_role"
    )


def test_parquet_binary_prompts_and_missing_columns(tmp_path):
    path = tmp_path / "bin.parquet"
    _write_parquet(path, {"prompt": [b"ok", b"\xff\xfe"]}, row_group_size=10)
    rows = list(open_input(str(path)).rows())
    assert rows[0].prompt == "ok" and rows[1].error.code == "invalid_utf8"
    with pytest.raises(UsageError, match="no prompt column 'text'"):
        open_input(str(path), prompt_column="text")
    with pytest.raises(UsageError, match="--id-column 'nope'"):
        open_input(str(path), id_column="nope")
