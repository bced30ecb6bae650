"""Reading run-batch inputs one row at a time, never the whole file.

Owns: the three input formats (simple JSONL, OpenAI Batch API JSONL, Parquet), their detection,
and turning each raw row into an `InputRow`: a prompt (text, chat messages or token ids) with its
per-row sampling overrides, or a structured `RequestError` for a bad row (invalid JSON or UTF-8,
a missing/empty prompt, wrong types, unknown chat roles). A bad row never raises.

Row numbering: `index` is 0-based and counts every physical line of a JSONL input (blank lines
are skipped but keep their number) or every Parquet row; the default id is `index + 1`.
`position` is where reading resumes at that row: a byte offset (JSONL) or a row number (Parquet).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from llmctl.errors import RequestError, UsageError

FORMATS = ("auto", "jsonl", "openai", "parquet")
OVERRIDE_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos")
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
OPENAI_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
MAX_LINE_BYTES = 16 * 1024 * 1024  # a longer line becomes a `row_too_long` error row, unread


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


def _err(code: str, message: str) -> RequestError:
    return RequestError(code, message)


# ---------------------------------------------------------------------------------------------
# Row validation (pure functions on parsed JSON values)


def validate_messages(messages: object) -> list[dict]:
    """Chat messages as [{'role': str, 'content': str}, ...]; text content parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise _err("invalid_messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _err("invalid_messages", f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise _err("invalid_messages", f"messages[{i}].role must be a string")
        if role not in CHAT_ROLES:
            raise _err("unknown_role", f"messages[{i}] has unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        if isinstance(content, list):  # OpenAI content parts: only text parts are supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _err("invalid_messages", f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _err("invalid_messages", f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def validate_token_ids(ids: object) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _err("invalid_type", "prompt_token_ids must be a list of integers")
    if not ids:
        raise _err("empty_prompt", "prompt_token_ids is empty")
    if any(t < 0 for t in ids):
        raise _err("invalid_token_id", "prompt_token_ids must not be negative")
    return ids


def _fill_prompt(row: InputRow, obj: dict, keys: tuple[str, str, str]) -> None:
    """Set row.prompt/messages/prompt_token_ids from obj, or row.error. keys: the three field names."""
    present = [k for k in keys if obj.get(k) is not None]
    if not present:
        row.error = _err("missing_prompt", f"row has none of {', '.join(keys)}")
        return
    if len(present) > 1:
        row.error = _err("invalid_row", f"row has more than one of {', '.join(present)}; give exactly one")
        return
    key = present[0]
    value = obj[key]
    try:
        if key == keys[0]:
            if not isinstance(value, str):
                raise _err("invalid_type", f"{key} must be a string, got {type(value).__name__}")
            if value == "":
                raise _err("empty_prompt", f"{key} is empty")
            row.prompt = value
        elif key == keys[1]:
            row.messages = validate_messages(value)
        else:
            row.prompt_token_ids = validate_token_ids(value)
    except RequestError as e:
        row.error = e


def parse_simple(obj: object, index: int, position: int, end_position: int) -> InputRow:
    """A simple-JSONL (or Parquet) row: id?, one of prompt/messages/prompt_token_ids, overrides."""
    row = InputRow(index=index, position=position, end_position=end_position, id=index + 1)
    if not isinstance(obj, dict):
        row.error = _err("invalid_row", f"a row must be a JSON object, got {_json_type(obj)}")
        return row
    rid = obj.get("id")
    if rid is not None:
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            row.error = _err("invalid_id", f"id must be a string or an integer, got {_json_type(rid)}")
            return row
        row.id = rid
    _fill_prompt(row, obj, PROMPT_KEYS)
    row.overrides = {k: obj[k] for k in OVERRIDE_KEYS if obj.get(k) is not None}
    return row


def parse_openai(obj: object, index: int, position: int, end_position: int) -> InputRow:
    """An OpenAI Batch API request line: custom_id, method, url, body."""
    row = InputRow(index=index, position=position, end_position=end_position, id=index + 1)
    if not isinstance(obj, dict):
        row.error = _err("invalid_row", f"a request must be a JSON object, got {_json_type(obj)}")
        return row
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        row.error = _err("invalid_custom_id", "custom_id must be a non-empty string")
        return row
    row.custom_id = row.id = cid
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        row.error = _err("invalid_method", f"method must be POST, got {method!r}")
    elif url not in OPENAI_ENDPOINTS:
        row.error = _err("unsupported_url", f"url must be one of {', '.join(OPENAI_ENDPOINTS)}, got {url!r}")
    elif not isinstance(body, dict):
        row.error = _err("invalid_body", "body must be a JSON object")
    if row.error is not None:
        return row
    row.endpoint = OPENAI_ENDPOINTS[url]
    n = body.get("n", 1)
    if n != 1:
        row.error = _err("unsupported_parameter", f"n must be 1 (one completion per request), got {n!r}")
        return row
    if row.endpoint == "chat":
        _fill_prompt(row, {"messages": body.get("messages")}, ("prompt", "messages", "prompt_token_ids"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            row.error = _err("unsupported_parameter", "one prompt per request: batch several prompts as several lines")
            return row
        key = "prompt_token_ids" if isinstance(prompt, list) else "prompt"
        _fill_prompt(row, {key: prompt}, PROMPT_KEYS)
    overrides = {k: body[k] for k in OVERRIDE_KEYS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        overrides["max_tokens"] = body["max_completion_tokens"]
    row.overrides = overrides
    return row


def _json_type(v: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def decode_json_line(line: bytes) -> tuple[object, RequestError | None]:
    """bytes of one line -> (parsed value, None) or (None, error)."""
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


# ---------------------------------------------------------------------------------------------
# Sources


class JsonlSource:
    """Rows of a JSONL stream (a file, or stdin), parsed by `parse` (simple or OpenAI)."""

    def __init__(self, stream: BinaryIO, fmt: str, seekable: bool, first_lines: list[bytes] | None = None,
                 max_line_bytes: int = MAX_LINE_BYTES):
        self.format = fmt
        self._stream = stream
        self._seekable = seekable
        self._pushed_back = list(first_lines or [])  # lines already read for format detection (stdin)
        self._parse: Callable = parse_openai if fmt == "openai" else parse_simple
        self.max_line_bytes = max_line_bytes

    def _readline(self) -> tuple[bytes, int, bool]:
        """(line, bytes consumed, too_long). A too-long line is skipped to its end, not kept."""
        if self._pushed_back:
            line = self._pushed_back.pop(0)
            return line, len(line), False
        line = self._stream.readline(self.max_line_bytes)
        if len(line) < self.max_line_bytes or line.endswith(b"\n"):
            return line, len(line), False
        consumed = len(line)
        while True:  # drop the rest of an oversized line in bounded pieces
            more = self._stream.readline(self.max_line_bytes)
            consumed += len(more)
            if not more or more.endswith(b"\n"):
                return b"", consumed, True

    def rows(self, start_index: int = 0, start_position: int = 0) -> Iterator[InputRow]:
        """Rows from `start_index` on; `start_position` is that row's byte offset (seekable input)."""
        index, position = 0, 0
        if start_index or start_position:
            if self._seekable:
                self._stream.seek(start_position)
                self._pushed_back = []
                index, position = start_index, start_position
            else:  # a pipe: read past the rows a previous session committed
                while index < start_index:
                    line, n, _ = self._readline()
                    if n == 0:
                        return
                    index, position = index + 1, position + n
        while True:
            line, n, too_long = self._readline()
            if n == 0:
                return
            start, position = position, position + n
            if too_long:
                row = InputRow(index=index, position=start, end_position=position, id=index + 1,
                               error=_err("row_too_long", f"line is longer than {self.max_line_bytes} bytes"))
                index += 1
                yield row
                continue
            if not line.strip():
                index += 1
                continue
            obj, error = decode_json_line(line)
            if error is not None:
                row = InputRow(index=index, position=start, end_position=position, id=index + 1, error=error)
            else:
                row = self._parse(obj, index, start, position)
            index += 1
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
                raise UsageError(f"{path}: {flag} {col!r} is not a column; columns: {', '.join(sorted(names))}")
        self._map = {"prompt": prompt_column if prompt_column in names else None,
                     "messages": messages_column, "prompt_token_ids": "prompt_token_ids" if "prompt_token_ids" in names else None,
                     "id": id_column}
        if not any(self._map[k] for k in PROMPT_KEYS):
            raise UsageError(f"{path}: no prompt column {prompt_column!r} (see --prompt-column, --messages-column); "
                             f"columns: {', '.join(sorted(names))}")
        self._overrides = [k for k in OVERRIDE_KEYS if k in names]
        self._columns = sorted({c for c in self._map.values() if c} | set(self._overrides))
        self._batch_rows = batch_rows

    def count_rows(self) -> int:
        return self._file.metadata.num_rows

    def rows(self, start_index: int = 0, start_position: int = 0) -> Iterator[InputRow]:
        meta = self._file.metadata
        first, skip, seen = 0, 0, 0  # first row group to read, rows of it to drop
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if seen + n > start_index:
                first, skip = rg, start_index - seen
                break
            seen += n
        else:
            return
        index = start_index - skip
        groups = list(range(first, meta.num_row_groups))
        for batch in self._file.iter_batches(batch_size=self._batch_rows, row_groups=groups, columns=self._columns):
            for record in batch.to_pylist():
                if index >= start_index:
                    yield self._row(record, index)
                index += 1

    def _row(self, record: dict, index: int) -> InputRow:
        obj: dict = {k: record[c] for k, c in self._map.items() if c and record.get(c) is not None}
        obj.update({k: record[k] for k in self._overrides if record.get(k) is not None})
        try:
            if isinstance(obj.get("prompt"), bytes):
                obj["prompt"] = obj["prompt"].decode("utf-8")
            if isinstance(obj.get("messages"), (str, bytes)):
                obj["messages"], error = decode_json_line(obj["messages"] if isinstance(obj["messages"], bytes)
                                                          else obj["messages"].encode("utf-8"))
                if error is not None:
                    return InputRow(index=index, position=index, end_position=index + 1, id=index + 1,
                                    error=_err(error.code, f"{self._map['messages']}: {error.message}"))
        except UnicodeDecodeError as e:
            return InputRow(index=index, position=index, end_position=index + 1, id=index + 1,
                            error=_err("invalid_utf8", f"prompt is not valid UTF-8 (byte {e.start})"))
        if isinstance(obj.get("stop"), tuple):
            obj["stop"] = list(obj["stop"])
        return parse_simple(obj, index, index, index + 1)

    def close(self) -> None:
        pass


def detect_format(first_line: bytes) -> str:
    """'openai' when the first non-blank line is an object with custom_id and body, else 'jsonl'."""
    obj, error = decode_json_line(first_line)
    if error is None and isinstance(obj, dict) and "custom_id" in obj and "body" in obj:
        return "openai"
    return "jsonl"


def open_input(path: str, fmt: str = "auto", prompt_column: str = "prompt", id_column: str | None = None,
               messages_column: str | None = None, stdin: BinaryIO | None = None) -> JsonlSource | ParquetSource:
    """Open INPUT ('-' = stdin) as a row source; the format is detected unless given."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown --input-format {fmt!r}; use one of {', '.join(FORMATS)}")
    if path == "-":
        if fmt == "parquet":
            raise UsageError("Parquet input cannot be read from stdin; pass a file path")
        stream = stdin if stdin is not None else sys.stdin.buffer
        first: list[bytes] = []
        if fmt == "auto":  # read up to the first non-blank line, then hand the lines back to the reader
            fmt = "jsonl"
            while line := stream.readline(MAX_LINE_BYTES):
                first.append(line)
                if line.strip():
                    fmt = detect_format(line)
                    break
        return JsonlSource(stream, fmt, seekable=False, first_lines=first)
    p = Path(path)
    if not p.exists():
        raise UsageError(f"input {path} not found")
    if p.is_dir():
        raise UsageError(f"input {path} is a folder; pass a .jsonl or .parquet file")
    if fmt == "parquet" or (fmt == "auto" and p.suffix.lower() == ".parquet"):
        return ParquetSource(p, prompt_column, id_column, messages_column)
    stream = open(p, "rb")
    if fmt == "auto":
        fmt = "jsonl"
        while line := stream.readline(MAX_LINE_BYTES):
            if line.strip():
                fmt = detect_format(line)
                break
        stream.seek(0)
    return JsonlSource(stream, fmt, seekable=True)
