"""`llmctl run-batch --reorder prefix` end to end: on the demo model the rows equal an input-order
run's while the prefix cache serves more; the options' errors; a killed reordered job resumes to
the uninterrupted output (a child process on a fake engine, as test_run_batch_kill)."""

from __future__ import annotations

import json
import random
import signal

import pytest

from llmctl.batch.journal import state_path
from llmctl.cli import main
from tests.test_run_batch_kill import child, run_child, wait_for_commits


def shared_prefix_input(path, n=24, groups=6, seed=0):
    """`groups` long prefixes, each shared by n / groups rows, shuffled."""
    rng = random.Random(seed)
    docs = [" ".join(f"w{g}x{j}" for j in range(40)) for g in range(groups)]
    rows = [{"prompt": f"{docs[i % groups]} question {i}?"} for i in range(n)]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(inp, out, *extra):
    report = out.with_suffix(".report.json")
    args = [str(inp), "-o", str(out), "-q", "--max-tokens", "4", "--report-json", str(report)]
    assert main(["run-batch", *args, *extra]) == 0
    return json.loads(report.read_text())


def test_reordered_rows_equal_input_order_rows_with_more_prefix_cache_hits(tmp_path):
    inp = shared_prefix_input(tmp_path / "in.jsonl")
    # a KV cache of a few prompts: in input order a prefix is mostly evicted before its next row
    small = ["--kv-cache-memory", "1MiB", "--max-num-seqs", "4"]
    plain = run(inp, tmp_path / "plain.jsonl", *small)
    grouped = run(inp, tmp_path / "grouped.jsonl", *small, "--reorder", "prefix")
    assert (tmp_path / "grouped.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
    assert grouped["rows"] == plain["rows"] == 24 and grouped["errors"] == 0
    hits = grouped["prefix_cache"]["hit_rate"], plain["prefix_cache"]["hit_rate"]
    assert hits[0] > hits[1] + 0.2, hits


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--reorder", "length"], "--reorder must be one of none, prefix"),
        (["--reorder-window", "8"], "--reorder-window is for --reorder prefix"),
        (["--reorder", "prefix", "--ray"], "--reorder prefix is not available with --ray"),
    ],
)
def test_bad_reorder_options_are_one_line_usage_errors(tmp_path, capsys, extra, message):
    inp = shared_prefix_input(tmp_path / "in.jsonl", n=3, groups=1)
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()


def test_a_killed_reordered_job_resumes_to_the_uninterrupted_input_order_output(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [
        {"prompt": f"{'ABCDEFGH'[i % 7] * 40} {i}", "max_tokens": 1 + (i * 7) % 5}
        for i in range(300)
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = tmp_path / "ref.jsonl"
    rc, _, err = run_child([str(inp), "-o", str(ref), "-q"])  # input order
    assert rc == 0, err
    out = tmp_path / "out.jsonl"
    grouped = ["--reorder", "prefix", "--reorder-window", "64"]
    proc = child([str(inp), "-o", str(out), "-q", *grouped], delay=0.01)
    wait_for_commits(out, 40, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    state = json.loads(state_path(out).read_text())
    assert 40 <= state["stats"]["rows"] < 300 and not state["complete"]
    rc, _, err = run_child([str(inp), "-o", str(out), "-q", *grouped])
    assert rc == 0, err
    assert out.read_bytes() == ref.read_bytes()  # every row once, in input order, same rows
    assert json.loads(state_path(out).read_text())["stats"]["rows"] == 300


def test_the_vllm_backend_takes_the_same_order_and_writes_the_same_rows(tmp_path, monkeypatch):
    import vllm_stub

    vllm_stub.install(monkeypatch)
    inp = shared_prefix_input(tmp_path / "in.jsonl", n=12, groups=3)
    outs = []
    for extra in ([], ["--reorder", "prefix"]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        argv = ["run-batch", str(inp), "-o", str(out), "--backend", "vllm", "-q", *extra]
        assert main([*argv, "--max-model-len", "512", "--max-tokens", "3"]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 12
