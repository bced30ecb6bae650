"""One run-batch input row, from parsed JSON to an `InputRow` or that row's error.

Owns: `InputRow`, the two JSONL row shapes (simple rows: `prompt` | `messages` |
`prompt_token_ids` with per-row sampling overrides, and n / logprobs / prompt_logprobs in their
own spellings per shape, `output_overrides`, and the `model` / `lora` names that pick a LoRA
adapter (batch/adapters.py); OpenAI Batch API rows: `custom_id`,
`method`, `url`, `body`), `decode_json_line`/`parse_line` (whatever goes wrong reading one row is
that row's error, never an exception), the fields we refuse rather than ignore, and `CustomIds`
(a repeated `custom_id` is an error row). The request checks themselves are in
engine/requests.py. Row numbering: `index` is 0-based and counts every physical line (blank lines
keep their number); the default id is `index + 1`; `position` is where reading resumes at the row.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import Callable

from llmctl.batch.row_fields import (
    OUTPUT_KEYS,
    OVERRIDE_KEYS,
    STRUCTURED_KEYS,
    output_overrides,
    refuse_unsupported,
    request_error,
    row_overrides,
    sampling_params_overrides,
    structured_override,
)
from llmctl.batch.tool_calls import check_tool_choice, check_tools, tool_constraint
from llmctl.engine.requests import (
    check_text,
    json_type,
    show,
    validate_messages,
    validate_token_ids,
)
from llmctl.errors import RequestError

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
OPENAI_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
OPENAI_PROMPT = {"completions": "prompt", "chat": "messages"}
# Body fields accepted and ignored: they do not change the answer (`model` picks a LoRA adapter
# where the job serves some, and is ignored otherwise: InputRow.model).
OPENAI_IGNORED = ("model", "user", "metadata", "store", "service_tier")
BOM = b"\xef\xbb\xbf"
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
    tools: list[dict] | None = None  # chat rows: the functions the model may call
    tool_choice: str | dict | None = None  # none / auto / required / a named function
    # which model serves it, as the row names it: OpenAI body.model or a simple row's model
    # (the base model or a LoRA adapter's name), a simple row's lora (an adapter's name)
    model: str | None = None
    lora: str | None = None


# ---------------------------------------------------------------------------------------------
# Row validation (pure functions on parsed JSON values; they raise RequestError)


def _fill_prompt(row: InputRow, obj: dict) -> None:
    """Set row.prompt/messages/prompt_token_ids from obj's one prompt key."""
    present = [k for k in PROMPT_KEYS if obj.get(k) is not None]
    if not present:
        raise request_error("missing_prompt", f"row has none of {', '.join(PROMPT_KEYS)}")
    if len(present) > 1:
        raise request_error(
            "invalid_row", f"row has more than one of {', '.join(present)}; give exactly one"
        )
    key = present[0]
    value = obj[key]
    if key == "prompt":
        if not isinstance(value, str):
            raise request_error("invalid_type", f"prompt must be a string, got {json_type(value)}")
        if value == "":
            raise request_error("empty_prompt", "prompt is empty")
        row.prompt = check_text(value, "prompt")
    elif key == "messages":
        row.messages = validate_messages(value)
    else:
        row.prompt_token_ids = validate_token_ids(value)


TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


def _tools(row: InputRow, obj: dict, where: str) -> None:
    """A chat row's tools and tool_choice; a call it requires constrains the output."""
    if not obj.get("tools") and obj.get("tool_choice") in (None, "none"):
        return  # no tools (an empty list is none)
    row.tools = check_tools(obj["tools"], where) if obj.get("tools") else None
    row.tool_choice = check_tool_choice(obj.get("tool_choice"), row.tools, where)
    parallel = obj.get("parallel_tool_calls") is not False
    constraint = row.tools and tool_constraint(row.tools, row.tool_choice, parallel)
    if constraint and "structured_outputs" in row.overrides:
        raise request_error(
            "invalid_parameter",
            f"{where}tool_choice requires a call, and the row constrains its output too; give one",
            param="tool_choice",
        )
    if constraint:
        row.overrides["structured_outputs"] = constraint


def _name(obj: dict, key: str, where: str) -> str | None:
    """A model or adapter name field: a string, or absent."""
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise request_error(
            "invalid_type", f"{where}{key} must be a string, got {json_type(value)}", param=key
        )
    return value


def parse_simple(obj: object, index: int, position: int, end_position: int) -> InputRow:
    """A simple-JSONL (or Parquet) row: id?, one of prompt/messages/prompt_token_ids, overrides."""
    row = InputRow(index=index, position=position, end_position=end_position, id=index + 1)
    try:
        if not isinstance(obj, dict):
            raise request_error("invalid_row", f"a row must be a JSON object, got {json_type(obj)}")
        rid = obj.get("id")
        if rid is not None:
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                raise request_error(
                    "invalid_id", f"id must be a string or an integer, got {json_type(rid)}"
                )
            row.id = rid  # a lone surrogate in it is echoed back as the same JSON escape
        _fill_prompt(row, obj)
        row.model, row.lora = _name(obj, "model", ""), _name(obj, "lora", "")
        chat = row.messages is not None  # tools are for chat rows
        refuse_unsupported({k: v for k, v in obj.items() if not chat or k not in TOOL_KEYS}, None)
        own = {**row_overrides(obj), **structured_override(obj)}
        row.overrides = {**sampling_params_overrides(obj, own), **output_overrides(obj)}
        _tools(row, obj, "")
    except RequestError as e:
        row.error = e
    return row


def _openai_prompt(row: InputRow, body: dict) -> None:
    key = OPENAI_PROMPT[row.endpoint]
    value = body.get(key)
    if value is None:
        raise request_error("missing_prompt", f"body.{key} is missing", param=key)
    if key == "messages":
        row.messages = validate_messages(value, "body.messages")
        return
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one prompt, in a list
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        kind = "strings" if all(isinstance(p, str) for p in value) else "prompts"
        raise request_error(
            "unsupported_parameter",
            f"body.prompt is a list of {len(value)} {kind}: "
            f"each line of a batch is one request with one answer; "
            f"put each prompt on its own line",
            param="prompt",
        )
    if isinstance(value, list):
        row.prompt_token_ids = validate_token_ids(value, "body.prompt")
    elif not isinstance(value, str):
        raise request_error(
            "invalid_type",
            f"body.prompt must be a string, a list of token ids or a list "
            f"of one of them, got {json_type(value)}",
            param="prompt",
        )
    elif not value:
        raise request_error("empty_prompt", "body.prompt is empty", param="prompt")
    else:
        row.prompt = check_text(value, "body.prompt")


def _openai_envelope(row: InputRow, obj: dict) -> dict:
    """Check custom_id, method and url; returns the body."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise request_error("invalid_custom_id", "custom_id must be a non-empty string")
    row.custom_id = row.id = cid
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        raise request_error("invalid_method", f"method must be POST, got {show(method)}")
    if not isinstance(url, str) or url not in OPENAI_ENDPOINTS:
        raise request_error(
            "unsupported_url", f"url must be one of {', '.join(OPENAI_ENDPOINTS)}, got {show(url)}"
        )
    if not isinstance(body, dict):
        raise request_error("invalid_body", f"body must be a JSON object, got {json_type(body)}")
    row.endpoint = OPENAI_ENDPOINTS[url]
    return body


def parse_openai(obj: object, index: int, position: int, end_position: int) -> InputRow:
    """An OpenAI Batch API request line: custom_id, method, url, body."""
    row = InputRow(index=index, position=position, end_position=end_position, id=index + 1)
    try:
        if not isinstance(obj, dict):
            raise request_error(
                "invalid_row", f"a request must be a JSON object, got {json_type(obj)}"
            )
        body = _openai_envelope(row, obj)
        allowed = (
            *(TOOL_KEYS if row.endpoint == "chat" else ()),
            OPENAI_PROMPT[row.endpoint],
            *OVERRIDE_KEYS,
            "max_completion_tokens",
            *OUTPUT_KEYS,
            *STRUCTURED_KEYS,
            *OPENAI_IGNORED,
        )
        refuse_unsupported(body, allowed, "body.")
        _openai_prompt(row, body)
        row.model = _name(body, "model", "body.")
        row.overrides = {
            **row_overrides(body, "body."),
            **output_overrides(body, row.endpoint, "body."),
            **structured_override(body, "body."),
        }
        _tools(row, body, "body.")
    except RequestError as e:
        row.error = e
    return row


def decode_json_line(line: bytes) -> tuple[object, RequestError | None]:
    """bytes of one line -> (parsed value, None) or (None, error). Never raises."""
    if line.startswith(BOM):
        line = line[len(BOM) :]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, request_error("invalid_utf8", f"line is not valid UTF-8 (byte {e.start})")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, request_error("invalid_json", f"invalid JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return None, request_error("invalid_json", "invalid JSON: nested too deeply")
    except ValueError as e:  # an integer of more digits than Python converts
        if "digits" in str(e):
            return None, request_error(
                "invalid_json",
                f"invalid JSON: a number has more than {sys.get_int_max_str_digits()} digits",
            )
        return None, request_error("invalid_json", f"invalid JSON: {show(str(e))}")


def parse_line(parse: Callable, line: bytes, index: int, start: int, end: int) -> InputRow:
    """One JSONL line -> its row; anything that goes wrong is that row's error."""
    try:
        obj, error = decode_json_line(line)
        if error is None:
            return parse(obj, index, start, end)
    except Exception as e:  # a row never stops the job, whatever it holds
        error = request_error(
            "invalid_row", f"cannot read this row ({type(e).__name__}: {show(str(e))})"
        )
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
            row.error = request_error(
                "duplicate_custom_id",
                f"custom_id {show(cid)} was already used "
                f"by an earlier request; they must be unique",
            )
        self._seen.add(key)
