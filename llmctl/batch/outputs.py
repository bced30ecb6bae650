"""Writing run-batch results: the row shapes and the append-only sinks.

Owns: `RowResult` (what one input row produced), the two output shapes (the simple shape:
id, text, finish_reason, usage, error, token_ids?; and the OpenAI Batch API output shape with
deterministic ids, so a resumed job writes the same bytes as an uninterrupted one), the sinks
(a locked file appended, hashed and fsynced in chunks; stdout), `open_locked` (the advisory
lock that keeps two jobs off one output), and the streaming JSONL -> Parquet conversion used for
`.parquet` outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from llmctl.batch.digests import new_hasher
from llmctl.batch.journal import temp_path
from llmctl.batch.logprob_records import openai_choices, simple_fields, vllm_prompt_logprobs
from llmctl.batch.rows import InputRow
from llmctl.batch.tool_calls import openai_tool_calls
from llmctl.errors import RequestError, UsageError


@dataclass
class RowResult:
    """The outcome of one input row: generated text, or an error."""

    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] | None = None
    error: RequestError | None = None
    ttft: float | None = None
    tpot: float | None = None
    outputs: list | None = None  # the engine's CompletionOutputs (n > 1, logprobs)
    prompt_logprobs: list | None = None
    logprobs_k: int | None = None  # top alternatives asked per position
    prompt_logprobs_k: int | None = None
    # structured outputs: the row's status ("valid", "incomplete", "invalid": the worst of its
    # completions) and, where not valid, the error its output row carries beside the text
    structured: str | None = None
    structured_error: RequestError | None = None
    # rows with tools: (content, calls or None) per completion (batch/tool_calls.py)
    tools: list[tuple[str | None, list[dict] | None]] | None = None

    @property
    def error_code(self) -> str | None:
        """The code counted for this row: its failure, or its constraint's."""
        error = self.error or self.structured_error
        return None if error is None else error.code

    @classmethod
    def of(cls, out: Any, params: Any, decode: Callable[[list[int]], str]) -> "RowResult":
        """A finished engine request (`RequestOutput`-like) served with `params`."""
        outs = getattr(out, "outputs", None)
        text = out.text if out.text is not None else decode(out.output_token_ids)
        structured, structured_error = _structured(outs or [])
        return cls(
            text=text,
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=sum(len(c.token_ids) for c in outs)
            if outs
            else len(out.output_token_ids),
            token_ids=list(out.output_token_ids),
            ttft=out.ttft,
            tpot=out.tpot,
            outputs=outs,
            prompt_logprobs=getattr(out, "prompt_logprobs", None),
            logprobs_k=params.logprobs,
            prompt_logprobs_k=params.prompt_logprobs,
            structured=structured,
            structured_error=structured_error,
        )

    @classmethod
    def failed(cls, error: RequestError, prompt_tokens: int = 0) -> "RowResult":
        return cls(
            text=None,
            finish_reason=None,
            prompt_tokens=prompt_tokens,
            completion_tokens=0,
            error=error,
        )


def _structured(outputs: list) -> tuple[str | None, RequestError | None]:
    """A constrained row's status over its completions, and the error of the first that is not
    valid (structured_output_incomplete: cut off, by max_tokens or a stop string, before the
    constraint was complete; structured_output_invalid: complete but failing the check)."""
    statuses = [getattr(c, "structured_output", None) for c in outputs]
    if not any(statuses):
        return None, None
    for status in ("invalid", "incomplete"):
        for c, s in zip(outputs, statuses):
            if s == status:
                where = f"completion {c.index}: " if len(outputs) > 1 else ""
                message = f"{where}{c.structured_output_error}"
                return status, RequestError(f"structured_output_{status}", message)
    return "valid", None


def simple_record(row: InputRow, result: RowResult, include_token_ids: bool = False) -> dict:
    rec = {
        "id": row.id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
        },
        "error": None if result.error is None else result.error.to_dict(),
    }
    if result.tools and result.tools[0][1] is not None:
        rec["tool_calls"] = result.tools[0][1]
    if result.structured is not None:
        rec["structured_output"] = result.structured
        if result.structured_error is not None:
            rec["error"] = result.structured_error.to_dict()
    if include_token_ids:
        rec["token_ids"] = result.token_ids
    if result.error is None:
        rec.update(simple_fields(result, include_token_ids))
    return rec


def _stable_id(*parts: object, n: int = 24) -> str:
    """A deterministic id from the row's identity (same input -> same id after any resume)."""
    text = "\x1f".join(map(str, parts))  # a custom_id may hold a lone surrogate ("\ud800")
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def _bad_request(e: RequestError, key: str) -> dict:
    """The HTTP 400 response OpenAI gives a request it refuses."""
    error = {
        "message": e.message,
        "type": "invalid_request_error",
        "param": getattr(e, "param", None),
        "code": e.code,
    }
    return {"status_code": 400, "request_id": f"req_{key}", "body": {"error": error}}


def openai_record(
    row: InputRow, result: RowResult, model: str, created: int, include_token_ids: bool = False
) -> dict:
    """One line of an OpenAI Batch API output file (`response.body` a completion object)."""
    key = _stable_id(row.custom_id, row.index)
    rec: dict = {"id": f"batch_req_{key}", "custom_id": row.custom_id}
    if result.error is not None:  # as OpenAI answers a bad request: an HTTP 400 response, and
        # `error` null (that field is for requests that failed without an HTTP response)
        rec["response"], rec["error"] = _bad_request(result.error, key), None
        return rec
    if row.endpoint == "chat":
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        obj, prefix = "text_completion", "cmpl"
    if result.outputs:
        choices = openai_choices(result, row.endpoint, include_token_ids)
    else:  # a result built without the engine's completions (tests, fakes)
        choices = [_plain_choice(row.endpoint, result, include_token_ids)]
    for choice, (content, calls) in zip(choices, result.tools or ()):
        if calls is not None:  # OpenAI's shape of a message that calls tools
            choice["message"]["content"] = content
            choice["message"]["tool_calls"] = openai_tool_calls(
                calls, f"{key}\x1f{choice['index']}"
            )
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
    prompt_lps = None
    if result.prompt_logprobs is not None:
        prompt_lps = vllm_prompt_logprobs(result.prompt_logprobs)
        if row.endpoint != "chat":  # vLLM: on each completions choice, on the chat response
            for c in choices:
                c["prompt_logprobs"] = prompt_lps
    usage = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
    rec["response"] = {
        "status_code": 200,
        "request_id": f"req_{key}",
        "body": {
            "id": f"{prefix}-{key}",
            "object": obj,
            "created": created,
            "model": row.lora or model,  # vLLM's answer names the adapter that served it
            "choices": choices,
            "usage": usage,
        },
    }
    if prompt_lps is not None and row.endpoint == "chat":
        rec["response"]["body"]["prompt_logprobs"] = prompt_lps
    # the response stands (finish_reason says why it ended); the line's error says that the
    # constraint was not met
    e = result.structured_error
    rec["error"] = None if e is None else e.to_dict()
    return rec


def _plain_choice(endpoint: str | None, result: RowResult, include_token_ids: bool) -> dict:
    if endpoint == "chat":
        choice: dict = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
    else:
        choice = {
            "index": 0,
            "text": result.text,
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
    if include_token_ids:
        choice["token_ids"] = result.token_ids
    return choice


def encode_record(rec: dict) -> bytes:
    """One JSONL line. A lone surrogate (from a "\\ud800" escape in the input) is written back as
    the same JSON escape, so the line stays valid UTF-8 and valid JSON."""
    return (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
        "utf-8", "backslashreplace"
    )


def open_locked(path: Path, create: bool) -> BinaryIO:
    """Open path for appending and take an exclusive advisory lock for the life of the file object
    (released by the OS even on kill -9). create=True makes a new file and refuses an existing one
    (it appeared since the job looked: another job may own it)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        f: BinaryIO = os.fdopen(os.open(path, flags, 0o644), "r+b")
    except FileExistsError:
        raise UsageError(
            f"{path} appeared while the model was loading (another llmctl "
            f"run-batch?); rerun the command"
        ) from None
    except OSError as e:
        raise UsageError(f"cannot open {path} for writing: {e.strerror or e}") from None
    try:
        import fcntl
    except ImportError:  # not POSIX: no protection against two jobs on one output
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise UsageError(
            f"another llmctl run-batch is writing {path}; wait for it or choose another output"
        ) from None
    return f


class FileSink:
    """Appends lines to an open, locked file; `commit()` flushes and fsyncs and returns the
    committed size, and `digest()` is the BLAKE2b hash of those bytes.

    On open the file is cut back to `committed_bytes` (what the state file says was committed),
    which drops any rows a killed session wrote after its last commit, torn last line included.
    `hasher` holds the hash of those first bytes (checked by the caller against the state file).
    A failed close is ignored: what `commit()` returned is on disk, and nothing after it counts.
    """

    def __init__(self, f: BinaryIO, path: Path, committed_bytes: int = 0, hasher=None):
        self.path = path
        self._f = f
        size = os.fstat(self._f.fileno()).st_size
        if size < committed_bytes:
            raise UsageError(
                f"{path} is shorter ({size} bytes) than its state file says "
                f"({committed_bytes}); it was changed by hand: pass --overwrite to "
                f"start over"
            )
        self._f.truncate(committed_bytes)
        self._f.seek(committed_bytes)
        self.bytes = committed_bytes
        self._hash = hasher if hasher is not None else new_hasher()

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.bytes += len(data)

    def commit(self) -> int:
        self._f.flush()
        os.fsync(self._f.fileno())
        return self.bytes

    def digest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # e.g. the disk is full: the rows since the last commit are dropped by the rerun


class StdoutSink:
    """`-o -`: rows go to stdout as they are committed; nothing to resume."""

    def __init__(self, stream: BinaryIO | None = None):
        self._f = stream if stream is not None else sys.stdout.buffer
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self.bytes += len(data)

    def commit(self) -> int:
        self._f.flush()
        return self.bytes

    def close(self) -> None:
        self._f.flush()


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _output_fields(journal: Path, include_token_ids: bool) -> list:
    """Parquet columns for logprobs, prompt_logprobs and outputs (n > 1), only when some row of
    the journal has them (one extra pass over it)."""
    import pyarrow as pa

    present: set[str] = set()
    wanted = ("logprobs", "prompt_logprobs", "outputs")
    with open(journal, "rb") as f:
        for line in f:
            if b'logprobs"' in line or b'"outputs"' in line:  # cheap test, then the real one
                present.update(k for k in wanted if k in json.loads(line))
    tok = pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
    pos = pa.struct([*tok, ("rank", pa.int64()), ("top_logprobs", pa.list_(tok))])
    one = [("index", pa.int64()), ("text", pa.string()), ("finish_reason", pa.string())]
    if include_token_ids:
        one.append(("token_ids", pa.list_(pa.int64())))
    one.append(("logprobs", pa.list_(pos)))
    types = {
        "logprobs": pa.list_(pos),
        "prompt_logprobs": pa.list_(pos),
        "outputs": pa.list_(pa.struct(one)),
    }
    return [pa.field(k, types[k]) for k in wanted if k in present]


def journal_to_parquet(
    journal: Path, out: Path, include_token_ids: bool, chunk_rows: int = 8192
) -> None:
    """Convert a simple-shape JSONL journal to Parquet in chunks; the file appears atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields = [
        pa.field("id", pa.string()),
        pa.field("text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field(
            "usage", pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64())])
        ),
        pa.field("error", pa.struct([("code", pa.string()), ("message", pa.string())])),
    ]
    if include_token_ids:
        fields.append(pa.field("token_ids", pa.list_(pa.int64())))
    fields += _output_fields(journal, include_token_ids)
    schema = pa.schema(fields)
    tmp = temp_path(out)

    def table(recs: list[dict]):
        for r in recs:  # Parquet strings are UTF-8: a lone surrogate (an input id's "\ud800")
            r["id"] = _utf8(str(r["id"]))  # is kept as the escape the JSONL output writes
            if r["error"] is not None:
                r["error"]["message"] = _utf8(r["error"]["message"])
        return pa.Table.from_pylist(recs, schema=schema)

    with open(journal, "rb") as f, pq.ParquetWriter(str(tmp), schema) as writer:
        chunk: list[dict] = []
        for line in f:
            chunk.append(json.loads(line))
            if len(chunk) >= chunk_rows:
                writer.write_table(table(chunk))
                chunk = []
        if chunk:
            writer.write_table(table(chunk))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
