"""The prefix hashes that let a resume prove it continues the same input (llmctl.batch.digests)."""

from __future__ import annotations

import hashlib
import io

import pytest

from llmctl.batch.digests import (
    FileHasher,
    NotVerifiedYet,
    PrefixChanged,
    StreamHasher,
    parquet_hasher,
)
from llmctl.batch.inputs import open_input


def blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


DATA = (
    b'\n  \n{"prompt": "a"}\n\n\n{"prompt": "b"}\n \t \n{oops\n'
    + b'{"prompt": "'
    + b"x" * 300
    + b'"}\n\n{"prompt": "last, no newline"}'
)


def test_stream_digests_at_every_row_boundary_equal_the_hash_of_the_prefix():
    stream = StreamHasher(io.BytesIO(DATA), long_line=64)
    source = open_input("-", stdin=stream)
    source.max_line_bytes = 64  # the 300-byte line is a too-long row
    rows = list(source.rows())
    codes = [r.error.code if r.error else None for r in rows]
    assert codes == [None, None, "invalid_json", "row_too_long", None]
    positions = sorted({0} | {r.position for r in rows} | {r.end_position for r in rows})
    assert positions[-1] == len(DATA)
    for p in positions:  # commits ask in increasing order, after the reader went past
        assert stream.digest_at(p) == blake(DATA[:p])


def test_runs_of_blank_lines_keep_no_hash_state():
    data = b"\n" * 100_000 + b'{"prompt": "a"}\n' + b"   \n" * 100_000
    stream = StreamHasher(io.BytesIO(data))
    rows = list(open_input("-", stdin=stream).rows())
    assert len(rows) == 1 and len(stream._marks) <= 3  # not one per blank line
    assert stream.digest_at(rows[0].position) == blake(data[: rows[0].position])


@pytest.mark.parametrize(
    "other, ok", [(DATA, True), (DATA.replace(b'"a"', b'"c"'), False), (DATA[:20], False)]
)
def test_a_stream_read_again_is_checked_against_the_recorded_prefix(other, ok):
    position = DATA.index(b"{oops")
    stream = StreamHasher(io.BytesIO(other))
    stream.expect(position, blake(DATA[:position]))
    with pytest.raises(NotVerifiedYet):  # no commit may vouch for bytes not checked yet
        stream.digest_at(position)
    if ok:
        assert b"".join(iter(lambda: stream.readline(), b"")) == DATA
        assert stream.digest_at(len(DATA)) == blake(DATA)
    else:
        with pytest.raises(PrefixChanged, match="the input changed"):
            while stream.readline():
                pass
        with pytest.raises(PrefixChanged):
            stream.digest_at(position)  # a commit after the failure cannot record a hash


def test_file_hasher_reads_each_byte_once_and_moves_forward(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(DATA)
    h = FileHasher(path)
    for p in (0, 10, 10, 57, len(DATA)):
        assert h.digest_at(p) == blake(DATA[:p])
    with pytest.raises(PrefixChanged):
        FileHasher(path).digest_at(len(DATA) + 1)


def test_parquet_hash_covers_the_row_groups_consumed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(name, texts):
        pq.write_table(pa.table({"prompt": texts}), str(tmp_path / name), row_group_size=10)
        return parquet_hasher(tmp_path / name)

    texts = [f"line {i}" for i in range(40)]
    base, same, late, early = (
        write("a.parquet", texts),
        write("b.parquet", texts),
        write("c.parquet", texts[:35] + ["changed"] * 5),
        write("d.parquet", ["changed"] + texts[1:]),
    )
    for p in (0, 5, 10, 25):
        assert base.digest_at(p) == same.digest_at(p) == late.digest_at(p)
    assert early.digest_at(5) != base.digest_at(5)
    assert late.digest_at(40) != base.digest_at(40)
    renamed = pa.table({"text": texts})  # same bytes, another column name
    pq.write_table(renamed, str(tmp_path / "e.parquet"), row_group_size=10)
    assert parquet_hasher(tmp_path / "e.parquet").digest_at(5) != base.digest_at(5)
