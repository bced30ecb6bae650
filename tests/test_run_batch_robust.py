"""run-batch against hostile files and flags: the input is never destroyed, a changed input or
output is never resumed as if it were the same, and mistakes fail before any work."""

from __future__ import annotations

import json
import os
import random

import pytest

import llmctl.commands.run_batch as rb
from llmctl.batch.fake import FakeEngine, FakeRuntime
from llmctl.batch.journal import state_path
from llmctl.cli import main
from tests.test_run_batch_cli import InterruptAt, engines, prompts, read_jsonl, write_jsonl  # noqa: F401


@pytest.mark.parametrize("link", ["hard", "sym"])
def test_output_that_is_the_input_through_a_link_is_refused(tmp_path, engines, capsys, link):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    before = inp.read_bytes()
    out = tmp_path / "out.jsonl"
    (os.link if link == "hard" else os.symlink)(inp, out)
    assert main(["run-batch", str(inp), "-o", str(out), "--overwrite", "-q"]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert inp.read_bytes() == before


def test_input_named_like_the_state_file_is_refused(tmp_path, engines, capsys):
    out = tmp_path / "out.jsonl"
    inp = write_jsonl(state_path(out), prompts(3))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    assert "is the input file" in capsys.readouterr().err


@pytest.mark.parametrize("stdin", [False, True])
def test_resume_refuses_a_shuffled_input_of_the_same_size(tmp_path, engines, capsys, monkeypatch, stdin):
    import io
    import sys

    rows = prompts(60)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = ["-"] if stdin else [str(inp)]

    def feed(data: bytes):
        if stdin:
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))

    feed(inp.read_bytes())
    engines.append(InterruptAt(8))
    assert main(["run-batch", *args, "-o", str(out), "-q"]) == 130
    assert json.loads(state_path(out).read_text())["next_index"] > 0
    random.Random(0).shuffle(rows)
    write_jsonl(inp, rows)  # same bytes in another order: same size
    feed(inp.read_bytes())
    capsys.readouterr()
    assert main(["run-batch", *args, "-o", str(out), "-q"]) == 2
    assert "input changed since the job started" in capsys.readouterr().err
    assert not json.loads(state_path(out).read_text())["complete"]


def test_resume_from_the_same_input_still_continues(tmp_path, engines):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0
    engines.append(InterruptAt(8))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    assert json.loads(state_path(out).read_text())["input_digest"]
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert out.read_bytes() == ref.read_bytes()


def test_parquet_input_with_rows_reordered_is_not_resumed(tmp_path, engines, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = prompts(40)
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(inp))
    out = tmp_path / "out.jsonl"
    engines.append(InterruptAt(5))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    pq.write_table(pa.Table.from_pylist(rows[::-1]), str(inp))
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    assert "content changed" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["truncate", "append", "edit"])
def test_finished_output_changed_afterwards_is_not_reported_complete(tmp_path, engines, capsys, change):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    data = out.read_bytes()
    if change == "truncate":
        out.write_bytes(data[: len(data) // 2])
    elif change == "append":
        out.write_bytes(data + b'{"id": 11}\n')
    else:
        out.write_bytes(data.replace(b"ROMEO", b"JULIET", 1) if b"ROMEO" in data else data[::-1])
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out)]) == 2
    assert "was changed since its job finished" in capsys.readouterr().err
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite"]) == 0
    assert len(read_jsonl(out)) == 10


def test_unchanged_finished_output_is_still_complete(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(10))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert main(["run-batch", str(inp), "-o", str(out)]) == 0
    assert "already complete" in capsys.readouterr().err


def test_failed_model_load_leaves_nothing_and_the_corrected_rerun_works(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    missing = tmp_path / "no-such-model"
    rb_load = rb._load_runtime
    try:
        from llmctl.runtime.loader import load_runtime

        rb._load_runtime = lambda model, **k: load_runtime(model, **k)  # the real loader: it fails
        assert main(["run-batch", str(inp), "-o", str(out), "--model", str(missing), "-q"]) == 2
    finally:
        rb._load_runtime = rb_load
    assert "not found" in capsys.readouterr().err
    assert not out.exists() and not state_path(out).exists()
    # a state left by an older run that committed nothing does not block the corrected rerun either
    state_path(out).write_text(json.dumps({"version": 2, "complete": False, "created": 0, "next_index": 0,
                                           "next_position": 0, "done_after": [], "output_bytes": 0,
                                           "fingerprint": {"model": "elsewhere"}, "stats": {}}))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert len(read_jsonl(out)) == 5


def test_option_mistakes_fail_before_any_work(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    cases = [
        (["-o", str(tmp_path / "o.jsonl"), "--summary-json", str(tmp_path / "nope" / "s.json")], "does not exist"),
        (["-o", "/dev/null"], "not a regular file"),
        (["-o", str(tmp_path / "missing" / "o.jsonl")], "does not exist"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert main(["run-batch", str(inp), *args, "-q"]) == 2, args
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_max_model_len_above_the_models_says_it_is_capped(tmp_path, monkeypatch, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(2))
    engine = FakeEngine(max_num_seqs=4, max_model_len=64)
    monkeypatch.setattr(rb, "_load_runtime", lambda *a, **k: FakeRuntime(engine))
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--max-model-len", "100000"]) == 0
    assert "--max-model-len 100000 is capped at the model's context, 64 tokens" in capsys.readouterr().err


def test_without_o_the_output_goes_beside_the_input(tmp_path, engines, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = write_jsonl(tmp_path / "prompts.jsonl", prompts(4))
    assert main(["run-batch", str(inp)]) == 0
    out = tmp_path / "prompts.out.jsonl"
    assert len(read_jsonl(out)) == 4 and str(out) in capsys.readouterr().err
    pq.write_table(pa.Table.from_pylist(prompts(3)), str(tmp_path / "p.parquet"))
    assert main(["run-batch", str(tmp_path / "p.parquet"), "-q"]) == 0
    assert pq.read_table(str(tmp_path / "p.out.parquet")).num_rows == 3
    assert main(["run-batch", str(inp)]) == 0  # a rerun resumes (here: is already complete)
    assert "already complete" in capsys.readouterr().err
