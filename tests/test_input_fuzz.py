"""Fuzzing the run-batch input layer: seeded mutations of valid rows (truncation, random bytes,
huge numbers, deep nesting, wrong types, BOMs, surrogates, non-UTF-8) never raise, and give
exactly one row, and one output line, per non-blank input line.

A few thousand lines run in the normal suite; LLMCTL_FUZZ_LINES=100000 runs the long version.
"""

from __future__ import annotations

import io
import json
import os
import random

import pytest

from llmctl.batch.inputs import JsonlSource, open_input
from llmctl.batch.loop import BatchLoop, LoopSettings
from llmctl.batch.outputs import encode_record, openai_record, simple_record
from llmctl.batch.rows import BOM
from llmctl.engine.params import SamplingParams
from tests.fakes import FakeEngine, FakeRuntime

LINES = int(os.environ.get("LLMCTL_FUZZ_LINES", "3000"))
SEED = 13

_MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]
VALID = [
    {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0.5, "seed": 7, "stop": ["\n"]},
    {"id": "q1", "messages": _MSGS, "top_p": 0.9, "top_k": 5},
    {"id": 12, "prompt_token_ids": [1, 2, 3], "ignore_eos": True, "min_p": 0.1},
    {"prompt": "caf\u00e9 \U0001f600", "repetition_penalty": 1.1, "presence_penalty": 0.2},
    {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": _MSGS, "max_completion_tokens": 2, "stream": False},
    },
    {
        "custom_id": "c2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": ["JULIET:"], "max_tokens": 2, "n": 1, "frequency_penalty": 0.5},
    },
]
ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    10**30,
    "",
    "x",
    [],
    {},
    [1, "2"],
    {"a": [None]},
    float("inf"),
    float("nan"),
    "\ud800",
    ["\udfff"],
    [[[]]],
    -(10**20),
]
ODD_TOKENS = [
    b"9" * 5000,
    b"1e999",
    b"-Infinity",
    b"NaN",
    b"[" * 5000,
    b"{" * 3000,
    b'"\\ud800"',
    b'"\\udc00x"',
    b"\xff",
    b"\xc3",
    b"\xef\xbb\xbf",
    b"\x00",
    b"\\",
    b'"',
]


def _mutate_value(rng: random.Random, obj):
    """Replace one value somewhere in obj by an odd one, or drop a key."""
    if isinstance(obj, dict) and obj:
        key = rng.choice(list(obj))
        if rng.random() < 0.2:
            return {k: v for k, v in obj.items() if k != key}
        return {
            **obj,
            key: _mutate_value(rng, obj[key]) if rng.random() < 0.4 else rng.choice(ODD_VALUES),
        }
    if isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        return obj[:i] + [_mutate_value(rng, obj[i])] + obj[i + 1 :]
    return rng.choice(ODD_VALUES)


def _mutate_bytes(rng: random.Random, line: bytes) -> bytes:
    kind = rng.randrange(7)
    at = rng.randrange(len(line) + 1)
    if kind == 0:
        return line[:at]  # truncated
    if kind == 1:
        return line[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + line[at:]
    if kind == 2:
        return line[:at] + rng.choice(ODD_TOKENS) + line[at:]
    if kind == 3:
        depth = rng.choice([10, 1000, 20_000])
        return b"[" * depth + line + b"]" * depth  # deep nesting
    if kind == 4:
        return BOM + line
    if kind == 5:
        return line.replace(b"3", b"9" * rng.choice([20, 4400, 6000]), 1)  # huge numbers
    return rng.choice([b"", b"  ", b"\t", BOM, BOM + b" ", b"\r"])  # blank, or nearly


def fuzz_input(n_lines: int, seed: int, fmt: str) -> bytes:
    """Rows of `fmt` (one in twenty of the other format), half mutated as JSON values, then
    most mutated as bytes; custom_ids unique but for one in fifty."""
    rng = random.Random(seed)
    own = [v for v in VALID if ("custom_id" in v) == (fmt == "openai")]
    other = [v for v in VALID if v not in own]
    out = []
    for i in range(n_lines):
        obj = rng.choice(other if rng.random() < 0.05 else own)
        if "custom_id" in obj:
            obj = {**obj, "custom_id": f"c{rng.randrange(i + 1) if rng.random() < 0.02 else i}"}
        if rng.random() < 0.5:
            obj = _mutate_value(rng, obj)
        line = json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            line = _mutate_bytes(rng, line)
        out.append(line.replace(b"\n", b" "))  # the mutations keep one line each
    return b"\n".join(out) + b"\n"


def non_blank_lines(data: bytes) -> list[int]:
    """Indexes of the lines that hold more than whitespace (after an optional UTF-8 BOM)."""
    lines = data.split(b"\n")[:-1]
    return [i for i, line in enumerate(lines) if line.removeprefix(BOM).strip()]


class _Sink:
    def __init__(self):
        self.lines = 0
        self.data = io.BytesIO()

    def write(self, data: bytes) -> None:
        self.lines += 1
        self.data.write(data)

    def commit(self) -> int:
        return self.data.tell()


def _serve(rows, fmt: str) -> _Sink:
    engine, sink = FakeEngine(max_num_seqs=64, max_model_len=64), _Sink()
    if fmt == "openai":

        def record(row, r):
            return encode_record(openai_record(row, r, "fake", 0))
    else:

        def record(row, r):
            return encode_record(simple_record(row, r))

    BatchLoop(
        engine,
        FakeRuntime(engine),
        rows,
        sink,
        record,
        SamplingParams(max_tokens=2),
        LoopSettings(max_in_flight=128, window=512),
    ).run()
    return sink


@pytest.mark.parametrize("fmt", ["jsonl", "openai"])
def test_every_non_blank_line_becomes_exactly_one_row_and_one_output_line(fmt):
    fuzz_data = fuzz_input(LINES, SEED, fmt)
    expected = non_blank_lines(fuzz_data)
    assert len(expected) > 0.8 * LINES  # the mutator makes some blank lines, not many
    rows = list(JsonlSource(io.BytesIO(fuzz_data), fmt, seekable=True).rows())
    assert [r.index for r in rows] == expected
    errors = sum(r.error is not None for r in rows)
    assert 0.2 * len(rows) < errors < 0.9 * len(rows)  # both kinds of row are exercised
    sink = _serve(iter(rows), fmt)
    assert sink.lines == len(expected)
    for line in sink.data.getvalue().splitlines():
        json.loads(line)  # every output line is valid JSON (and valid UTF-8)


@pytest.mark.parametrize("fmt", ["jsonl", "openai"])
def test_stdin_with_format_detection_reads_the_same_rows(fmt):
    fuzz_data = fuzz_input(min(LINES, 3000), SEED + 1, fmt)
    src = open_input("-", stdin=io.BytesIO(fuzz_data))
    assert [r.index for r in src.rows()] == non_blank_lines(fuzz_data)
