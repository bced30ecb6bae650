"""Reading run-batch inputs one row at a time, never the whole file.

Owns: the sources of the three input formats (simple JSONL and OpenAI Batch API JSONL from a file
or stdin, Parquet one record batch at a time), their detection (from the first valid rows, not
only the first line; stdin's first lines are replayed) and `open_input`. Each raw row becomes an
`InputRow` through rows.py. A UTF-8 byte-order mark at the start of a line (the input's first
line, or a file concatenated after another) is skipped; positions still count its bytes.
`position` is a byte offset (JSONL) or a row number (Parquet).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from llmctl.batch.row_fields import OUTPUT_KEYS, OVERRIDE_KEYS
from llmctl.batch.rows import (
    BOM,
    PROMPT_KEYS,
    CustomIds,
    InputRow,
    decode_json_line,
    parse_line,
    parse_openai,
    parse_simple,
    request_error,
)
from llmctl.batch.uris import is_uri, open_binary
from llmctl.engine.requests import show
from llmctl.errors import RequestError, UsageError

FORMATS = ("auto", "jsonl", "openai", "parquet")
MAX_LINE_BYTES = 16 * 1024 * 1024  # a longer line becomes a `row_too_long` error row, unread
DETECT_LINES = 32  # format detection reads at most this many non-blank lines...
DETECT_BYTES = 1 << 20  # ...and stops after this many bytes (both kept to be read again)
_OTHER_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")  # UTF-16/32, either byte order


# ---------------------------------------------------------------------------------------------
# Sources


class ReplayStream:
    """A stream that cannot seek (stdin) whose first lines can be read twice: what is read while
    `recording` is kept, and after `rewind()` it is served again before the rest of the stream."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._kept = bytearray()
        self._pos = 0
        self.recording = True

    def readline(self, limit: int) -> bytes:
        if self._pos >= len(self._kept):
            if not self.recording:
                self._kept, self._pos = bytearray(), 0  # replayed: free it
            return self._read(limit)
        end = self._kept.find(b"\n", self._pos, self._pos + limit)
        stop = min(len(self._kept), self._pos + limit) if end < 0 else end + 1
        part = bytes(self._kept[self._pos : stop])
        self._pos = stop
        if part.endswith(b"\n") or len(part) >= limit or self._pos < len(self._kept):
            return part
        return part + self._read(limit - len(part))  # a line that continues past what was kept

    def _read(self, limit: int) -> bytes:
        line = self._stream.readline(limit)
        if self.recording:
            self._kept += line
            self._pos += len(line)
        return line

    def rewind(self) -> None:
        """Serve everything read so far again."""
        self._pos = 0

    def release(self) -> None:
        """Keep nothing more: what was kept is served once more, then freed."""
        self.recording = False

    def close(self) -> None:
        if self._stream is not sys.stdin.buffer:
            self._stream.close()


class JsonlSource:
    """Rows of a JSONL stream (a file, or stdin), parsed by `parse` (simple or OpenAI)."""

    def __init__(
        self,
        stream: BinaryIO | ReplayStream,
        fmt: str,
        seekable: bool,
        max_line_bytes: int = MAX_LINE_BYTES,
    ):
        self.format = fmt
        self._stream = stream
        self._seekable = seekable
        self._parse: Callable = parse_openai if fmt == "openai" else parse_simple
        self.max_line_bytes = max_line_bytes

    def _readline(self) -> tuple[bytes, int, bool]:
        """(line, bytes consumed, too_long). A too-long line is skipped to its end, not kept."""
        line = self._stream.readline(self.max_line_bytes)
        if len(line) < self.max_line_bytes or line.endswith(b"\n"):
            return line, len(line), False
        consumed = len(line)
        while True:  # drop the rest of an oversized line in bounded pieces
            more = self._stream.readline(self.max_line_bytes)
            consumed += len(more)
            if not more or more.endswith(b"\n"):
                return b"", consumed, True

    def _lines(self, index: int, position: int) -> Iterator[tuple[int, int, int, bytes, bool]]:
        """(index, start, end, line, too_long) for every physical line from (index, position)."""
        if self._seekable:
            self._stream.seek(position)
        while True:
            line, n, too_long = self._readline()
            if n == 0:
                return
            yield index, position, position + n, line, too_long
            index, position = index + 1, position + n

    def rows(self, start_index: int = 0, start_position: int = 0) -> Iterator[InputRow]:
        """Rows from `start_index` on; `start_position` is that row's byte offset. A pipe, and an
        OpenAI batch (whose duplicate check needs the ids before), read the rows before again."""
        ids = CustomIds() if self.format == "openai" else None
        skip_to = start_index
        if self._seekable and ids is None:
            lines, skip_to = self._lines(start_index, start_position), 0
        else:
            lines = self._lines(0, 0)
        for index, start, end, line, too_long in lines:
            if too_long:
                row = InputRow(
                    index=index,
                    position=start,
                    end_position=end,
                    id=index + 1,
                    error=request_error(
                        "row_too_long", f"line is longer than {self.max_line_bytes} bytes"
                    ),
                )
            elif not line.removeprefix(BOM).strip():
                continue
            elif index < skip_to and ids is None:
                continue  # served by an earlier session: no need to parse it
            else:
                row = parse_line(self._parse, line, index, start, end)
            if ids is not None:
                ids.check(row)
            if index >= skip_to:
                yield row

    def count_rows(self) -> int | None:
        """Lines in a seekable file, counted in 1 MiB chunks (for progress); None for a pipe."""
        if not self._seekable:
            return None
        here = self._stream.tell()
        self._stream.seek(0)
        lines, last = 0, b"\n"
        while chunk := self._stream.read(1 << 20):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
        self._stream.seek(here)
        return lines + (last != b"\n")

    def close(self) -> None:
        if self._stream is not sys.stdin.buffer:
            self._stream.close()


class ParquetSource:
    """Rows of a Parquet file, read one record batch at a time (never the whole table)."""

    format = "parquet"
    _INTEGER_FIELDS = ("id", "max_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs")

    def __init__(
        self,
        path: Path | str,
        prompt_column: str = "prompt",
        id_column: str | None = None,
        messages_column: str | None = None,
        batch_rows: int = 1024,
    ):
        import pyarrow.parquet as pq

        try:
            self._file = pq.ParquetFile(open_binary(path) if is_uri(path) else str(path))
        except Exception as e:
            raise UsageError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from None
        names = set(self._file.schema_arrow.names)
        for flag, col in (("--id-column", id_column), ("--messages-column", messages_column)):
            if col is not None and col not in names:
                raise UsageError(
                    f"{path}: {flag} {col!r} is not a column; columns: {', '.join(sorted(names))}"
                )
        if messages_column is None and prompt_column not in names and "messages" in names:
            messages_column = "messages"  # Ray Data LLM's column, found without --messages-column
        self._map = {
            "prompt": prompt_column if prompt_column in names else None,
            "messages": messages_column,
            "prompt_token_ids": ("prompt_token_ids" if "prompt_token_ids" in names else None),
            "id": id_column,
        }
        if not any(self._map[k] for k in PROMPT_KEYS):
            raise UsageError(
                f"{path}: no prompt column {prompt_column!r} (see --prompt-column, "
                f"--messages-column); columns: {', '.join(sorted(names))}"
            )
        self.row_overrides = [
            k
            for k in (*OVERRIDE_KEYS, *OUTPUT_KEYS, "sampling_params", "model", "lora")
            if k in names  # model / lora: which LoRA adapter serves the row (batch/adapters.py)
        ]
        self._columns = sorted({c for c in self._map.values() if c} | set(self.row_overrides))
        self._batch_rows = batch_rows

    def count_rows(self) -> int:
        return self._file.metadata.num_rows

    def rows(self, start_index: int = 0, start_position: int = 0) -> Iterator[InputRow]:
        meta = self._file.metadata
        first = 0  # the row number of the group's first row
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if first + n > start_index:
                yield from self._group_rows(rg, first, n, start_index)
            first += n

    def _group_rows(self, rg: int, first: int, n: int, start_index: int) -> Iterator[InputRow]:
        """The rows of one row group from start_index on; a group that cannot be read (corrupt,
        or a type pyarrow cannot convert) gives an error row for each of its unread rows."""
        index = first
        try:
            for batch in self._file.iter_batches(
                batch_size=self._batch_rows, row_groups=[rg], columns=self._columns
            ):
                for record in batch.to_pylist():
                    if index >= start_index:
                        yield self._row(record, index)
                    index += 1
        except Exception as e:
            error = request_error(
                "invalid_row",
                f"cannot read Parquet row group {rg} ({type(e).__name__}: {show(str(e))})",
            )
            for i in range(max(index, start_index), first + n):
                yield InputRow(index=i, position=i, end_position=i + 1, id=i + 1, error=error)

    def _row(self, record: dict, index: int) -> InputRow:
        try:
            obj = self._record_to_obj(record)
        except RequestError as e:
            return InputRow(
                index=index, position=index, end_position=index + 1, id=index + 1, error=e
            )
        except Exception as e:  # a row never stops the job, whatever it holds
            return InputRow(
                index=index,
                position=index,
                end_position=index + 1,
                id=index + 1,
                error=request_error(
                    "invalid_row", f"cannot read this row ({type(e).__name__}: {show(str(e))})"
                ),
            )
        return parse_simple(obj, index, index, index + 1)

    def _record_to_obj(self, record: dict) -> dict:
        """A Parquet record as the JSON object a simple row would be."""
        obj: dict = {k: record[c] for k, c in self._map.items() if c and record.get(c) is not None}
        obj.update({k: record[k] for k in self.row_overrides if record.get(k) is not None})
        if isinstance(obj.get("prompt"), bytes):
            try:
                obj["prompt"] = obj["prompt"].decode("utf-8")
            except UnicodeDecodeError as e:
                raise request_error(
                    "invalid_utf8", f"prompt is not valid UTF-8 (byte {e.start})"
                ) from None
        for key in ("messages", "sampling_params"):  # list or struct columns, or JSON text
            raw = obj.get(key)
            if isinstance(raw, (str, bytes)):
                obj[key], error = decode_json_line(raw.encode() if isinstance(raw, str) else raw)
                if error is not None:
                    raise request_error(error.code, f"{self._map.get(key, key)}: {error.message}")
        if isinstance(obj.get("stop"), tuple):
            obj["stop"] = list(obj["stop"])
        for key in self._INTEGER_FIELDS:  # a float column (pandas' int with nulls) of whole numbers
            v = obj.get(key)
            if isinstance(v, float) and v.is_integer():
                obj[key] = int(v)
        return obj

    def close(self) -> None:
        pass


def _looks_openai(obj: object) -> bool:
    return (
        isinstance(obj, dict)
        and ("custom_id" in obj or "body" in obj)
        and not any(k in obj for k in PROMPT_KEYS)
    )


def detect_format(readline: Callable[[int], bytes]) -> str:
    """'openai' when the first line that is a JSON object looks like an OpenAI batch request
    (custom_id or body, no prompt key), else 'jsonl'. Lines that are not JSON objects are
    passed over, for at most DETECT_LINES non-blank lines and DETECT_BYTES bytes."""
    seen_lines, seen_bytes = 0, 0
    while seen_lines < DETECT_LINES and seen_bytes < DETECT_BYTES:
        line = readline(MAX_LINE_BYTES)
        if not line:
            break
        seen_bytes += len(line)
        if not line.removeprefix(BOM).strip():
            continue
        seen_lines += 1
        obj, error = decode_json_line(line)
        if error is None and isinstance(obj, dict):
            return "openai" if _looks_openai(obj) else "jsonl"
    return "jsonl"


def _refuse_other_encodings(first: bytes, name: str) -> None:
    if first.startswith(_OTHER_BOMS):
        raise UsageError(
            f"{name} starts with a UTF-16/UTF-32 byte-order mark; run-batch reads "
            f"UTF-8 JSONL: convert it first (iconv -f UTF-16 -t UTF-8)"
        )


def open_input(
    path: str,
    fmt: str = "auto",
    prompt_column: str = "prompt",
    id_column: str | None = None,
    messages_column: str | None = None,
    stdin: BinaryIO | None = None,
) -> JsonlSource | ParquetSource:
    """Open INPUT ('-' = stdin) as a row source; the format is detected unless given."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown --input-format {fmt!r}; use one of {', '.join(FORMATS)}")
    if path == "-":
        if fmt == "parquet":
            raise UsageError("Parquet input cannot be read from stdin; pass a file path")
        stream = ReplayStream(stdin if stdin is not None else sys.stdin.buffer)
        _refuse_other_encodings(stream.readline(4), "stdin")
        stream.rewind()
        if fmt == "auto":
            fmt = detect_format(stream.readline)
            stream.rewind()
        stream.release()
        return JsonlSource(stream, fmt, seekable=False)
    p = Path(path)
    uri = is_uri(path)  # s3://..., file://...: read in place through pyarrow
    if not uri and not p.exists():
        raise UsageError(f"input {path} not found")
    if not uri and p.is_dir():
        raise UsageError(f"input {path} is a folder; pass a .jsonl or .parquet file")
    if fmt == "parquet" or (fmt == "auto" and p.suffix.lower() == ".parquet"):
        return ParquetSource(path if uri else p, prompt_column, id_column, messages_column)
    stream = open_binary(path)
    try:
        _refuse_other_encodings(stream.read(4), path)
    except UsageError:
        stream.close()
        raise
    stream.seek(0)
    if fmt == "auto":
        fmt = detect_format(stream.readline)
        stream.seek(0)
    return JsonlSource(stream, fmt, seekable=True)
