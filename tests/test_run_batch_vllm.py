"""run-batch as a vLLM user calls it: vLLM's flag spellings, --speculative-config, --generation-
config, top_k -1/0, Ray Data LLM rows (`sampling_params`, a Parquet `messages` column)."""

from __future__ import annotations

import json

import pytest
from test_run_batch_cli import engines, read_jsonl, write_jsonl  # noqa: F401
from test_run_batch_options import captured_options

from llmctl.batch.options import default_sampling
from llmctl.cli import main
from llmctl.engine.config import EngineConfig
from llmctl.engine.vllm_config import parse_vllm_bytes, speculative_from_vllm
from llmctl.errors import UsageError
from llmctl.runtime.generation_config import generation_defaults
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from tests.fakes import FakeEngine


class Recording(FakeEngine):
    """A FakeEngine that keeps the SamplingParams of every request."""

    def __init__(self):
        super().__init__(max_num_seqs=4, max_model_len=64)
        self.params = []

    def add_request(self, rid, ids, params):
        self.params.append(params)
        super().add_request(rid, ids, params)


def test_vllm_spellings_reach_the_same_options_as_ours(monkeypatch):
    seen = captured_options(monkeypatch)
    ours = ["run-batch", "in.jsonl", "-o", "o.jsonl", "--no-prefix-caching"]
    ours += ["--kv-cache-memory", "2GiB", "--speculative", "ngram", "--num-speculative-tokens", "3"]
    theirs = ["run-batch", "-i", "in.jsonl", "--output-file", "o.jsonl"]
    theirs += ["--no-enable-prefix-caching", "--kv-cache-memory-bytes", "2G"]
    theirs += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    assert main(ours) == 0 and main(theirs) == 0
    a, b = seen
    assert (a.input, a.output) == (b.input, b.output) == ("in.jsonl", "o.jsonl")
    assert a.engine["kv_cache_memory"] == b.engine["kv_cache_memory"] == 2 * 1024**3
    assert a.engine["enable_prefix_caching"] is b.engine["enable_prefix_caching"] is False
    assert b.engine["speculative"] == "ngram" and b.engine["num_speculative_tokens"] == 3
    # vLLM's prompt-lookup defaults come with its JSON; our own flag keeps ours
    assert (b.engine["prompt_lookup_max"], b.engine["prompt_lookup_min"]) == (5, 5)
    assert "prompt_lookup_max" not in a.engine
    assert main(["run-batch", "in.jsonl", "--enable-prefix-caching"]) == 0
    assert seen[-1].engine == {"enable_prefix_caching": True}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["x.jsonl", "-i", "y.jsonl"], "INPUT or -i/--input-file, not both"),
        (["-q"], "no input"),
        (["x", "--kv-cache-memory", "1GiB", "--kv-cache-memory-bytes", "1G"], "not both"),
        (["x", "--speculative-config", '{"method": "ngram"}', "--draft", "d"], "--draft"),
        (["x", "--speculative-config", '{"method": "eagle", "model": "e"}'], "'eagle'"),
        (["x", "--speculative-config", '{"method": "ngram", "quantization": "fp8"}'], "quant"),
        (["x", "--speculative-config", "ngram"], "not JSON"),
        (["x", "--progress", "fancy"], "--progress must be one of"),
        (["x", "--log-level", "loud"], "--log-level must be one of"),
    ],
)
def test_contradictions_and_what_llmctl_lacks_are_one_line_refusals(argv, message, capsys):
    assert main(["run-batch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_vllm_byte_sizes_and_speculative_json_read_as_vllm_reads_them():
    assert parse_vllm_bytes("1K") == 1024 and parse_vllm_bytes("1k") == 1000
    assert parse_vllm_bytes("2.5g") == 2_500_000_000 and parse_vllm_bytes("4096") == 4096
    assert parse_vllm_bytes("3GiB") == 3 * 1024**3  # our units too
    with pytest.raises(UsageError, match="no decimals"):
        parse_vllm_bytes("1.5G")
    draft = speculative_from_vllm({"model": "/d", "num_speculative_tokens": 2})  # Python's dict
    assert draft == {"speculative": "draft", "draft_model": "/d", "num_speculative_tokens": 2}
    lookup = speculative_from_vllm('{"model": "[ngram]", "prompt_lookup_max": 4}')
    assert (lookup["speculative"], lookup["prompt_lookup_max"], lookup["prompt_lookup_min"]) == (
        "ngram",
        4,
        4,
    )
    for bad in ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "[1]"):
        with pytest.raises(UsageError):
            speculative_from_vllm(bad)
    config = EngineConfig(**speculative_from_vllm('{"method": "ngram", "prompt_lookup_min": 2}'))
    assert (config.prompt_lookup_max, config.prompt_lookup_min) == (2, 2)


def test_served_model_name_names_the_model_of_openai_rows(tmp_path, engines):
    body = {"prompt": "ROMEO:", "max_tokens": 2}
    row = {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": body}
    inp = write_jsonl(tmp_path / "in.jsonl", [row])
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(inp), "--output-file", str(out), "-q"]) == 0
    assert read_jsonl(out)[0]["response"]["body"]["model"] == "fake-model"
    argv = ["run-batch", str(inp), "-o", str(out), "-q", "--served-model-name", "my-llm"]
    assert main([*argv, "--overwrite"]) == 0
    assert read_jsonl(out)[0]["response"]["body"]["model"] == "my-llm"


def test_top_k_minus_one_and_zero_mean_no_cut(tmp_path, engines):
    engine = Recording()
    engines.append(engine)
    rows = [{"prompt": "a", "top_k": -1}, {"prompt": "b", "top_k": 0}, {"prompt": "c"}]
    rows.append({"prompt": "d", "top_k": -2})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--top-k", "-1"]) == 0
    got = read_jsonl(out)
    assert [r["error"] for r in got[:3]] == [None, None, None]
    assert got[3]["error"]["code"] == "invalid_parameter"
    assert [p.top_k for p in engine.params] == [None, None, None]


def test_a_rows_sampling_params_object_is_honoured(tmp_path, engines):
    engine = Recording()
    engines.append(engine)
    sp = {"max_tokens": 3, "temperature": 0.7, "top_k": -1, "seed": 11, "stop_token_ids": [9]}
    rows = [
        {"prompt": "a", "sampling_params": {**sp, "skip_special_tokens": True}},
        {"prompt": "b", "max_tokens": 3, "sampling_params": {"max_tokens": 3, "top_p": 0.5}},
        {"prompt": "c", "max_tokens": 2, "sampling_params": {"max_tokens": 3}},
        {"prompt": "d", "sampling_params": {"n": 2, "logprobs": 1, "prompt_logprobs": 0}},
        {"prompt": "e", "sampling_params": {"bad_words": ["x"]}},
        {"prompt": "f", "sampling_params": {"top_p": "x"}},
        {"prompt": "g", "sampling_params": [1]},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    got = read_jsonl(out)
    a, b, d = engine.params
    assert (d.n, d.logprobs, d.prompt_logprobs) == (2, 1, 0)  # vLLM's fields, not refused
    assert (a.max_tokens, a.temperature, a.top_k, a.seed, a.stop_token_ids) == (
        3,
        0.7,
        None,
        11,
        [9],
    )
    assert (b.max_tokens, b.top_p) == (3, 0.5)
    assert got[0]["usage"]["completion_tokens"] == 3 and got[1]["error"] is None
    assert got[3]["error"] is None
    codes = [r["error"]["code"] for r in got[2:3] + got[4:]]
    assert codes == ["invalid_parameter", "unsupported_parameter"] + ["invalid_parameter"] * 2
    assert "given in the row (2) and in sampling_params (3)" in got[2]["error"]["message"]


def test_ray_data_parquet_rows_need_no_column_flags(tmp_path, engines):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    engine = Recording()
    engines.append(engine)
    table = pa.table(
        {
            "messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
            "sampling_params": [{"max_tokens": 2, "temperature": 0.5}, {"max_tokens": 4}],
        }
    )
    inp = tmp_path / "ray.parquet"
    pq.write_table(table, inp)
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    got = read_jsonl(out)
    assert [r["error"] for r in got] == [None, None]
    assert [r["usage"]["completion_tokens"] for r in got] == [2, 4]
    assert [p.temperature for p in engine.params] == [0.5, 0.0]  # the second: our default
    # JSON text columns, as pandas writes them, are read too
    text = pa.table(
        {
            "messages": ['[{"role": "user", "content": "hi"}]'],
            "sampling_params": ['{"max_tokens": 3}'],
        }
    )
    pq.write_table(text, inp)
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite"]) == 0
    assert read_jsonl(out)[0]["usage"]["completion_tokens"] == 3


def write_generation_config(folder, **values):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return folder


def test_generation_config_modes(tmp_path):
    model = write_generation_config(
        tmp_path / "m", temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=64, do_sample=True
    )
    auto = generation_defaults("auto", model)
    assert auto == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert generation_defaults("none", model) == {}
    assert generation_defaults("vllm", model) == {"temperature": 1.0}
    assert generation_defaults(str(model), None) == auto  # a folder, as vLLM takes one
    assert generation_defaults("auto", DEMO_MODEL_DIR) == {"temperature": 1.0}  # no sampling keys
    with pytest.raises(UsageError, match="a folder that holds"):
        generation_defaults("sometimes", model)
    write_generation_config(tmp_path / "bad", top_p="high")
    with pytest.raises(UsageError, match="top_p must be a number"):
        generation_defaults("auto", tmp_path / "bad")


def test_generation_config_auto_goes_under_flags_and_rows(tmp_path, engines):
    model = write_generation_config(tmp_path / "m", temperature=0.6, top_p=0.9, top_k=20)
    engine = Recording()
    engines.append(engine)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b", "top_k": -1}])
    out = tmp_path / "out.jsonl"
    argv = ["run-batch", str(inp), "-o", str(out), "--model", str(model), "--top-p", "0.5"]
    assert main([*argv, "--generation-config", "auto", "--progress", "none"]) == 0
    a, b = engine.params
    assert (a.temperature, a.top_p, a.top_k) == (0.6, 0.5, 20)  # the flag wins over the file
    assert (b.temperature, b.top_p, b.top_k) == (0.6, 0.5, None)  # the row wins over both


def test_generation_config_none_is_the_default_and_greedy(tmp_path):
    from llmctl.batch.options import BatchOptions

    opts = BatchOptions(input="x")
    assert opts.generation_config == "none" and default_sampling(opts).temperature == 0.0
    assert default_sampling(opts, {"temperature": 1.0, "top_k": 0}).top_k is None
    with pytest.raises(UsageError, match="--generation-config none"):
        default_sampling(opts, {"top_p": 7})


def test_gpu_memory_utilization_is_accepted_and_ignored_on_the_cpu(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    argv = ["run-batch", str(inp), "-o", str(out), "--gpu-memory-utilization", "0.9"]
    assert main([*argv, "--progress", "none"]) == 0
    assert "--gpu-memory-utilization is for CUDA and ignored on the CPU" in capsys.readouterr().err
    assert main([*argv, "--gpu-memory-utilization", "1.5", "--overwrite"]) == 2
    assert "must be in (0, 1]" in capsys.readouterr().err


def test_gpu_memory_utilization_budget_follows_vllms_rule():
    import torch

    from llmctl.engine.model_runner import activation_reserve, utilization_budget
    from llmctl.models.config import ModelConfig

    gib = 1024**3
    # 80 GiB device, 0.9 of it for this job: 72 GiB minus 10 GiB weights minus a 2 GiB reserve
    assert utilization_budget(0.9, 80 * gib, 70 * gib, 10 * gib, 2 * gib) == 60 * gib
    # never more than is free now (another process holds memory)
    assert utilization_budget(0.9, 80 * gib, 30 * gib, 10 * gib, 2 * gib) == 28 * gib
    assert utilization_budget(0.1, 80 * gib, 70 * gib, 10 * gib, 2 * gib) == 0
    config = ModelConfig.from_file(DEMO_MODEL_DIR / "config.json")
    small = activation_reserve(config, EngineConfig(max_num_batched_tokens=16), torch.float32)
    big = activation_reserve(config, EngineConfig(), torch.float32)
    assert 0 < small < big


def test_the_kv_cache_is_sized_from_the_utilization_on_cuda_only(monkeypatch):
    import torch

    from llmctl.engine import model_runner as mr
    from llmctl.models.config import ModelConfig

    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)
    config = ModelConfig.from_file(DEMO_MODEL_DIR / "config.json")
    cfg = EngineConfig(gpu_memory_utilization=0.5)
    reserve = mr.activation_reserve(config, cfg, torch.float32)
    assert mr._kv_budget(config, cfg, "cuda:0", 4096) == 30 * gib - reserve
    assert mr._kv_budget(config, cfg, "cpu", 4096) == mr._kv_budget(
        config, EngineConfig(), "cpu", 4096
    )
    both = EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory=gib)  # vLLM: the bytes win
    assert mr._kv_budget(config, both, "cuda:0", 4096) == gib


def test_vllm_style_invocation_runs_unchanged_on_the_demo_model(tmp_path):
    """`llmctl run-batch -i X --output-file Y --model M --enable-prefix-caching`, as vLLM's
    run-batch is called, gives the rows our own spelling gives; with Ray-style rows."""
    rows = [
        {"id": "a", "prompt": "ROMEO:", "max_tokens": 4},
        {"id": "b", "prompt": "JULIET:", "sampling_params": {"max_tokens": 3, "ignore_eos": True}},
        {"id": "c", "prompt": "KING:", "max_tokens": 3, "temperature": 0.8, "top_k": -1, "seed": 5},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    theirs, ours = tmp_path / "theirs.jsonl", tmp_path / "ours.jsonl"
    model = str(DEMO_MODEL_DIR)
    argv = ["run-batch", "-i", str(inp), "--output-file", str(theirs), "--model", model]
    assert main([*argv, "--enable-prefix-caching"]) == 0
    assert main(["run-batch", str(inp), "-o", str(ours), "-m", model, "-q"]) == 0
    got = read_jsonl(theirs)
    assert got == read_jsonl(ours)
    assert [r["error"] for r in got] == [None, None, None]
    assert got[1]["usage"]["completion_tokens"] == 3
