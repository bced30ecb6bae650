"""One run-batch input row, from parsed JSON to an `InputRow` or that row's error.

Owns: `InputRow`, the two JSONL row shapes (simple rows: `prompt` | `messages` |
`prompt_token_ids` with per-row sampling overrides, and n / logprobs / prompt_logprobs in their
own spellings per shape, `output_overrides`; OpenAI Batch API rows: `custom_id`,
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

from llmctl.engine.requests import (
    check_text,
    json_type,
    show,
    validate_messages,
    validate_token_ids,
)
from llmctl.errors import RequestError

OVERRIDE_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
)
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
OPENAI_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
OPENAI_PROMPT = {"completions": "prompt", "chat": "messages"}
# Body fields accepted and ignored: they do not change the answer.
OPENAI_IGNORED = ("model", "user", "metadata", "store", "service_tier")
# Generation features llmctl does not implement, with the values that ask for none of them. In an
# OpenAI body every other unknown field is refused too; a simple row may carry other keys.
NEUTRAL_VALUES: dict[str, tuple] = {
    "best_of": (1,),
    "stream": (False,),
    "stream_options": (),
    "echo": (False,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}
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


def request_error(code: str, message: str, param: str | None = None) -> RequestError:
    return RequestError(code, message, param=param)


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


_OVERRIDE_SHAPES = {
    "stop": ("a string or an array of strings", (str, list)),
    "ignore_eos": ("true or false", (bool, int, float, str)),
}


def row_overrides(obj: dict, where: str = "") -> dict:
    """The row's sampling overrides, as given; values in the wrong JSON shape are refused here
    (an array where a number goes), their ranges and types by SamplingParams (job)."""
    out = {}
    for key in (*OVERRIDE_KEYS, "max_completion_tokens"):
        value = obj.get(key)
        if value is None:
            continue
        wanted, shapes = _OVERRIDE_SHAPES.get(key, ("a number", (bool, int, float, str)))
        if not isinstance(value, shapes):
            raise request_error(
                "invalid_parameter",
                f"{where}{key} must be {wanted}, got {json_type(value)}",
                param=key,
            )
        if key == "stop":
            for s in [value] if isinstance(value, str) else value:
                if isinstance(s, str):
                    check_text(s, f"{where}stop")
        out["max_tokens" if key == "max_completion_tokens" else key] = value
    return out


OUTPUT_KEYS = ("n", "logprobs", "top_logprobs", "prompt_logprobs")


def output_overrides(obj: dict, endpoint: str | None = None, where: str = "") -> dict:
    """n, logprobs and prompt_logprobs as SamplingParams fields (their ranges are checked
    there). Simple rows and completions ask `logprobs: k`; chat asks `logprobs: true` with
    `top_logprobs: k` (OpenAI's spellings)."""
    out = {k: obj[k] for k in ("n", "prompt_logprobs") if obj.get(k) is not None}
    lp, top = obj.get("logprobs"), obj.get("top_logprobs")
    if endpoint == "chat":
        if lp is not None and not isinstance(lp, bool):
            raise request_error(
                "invalid_parameter", f"{where}logprobs must be true or false", param="logprobs"
            )
        if top is not None and not lp:
            raise request_error(
                "invalid_parameter",
                f"{where}top_logprobs needs {where}logprobs: true",
                param="top_logprobs",
            )
        if lp:
            out["logprobs"] = 0 if top is None else top
        return out
    if top is not None and top != 0:
        raise request_error(
            "invalid_parameter",
            f"{where}top_logprobs is the chat endpoint's; here logprobs: K asks for K alternatives",
            param="top_logprobs",
        )
    if lp is True:
        raise request_error(
            "invalid_parameter",
            f"{where}logprobs must be the number of alternatives (0 to 20), got true",
            param="logprobs",
        )
    if lp is not None and lp is not False:
        out["logprobs"] = lp
    return out


def _is_neutral(value: object, neutral: tuple) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


def _refuse_unsupported(
    obj: dict, allowed: tuple | None, where: str, neutral_values: dict = NEUTRAL_VALUES
) -> None:
    """A generation feature we do not implement is an error, never silently ignored. With
    `allowed` (an OpenAI body, sampling_params) every field not in it is such a feature."""
    for key, value in obj.items():
        if value is None or (allowed is not None and key in allowed):
            continue
        neutral = neutral_values.get(key)
        if neutral is None and allowed is None:
            continue  # a simple row's own columns (metadata) are passed over
        if neutral is None or not _is_neutral(value, neutral):
            raise request_error(
                "unsupported_parameter",
                f"{where}{key}={show(value)} is not supported: run-batch answers with plain "
                f"text (n of them with n), not streams, tools or structured output; remove "
                f"the field",
                param=key,
            )


# vLLM SamplingParams fields a row's `sampling_params` may hold besides OVERRIDE_KEYS and
# stop_token_ids, with the values that change nothing here (other values are refused).
VLLM_NEUTRAL_VALUES: dict[str, tuple] = {
    "min_tokens": (0,),
    "detokenize": (True,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "bad_words": ([],),
    "flat_logprobs": (False,),
    "extra_args": ({},),
}


def sampling_params_overrides(obj: dict, overrides: dict) -> dict:
    """`overrides` with the row's `sampling_params` object (Ray Data LLM and vLLM rows: the
    SamplingParams fields by vLLM's names) merged in; a field given both there and in the row
    with another value, or one llmctl does not implement, is the row's error."""
    sp = obj.get("sampling_params")
    if sp is None:
        return overrides
    if not isinstance(sp, dict):
        raise request_error(
            "invalid_parameter",
            f"sampling_params must be an object, got {json_type(sp)}",
            param="sampling_params",
        )
    sp = {k: v for k, v in sp.items() if v is not None}
    known = (*OVERRIDE_KEYS, "stop_token_ids")
    _refuse_unsupported(sp, known, "sampling_params.", {**NEUTRAL_VALUES, **VLLM_NEUTRAL_VALUES})
    merged = dict(overrides)
    found = row_overrides(sp, "sampling_params.")
    ids = sp.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise request_error(
                "invalid_parameter",
                "sampling_params.stop_token_ids must be an array of integers",
                param="stop_token_ids",
            )
        found["stop_token_ids"] = ids
    for key, value in found.items():
        if key in merged and merged[key] != value:
            raise request_error(
                "invalid_parameter",
                f"{key} is given in the row ({show(merged[key])}) and in sampling_params "
                f"({show(value)}); give it once",
                param=key,
            )
        merged[key] = value
    return merged


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
        _refuse_unsupported(obj, None, "")
        row.overrides = {
            **sampling_params_overrides(obj, row_overrides(obj)),
            **output_overrides(obj),
        }
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
            OPENAI_PROMPT[row.endpoint],
            *OVERRIDE_KEYS,
            "max_completion_tokens",
            *OUTPUT_KEYS,
            *OPENAI_IGNORED,
        )
        _refuse_unsupported(body, allowed, "body.")
        _openai_prompt(row, body)
        row.overrides = {
            **row_overrides(body, "body."),
            **output_overrides(body, row.endpoint, "body."),
        }
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
