"""`llmctl run-batch` end to end on the real engine and the embedded demo model (float32, greedy,
CPU)."""

from __future__ import annotations

import json

import pytest

import llmctl.commands.run_batch as rb
from llmctl.batch.journal import state_path
from llmctl.cli import main

ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--kv-cache-memory",
    "16MiB",
    "--max-model-len",
    "48",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
    "--max-tokens",
    "4",
    "-q",
]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def reference():
    """Greedy continuations computed straight through the engine, without run-batch."""
    from llmctl.engine.config import EngineConfig
    from llmctl.engine.params import SamplingParams
    from llmctl.runtime.loader import load_runtime

    rt = load_runtime(None, dtype="float32", device="cpu")
    prompts = {
        "romeo": rt.encode("ROMEO:"),
        "juliet": rt.encode("JULIET:"),
        "chat": rt.apply_chat_template([{"role": "user", "content": "Who art thou?"}]),
    }
    engine, got = rt.start_engine(EngineConfig(kv_cache_memory=16 << 20)), {}
    for name, ids in prompts.items():
        engine.add_request(
            name, ids, SamplingParams(max_tokens=4 if name != "juliet" else 2, temperature=0.0)
        )
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = (out.output_token_ids, out.text, len(out.prompt_token_ids))
    return got


def test_demo_model_rows_match_the_engine_and_bad_rows_are_reported(tmp_path, reference):
    inp = tmp_path / "in.jsonl"
    rows = [
        {"id": "r", "prompt": "ROMEO:"},
        {"id": "c", "messages": [{"role": "user", "content": "Who art thou?"}]},
        {"id": "j", "prompt": "JULIET:", "max_tokens": 2},
        {"id": "long", "prompt": "ROMEO: " * 40},  # longer than --max-model-len 48
        {"id": "role", "messages": [{"role": "narrator", "content": "x"}]},
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    summary = tmp_path / "s.json"
    assert (
        main(
            [
                "run-batch",
                str(inp),
                "-o",
                str(out),
                "--include-token-ids",
                "--report-json",
                str(summary),
                *ENGINE_ARGS,
            ]
        )
        == 0
    )
    r, c, j, long, role = read_jsonl(out)
    for row, name in ((r, "romeo"), (c, "chat"), (j, "juliet")):
        ids, text, n_prompt = reference[name]
        assert row["token_ids"] == ids and row["text"] == text and row["error"] is None
        assert row["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(ids)}
    assert len(j["token_ids"]) == 2 and r["finish_reason"] == "length"
    assert long["error"]["code"] == "prompt_too_long" and long["text"] is None
    assert role["error"]["code"] == "unknown_role"
    s = json.loads(summary.read_text())
    assert (
        s["rows"] == 5 and s["errors"] == 2 and s["output_tokens"] == 10 and s["ttft_s"]["p50"] > 0
    )


def test_openai_chat_request_on_the_demo_model(tmp_path, reference):
    inp = tmp_path / "batch.jsonl"
    inp.write_text(
        json.dumps(
            {
                "custom_id": "q1",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "demo",
                    "messages": [{"role": "user", "content": "Who art thou?"}],
                },
            }
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), *ENGINE_ARGS]) == 0
    (line,) = read_jsonl(out)
    body = line["response"]["body"]
    assert line["custom_id"] == "q1" and line["response"]["status_code"] == 200
    assert body["choices"][0]["message"]["content"] == reference["chat"][1]
    assert body["usage"]["completion_tokens"] == 4


def test_interrupted_real_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    inp = tmp_path / "in.jsonl"
    names = ["ROMEO", "JULIET", "NURSE", "FRIAR", "PRINCE"]
    inp.write_text(
        "".join(
            json.dumps({"prompt": f"{n}:", "max_tokens": 1 + i % 3}) + "\n"
            for i, n in enumerate(names)
        )
    )
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "--max-in-flight", "2", *ENGINE_ARGS]) == 0

    load = rb._load_runtime

    def load_and_interrupt(*a, **k):  # the real engine, stopped by a Ctrl-C at the job's 3rd step
        runtime = load(*a, **k)
        start = runtime.start_engine

        def start_interrupted(cfg):
            engine = start(cfg)
            warm_up = engine.warm_up  # its steps (before the job) are not counted

            def warm_up_then_interrupt():
                warm_up()
                monkeypatch.setattr(engine, "step", interrupting(engine.step))

            monkeypatch.setattr(engine, "warm_up", warm_up_then_interrupt)
            return engine

        monkeypatch.setattr(runtime, "start_engine", start_interrupted)
        return runtime

    def interrupting(step):
        calls = []

        def interrupting_step():
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return step()

        return interrupting_step

    monkeypatch.setattr(rb, "_load_runtime", load_and_interrupt)
    assert (
        main(["run-batch", str(inp), "-o", str(out), "--max-in-flight", "2", *ENGINE_ARGS]) == 130
    )
    state = json.loads(state_path(out).read_text())
    assert 0 < state["stats"]["rows"] < len(names)
    monkeypatch.setattr(rb, "_load_runtime", load)
    assert main(["run-batch", str(inp), "-o", str(out), "--max-in-flight", "2", *ENGINE_ARGS]) == 0
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize(
    "spec",
    [
        ["--speculative", "ngram"],
        ["--speculative", "auto", "--speculative-max-batch", "3"],
        ["--draft", "DEMO"],
    ],
)
def test_speculative_run_batch_gives_the_plain_greedy_rows_and_reports_acceptance(tmp_path, spec):
    from llmctl.runtime.resolve import resolve_model_path

    spec = [
        resolve_model_path(None) if a == "DEMO" else a for a in spec
    ]  # the model as its own draft
    inp = tmp_path / "in.jsonl"
    # Prompts that repeat themselves, so prompt lookup finds drafts to propose.
    rows = [{"id": i, "prompt": "ROMEO: to be or not to be. " * 2 + "ROMEO: to"} for i in range(3)]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*ENGINE_ARGS, "--max-tokens", "8", "--max-model-len", "64", "--include-token-ids"]
    plain, fast = tmp_path / "plain.jsonl", tmp_path / "fast.jsonl"
    summary = tmp_path / "s.json"
    assert main(["run-batch", str(inp), "-o", str(plain), *args]) == 0
    assert (
        main(["run-batch", str(inp), "-o", str(fast), "--report-json", str(summary), *args, *spec])
        == 0
    )
    assert read_jsonl(fast) == read_jsonl(plain)
    s = json.loads(summary.read_text())["speculative"]
    assert s["proposed_tokens"] > 0 and 0 <= s["accepted_tokens"] <= s["proposed_tokens"]
    if "--draft" in spec:  # the model drafting for itself agrees with itself on every greedy token
        assert s["accepted_tokens"] == s["proposed_tokens"]


def test_speculative_settings_resolve_the_options():
    from llmctl.engine.config import AUTO_SPEC_MAX_BATCH, EngineConfig, speculative_settings
    from llmctl.errors import UsageError

    assert speculative_settings("off", None, 4, None) == {}
    assert speculative_settings("off", "d", 3, None)["speculative"] == "draft"
    auto = speculative_settings("auto", None, 4, None)
    assert auto["speculative"] == "ngram" and auto["speculative_max_batch"] == AUTO_SPEC_MAX_BATCH
    assert speculative_settings("auto", "d", 4, 2) == dict(
        speculative="draft", draft_model="d", num_speculative_tokens=4, speculative_max_batch=2
    )
    assert speculative_settings("ngram", None, 4, None)["speculative_max_batch"] is None
    for bad in (("fast", None), ("ngram", "d")):
        with pytest.raises(UsageError):
            speculative_settings(bad[0], bad[1], 4, None)
    with pytest.raises(UsageError, match="--draft"):
        EngineConfig(**speculative_settings("draft", None, 4, None))
