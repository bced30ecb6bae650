"""Content fingerprints that let a resumed run-batch job prove it continues the same files.

Owns: the BLAKE2b prefix hashes kept in the state file. `FileHasher` hashes a file's first bytes
up to a growing boundary, re-reading each byte once from its own handle (the input of a job, or a
Parquet input up to the row groups consumed); `StreamHasher` wraps a stream read once (stdin) and
hashes it as it passes, keeping the hash state at line boundaries so the digest at a committed
position is known after the reader went past it; `hash_file_prefix` re-hashes a file's first n
bytes (an output's committed prefix, or a finished output) and returns the hasher to continue.

A hash covers bytes [0, position). Positions only grow within one job.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from pathlib import Path
from typing import BinaryIO, Callable

from llmctl.batch.uris import open_binary
from llmctl.errors import UsageError

CHUNK = 1 << 20


def new_hasher():
    return hashlib.blake2b(digest_size=32)


class PrefixChanged(UsageError):
    """The bytes a job already consumed are not the bytes it consumed before."""


class NotVerifiedYet(Exception):
    """A resumed stream has not been read again up to the position its state recorded; a commit
    now would vouch for rows read from bytes not yet checked, so it waits."""


def hash_file_prefix(path: Path, n: int, hasher=None, start: int = 0):
    """Update `hasher` (a new one by default) with bytes [start, n) of path; returns it.

    Raises PrefixChanged when the file is shorter than n bytes.
    """
    h = hasher if hasher is not None else new_hasher()
    with open_binary(path) as f:  # a local file or a URI input
        f.seek(start)
        left = n - start
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                raise PrefixChanged(f"{path} is shorter than the {n} bytes already consumed")
            h.update(chunk)
            left -= len(chunk)
    return h


class FileHasher:
    """Hash of a file's first `boundary(position)` bytes; `digest_at` only moves forward.

    `boundary` maps a resume position to a byte offset (identity for JSONL; the end of the row
    groups holding the rows before it for Parquet). `salt` is hashed first (Parquet: the schema).
    """

    def __init__(self, path: Path, boundary: Callable[[int], int] = lambda p: p, salt: bytes = b""):
        self.path = path
        self._boundary = boundary
        self._h = new_hasher()
        self._h.update(salt)
        self._offset = 0

    def digest_at(self, position: int) -> str:
        end = self._boundary(position)
        if end > self._offset:
            hash_file_prefix(self.path, end, self._h, self._offset)
            self._offset = end
        return self._h.hexdigest()


class StreamHasher:
    """A read-once binary stream (stdin) that hashes what passes through it.

    The hash state is kept at every line boundary a row can start or end at (all of them, except
    between two lines of ASCII whitespace), from the last position asked for on, so the digest at
    a committed position is known although the reader is ahead of it. `expect(position, digest)`
    (from the state file): reaching that position with another digest, or the end of the stream
    before it, raises PrefixChanged (a resumed job fed another stream). `long_line`: a line this
    long is a row whatever its bytes (the reader's too-long-line limit).
    """

    def __init__(self, raw: BinaryIO, long_line: int = 1 << 24):
        self._raw = raw
        self._h = new_hasher()
        self._offset = 0
        self._expect: tuple[int, str] | None = None
        self._failed = False
        self._long_line = long_line
        self._line_len = 0  # bytes of the current line so far
        self._line_content = False  # the current line has a non-whitespace byte (or is very long)
        self._pending: tuple[int, object] | None = None  # a line start kept only if content follows
        self._marks: deque[tuple[int, object]] = deque([(0, self._h.copy())])

    # -- reading --------------------------------------------------------------------------------

    def readline(self, limit: int = -1) -> bytes:
        return self._consume(self._raw.readline(limit))

    def read(self, n: int = -1) -> bytes:
        return self._consume(self._raw.read(n))

    def peek(self, n: int = 0) -> bytes:
        return self._raw.peek(n)

    def close(self) -> None:
        pass  # stdin belongs to the process

    def _consume(self, data: bytes) -> bytes:
        if not data:
            if self._line_len:  # a last line without a newline ends at the end of the stream
                self._end_line()
            self._check(at_end=True)
            return data
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start : nl + 1]
            self._add(piece)
            if nl < 0:
                break
            self._end_line()
            start = nl + 1
        return data

    def _add(self, piece: bytes) -> None:
        self._h.update(piece)
        self._offset += len(piece)
        self._line_len += len(piece)
        if not self._line_content and (piece.strip() or self._line_len >= self._long_line):
            self._line_content = True
            if self._pending is not None:  # this line's start is a row start after all
                self._marks.append(self._pending)
                self._pending = None

    def _end_line(self) -> None:
        mark = (self._offset, self._h.copy())
        if self._line_content:
            self._marks.append(mark)
            self._pending = None
        else:
            self._pending = mark
        self._line_content, self._line_len = False, 0
        self._check(at_end=False)

    def _check(self, at_end: bool) -> None:
        if self._expect is None or self._failed:
            return
        position, digest = self._expect
        if self._offset < position and not at_end:
            return
        if self._offset == position and self._h.hexdigest() == digest:
            self._expect = None  # verified: the stream starts with the bytes consumed before
            return
        self._fail(position)

    def _fail(self, position: int) -> None:
        self._failed = True
        raise PrefixChanged(
            f"the input changed since the job started: its first {position} bytes "
            f"are not the rows already served; feed the same input, or pass "
            f"--overwrite to start over"
        )

    # -- digests --------------------------------------------------------------------------------

    def expect(self, position: int, digest: str) -> None:
        """Require the stream's first `position` bytes to hash to `digest` (checked once read)."""
        if position > self._offset:
            self._expect = (position, digest)
            return
        try:
            same = self._lookup(position) == digest
        except ValueError:  # not a line boundary of this stream
            same = False
        if not same:
            self._fail(position)

    def digest_at(self, position: int) -> str:
        """The hash of bytes [0, position); position must be a row boundary not before the last."""
        if self._failed:
            raise PrefixChanged("the input changed since the job started")
        if self._expect is not None:
            raise NotVerifiedYet(f"input not read again up to position {self._expect[0]} yet")
        return self._lookup(position)

    def _lookup(self, position: int) -> str:
        if position == self._offset:
            return self._h.hexdigest()
        if self._pending is not None and self._pending[0] == position:
            return self._pending[1].hexdigest()
        while self._marks and self._marks[0][0] < position:
            self._marks.popleft()
        if self._marks and self._marks[0][0] == position:
            return self._marks[0][1].hexdigest()
        raise ValueError(f"no hash state kept at input position {position}")


def parquet_hasher(path: Path) -> FileHasher:
    """Parquet: the rows before position p lie in the row groups that start before p; hash the
    file up to the end of their column chunks (and the schema, which maps columns to names)."""
    import pyarrow.parquet as pq

    with open_binary(path) as f:
        pf = pq.ParquetFile(f)
        meta, arrow_schema = pf.metadata, pf.schema_arrow

    firsts, ends, first, end = [], [], 0, 0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for j in range(rg.num_columns):
            c = rg.column(j)
            start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
            end = max(end, start + c.total_compressed_size)
        firsts.append(first)
        ends.append(end)
        first += rg.num_rows

    def boundary(position: int) -> int:
        touched = bisect.bisect_left(firsts, position)  # row groups starting before position
        return ends[touched - 1] if touched else 0

    schema = arrow_schema.to_string(show_field_metadata=False, show_schema_metadata=False)
    return FileHasher(path, boundary, salt=schema.encode("utf-8"))
