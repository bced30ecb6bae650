"""Tool calling in run-batch chat rows: tools rendered by the model's chat template, a required
or named call constrained to the tools' schemas, calls read back (the Hermes/Qwen format for
`auto`) into OpenAI's `tool_calls`, and the rows' errors (the demo model with a Hermes-style
template)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmctl.batch.rows import parse_openai, parse_simple
from llmctl.batch.tool_calls import openai_tool_calls, tool_calls_of
from llmctl.cli import main
from llmctl.runtime.loader import load_runtime
from llmctl.runtime.resolve import DEMO_MODEL_DIR

HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{%- for t in tools %}\n{{ t.function | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory) -> Path:
    """The demo model with a Hermes-style chat template that renders tools."""
    d = tmp_path_factory.mktemp("hermes")
    for f in DEMO_MODEL_DIR.iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HERMES
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_tools_are_rendered_by_the_template(hermes_model):
    runtime = load_runtime(str(hermes_model), dtype="float32")
    assert runtime.tool_call_format == "hermes"
    text = runtime.decode(runtime.apply_chat_template(ASK, tools=[WEATHER]))
    assert "get_weather" in text and "The weather in a city" in text
    assert "get_weather" not in runtime.decode(runtime.apply_chat_template(ASK))


def run(tmp_path: Path, rows: list[dict], model: Path) -> list[dict]:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run-batch", str(inp), "-o", str(out), "--model", str(model), "-q"]
    assert main([*args, "--dtype", "float32", "--max-tokens", "64"]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def chat(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": ASK, "tools": [WEATHER, TIME], **body},
    }


def test_required_and_named_calls_come_back_as_tool_calls(tmp_path, hermes_model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    one = dict(tool_choice="required", parallel_tool_calls=False)
    rows = [chat("named", tool_choice=named), chat("required", **one)]
    out = {r["custom_id"]: r for r in run(tmp_path, rows, hermes_model)}
    for cid in ("named", "required"):
        choice = out[cid]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] is None and message["tool_calls"]
        for call in message["tool_calls"]:
            assert call["id"].startswith("call_") and call["type"] == "function"
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert args["city"] in ("Paris", "Rome") and args["days"] in (1, 2, 3)
            else:
                assert call["function"]["name"] == "get_time" and args["zone"] in ("UTC", "CET")
    weather = out["named"]["response"]["body"]["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in weather] == ["get_weather"]


def test_simple_rows_and_auto(tmp_path, hermes_model):
    rows = [
        {
            "id": "r",
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        {"id": "a", "messages": ASK, "tools": [WEATHER]},  # auto: the demo model calls nothing
    ]
    r, a = run(tmp_path, rows, hermes_model)
    assert r["tool_calls"][0]["name"] == "get_weather" and r["structured_output"] == "valid"
    assert "tool_calls" not in a and a["text"] and a["error"] is None


def test_hermes_calls_are_parsed_from_text():
    call = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    text = f"Let me check.<tool_call>\n{call}\n</tool_call>"
    content, calls = tool_calls_of(text, "auto", "hermes")
    assert content == "Let me check." and calls == [
        {"name": "get_weather", "arguments": {"city": "Rome"}}
    ]
    assert tool_calls_of(text, "auto", None) == (text, None)  # a format we cannot read
    assert tool_calls_of("<tool_call>{oops</tool_call>", "auto", "hermes")[1] is None
    ids = [c["id"] for c in openai_tool_calls(calls * 2, "k")]
    assert len(set(ids)) == 2 and ids == [c["id"] for c in openai_tool_calls(calls * 2, "k")]


@pytest.mark.parametrize(
    "body,code,words",
    [
        ({"tools": [{"type": "function"}]}, "invalid_parameter", "tools[0] must be"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "invalid_parameter", "tool_choice must"),
        ({"tool_choice": "required"}, "invalid_parameter", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "invalid_parameter",
            "not in tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "invalid_parameter",
            "give one",
        ),
    ],
)
def test_bad_tool_fields_are_the_rows_errors(body, code, words):
    row = parse_openai(chat("x", **{"tools": None, **body}), 0, 0, 1)
    assert row.error is not None and row.error.code == code and words in row.error.message


def test_tools_need_a_chat_row():
    row = parse_simple({"prompt": "x", "tools": [WEATHER]}, 0, 0, 1)
    assert row.error.code == "unsupported_parameter"
    completions = {
        "custom_id": "c",
        "url": "/v1/completions",
        "method": "POST",
        "body": {"prompt": "x", "tools": [WEATHER]},
    }
    assert parse_openai(completions, 0, 0, 1).error.code == "unsupported_parameter"


def test_python_chat_takes_tools(hermes_model):
    from llmctl import LLM, SamplingParams

    llm = LLM(str(hermes_model), dtype="float32")
    params = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat(ASK, params, tools=[WEATHER])[0]
    assert "get_weather" in out.prompt
    assert "get_weather" not in llm.chat(ASK, params)[0].prompt
