"""Reading run-batch inputs one row at a time, never the whole file.

Owns: the three input formats (simple JSONL, OpenAI Batch API JSONL, Parquet), their detection
(from the first valid rows, not only the first line), and turning each raw row into an
`InputRow`: a prompt (text, chat messages or token ids) with its per-row sampling overrides, or a
structured `RequestError` for a bad row (invalid JSON or UTF-8, a missing/empty prompt, wrong
types, unknown chat roles, text that is not text, fields we do not implement, a repeated
`custom_id`). A bad row never raises: whatever goes wrong reading one row is that row's error.

Row numbering: `index` is 0-based and counts every physical line of a JSONL input (blank lines
are skipped but keep their number) or every Parquet row; the default id is `index + 1`.
`position` is where reading resumes at that row: a byte offset (JSONL) or a row number (Parquet).
A UTF-8 byte-order mark at the start of a line (the input's first line, or a file concatenated
after another) is skipped; positions still count its bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from llmctl.engine.requests import check_text, json_type, show, validate_messages, validate_token_ids
from llmctl.errors import RequestError, UsageError

FORMATS = ("auto", "jsonl", "openai", "parquet")
OVERRIDE_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos")
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
OPENAI_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
OPENAI_PROMPT = {"completions": "prompt", "chat": "messages"}
# Body fields accepted and ignored: they do not change the answer.
OPENAI_IGNORED = ("model", "user", "metadata", "store", "service_tier")
# Generation features llmctl does not implement, with the values that ask for none of them. In an
# OpenAI body every other unknown field is refused too; a simple row may carry other keys.
NEUTRAL_VALUES: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "stream": (False,), "stream_options": (), "echo": (False,),
    "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (),
}
MAX_LINE_BYTES = 16 * 1024 * 1024  # a longer line becomes a `row_too_long` error row, unread
DETECT_LINES = 32  # format detection reads at most this many non-blank lines...
DETECT_BYTES = 1 << 20  # ...and stops after this many bytes (both kept to be read again)
BOM = b"\xef\xbb\xbf"
_OTHER_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")  # UTF-16/32, either byte order
_LONG_ID = 64  # custom_ids longer than this are remembered by a 16-byte digest


@dataclass
class InputRow:
    """One input row: what to generate from, or why it cannot be served."""

    index: int
    position: int  # where reading resumes at this row (byte offset or Parquet row number)
    end_position: int  # where reading resumes after this row
    id: str | int
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    overrides: dict = field(default_factory=dict)  # SamplingParams field -> value, as given
    error: RequestError | None = None
    custom_id: str | None = None  # OpenAI batch rows only
    endpoint: str | None = None  # OpenAI batch rows only: "completions" | "chat"


def _err(code: str, message: str, param: str | None = None) -> RequestError:
    return RequestError(code, message, param=param)


# ---------------------------------------------------------------------------------------------
# Row validation (pure functions on parsed JSON values; they raise RequestError)


def _fill_prompt(row: InputRow, obj: dict) -> None:
    """Set row.prompt/messages/prompt_token_ids from obj's one prompt key."""
    present = [k for k in PROMPT_KEYS if obj.get(k) is not None]
    if not present:
        raise _err("missing_prompt", f"row has none of {', '.join(PROMPT_KEYS)}")
    if len(present) > 1:
        raise _err("invalid_row",
                   f"row has more than one of {', '.join(present)}; give exactly one")
    key = present[0]
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise _err("invalid_type", f"prompt must be a string, got {json_type(value)}")
        if value == "":
            raise _err("empty_prompt", "prompt is empty")
        row.prompt = check_text(value, "prompt")
    elif key == "messages":
        row.messages = validate_messages(value)
    else:
        row.prompt_token_ids = validate_token_ids(value)


_OVERRIDE_SHAPES = {"stop": ("a string or an array of strings", (str, list)),
                    "ignore_eos": ("true or false", (bool, int, float, str))}


def _overrides(obj: dict, where: str = "") -> dict:
    """The row's sampling overrides, as given; values in the wrong JSON shape are refused here
    (an array where a number goes), their ranges and types by SamplingParams (job)."""
    out = {}
    for key in (*OVERRIDE_KEYS, "max_completion_tokens"):
        value = obj.get(key)
        if value is None:
            continue
        wanted, shapes = _OVERRIDE_SHAPES.get(key, ("a number", (bool, int, float, str)))
        if not isinstance(value, shapes):
            raise _err("invalid_parameter", f"{where}{key} must be {wanted}, "
                                            f"got {json_type(value)}", param=key)
        if key == "stop":
            for s in [value] if isinstance(value, str) else value:
                if isinstance(s, str):
                    check_text(s, f"{where}stop")
        out["max_tokens" if key == "max_completion_tokens" else key] = value
    return out


def _is_neutral(value: object, neutral: tuple) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


def _refuse_unsupported(obj: dict, allowed: tuple | None, where: str) -> None:
    """A generation feature we do not implement is an error, never silently ignored. With
    `allowed` (an OpenAI body) every field not in it is such a feature."""
    for key, value in obj.items():
        if value is None or (allowed is not None and key in allowed):
            continue
        neutral = NEUTRAL_VALUES.get(key)
        if neutral is None and allowed is None:
            continue  # a simple row's own columns (metadata) are passed over
        if neutral is None or not _is_neutral(value, neutral):
            raise _err("unsupported_parameter",
                       f"{where}{key}={show(value)} is not supported: run-batch answers each "
                       f"request with one plain-text completion; remove the field", param=key)


def parse_simple(obj: object, index: int, position: int, end_position: int) -> InputRow:
    """A simple-JSONL (or Parquet) row: id?, one of prompt/messages/prompt_token_ids, overrides."""
    row = InputRow(index=index, position=position, end_position=end_position, id=index + 1)
    try:
        if not isinstance(obj, dict):
            raise _err("invalid_row", f"a row must be a JSON object, got {json_type(obj)}")
        rid = obj.get("id")
        if rid is not None:
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                raise _err("invalid_id",
                           f"id must be a string or an integer, got {json_type(rid)}")
            row.id = rid  # a lone surrogate in it is echoed back as the same JSON escape
        _fill_prompt(row, obj)
        _refuse_unsupported(obj, None, "")
        row.overrides = _overrides(obj)
    except RequestError as e:
        row.error = e
    return row


def _openai_prompt(row: InputRow, body: dict) -> None:
    key = OPENAI_PROMPT[row.endpoint]
    value = body.get(key)
    if value is None:
        raise _err("missing_prompt", f"body.{key} is missing", param=key)
    if key == "messages":
        row.messages = validate_messages(value, "body.messages")
        return
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt, in a list
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        kind = "strings" if all(isinstance(p, str) for p in value) else "prompts"
        raise _err("unsupported_parameter", f"body.prompt is a list of {len(value)} {kind}: "
                                            f"each line of a batch is one request with one answer; "
                                            f"put each prompt on its own line", param="prompt")
    if isinstance(value, list):
        row.prompt_token_ids = validate_token_ids(value, "body.prompt")
    elif not isinstance(value, str):
        raise _err("invalid_type", f"body.prompt must be a string, a list of token ids or a list "
                                   f"of one of them, got {json_type(value)}", param="prompt")
    elif not value:
        raise _err("empty_prompt", "body.prompt is empty", param="prompt")
    else:
        row.prompt = check_text(value, "body.prompt")


def _openai_envelope(row: InputRow, obj: dict) -> dict:
    """Check custom_id, method and url; returns the body."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _err("invalid_custom_id", "custom_id must be a non-empty string")
    row.custom_id = row.id = cid
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        raise _err("invalid_method", f"method must be POST, got {show(method)}")
    if not isinstance(url, str) or url not in OPENAI_ENDPOINTS:
        raise _err("unsupported_url", f"url must be one of {', '.join(OPENAI_ENDPOINTS)}, "
                                      f"got {show(url)}")
    if not isinstance(body, dict):
        raise _err("invalid_body", f"body must be a JSON object, got {json_type(body)}")
    row.endpoint = OPENAI_ENDPOINTS[url]
    return body


def parse_openai(obj: object, index: int, position: int, end_position: int) -> InputRow:
    """An OpenAI Batch API request line: custom_id, method, url, body."""
    row = InputRow(index=index, position=position, end_position=end_position, id=index + 1)
    try:
        if not isinstance(obj, dict):
            raise _err("invalid_row", f"a request must be a JSON object, got {json_type(obj)}")
        body = _openai_envelope(row, obj)
        allowed = (OPENAI_PROMPT[row.endpoint], *OVERRIDE_KEYS, "max_completion_tokens",
                   *OPENAI_IGNORED)
        _refuse_unsupported(body, allowed, "body.")
        _openai_prompt(row, body)
        row.overrides = _overrides(body, "body.")
    except RequestError as e:
        row.error = e
    return row


def decode_json_line(line: bytes) -> tuple[object, RequestError | None]:
    """bytes of one line -> (parsed value, None) or (None, error). Never raises."""
    if line.startswith(BOM):
        line = line[len(BOM):]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, _err("invalid_utf8", f"line is not valid UTF-8 (byte {e.start})")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, _err("invalid_json", f"invalid JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return None, _err("invalid_json", "invalid JSON: nested too deeply")
    except ValueError as e:  # an integer of more digits than Python converts
        if "digits" in str(e):
            return None, _err("invalid_json", f"invalid JSON: a number has more than "
                                              f"{sys.get_int_max_str_digits()} digits")
        return None, _err("invalid_json", f"invalid JSON: {show(str(e))}")


def parse_line(parse: Callable, line: bytes, index: int, start: int, end: int) -> InputRow:
    """One JSONL line -> its row; anything that goes wrong is that row's error."""
    try:
        obj, error = decode_json_line(line)
        if error is None:
            return parse(obj, index, start, end)
    except Exception as e:  # a row never stops the job, whatever it holds
        error = _err("invalid_row", f"cannot read this row ({type(e).__name__}: {show(str(e))})")
    return InputRow(index=index, position=start, end_position=end, id=index + 1, error=error)


class CustomIds:
    """The custom_ids seen so far in an OpenAI batch: the first use is served, a repeat is an
    error row. Memory grows with the number of distinct ids (at most ~100 bytes each: long ids
    are kept as digests); it is a function of the rows read, so a resume rebuilds it by reading
    the rows before the resume point again."""

    def __init__(self) -> None:
        self._seen: set[str | bytes] = set()

    def check(self, row: InputRow) -> None:
        cid = row.custom_id
        if cid is None:
            return
        key: str | bytes = cid
        if len(cid) > _LONG_ID:
            key = hashlib.blake2b(cid.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in self._seen:
            row.error = _err("duplicate_custom_id", f"custom_id {show(cid)} was already used "
                                                    f"by an earlier request; they must be unique")
        self._seen.add(key)


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
        part = bytes(self._kept[self._pos:stop])
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

    def __init__(self, stream: BinaryIO | ReplayStream, fmt: str, seekable: bool,
                 max_line_bytes: int = MAX_LINE_BYTES):
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
                row = InputRow(index=index, position=start, end_position=end, id=index + 1,
                               error=_err("row_too_long",
                                          f"line is longer than {self.max_line_bytes} bytes"))
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
    _INTEGER_FIELDS = ("id", "max_tokens", "top_k", "seed")

    def __init__(self, path: Path, prompt_column: str = "prompt", id_column: str | None = None,
                 messages_column: str | None = None, batch_rows: int = 1024):
        import pyarrow.parquet as pq

        try:
            self._file = pq.ParquetFile(str(path))
        except Exception as e:
            raise UsageError(f"{path}: cannot read as Parquet ({type(e).__name__}: {e})") from None
        names = set(self._file.schema_arrow.names)
        for flag, col in (("--id-column", id_column), ("--messages-column", messages_column)):
            if col is not None and col not in names:
                raise UsageError(f"{path}: {flag} {col!r} is not a column; "
                                 f"columns: {', '.join(sorted(names))}")
        self._map = {"prompt": prompt_column if prompt_column in names else None,
                     "messages": messages_column,
                     "prompt_token_ids": ("prompt_token_ids" if "prompt_token_ids" in names
                                          else None),
                     "id": id_column}
        if not any(self._map[k] for k in PROMPT_KEYS):
            raise UsageError(f"{path}: no prompt column {prompt_column!r} (see --prompt-column, "
                             f"--messages-column); columns: {', '.join(sorted(names))}")
        self._overrides = [k for k in OVERRIDE_KEYS if k in names]
        self._columns = sorted({c for c in self._map.values() if c} | set(self._overrides))
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
            for batch in self._file.iter_batches(batch_size=self._batch_rows, row_groups=[rg],
                                                 columns=self._columns):
                for record in batch.to_pylist():
                    if index >= start_index:
                        yield self._row(record, index)
                    index += 1
        except Exception as e:
            error = _err("invalid_row", f"cannot read Parquet row group {rg} "
                                        f"({type(e).__name__}: {show(str(e))})")
            for i in range(max(index, start_index), first + n):
                yield InputRow(index=i, position=i, end_position=i + 1, id=i + 1, error=error)

    def _row(self, record: dict, index: int) -> InputRow:
        try:
            obj = self._record_to_obj(record)
        except RequestError as e:
            return InputRow(index=index, position=index, end_position=index + 1, id=index + 1,
                            error=e)
        except Exception as e:  # a row never stops the job, whatever it holds
            return InputRow(index=index, position=index, end_position=index + 1, id=index + 1,
                            error=_err("invalid_row", f"cannot read this row "
                                                      f"({type(e).__name__}: {show(str(e))})"))
        return parse_simple(obj, index, index, index + 1)

    def _record_to_obj(self, record: dict) -> dict:
        """A Parquet record as the JSON object a simple row would be."""
        obj: dict = {k: record[c] for k, c in self._map.items() if c and record.get(c) is not None}
        obj.update({k: record[k] for k in self._overrides if record.get(k) is not None})
        if isinstance(obj.get("prompt"), bytes):
            try:
                obj["prompt"] = obj["prompt"].decode("utf-8")
            except UnicodeDecodeError as e:
                raise _err("invalid_utf8", f"prompt is not valid UTF-8 (byte {e.start})") from None
        if isinstance(obj.get("messages"), (str, bytes)):
            raw = obj["messages"]
            obj["messages"], error = decode_json_line(raw if isinstance(raw, bytes)
                                                      else raw.encode("utf-8"))
            if error is not None:
                raise _err(error.code, f"{self._map['messages']}: {error.message}")
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
    return (isinstance(obj, dict) and ("custom_id" in obj or "body" in obj)
            and not any(k in obj for k in PROMPT_KEYS))


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
        raise UsageError(f"{name} starts with a UTF-16/UTF-32 byte-order mark; run-batch reads "
                         f"UTF-8 JSONL: convert it first (iconv -f UTF-16 -t UTF-8)")


def open_input(path: str, fmt: str = "auto", prompt_column: str = "prompt",
               id_column: str | None = None, messages_column: str | None = None,
               stdin: BinaryIO | None = None) -> JsonlSource | ParquetSource:
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
    if not p.exists():
        raise UsageError(f"input {path} not found")
    if p.is_dir():
        raise UsageError(f"input {path} is a folder; pass a .jsonl or .parquet file")
    if fmt == "parquet" or (fmt == "auto" and p.suffix.lower() == ".parquet"):
        return ParquetSource(p, prompt_column, id_column, messages_column)
    stream = open(p, "rb")
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
