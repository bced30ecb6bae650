"""`profile compare` (regression exit codes for CI), `--measure-machine` and its cache, `profile
--help`."""

from __future__ import annotations

import json

import pytest

from llmctl.cli import main
from llmctl.errors import UsageError
from llmctl.profiling import compare, machine
from llmctl.profiling.report import load_record, markdown, sweep_record


def _point(batch, ttft, tpot, decode_tps, prompt=128, gen=64):
    def s(v):
        return {"mean": v, "p50": v, "p90": v * 1.1, "p99": v * 1.2, "n": 3}

    return {
        "batch_size": batch,
        "prompt_len": prompt,
        "gen_len": gen,
        "repeats": 3,
        "ttft_s": s(ttft),
        "tpot_s": s(tpot),
        "e2e_s": s(ttft + tpot * (gen - 1)),
        "decode_tokens_per_s": s(decode_tps),
        "decode_tokens_per_s_per_sequence": s(1 / tpot),
        "prefill_tokens_per_s": s(batch * prompt / ttft),
        "output_tokens_per_s": s(decode_tps * 0.9),
        "wall_s": s(1.0),
        "kv_blocks_used": batch * 12,
        "peak_memory_bytes": 2**30,
        "peak_memory_kind": "cpu_peak_rss",
        "mbu": None,
        "mfu": None,
    }


def _record(points):
    env = {
        "llmctl_version": "0",
        "torch_version": "t",
        "device": "cpu",
        "cpu_model": "x",
        "cpu_threads": 2,
        "gpu_name": None,
        "dtype": "bfloat16",
        "date": "2026-01-01",
    }
    return sweep_record("m", env, {}, {"repeat": 3}, None, points)


def _write(tmp_path, name, points):
    path = tmp_path / name
    path.write_text(json.dumps(_record(points)))
    return str(path)


BASE = [_point(1, 0.10, 0.020, 50.0), _point(8, 0.40, 0.025, 320.0)]


def test_identical_records_pass(tmp_path, capsys):
    a = _write(tmp_path, "a.json", BASE)
    assert main(["profile", "compare", a, a]) == 0
    out = capsys.readouterr()
    assert "B/A" in out.out and "no regression" in out.err


def test_latency_regression_beyond_threshold_fails(tmp_path, capsys):
    a = _write(tmp_path, "a.json", BASE)
    b = _write(tmp_path, "b.json", [_point(1, 0.11, 0.020, 50.0), BASE[1]])  # TTFT +10%
    assert main(["profile", "compare", a, b, "--threshold", "5%"]) == 1
    out = capsys.readouterr()
    assert "REGRESSION" in out.out and "regression(s) of B beyond 5.0%" in out.err
    assert main(["profile", "compare", a, b, "--threshold", "20%"]) == 0


def test_throughput_drop_fails_and_improvement_passes(tmp_path):
    a = _write(tmp_path, "a.json", BASE)
    slower = _write(
        tmp_path, "slow.json", [BASE[0], _point(8, 0.40, 0.025, 280.0)]
    )  # decode -12.5%
    faster = _write(
        tmp_path, "fast.json", [_point(1, 0.05, 0.010, 100.0), _point(8, 0.2, 0.012, 640.0)]
    )
    assert main(["profile", "compare", a, slower, "--threshold", "0.1"]) == 1
    assert main(["profile", "compare", a, faster]) == 0
    assert main(["profile", "compare", faster, a]) == 1  # the other way round it is a regression


def test_compare_records_details():
    a, b = _record(BASE), _record([_point(1, 0.2, 0.020, 50.0), _point(32, 1.0, 0.03, 900.0)])
    result = compare.compare_records(a, b, 0.05)
    assert result.only_in_a == [(8, 128, 64)] and result.only_in_b == [(32, 128, 64)]
    ttft = next(d for d in result.deltas if d.metric == "ttft_s")
    assert ttft.ratio == pytest.approx(2.0) and ttft.regression and ttft.lower_is_better
    prefill = next(d for d in result.deltas if d.metric == "prefill_tokens_per_s")
    assert (
        prefill.ratio == pytest.approx(0.5) and prefill.regression and not prefill.lower_is_better
    )
    assert {d.metric for d in result.regressions} == {"ttft_s", "e2e_s", "prefill_tokens_per_s"}
    p99 = compare.compare_records(a, a, 0.0, stat="p99")
    assert not p99.regressions and p99.stat == "p99"


def test_threshold_parsing_and_bad_inputs(tmp_path, capsys):
    assert compare.parse_threshold("5%") == pytest.approx(0.05)
    assert compare.parse_threshold("0.1") == pytest.approx(0.1)
    for bad in ("-5%", "abc", "150%"):
        with pytest.raises(UsageError):
            compare.parse_threshold(bad)
    a = _write(tmp_path, "a.json", BASE)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something-else"}))
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**_record(BASE), "schema_version": 99}))
    assert main(["profile", "compare", a, str(other)]) == 2
    assert main(["profile", "compare", a, str(newer)]) == 2
    assert "schema version 99" in capsys.readouterr().err
    assert main(["profile", "compare", a]) == 2
    assert main(["profile", "compare", a, str(tmp_path / "missing.json")]) == 2
    disjoint = _write(tmp_path, "d.json", [_point(64, 1, 0.1, 10.0)])
    assert main(["profile", "compare", a, disjoint]) == 2
    with pytest.raises(UsageError):
        load_record(other)


def test_environment_differences_are_noted(tmp_path, capsys):
    a = _record(BASE)
    b = _record(BASE)
    b["environment"] = {**b["environment"], "dtype": "float32", "cpu_threads": 8}
    assert compare.environment_differences(a, b) == [
        "cpu_threads: 2 -> 8",
        "dtype: bfloat16 -> float32",
    ]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main(["profile", "compare", str(pa), str(pb)]) == 0
    assert "different environments" in capsys.readouterr().out


def test_markdown_table_has_a_row_per_point():
    text = markdown(_record(BASE))
    assert text.count("\n| 1 | 128 | 64 |") == 1 and text.count("\n| 8 | 128 | 64 |") == 1
    assert "100.00" in text  # TTFT p50 of batch 1 in ms


def test_measure_machine_cache_respects_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machine.cache_path() == tmp_path / "xdg" / "llmctl" / "machine.json"
    assert machine.cached_peaks("cpu") is None
    peaks = machine.measure_machine("cpu", nbytes=8 * 2**20, matmul_n=128)
    assert (
        peaks.memory_bandwidth > 1e8
        and peaks.matmul_flops_bf16 > 1e6
        and peaks.matmul_flops_fp32 > 1e6
    )
    machine.save_peaks(peaks)
    cached = machine.cached_peaks("cpu")
    assert cached == peaks and "threads=" in cached.key
    data = json.loads(machine.cache_path().read_text())
    data["machines"]["cuda:Some GPU"] = {**peaks.to_dict(), "key": "cuda:Some GPU"}
    machine.cache_path().write_text(json.dumps(data))
    machine.save_peaks(peaks)  # other machines' entries survive a re-measure
    assert "cuda:Some GPU" in json.loads(machine.cache_path().read_text())["machines"]
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert (
            machine.cached_peaks("cpu") is None
        )  # keyed by thread count: another setting is another machine
    finally:
        torch.set_num_threads(threads)


def test_measure_machine_cli_and_estimate_uses_cached_bandwidth(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(
        machine,
        "measure_machine",
        lambda device: machine.MachinePeaks(
            machine.machine_key(device), device, 5e10, 1e12, 2e12, "now", {}
        ),
    )
    assert main(["profile", "--measure-machine", "--device", "cpu"]) == 0
    assert "50.0 GB/s" in capsys.readouterr().out
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 100,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "max_position_embeddings": 64,
            }
        )
    )
    out = tmp_path / "e.json"
    assert main(["profile", "--estimate", str(cfg), "--report-json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (
        record["estimate"]["bandwidth"] == 5e10
        and "measured on this machine" in record["bandwidth_source"]
    )


def test_profile_help_explains_all_forms(capsys):
    assert main(["profile", "--help"]) == 0
    text = capsys.readouterr().out
    for needle in (
        "profile compare A.json B.json",
        "--estimate",
        "--batch-sizes",
        "--threshold",
        "--measure-machine",
        "Measured sweep",
        "Compare",
    ):
        assert needle in text, needle
