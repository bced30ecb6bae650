"""Structured outputs and tool calls on a real chat model, through `llmctl run-batch` as a user
runs it (issue 37's acceptance): JSON-schema extraction rows all parse and validate; json_object,
choice and regex rows all comply; rows cut off by max_tokens are reported incomplete; tool-call
rows return `tool_calls` under a Qwen/Hermes-style chat template (the model's folder copied with
such a template, since SmolLM2's own renders no tools).

    python benchmarks/check_structured_real.py --model $TMPDIR/smollm2-135m-instruct \
        --out benchmarks/results/structured_real_smollm2.json

Prints one line per kind and `RESULT {json}`; exit 1 when a row that should comply does not.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import SCHEMAS, TEXTS  # noqa: E402

QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\nYou are a function-calling assistant. Functions:\n"
    "<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\nFor each call return "
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rows() -> list[dict]:
    out = []
    for i in range(16):
        schema, text = SCHEMAS[i % 4], TEXTS[i % len(TEXTS)]
        ask = f"Extract as JSON with the schema {json.dumps(schema)}:\n{text}"
        out.append({"id": f"json-{i}", "messages": user(ask), "guided_json": schema})
    for i, text in enumerate(TEXTS):
        out.append(
            {"id": f"object-{i}", "messages": user(f"Describe as a JSON object: {text}"),
             "response_format": {"type": "json_object"}}
        )  # fmt: skip
        out.append(
            {"id": f"choice-{i}", "messages": user(f"Is this positive or negative? {text}"),
             "structured_outputs": {"choice": ["positive", "negative", "neutral"]}}
        )  # fmt: skip
        out.append(
            {"id": f"regex-{i}", "messages": user(f"Give a date (YYYY-MM-DD) for: {text}"),
             "guided_regex": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"}
        )  # fmt: skip
    for i in range(4):
        out.append(
            {"id": f"cut-{i}", "messages": user(f"Extract: {TEXTS[i]}"),
             "guided_json": SCHEMAS[0], "max_tokens": 4}
        )  # fmt: skip
    return out


def tool_rows() -> list[dict]:
    cities = ["Paris", "Tokyo", "Lima", "Oslo"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    return [
        {"id": f"tool-{i}", "messages": user(f"What's the weather in {c}?"), "tools": [WEATHER],
         "tool_choice": named if i % 2 else "required", "parallel_tool_calls": False}
        for i, c in enumerate(cities)
    ]  # fmt: skip


def run(model: Path, rows: list[dict], work: Path, name: str) -> list[dict]:
    from llmctl.cli import main

    inp, out = work / f"{name}.jsonl", work / f"{name}.out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["run-batch", str(inp), "-o", str(out), "--model", str(model), "--dtype",
               "bfloat16", "--max-tokens", "160", "-q"])  # fmt: skip
    assert rc == 0, rc
    return [json.loads(line) for line in out.read_text().splitlines()]


def complies(row: dict, out: dict) -> bool:
    text = out["text"]
    try:
        if "guided_json" in row:
            jsonschema.validate(json.loads(text), row["guided_json"])
        elif "response_format" in row:
            return isinstance(json.loads(text), dict)
        elif "structured_outputs" in row:
            return text in row["structured_outputs"]["choice"]
        elif "guided_regex" in row:
            return re.fullmatch(row["guided_regex"], text) is not None
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="structured-real-"))
    results: dict = {}
    given = rows()
    for row, out in zip(given, run(model, given, work, "rows")):
        kind = row["id"].split("-")[0]
        r = results.setdefault(kind, {"rows": 0, "comply": 0, "statuses": {}, "example": None})
        r["rows"] += 1
        status = out.get("structured_output")
        r["statuses"][status] = r["statuses"].get(status, 0) + 1
        r["comply"] += status == "valid" and complies(row, out)
        r["example"] = r["example"] or out["text"]
    tools_model = work / "with-tools"
    shutil.copytree(model, tools_model)
    config = json.loads((tools_model / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TOOLS
    (tools_model / "tokenizer_config.json").write_text(json.dumps(config))
    (tools_model / "chat_template.jinja").unlink(missing_ok=True)
    calls = [o.get("tool_calls") for o in run(tools_model, tool_rows(), work, "tools")]
    results["tool"] = {
        "rows": len(calls),
        "with_tool_calls": sum(bool(c) for c in calls),
        "example": calls[0],
    }
    ok = all(r["comply"] == r["rows"] for k, r in results.items() if k not in ("cut", "tool"))
    ok = ok and results["cut"]["statuses"] == {"incomplete": 4}
    ok = ok and results["tool"]["with_tool_calls"] == results["tool"]["rows"]
    for kind, r in results.items():
        print(kind, {k: v for k, v in r.items() if k != "example"}, "e.g.", r["example"])
    print("RESULT", json.dumps({"ok": ok, **results}))
    if args.out:
        Path(args.out).write_text(json.dumps({"ok": ok, **results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
