"""run-batch's flags: defaults owned by the dataclasses (a flag not given never reaches them),
--report-json as the one JSON spelling ('-': stdout), and --summary-json as its hidden old alias."""

from __future__ import annotations

import json

from test_run_batch_cli import engines, prompts, read_jsonl, write_jsonl  # noqa: F401

import llmctl.commands.run_batch as rb
from llmctl.batch.options import BATCH_SAMPLING_DEFAULTS, BatchOptions, default_sampling
from llmctl.cli import main
from llmctl.engine.config import EngineConfig


def captured_options(monkeypatch) -> list[BatchOptions]:
    seen: list[BatchOptions] = []
    monkeypatch.setattr(rb, "_run", lambda opts, quiet: seen.append(opts))
    return seen


def test_flags_not_given_leave_the_defaults_to_the_dataclasses(monkeypatch):
    seen = captured_options(monkeypatch)
    assert main(["run-batch", "in.jsonl"]) == 0
    opts = seen[0]
    assert opts.sampling == {} and opts.engine == {}
    assert (opts.dtype, opts.device, opts.input_format, opts.report_json) == (
        "auto",
        "auto",
        "auto",
        None,
    )
    params = default_sampling(opts)
    assert params.max_tokens == BATCH_SAMPLING_DEFAULTS["max_tokens"] and params.temperature == 0.0
    assert EngineConfig(**opts.engine) == EngineConfig()


def test_flags_given_reach_the_dataclasses(monkeypatch):
    seen = captured_options(monkeypatch)
    argv = ["run-batch", "in.jsonl", "--max-tokens", "7", "--top-p", "0.5", "--stop", "x"]
    argv += ["--block-size", "32", "--kv-cache-memory", "1MiB", "--no-prefix-caching"]
    argv += ["--enforce-eager", "--speculative", "ngram", "--num-speculative-tokens", "2"]
    argv += ["--batch-invariant"]
    assert main(argv) == 0
    opts = seen[0]
    assert opts.sampling == {"max_tokens": 7, "top_p": 0.5, "stop": ["x"]}
    assert opts.engine == {
        "block_size": 32,
        "kv_cache_memory": 1024**2,
        "enable_prefix_caching": False,
        "cuda_graphs": False,
        "speculative": "ngram",
        "num_speculative_tokens": 2,
        "batch_invariant": True,
    }
    assert EngineConfig(**opts.engine).max_num_seqs == EngineConfig().max_num_seqs


def test_help_quotes_the_dataclass_defaults(capsys):
    assert main(["run-batch", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {EngineConfig().max_num_seqs})" in text.replace("│ ", "")
    assert "--summary-json" not in text  # the old spelling is hidden


def test_report_json_dash_writes_the_summary_to_stdout(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(4))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "--report-json", "-", "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 4 and summary["output"] == str(out)
    assert len(read_jsonl(out)) == 4


def test_report_json_dash_with_rows_on_stdout_is_refused(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    assert main(["run-batch", str(inp), "-o", "-", "--report-json", "-", "-q"]) == 2
    captured = capsys.readouterr()
    assert "--report-json - writes standard output" in captured.err and captured.out == ""


def test_summary_json_still_works_with_a_deprecation_line(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out, summary = tmp_path / "out.jsonl", tmp_path / "s.json"
    assert main(["run-batch", str(inp), "-o", str(out), "--summary-json", str(summary), "-q"]) == 0
    err = capsys.readouterr().err
    assert "--summary-json is deprecated; use --report-json" in err
    assert json.loads(summary.read_text())["rows"] == 3


def test_old_and_new_spelling_together_are_refused(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(1))
    argv = ["run-batch", str(inp), "--summary-json", "a.json", "--report-json", "b.json"]
    assert main(argv) == 2
    assert "pass only one" in capsys.readouterr().err


def test_batch_invariant_is_part_of_what_a_resume_must_share():
    from llmctl.batch.options import fingerprint

    plain = BatchOptions(input="-")
    invariant = BatchOptions(input="-", engine={"batch_invariant": True})
    params = default_sampling(plain)
    a, b = fingerprint(plain, "jsonl", params), fingerprint(invariant, "jsonl", params)
    assert "batch_invariant" not in a  # states written before the switch existed still match
    assert b["batch_invariant"] is True and a != b
