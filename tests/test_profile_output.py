"""profile's output layer: --report-json (file or '-' = stdout, then no table), the hidden --json
alias, one dtype spelling (float32/bfloat16/float16) in records and tables, the sweep's KV
sizing policy, and compare's JSON."""

from __future__ import annotations

import json

import pytest
from test_estimate import TINY
from test_profile_compare import BASE, _point, _write

from llmctl.cli import main
from llmctl.engine.config import EngineConfig
from llmctl.models.config import ModelConfig
from llmctl.profiling import compare
from llmctl.profiling import estimate as est
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.estimate_job import EstimateRequest, run_estimate
from llmctl.profiling.sweep_job import SweepRequest, int_list, sweep_engine_config


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize(
    "given, canonical",
    [("bf16", "bfloat16"), ("FP16", "float16"), ("fp32", "float32"), ("torch.float16", "float16")],
)
def test_short_dtype_spellings_map_to_one(given, canonical):
    assert canonical_dtype(given) == canonical
    config = ModelConfig.from_dict(TINY)
    e = est.estimate(config, dtype=given, seq_len=8)
    assert e.dtype == canonical and e.kv_dtype == canonical


def test_int_weights_keep_a_bfloat16_kv_cache_and_fp8_stays():
    config = ModelConfig.from_dict(TINY)
    assert est.estimate(config, dtype="int4", group_size=32, seq_len=8).kv_dtype == "bfloat16"
    assert est.estimate(config, dtype="bf16", kv_dtype="fp8", seq_len=8).kv_dtype == "fp8"


def test_estimate_record_and_table_spell_dtypes_in_full(cfg, capsys):
    assert main(["profile", "--estimate", str(cfg), "--dtype", "bf16", "--report-json", "-"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)  # only the JSON on stdout: no table
    assert (
        record["estimate"]["dtype"] == "bfloat16" and record["environment"]["dtype"] == "bfloat16"
    )
    assert record["estimate"]["kv_dtype"] == "bfloat16"
    assert main(["profile", "--estimate", str(cfg), "--dtype", "fp32"]) == 0
    table = capsys.readouterr().out
    assert "KV per token (float32)" in table and "fp32" not in table


def test_estimate_request_defaults_are_the_commands(cfg):
    result = run_estimate(str(cfg), EstimateRequest(bandwidth="100"))
    assert result.estimate.batch == 1 and result.bandwidth_source == "--bandwidth"
    assert result.estimate.dtype == "bfloat16"  # auto: the config names no dtype


def test_old_json_spelling_still_writes_with_a_deprecation_line(cfg, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["profile", "--estimate", str(cfg), "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "--json is deprecated; use --report-json" in captured.err
    assert "KV per token" in captured.out  # a file: the table still goes to stdout
    assert json.loads(out.read_text())["schema"] == "llmctl.profile.estimate"
    argv = ["profile", "--estimate", str(cfg), "--json", str(out), "--report-json", "-"]
    assert main(argv) == 2


def test_markdown_and_json_on_stdout_are_refused(capsys):
    assert main(["profile", "--markdown", "--report-json", "-", "-q"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_help_hides_the_old_spelling_and_quotes_the_defaults(capsys):
    assert main(["profile", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--report-json" in text and "--json " not in text
    assert "(default: 1,8,32)" in " ".join(text.split())


def test_sweep_kv_cache_holds_the_largest_batch_at_once():
    config = ModelConfig.from_dict(TINY)
    block = EngineConfig().block_size
    got = sweep_engine_config(config, "bfloat16", 40, 100, None, 3)
    per_seq = est.kv_bytes_per_sequence(config, 100 + block, "bfloat16", block)
    assert got.kv_cache_memory == 40 * per_seq and got.seed == 3
    assert got.max_num_seqs == max(40, EngineConfig().max_num_seqs)
    assert sweep_engine_config(config, "float32", 1, 10, "1MiB", 0).kv_cache_memory == 2**20
    assert SweepRequest().batch_sizes == int_list("1,8,32", "--batch-sizes")


def test_compare_json_on_stdout_has_no_table_and_keeps_the_exit_code(tmp_path, capsys):
    a = _write(tmp_path, "a.json", BASE)
    b = _write(tmp_path, "b.json", [_point(1, 0.20, 0.020, 50.0), BASE[1]])  # TTFT doubled
    assert main(["profile", "compare", a, b, "--report-json", "-"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["schema"] == compare.COMPARE_SCHEMA and doc["regressions"] >= 1
    assert any(d["metric"] == "ttft_s" and d["regression"] for d in doc["deltas"])
    assert "regression(s)" in captured.err


def test_environment_differences_read_old_short_dtypes():
    from test_profile_compare import _record

    old, new = _record(BASE), _record(BASE)
    old["environment"]["dtype"] = "bf16"
    assert compare.environment_differences(old, new) == []
