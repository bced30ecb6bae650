"""What makes one request servable, checked the same way by run-batch, the Python API and the
engine, with one set of error codes.

Owns: `ERROR_CODES` (every code a request can fail with, and what it means; the README's table
is checked against it), the request checks (`check_text`, `validate_messages`,
`validate_token_ids`, `check_prompt_ids`) and `show`, the short form of a value in a message.
Everything raises RequestError, which callers turn into an error row or an exception.
"""

from __future__ import annotations

import json
import re
import reprlib

from llmctl.errors import RequestError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_SURROGATE = re.compile("[\ud800-\udfff]")

ERROR_CODES = {
    "invalid_json": "the line is not JSON (also: a number of over 4300 digits, too deep nesting)",
    "invalid_utf8": "the line or prompt is not UTF-8",
    "row_too_long": "the line is over 16 MiB (skipped unread)",
    "invalid_row": "not one object, more than one prompt, or unreadable (a bad Parquet row group)",
    "missing_prompt": "no prompt, messages or prompt_token_ids",
    "empty_prompt": "an empty prompt",
    "invalid_type": "a prompt, messages or id of the wrong type",
    "invalid_messages": "chat messages of the wrong shape",
    "unknown_role": "a chat role other than system, user, assistant, tool, developer",
    "invalid_id": "an id that is not a string or integer",
    "invalid_text": "a lone UTF-16 surrogate in a prompt, message or stop string",
    "invalid_token_id": "a negative token id, or one outside the vocabulary",
    "invalid_parameter": "a bad sampling value (type, NaN/Infinity, range, too many stop strings), "
    "or a wrong schema, pattern or grammar (named by its field path)",
    "unsupported_parameter": "a feature run-batch does not do (stream, tools, echo, best_of...), "
    "or a JSON Schema keyword the grammar engine cannot compile",
    "invalid_custom_id": "OpenAI batch: a missing or non-string custom_id",
    "duplicate_custom_id": "OpenAI batch: a custom_id already used (the first use is served)",
    "invalid_method": "OpenAI batch: a method other than POST",
    "unsupported_url": "OpenAI batch: a url other than /v1/completions or /v1/chat/completions",
    "invalid_body": "OpenAI batch: a body that is not an object",
    "chat_template_error": "the model's chat template failed on these messages",
    "chat_template_limit": "the model's chat template ran past its time or size limits",
    "no_chat_template": "messages for a model without a chat template",
    "no_tokenizer": "text for a model without a tokenizer",
    "tokenization_failed": "the tokenizer failed on the text",
    "prompt_too_long": "the prompt does not fit the context or the KV cache",
    "unknown_model": "a model or lora name that is neither the base model nor a LoRA adapter",
    "structured_output_incomplete": "a constrained output cut off (max_tokens, a stop string) "
    "before its constraint was complete; the text and finish_reason are kept",
    "structured_output_invalid": "a complete constrained output that fails its check (the "
    "JSON against the schema, the choice, the pattern); the text is kept",
}


def _err(code: str, message: str, param: str | None = None) -> RequestError:
    return RequestError(code, message, param=param)


def show(value: object) -> str:
    """A value as it appears in an error message: short, whatever its size or nesting."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = 40
    r.maxlevel = 2
    return r.repr(value)


def json_type(v: object) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def check_text(value: str, where: str) -> str:
    """`value`, unless it holds a lone UTF-16 surrogate (JSON "\\ud800"), which is not text."""
    if not value.isascii():
        bad = _SURROGATE.search(value)
        if bad is not None:
            point = f"\\u{ord(bad.group()):04x}"
            raise _err(
                "invalid_text",
                f"{where} contains a lone surrogate ({point} at "
                f"{bad.start()}), which is not text; encode the text as "
                f"UTF-8 or as surrogate pairs",
            )
    return value


def validate_messages(messages: object, where: str = "messages") -> list[dict]:
    """Chat messages as [{'role': str, 'content': str}, ...]; text content parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise _err(
            "invalid_messages", f"{where} must be a non-empty list of {{role, content}} objects"
        )
    out = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise _err("invalid_messages", f"{at} must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise _err("invalid_messages", f"{at}.role must be a string")
        if role not in CHAT_ROLES:
            raise _err(
                "unknown_role",
                f"{at} has unknown role {show(role)}; use one of {', '.join(CHAT_ROLES)}",
            )
        if isinstance(content, list):  # OpenAI content parts: only text parts are supported
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise _err(
                    "invalid_messages",
                    f"{at}.content parts must be {{'type': 'text', 'text': str}}",
                )
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise _err(
                "invalid_messages", f"{at}.content must be a string, got {json_type(content)}"
            )
        msg = {"role": role, "content": check_text(content, f"{at}.content")}
        out.append({**msg, **_tool_fields(m, calls, at)})
    return out


def _tool_fields(m: dict, calls: object, at: str) -> dict:
    """An assistant turn's earlier tool calls (arguments as objects, as chat templates read
    them) and a tool result's tool_call_id and name."""
    extra = {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)}
    if not calls:
        return extra
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise _err("invalid_messages", f"{at}.tool_calls must be a list of objects")
    kept = []
    for c in calls:
        f = c.get("function") if isinstance(c.get("function"), dict) else c
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # the template gets the text
        kept.append({**c, "function": {"name": f.get("name"), "arguments": args}})
    return {**extra, "tool_calls": kept}


def validate_token_ids(ids: object, where: str = "prompt_token_ids") -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise _err("invalid_type", f"{where} must be a list of integers")
    if not ids:
        raise _err("empty_prompt", f"{where} is empty")
    if any(t < 0 for t in ids):
        raise _err("invalid_token_id", f"{where} must not be negative")
    return ids


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """The engine's check of a prompt it is given: non-empty, integers in [0, vocab_size)."""
    if not ids:
        raise _err("empty_prompt", "the prompt has no tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise _err("invalid_token_id", f"prompt token ids must be integers in [0, {vocab_size})")
