"""`llmctl run-batch` through `llmctl.cli.main`, serving a fake engine: formats, resume rules, exit
codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llmctl.commands.run_batch as rb
from llmctl.batch.journal import journal_path, state_path
from llmctl.cli import main
from tests.fakes import FakeEngine, FakeRuntime


@pytest.fixture
def engines(monkeypatch):
    """Serve FakeEngines; a test may queue special engines for the next loads."""
    queue: list[FakeEngine] = []

    def load(model, dtype="auto", device="auto", model_impl="auto"):
        engine = queue.pop(0) if queue else FakeEngine(max_num_seqs=4, max_model_len=64)
        return FakeRuntime(engine)

    monkeypatch.setattr(rb, "_load_runtime", load)
    return queue


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] = ()) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"ROMEO {i}:", "max_tokens": 1 + (i * 7) % 5} for i in range(n)]


def test_simple_jsonl_end_to_end(tmp_path, engines, capsys):
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        prompts(12) + [{"id": "x", "prompt": "y" * 80}],
        raw_lines=[b"{oops", b'{"prompt": "\xff"}'],
    )
    out = tmp_path / "out.jsonl"
    summary = tmp_path / "summary.json"
    rc = main(
        [
            "run-batch",
            str(inp),
            "-o",
            str(out),
            "--include-token-ids",
            "--report-json",
            str(summary),
        ]
    )
    assert rc == 0
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == list(range(1, 13)) + ["x", 14, 15]
    assert set(rows[0]) == {"id", "text", "finish_reason", "usage", "error", "token_ids"}
    assert rows[0]["error"] is None and rows[0]["finish_reason"] == "length"
    assert len(rows[3]["token_ids"]) == rows[3]["usage"]["completion_tokens"] == 1 + (3 * 7) % 5
    assert [r["error"]["code"] for r in rows[12:]] == [
        "prompt_too_long",
        "invalid_json",
        "invalid_utf8",
    ]
    s = json.loads(summary.read_text())
    assert s["rows"] == 15 and s["errors"] == 3 and s["ok"] == 12
    assert s["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in rows)
    assert s["ttft_s"]["p50"] is not None and s["tpot_s"]["p99"] is not None
    err = capsys.readouterr().err
    assert "KV cache" in err and "summary" in err
    # rerunning a finished job is a no-op
    before = out.read_bytes()
    assert main(["run-batch", str(inp), "-o", str(out), "--include-token-ids", "-q"]) == 0
    assert out.read_bytes() == before


def test_openai_batch_shape_and_deterministic_ids(tmp_path, engines):
    reqs = [
        {
            "custom_id": "chat-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 3,
            },
        },
        {
            "custom_id": "cmpl-2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "ROMEO:", "max_tokens": 2},
        },
        {"custom_id": "bad-3", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    inp = write_jsonl(tmp_path / "batch.jsonl", reqs)
    out1, out2 = tmp_path / "o1.jsonl", tmp_path / "o2.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out1), "-q"]) == 0
    assert main(["run-batch", str(inp), "-o", str(out2), "-q", "--input-format", "openai"]) == 0
    chat, cmpl, bad = read_jsonl(out1)
    assert set(chat) == {"id", "custom_id", "response", "error"} and chat["error"] is None
    assert chat["custom_id"] == "chat-1" and chat["id"].startswith("batch_req_")
    resp = chat["response"]
    assert resp["status_code"] == 200 and resp["request_id"].startswith("req_")
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert (
        body["choices"][0]["message"]["role"] == "assistant"
        and len(body["choices"][0]["message"]["content"]) == 3
    )
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["index"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    assert (
        cmpl["response"]["body"]["object"] == "text_completion"
        and len(cmpl["response"]["body"]["choices"][0]["text"]) == 2
    )
    # a bad request is answered as OpenAI does: an HTTP 400 response with the error in its body,
    # and `error` null (that field is for requests that failed without a response)
    assert bad["response"]["status_code"] == 400 and bad["error"] is None
    assert bad["response"]["body"]["error"]["code"] == "unsupported_url"
    assert bad["response"]["body"]["error"]["type"] == "invalid_request_error"
    ids = lambda rows: [
        (r["id"], r["response"]["request_id"], r["response"]["body"].get("id")) for r in rows
    ]
    assert ids(read_jsonl(out1)) == ids(read_jsonl(out2))  # derived from custom_id, not random
    assert len({r["id"] for r in read_jsonl(out1)}) == 3


def test_parquet_in_and_out(tmp_path, engines):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"text": [f"line {i}" for i in range(30)], "key": list(range(100, 130))}),
        str(inp),
        row_group_size=7,
    )
    out = tmp_path / "out.parquet"
    rc = main(
        [
            "run-batch",
            str(inp),
            "-o",
            str(out),
            "--prompt-column",
            "text",
            "--id-column",
            "key",
            "--max-tokens",
            "2",
            "-q",
            "--include-token-ids",
        ]
    )
    assert rc == 0
    table = pq.read_table(str(out)).to_pylist()
    assert [r["id"] for r in table] == [str(i) for i in range(100, 130)]
    assert all(
        r["usage"]["completion_tokens"] == 2 and len(r["text"]) == 2 and r["error"] is None
        for r in table
    )
    assert len(table[0]["token_ids"]) == 2
    assert not journal_path(out).exists() and json.loads(state_path(out).read_text())["complete"]


def test_openai_input_refuses_parquet_output(tmp_path, engines, capsys):
    inp = write_jsonl(
        tmp_path / "b.jsonl",
        [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}],
    )
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "o.parquet")]) == 2
    assert "OpenAI batch output shape" in capsys.readouterr().err


def test_ordered_and_unordered(tmp_path, engines):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["run-batch", str(inp), "-o", str(a), "-q"]) == 0
    assert main(["run-batch", str(inp), "-o", str(b), "-q", "--unordered"]) == 0
    ra, rb_ = read_jsonl(a), read_jsonl(b)
    assert [r["id"] for r in ra] == list(range(1, 31))
    assert [r["id"] for r in rb_] != list(range(1, 31))
    assert sorted(rb_, key=lambda r: r["id"]) == ra


def test_resume_refused_with_other_settings_unless_overwrite(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--temperature", "0.7"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and "sampling.temperature was 0.0, now 0.7" in err
        and "--overwrite" in err
    )
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "-m", "other-model"]) == 2
    assert "model" in capsys.readouterr().err
    assert (
        main(
            [
                "run-batch",
                str(inp),
                "-o",
                str(out),
                "-q",
                "--temperature",
                "0.7",
                "--seed",
                "1",
                "--overwrite",
            ]
        )
        == 0
    )
    assert len(read_jsonl(out)) == 5


def test_existing_foreign_output_is_not_clobbered(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    assert main(["run-batch", str(inp), "-o", str(out)]) == 2
    assert "no run-batch state" in capsys.readouterr().err and out.read_text() == "precious\n"
    assert main(["run-batch", str(inp), "-o", str(inp)]) == 2
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "nowhere" / "o.jsonl")]) == 2
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--top-p", "2"]) == 2
    assert (
        main(["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--kv-cache-memory", "lots"])
        == 2
    )


def test_max_errors_exits_3_and_keeps_written_rows(tmp_path, engines, capsys):
    rows = [
        {"prompt": "ok"} if i % 4 else {"prompt": ""} for i in range(40)
    ]  # rows 1, 5, 9, ... fail
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    assert (
        main(
            [
                "run-batch",
                str(inp),
                "-o",
                str(out),
                "-q",
                "--max-errors",
                "2",
                "--report-json",
                str(summary),
            ]
        )
        == 3
    )
    assert "--max-errors 2" in capsys.readouterr().err
    written = read_jsonl(out)
    assert [r["id"] for r in written] == list(range(1, 10))  # up to the third failure (row 9)
    assert json.loads(summary.read_text())["errors"] == 3
    assert json.loads(state_path(out).read_text())["output_bytes"] == out.stat().st_size


class InterruptAt(FakeEngine):
    def __init__(self, at: int):
        super().__init__(max_num_seqs=4, max_model_len=64)
        self.at = at

    def step(self):
        if self.steps == self.at:
            raise KeyboardInterrupt
        return super().step()


@pytest.mark.parametrize("extra", [[], ["--unordered"]])
def test_ctrl_c_then_torn_line_then_resume_equals_uninterrupted(tmp_path, engines, capsys, extra):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(80))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"] + extra) == 0
    engines.append(InterruptAt(25))
    assert main(["run-batch", str(inp), "-o", str(out)] + extra) == 130
    assert "rerun the same command" in capsys.readouterr().err
    state = json.loads(state_path(out).read_text())
    assert 0 < state["stats"]["rows"] < 80 and not state["complete"]
    with open(
        out, "ab"
    ) as f:  # what a power loss can leave: rows after the last commit, a torn line
        f.write(b'{"id": 999, "text": "half')
    assert main(["run-batch", str(inp), "-o", str(out), "-q"] + extra) == 0
    got, want = read_jsonl(out), read_jsonl(ref)
    if extra:
        assert sorted(r["id"] for r in got) == list(range(1, 81))
        assert sorted(got, key=lambda r: r["id"]) == sorted(want, key=lambda r: r["id"])
    else:
        assert out.read_bytes() == ref.read_bytes()


def test_help_documents_exit_codes_and_an_example(capsys):
    assert main(["run-batch", "--help"]) == 0
    text = capsys.readouterr().out
    assert (
        "Exit codes" in text
        and "130" in text
        and "--max-errors" in text
        and "llmctl run-batch examples/" in text
    )


def test_parquet_output_resumes_through_its_journal(tmp_path, engines):
    import pyarrow.parquet as pq

    inp = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    ref, out = tmp_path / "ref.parquet", tmp_path / "out.parquet"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0
    engines.append(InterruptAt(20))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    assert journal_path(out).exists() and not out.exists()
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert pq.read_table(str(out)).to_pylist() == pq.read_table(str(ref)).to_pylist()
    assert not journal_path(out).exists()


def test_resume_refused_when_the_input_changed(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    out = tmp_path / "out.jsonl"
    engines.append(InterruptAt(5))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    write_jsonl(inp, prompts(31))
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    assert "the input changed since the job started" in capsys.readouterr().err


def test_sampling_defaults_and_row_overrides_reach_the_engine(tmp_path, engines):
    seen = []

    class Recording(FakeEngine):
        def add_request(self, rid, ids, params):
            seen.append(params)
            super().add_request(rid, ids, params)

    engines.append(Recording())
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [{"prompt": "a"}, {"prompt": "b", "top_k": 3, "stop": "x", "max_tokens": 2}],
    )
    assert (
        main(
            [
                "run-batch",
                str(inp),
                "-o",
                str(tmp_path / "o.jsonl"),
                "-q",
                "--max-tokens",
                "5",
                "--top-k",
                "7",
                "--stop",
                "\n\n",
                "--stop",
                "END",
                "--repetition-penalty",
                "1.2",
                "--ignore-eos",
                "--min-p",
                "0.1",
            ]
        )
        == 0
    )
    a, b = seen
    assert (
        a.max_tokens,
        a.top_k,
        a.stop,
        a.repetition_penalty,
        a.ignore_eos,
        a.min_p,
        a.temperature,
    ) == (5, 7, ["\n\n", "END"], 1.2, True, 0.1, 0.0)
    assert (b.max_tokens, b.top_k, b.stop) == (2, 3, ["x"])


def test_rerun_after_max_errors_continues_without_duplicates(tmp_path, engines):
    rows = [
        {"prompt": "ok", "max_tokens": 1 + i % 4} if i % 4 else {"prompt": ""} for i in range(40)
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--max-errors", "2"]) == 3
    assert (
        main(["run-batch", str(inp), "-o", str(out), "-q", "--max-errors", "5"]) == 3
    )  # the limit is a total
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert out.read_bytes() == ref.read_bytes()


def test_odd_json_values_become_error_rows_or_round_trip(tmp_path, engines):
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [],
        raw_lines=[
            # lone surrogate in an id: echoed back as an escape
            b'{"id": "a\\ud800", "prompt": "x", "max_tokens": 1}',
            b'{"prompt": "x", "temperature": NaN}',
            # not text: a clear invalid_text, not the tokenizer's TypeError
            b'{"prompt": "\\udc80"}',
            b'{"prompt": "x", "max_tokens": 1.5}',
            b'{"prompt": "x", "stop": [1]}',
        ],
    )
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    rows = [json.loads(line) for line in out.read_bytes().decode("utf-8").splitlines()]
    assert rows[0]["id"] == "a\ud800" and rows[0]["error"] is None
    assert [r["error"]["code"] for r in rows[1:]] == [
        "invalid_parameter",
        "invalid_text",
        "invalid_parameter",
        "invalid_parameter",
    ]


def test_a_second_job_on_the_same_output_is_refused(tmp_path, engines, capsys):
    import fcntl

    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    with open(out, "wb") as held:  # what a running job holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert main(["run-batch", str(inp), "-o", str(out), "--overwrite"]) == 2
        assert "another llmctl run-batch is writing" in capsys.readouterr().err
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite"]) == 0


def test_openai_batch_resumes_to_the_same_lines(tmp_path, engines):
    reqs = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"ROMEO {i}:", "max_tokens": 1 + i % 4},
        }
        for i in range(30)
    ]
    inp = write_jsonl(tmp_path / "b.jsonl", reqs)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0
    engines.append(InterruptAt(6))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0

    def strip_created(rows):
        for r in rows:
            r["response"]["body"].pop("created")
        return rows

    got = read_jsonl(out)
    assert len({r["response"]["body"]["created"] for r in got}) == 1  # one job, one creation time
    assert strip_created(got) == strip_created(read_jsonl(ref))


def test_stdin_input_to_a_file_resumes_by_reading_past_committed_rows(
    tmp_path, engines, monkeypatch
):
    import io
    import types

    data = b"".join(json.dumps(r).encode() + b"\n" for r in prompts(50))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"

    def run(path, extra=()):
        monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))
        return main(["run-batch", "-", "-o", str(path), "-q", *extra])

    assert run(ref) == 0
    engines.append(InterruptAt(12))
    assert run(out) == 130
    assert 0 < json.loads(state_path(out).read_text())["next_index"] < 50
    assert run(out) == 0
    assert out.read_bytes() == ref.read_bytes()


def test_overwrite_interrupted_while_loading_leaves_the_old_job_untouched(
    tmp_path, engines, monkeypatch
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    for out in (tmp_path / "o.jsonl", tmp_path / "o.parquet"):
        assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
        before = (out.read_bytes(), state_path(out).read_bytes())

        def interrupted_load(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(rb, "_load_runtime", interrupted_load)
        assert (
            main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite", "--max-tokens", "2"])
            == 130
        )
        # nothing is replaced before the model has loaded
        assert (out.read_bytes(), state_path(out).read_bytes()) == before
        monkeypatch.undo()
        monkeypatch.setattr(
            rb, "_load_runtime", lambda *a, **k: FakeRuntime(FakeEngine(max_num_seqs=4))
        )
        assert (
            main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite", "--max-tokens", "2"])
            == 0
        )
        state = json.loads(state_path(out).read_text())
        assert state["stats"]["rows"] == 10 and state["fingerprint"]["sampling.max_tokens"] == 2
