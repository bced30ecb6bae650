"""Tool calling in chat rows: OpenAI's `tools` and `tool_choice`, the constraint a required call
puts on the output, and the calls read back out of the text.

Owns: `check_tools` / `check_tool_choice` (the row's fields, or its error), `tool_constraint`
(`tool_choice` naming a function: the output is that function's arguments, constrained to its
parameters' schema; "required": a JSON list of calls, each one of the tools with its
arguments), and `tool_calls_of` (the calls in a finished text: from the constrained JSON, or, for
`auto`, in the Hermes/Qwen format `<tool_call>{"name": ..., "arguments": ...}</tool_call>` where
the model's chat template writes that; otherwise the text stays the content) and
`openai_tool_calls` (OpenAI's `tool_calls` shape, with deterministic ids). The tools themselves
are rendered into the prompt by the model's chat template (runtime/chat_template.py).
"""

from __future__ import annotations

import hashlib
import json
import re

from llmctl.engine.requests import json_type, show
from llmctl.engine.structured import StructuredOutputsParams
from llmctl.errors import RequestError

CHOICES = ("none", "auto", "required")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _bad(message: str, param: str) -> RequestError:
    return RequestError("invalid_parameter", message, param=param)


def check_tools(tools: object, where: str) -> list[dict]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]."""
    if not isinstance(tools, list) or not tools:
        raise _bad(f"{where}tools must be a non-empty list of function tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise _bad(
                f'{where}tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                "tools",
            )
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{where}tools[{i}].function.parameters must be a JSON schema", "tools")
        if name in names:
            raise _bad(f"{where}tools[{i}]: the name {show(name)} is used twice", "tools")
        names.add(name)
    return tools


def check_tool_choice(choice: object, tools: list[dict] | None, where: str) -> str | dict:
    """ "none", "auto", "required" or {"type": "function", "function": {"name"}} naming one of
    the tools; without tools only "none" means anything."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str) and choice in CHOICES:
        if choice != "none" and not tools:
            raise _bad(f"{where}tool_choice {show(choice)} needs tools", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise _bad(
            f"{where}tool_choice must be none, auto, required or a function object, got "
            f"{json_type(choice)}",
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise _bad(f"{where}tool_choice names {show(name)}, which is not in tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def tool_constraint(
    tools: list[dict], choice: str | dict, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The output constraint a required call puts on the row (none for auto and none); with
    `parallel` false (OpenAI's parallel_tool_calls) a required list holds one call."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_parameters(tool), source="tool_choice")
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, source="tool_choice")


def tool_calls_of(
    text: str, choice: str | dict, fmt: str | None
) -> tuple[str | None, list[dict] | None]:
    """(content, calls) of a finished text: calls as {"name", "arguments" (an object)}; None
    where the text holds none we can read (it is then all content)."""
    if isinstance(choice, dict):  # the text is the named function's arguments
        return None, [{"name": choice["function"]["name"], "arguments": _loads(text)}]
    if choice == "required":
        calls = _loads(text)
        if isinstance(calls, list) and all(isinstance(c, dict) for c in calls):
            return None, [{"name": c.get("name"), "arguments": c.get("arguments")} for c in calls]
        return text, None  # cut off before the list was complete: the row says so
    if choice != "auto" or fmt != "hermes":
        return text, None
    calls = []
    for body in _HERMES.findall(text):
        call = _loads(body)
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    if not calls:
        return text, None
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def openai_tool_calls(calls: list[dict], key: str) -> list[dict]:
    """OpenAI's tool_calls: ids from the row's stable key (a resumed job writes the same);
    arguments as JSON text."""
    out = []
    for i, c in enumerate(calls):
        args = c["arguments"]
        digest = hashlib.sha256(f"{key}\x1f{i}".encode()).hexdigest()[:24]
        out.append(
            {
                "id": f"call_{digest}",
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    return out
