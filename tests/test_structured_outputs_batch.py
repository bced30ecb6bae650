"""Structured outputs in run-batch (the embedded demo model): every spelling a row may use, the
output rows (simple and OpenAI shapes) with their status and errors, the summary's counts, the
job-wide flag, and a resumed job writing what an uninterrupted one writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmctl.batch.rows import parse_openai, parse_simple
from llmctl.cli import main
from llmctl.engine.structured import StructuredOutputsParams as SO
from tests.test_run_batch_kill import COMMIT_EVERY_8_AND_RUN

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def body(**kw) -> dict:
    return {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], **kw},
    }


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"structured_outputs": {"json": SCHEMA}}, SO(json=SCHEMA)),
        ({"structured_outputs": {"choice": ["a", "b"]}}, SO(choice=["a", "b"])),
        ({"guided_json": json.dumps(SCHEMA)}, SO(json=SCHEMA)),
        ({"guided_regex": "[0-9]+"}, SO(regex="[0-9]+")),
        ({"guided_choice": ["x"]}, SO(choice=["x"])),
        ({"guided_grammar": 'root ::= "a"'}, SO(grammar='root ::= "a"')),
        ({"sampling_params": {"guided_decoding": {"regex": "a"}}}, SO(regex="a")),
        ({"sampling_params": {"structured_outputs": {"json_object": True}}}, SO(json_object=True)),
        ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
def test_simple_row_spellings(fields, expected):
    row = parse_simple({"prompt": "x", **fields}, 0, 0, 1)
    assert row.error is None, row.error and row.error.message
    assert row.overrides.get("structured_outputs") == expected


def test_openai_response_format():
    schema = {"name": "p", "schema": SCHEMA, "strict": True}
    row = parse_openai(
        body(response_format={"type": "json_schema", "json_schema": schema}), 0, 0, 1
    )
    so = row.overrides["structured_outputs"]
    assert so == SO(json=SCHEMA)
    assert so.source == "body.response_format.json_schema.schema"
    row = parse_openai(body(structured_outputs={"regex": "a+"}), 0, 0, 1)
    assert row.overrides["structured_outputs"] == SO(regex="a+")


@pytest.mark.parametrize(
    "fields,code,words",
    [
        ({"response_format": {"type": "json_schema"}}, "invalid_parameter", "json_schema must be"),
        ({"response_format": {"type": "yaml"}}, "invalid_parameter", "type is text, json_object"),
        ({"guided_json": "{oops"}, "invalid_parameter", "guided_json.json: not JSON"),
        ({"guided_choice": [], "guided_regex": "a"}, "invalid_parameter", "give one"),
        ({"structured_outputs": {"jsn": {}}}, "unsupported_parameter", "unknown field 'jsn'"),
        (
            {"guided_regex": "a", "sampling_params": {"guided_regex": "b"}},
            "invalid_parameter",
            "give it once",
        ),
    ],
)
def test_wrong_spellings_are_the_rows_errors(fields, code, words):
    row = parse_simple({"prompt": "x", **fields}, 0, 0, 1)
    assert row.error is not None and row.error.code == code and words in row.error.message


def run(tmp_path: Path, rows: list[dict], *flags: str) -> tuple[list[dict], dict]:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    args = ["run-batch", str(inp), "-o", str(out), "--report-json", str(report), "-q"]
    rc = main([*args, "--dtype", "float32", "--overwrite", *flags])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return lines, json.loads(report.read_text())


def test_simple_rows_end_to_end(tmp_path):
    rows = [
        {"id": "json", "prompt": "ROMEO:", "structured_outputs": {"json": SCHEMA},
         "max_tokens": 64},
        {"id": "cut", "prompt": "ROMEO:", "guided_json": SCHEMA, "max_tokens": 2},
        {"id": "choice", "prompt": "KING:", "guided_choice": ["yes", "no"], "n": 2,
         "temperature": 1},
        {"id": "bad", "prompt": "x", "guided_json": {"type": "array", "uniqueItems": True}},
        {"id": "free", "prompt": "ROMEO:", "max_tokens": 4},
    ]  # fmt: skip
    out, report = run(tmp_path, rows)
    by = {r["id"]: r for r in out}
    assert json.loads(by["json"]["text"]).keys() == {"name", "age"}
    assert by["json"]["structured_output"] == "valid" and by["json"]["error"] is None
    assert by["cut"]["finish_reason"] == "length" and by["cut"]["text"]
    assert by["cut"]["error"]["code"] == "structured_output_incomplete"
    assert by["cut"]["structured_output"] == "incomplete"
    assert {o["text"] for o in by["choice"]["outputs"]} <= {"yes", "no"}
    assert [o["structured_output"] for o in by["choice"]["outputs"]] == ["valid", "valid"]
    assert by["bad"]["error"]["code"] == "unsupported_parameter" and by["bad"]["text"] is None
    assert "structured_output" not in by["free"]
    assert report["structured_outputs"] == {
        "constrained": 3,
        "valid": 2,
        "incomplete": 1,
        "invalid": 0,
    }
    assert report["errors_by_code"] == {
        "structured_output_incomplete": 1,
        "unsupported_parameter": 1,
    }


def test_openai_rows_end_to_end(tmp_path):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    rows = [
        {**body(response_format=fmt, max_tokens=64), "custom_id": "ok"},
        {**body(response_format=fmt, max_tokens=3), "custom_id": "cut"},
    ]
    out, _ = run(tmp_path, rows)
    ok, cut = out
    message = ok["response"]["body"]["choices"][0]["message"]["content"]
    assert set(json.loads(message)) == {"name", "age"} and ok["error"] is None
    assert cut["response"]["status_code"] == 200  # the text is kept; the line says what failed
    assert cut["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert cut["error"]["code"] == "structured_output_incomplete"


def test_job_wide_constraint_and_a_rows_own(tmp_path):
    rows = [{"prompt": "ROMEO:"}, {"prompt": "KING:", "guided_regex": "[0-9]{3}"}]
    flag = json.dumps({"choice": ["ROMEO", "JULIET"]})
    out, report = run(tmp_path, rows, "--structured-outputs", flag)
    assert out[0]["text"] in ("ROMEO", "JULIET") and len(out[1]["text"]) == 3
    assert out[1]["text"].isdigit() and report["structured_outputs"]["valid"] == 2
    schema_file = tmp_path / "so.json"
    schema_file.write_text(json.dumps({"json": {"type": "strin"}}))
    inp = tmp_path / "in.jsonl"
    assert main(["run-batch", str(inp), "-o", "-", "--structured-outputs", f"@{schema_file}"]) == 2


def test_interrupted_job_resumes_to_the_uninterrupted_output(tmp_path):
    """SIGINT after the first commits, then the same command again: the output equals an
    uninterrupted run's (batch-invariant, so batch make-up cannot change a token)."""
    so = [{"json": SCHEMA}, {"choice": ["yes", "no", "perhaps"]}, {"regex": "[a-z]{2,9}"}]
    rows = [{"prompt": f"ROMEO {i}:", "structured_outputs": so[i % 3]} for i in range(80)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # four rows at a time: rows finish one after another, so the interrupt lands mid-job
    flags = ["--dtype", "float32", "--batch-invariant", "--max-tokens", "48", "--max-num-seqs", "4"]
    flags.append("-q")
    whole = tmp_path / "whole.jsonl"
    assert main(["run-batch", str(inp), "-o", str(whole), *flags]) == 0
    part = tmp_path / "part.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-c",
        COMMIT_EVERY_8_AND_RUN,
        "run-batch",
        str(inp),
        "-o",
        str(part),
        *flags,
    ]
    child = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if part.exists() and part.read_text().count("\n") >= 8:
            child.send_signal(signal.SIGINT)
            break
        time.sleep(0.01)
    child.communicate(timeout=120)
    written = part.read_text().count("\n")
    assert 8 <= written < 80, "the job was not interrupted midway"
    assert main(["run-batch", str(inp), "-o", str(part), *flags]) == 0
    assert part.read_bytes() == whole.read_bytes()


def test_constrained_rows_travel_to_ray_replicas_intact():
    """Ray replicas get rows as JSON: the constraint (with where it came from) and the tools
    come back equal."""
    from llmctl.batch.ray.processor import _row_to_json, row_from_json
    from llmctl.engine.params import SamplingParams

    tools = [{"type": "function", "function": {"name": "f"}}]
    obj = {"messages": [{"role": "user", "content": "x"}], "guided_json": SCHEMA}
    row = parse_simple({**obj, "tools": tools, "tool_choice": "auto"}, 0, 0, 1)
    back = row_from_json(_row_to_json(row))
    so = SamplingParams(**back.overrides).structured_outputs
    assert so == SO(json=SCHEMA) and so.source == "guided_json"
    assert (back.tools, back.tool_choice) == (tools, "auto")
