"""run-batch against hostile files and flags (issue 13): the input is never destroyed, a resume
never continues another input or output, nothing is written before the model loads, every
option is checked before work, and write failures are one line and resumable."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import types

import pytest
from test_run_batch_cli import InterruptAt, engines, prompts, read_jsonl, write_jsonl  # noqa: F401

import llmctl.commands.run_batch as rb
from llmctl.batch import outputs, runner, session
from llmctl.batch.journal import journal_path, state_path
from llmctl.cli import main
from tests.fakes import FakeEngine, FakeRuntime

REAL_LOAD = rb._load_runtime  # the command's loader, before a fixture replaces it


def serve_fakes(monkeypatch) -> None:
    monkeypatch.setattr(
        rb,
        "_load_runtime",
        lambda *a, **k: FakeRuntime(FakeEngine(max_num_seqs=4, max_model_len=64)),
    )


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def listing(folder) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# -- the input is never the output --------------------------------------------------------------


@pytest.mark.parametrize("how", ["hardlink", "symlink"])
def test_an_output_that_is_the_input_under_another_name_is_refused(tmp_path, engines, capsys, how):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    before = inp.read_bytes()
    out = tmp_path / "out.jsonl"
    os.link(inp, out) if how == "hardlink" else out.symlink_to(inp)
    assert main(["run-batch", str(inp), "-o", str(out), "--overwrite", "-q"]) == 2
    assert "it is the input file" in one_line_error(capsys)
    assert inp.read_bytes() == before and not state_path(out).exists()


def test_a_state_file_that_is_the_input_is_refused(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    os.link(inp, state_path(out))
    assert main(["run-batch", str(inp), "-o", str(out), "--overwrite", "-q"]) == 2
    assert "it is the input file" in one_line_error(capsys)
    assert not out.exists() and read_jsonl(inp) == prompts(5)


def test_stdin_redirected_from_the_output_file_is_refused(tmp_path, engines, capsys, monkeypatch):
    out = write_jsonl(tmp_path / "out.jsonl", prompts(5))
    with open(out, "rb") as f:
        # `llmctl run-batch - -o out.jsonl < out.jsonl`
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(f))
        assert main(["run-batch", "-", "-o", str(out), "--overwrite", "-q"]) == 2
    assert "it is the input file" in one_line_error(capsys)
    assert read_jsonl(out) == prompts(5)


# -- a resume continues the same input ----------------------------------------------------------


def shuffled_same_size(path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    size = path.stat().st_size
    random.Random(0).shuffle(lines)
    path.write_bytes(b"".join(lines))
    assert path.stat().st_size == size


@pytest.mark.parametrize("extra", [[], ["--unordered"]])
def test_resume_refuses_a_shuffled_input_of_the_same_size(tmp_path, engines, capsys, extra):
    rows = [{"id": i, "prompt": f"ROMEO {i:03d}:", "max_tokens": 1 + i % 4} for i in range(200)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"] + extra) == 0
    engines.append(InterruptAt(30))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"] + extra) == 130
    assert json.loads(state_path(out).read_text())["stats"]["rows"] > 0
    original = inp.read_bytes()
    shuffled_same_size(inp)
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q"] + extra) == 2
    assert "the input changed since the job started" in one_line_error(capsys)
    inp.write_bytes(original)  # the original input resumes to the uninterrupted output
    assert main(["run-batch", str(inp), "-o", str(out), "-q"] + extra) == 0
    key = lambda r: r["id"]
    assert sorted(read_jsonl(out), key=key) == sorted(read_jsonl(ref), key=key)


def test_resume_refuses_a_parquet_input_with_other_rows(tmp_path, engines, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"line {i:03d}" for i in range(120)]
    inp = tmp_path / "in.parquet"

    def write(rows):
        pq.write_table(
            pa.table({"prompt": rows}),
            str(inp),
            row_group_size=16,
            compression="none",
            use_dictionary=False,
            write_statistics=False,
        )

    write(texts)
    size = inp.stat().st_size
    out = tmp_path / "out.jsonl"
    engines.append(InterruptAt(10))
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--max-tokens", "2"]) == 130
    write(texts[::-1])
    assert inp.stat().st_size == size
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--max-tokens", "2"]) == 2
    assert "the input changed since the job started" in one_line_error(capsys)
    write(texts)
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--max-tokens", "2"]) == 0
    assert [r["id"] for r in read_jsonl(out)] == list(range(1, 121))


def stdin_of(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(buffer=io.BytesIO(data)))


@pytest.mark.parametrize("extra", [[], ["--unordered"]])
@pytest.mark.parametrize("change", ["shuffled", "shorter"])
def test_stdin_resume_refuses_another_stream(tmp_path, engines, capsys, monkeypatch, change, extra):
    rows = [
        {"id": i, "prompt": f"ROMEO {i:03d}:", "max_tokens": 1 + (i * 7) % 5} for i in range(120)
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    args = ["run-batch", "-", "-q", "--max-tokens", "3", *extra]
    stdin_of(monkeypatch, data)
    assert main([*args, "-o", str(ref)]) == 0
    engines.append(InterruptAt(30))
    stdin_of(monkeypatch, data)
    assert main([*args, "-o", str(out)]) == 130
    state = json.loads(state_path(out).read_text())
    assert state["next_position"] > 0 and bool(state["done_after"]) == bool(extra)
    lines = data.splitlines(keepends=True)
    other = b"".join(lines[::-1]) if change == "shuffled" else data[: state["next_position"] // 2]
    stdin_of(monkeypatch, other)
    capsys.readouterr()
    assert main([*args, "-o", str(out)]) == 2
    assert "the input changed since the job started" in one_line_error(capsys)
    stdin_of(monkeypatch, data)
    assert main([*args, "-o", str(out)]) == 0
    key = lambda r: r["id"]
    assert sorted(read_jsonl(out), key=key) == sorted(read_jsonl(ref), key=key)


# -- a rerun checks the output it continues or reports ------------------------------------------


@pytest.mark.parametrize("damage", ["appended", "truncated", "same size"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_finished_output_changed_since_is_not_already_complete(
    tmp_path, engines, capsys, damage, suffix
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(20))
    out = tmp_path / ("out" + suffix)
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    good = out.read_bytes()
    bad = {
        "appended": good + b"x\n",
        "truncated": good[:-7],
        "same size": good[:100] + bytes([good[100] ^ 1]) + good[101:],
    }[damage]
    out.write_bytes(bad)
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    assert "was changed since its job finished" in one_line_error(capsys)
    assert out.read_bytes() == bad  # reported, not touched
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite"]) == 0
    assert out.read_bytes() == good


def test_resume_refuses_an_output_whose_committed_rows_were_changed(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(80))
    out = tmp_path / "out.jsonl"
    engines.append(InterruptAt(25))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    data = bytearray(out.read_bytes())
    data[5] ^= 1
    out.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    assert "were changed since" in one_line_error(capsys)


# -- nothing on disk until the model has loaded -------------------------------------------------


def test_a_failed_model_load_creates_nothing_and_the_corrected_rerun_runs(
    tmp_path, engines, capsys, monkeypatch
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    model = tmp_path / "pickled"
    model.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    (model / "pytorch_model.bin").write_bytes(b"not loaded")
    before = listing(tmp_path)
    monkeypatch.setattr(rb, "_load_runtime", REAL_LOAD)
    for bad in (str(model), str(tmp_path / "missing-model")):
        assert main(["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "-m", bad, "-q"]) == 2
        one_line_error(capsys)
        assert listing(tmp_path) == before
    serve_fakes(monkeypatch)
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "-q"]) == 0
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 6


def test_a_state_with_nothing_committed_is_replaced_by_a_rerun_with_other_settings(
    tmp_path, engines
):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"ROMEO {i}:"} for i in range(10)])
    out = tmp_path / "out.jsonl"
    engines.append(InterruptAt(0))  # stopped before any row was written (as a failed load left it)
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    assert json.loads(state_path(out).read_text())["stats"].get("rows", 0) == 0
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--max-tokens", "2"]) == 0
    assert [r["usage"]["completion_tokens"] for r in read_jsonl(out)] == [2] * 10


# -- every option checked before any work -------------------------------------------------------


@pytest.fixture
def counting_loads(monkeypatch):
    loads = []

    class Recording(FakeRuntime):
        def start_engine(self, engine_config=None):
            loads.append(engine_config)
            return super().start_engine(engine_config)

    def load(*a, **k):
        return Recording(FakeEngine(max_num_seqs=4, max_model_len=64))

    monkeypatch.setattr(rb, "_load_runtime", load)
    return loads


@pytest.mark.parametrize(
    "args, message",
    [
        (["--report-json", "{tmp}/nowhere/s.json"], "does not exist"),
        (["--report-json", "{tmp}"], "is a folder"),
        (["--report-json", "{tmp}/in.jsonl"], "it is the input file"),
        (["--report-json", "{tmp}/out.jsonl.llmctl-state.json"], "one of the job's own files"),
        (["-o", "/dev/null"], "not a regular file"),
        (["-o", "{tmp}"], "is a folder"),
        (["-o", "{tmp}/nowhere/o.jsonl"], "does not exist"),
        (["--prompt-column", "text"], "--prompt-column is for Parquet input"),
        (["--max-model-len", "0"], "Invalid value for '--max-model-len'"),  # click's usage error
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "0"], "--block-size"),
        (["--top-p", "2"], "top_p"),
        (["--kv-cache-memory", "lots"], "memory size"),
        (["--input-format", "csv"], "--input-format"),
    ],
)
def test_bad_options_fail_before_any_work_and_leave_nothing(
    tmp_path, counting_loads, capsys, args, message
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    before = listing(tmp_path)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = [] if "-o" in args else ["-o", str(tmp_path / "out.jsonl")]
    assert main(["run-batch", str(inp), *out, *args, "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if err.startswith("llmctl:"):
        assert len(err.strip().splitlines()) == 1
    assert counting_loads == [] and listing(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no folder either


def test_a_fifo_output_is_refused(tmp_path, counting_loads, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    os.mkfifo(tmp_path / "pipe")
    assert main(["run-batch", str(inp), "-o", str(tmp_path / "pipe"), "-q"]) == 2
    assert "-o - >" in one_line_error(capsys) and counting_loads == []


def test_an_output_folder_we_cannot_write_is_refused_before_work(
    tmp_path, counting_loads, capsys, monkeypatch
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    access = os.access  # root ignores the mode bits, so the folder's permission is what access says

    def no_write_in_folder(path, mode, *a, **k):
        return False if str(path) == str(folder) and mode & os.W_OK else access(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", no_write_in_folder)
    assert main(["run-batch", str(inp), "-o", str(folder / "o.jsonl"), "-q"]) == 2
    assert "permission denied" in one_line_error(capsys) and counting_loads == []
    assert list(folder.iterdir()) == []


def test_max_model_len_above_the_models_says_it_is_capped(tmp_path, counting_loads, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "o.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "--max-model-len", "4096"]) == 0
    assert counting_loads[0].max_model_len == 4096
    err = capsys.readouterr().err
    assert "--max-model-len 4096 is above the model's context length; capped to 64" in err


def test_a_summary_that_cannot_be_written_at_the_end_is_one_line(tmp_path, monkeypatch, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    folder = tmp_path / "reports"
    folder.mkdir()

    def load(*a, **k):  # the folder disappears while the job runs
        folder.rmdir()
        return FakeRuntime(FakeEngine(max_num_seqs=4))

    monkeypatch.setattr(rb, "_load_runtime", load)
    assert (
        main(
            [
                "run-batch",
                str(inp),
                "-o",
                str(tmp_path / "o.jsonl"),
                "-q",
                "--report-json",
                str(folder / "s.json"),
            ]
        )
        == 1
    )
    assert "cannot write --report-json" in one_line_error(capsys)
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 3  # the rows are kept


# -- disk full ----------------------------------------------------------------------------------


class FailingFile:
    """A sink file whose `op` fails with ENOSPC from its `after`-th call on."""

    def __init__(self, f, op: str, after: int):
        self._f, self.op, self.after, self.calls = f, op, after, 0

    def __getattr__(self, name):
        attr = getattr(self._f, name)
        if name != self.op:
            return attr

        def failing(*a):
            self.calls += 1
            if self.calls >= self.after:
                raise OSError(errno.ENOSPC, "No space left on device")
            return attr(*a)

        return failing


@pytest.mark.parametrize("op, after", [("write", 25), ("flush", 3), ("fsync", 3), ("close", 1)])
def test_disk_full_is_one_line_and_resumes_exactly(
    tmp_path, engines, capsys, monkeypatch, op, after
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0
    if op == "fsync":
        fsync, calls = os.fsync, []

        def failing_fsync(fd):
            calls.append(fd)
            if len(calls) >= after:
                raise OSError(errno.ENOSPC, "No space left on device")
            fsync(fd)

        monkeypatch.setattr(os, "fsync", failing_fsync)
    else:
        real_open = outputs.open_locked
        monkeypatch.setattr(
            runner, "open_locked", lambda *a, **k: FailingFile(real_open(*a, **k), op, after)
        )
    small_commits = runner.run_batch

    def run_batch(opts, *a, **k):
        opts.commit_rows = 8
        return small_commits(opts, *a, **k)

    monkeypatch.setattr(runner, "run_batch", run_batch)
    rc = main(["run-batch", str(inp), "-o", str(out), "-q"])
    monkeypatch.undo()
    serve_fakes(monkeypatch)
    if op == "close":  # everything was committed before the failed close: nothing is lost
        assert rc == 0 and out.read_bytes() == ref.read_bytes()
        return
    assert rc == 1
    rows = json.loads(state_path(out).read_text())["stats"].get("rows", 0)
    assert one_line_error(capsys) == (
        f"llmctl: error: disk full after {rows} committed rows; free space and rerun to resume"
    )
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert out.read_bytes() == ref.read_bytes()


# -- default output, state-file neighbours, interruptions at the end ----------------------------


def test_without_o_the_output_is_written_beside_the_input_and_named(tmp_path, engines, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = write_jsonl(tmp_path / "prompts.jsonl", prompts(4))
    summary = tmp_path / "s.json"
    assert main(["run-batch", str(inp), "--report-json", str(summary)]) == 0
    out = tmp_path / "prompts.out.jsonl"
    assert len(read_jsonl(out)) == 4 and state_path(out).exists()
    assert str(out) in capsys.readouterr().err
    assert json.loads(summary.read_text())["output"] == str(out)
    assert main(["run-batch", str(inp), "-q"]) == 0  # the same default: already complete
    pq.write_table(pa.table({"prompt": ["a", "b"]}), str(tmp_path / "t.parquet"))
    assert main(["run-batch", str(tmp_path / "t.parquet"), "-q"]) == 0
    assert pq.read_table(str(tmp_path / "t.out.parquet")).num_rows == 2


def test_stdin_without_o_writes_stdout(tmp_path, engines, monkeypatch):
    stdin_of(monkeypatch, b"".join(json.dumps(p).encode() + b"\n" for p in prompts(3)))
    sink = io.BytesIO()
    monkeypatch.setattr("sys.stdout", types.SimpleNamespace(buffer=sink, flush=lambda: None))
    monkeypatch.chdir(tmp_path)
    assert main(["run-batch", "-", "-q"]) == 0
    assert [json.loads(line)["id"] for line in sink.getvalue().splitlines()] == [1, 2, 3]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content, message",
    [
        (b"{not json", "not a readable run-batch state file"),
        (b'{"version": 99}', "written by a newer llmctl"),
        (
            b'{"version": 2, "fingerprint": 5, "created": 0, "next_index": 0, "next_position": 0, '
            b'"done_after": [], "output_bytes": 0, "stats": {}, "complete": false}',
            "not a readable",
        ),
        (
            b'{"version": 2, "fingerprint": {}, "created": 0, "next_index": 0, "next_position": 0, '
            b'"done_after": [], "output_bytes": -4, "stats": {}, "complete": false}',
            "not a readable",
        ),
        (None, "cannot read"),  # the state path is a folder
    ],
)
def test_a_bad_state_file_is_one_line_telling_to_overwrite(
    tmp_path, engines, capsys, content, message
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    if content is None:
        state_path(out).mkdir()
    else:
        state_path(out).write_bytes(content)
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    err = one_line_error(capsys)
    assert message in err and "--overwrite" in err
    if content is not None:
        assert main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite"]) == 0
        assert len(read_jsonl(out)) == 5


def test_a_state_from_the_previous_version_resumes_with_a_warning(tmp_path, engines, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(60))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0
    engines.append(InterruptAt(15))
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    state = json.loads(state_path(out).read_text())
    for key in ("output_blake2b", "input_hash", "final_bytes", "final_blake2b"):
        del state[key]
    state["version"] = 1
    state_path(out).write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["run-batch", str(inp), "-o", str(out)]) == 0
    assert "from an older llmctl" in capsys.readouterr().err
    assert out.read_bytes() == ref.read_bytes()
    assert json.loads(state_path(out).read_text())["version"] == 2


def test_ctrl_c_during_the_summary_says_the_job_is_complete(tmp_path, engines, capsys, monkeypatch):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"

    def interrupted(self, s):
        raise KeyboardInterrupt

    monkeypatch.setattr(rb.RichUI, "summary", interrupted)
    assert main(["run-batch", str(inp), "-o", str(out)]) == 130
    assert "the job is complete" in capsys.readouterr().err.strip().splitlines()[-1]
    assert json.loads(state_path(out).read_text())["complete"]


def test_ctrl_c_while_converting_to_parquet_finishes_on_rerun(
    tmp_path, engines, capsys, monkeypatch
):
    import pyarrow.parquet as pq

    inp = write_jsonl(tmp_path / "in.jsonl", prompts(30))
    ref, out = tmp_path / "ref.parquet", tmp_path / "out.parquet"
    assert main(["run-batch", str(inp), "-o", str(ref), "-q"]) == 0

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "journal_to_parquet", interrupted)
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 130
    assert "while finishing" in one_line_error(capsys) and journal_path(out).exists()
    monkeypatch.undo()
    serve_fakes(monkeypatch)
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 0
    assert pq.read_table(str(out)).to_pylist() == pq.read_table(str(ref)).to_pylist()
    assert not journal_path(out).exists()


def test_a_second_job_is_refused_before_it_loads_a_model(tmp_path, counting_loads, capsys):
    import fcntl

    inp = write_jsonl(tmp_path / "in.jsonl", prompts(5))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(inp), "-o", str(out), "-q", "--max-tokens", "1"]) == 0
    with open(out, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert main(["run-batch", str(inp), "-o", str(out), "-q", "--overwrite"]) == 2
    assert "another llmctl run-batch is writing" in one_line_error(capsys)
    assert len(counting_loads) == 1


def test_an_output_created_by_someone_else_while_the_model_loads_is_not_clobbered(
    tmp_path, monkeypatch, capsys
):
    inp = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    out = tmp_path / "out.jsonl"

    def load(*a, **k):
        out.write_text("theirs\n")
        return FakeRuntime(FakeEngine(max_num_seqs=4))

    monkeypatch.setattr(rb, "_load_runtime", load)
    assert main(["run-batch", str(inp), "-o", str(out), "-q"]) == 2
    assert "appeared while the model was loading" in one_line_error(capsys)
    assert out.read_text() == "theirs\n" and not state_path(out).exists()


def test_a_resumed_stdin_commits_nothing_before_it_is_checked(
    tmp_path, engines, capsys, monkeypatch
):
    """--unordered: rows past the watermark were written, so the stream is checked up to the
    last row read; with a smaller --max-in-flight rows finish before the check, and their commit
    must wait for it (else a changed stream would be vouched for)."""
    rows = [
        {"id": i, "prompt": f"ROMEO {i:03d}:", "max_tokens": 1 + (i * 7) % 5} for i in range(120)
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    out = tmp_path / "out.jsonl"
    args = ["run-batch", "-", "-o", str(out), "-q", "--unordered", "--max-tokens", "3"]
    engines.append(InterruptAt(3))
    stdin_of(monkeypatch, data)
    assert main(args) == 130
    state = json.loads(state_path(out).read_text())
    assert state["done_after"] and state["input_hash"]["position"] > state["next_position"]
    before = state_path(out).read_bytes()
    first = state["next_position"]  # the first row not written: changed, same length
    changed = data[:first] + data[first:].replace(b"ROMEO", b"JULIA", 1)
    real_run = runner.run_batch

    def commit_every_row(opts, *a, **k):
        opts.commit_rows = 1
        return real_run(opts, *a, **k)

    monkeypatch.setattr(runner, "run_batch", commit_every_row)
    stdin_of(monkeypatch, changed)
    capsys.readouterr()
    assert main(args + ["--max-in-flight", "1"]) == 2
    assert "the input changed since the job started" in one_line_error(capsys)
    assert state_path(out).read_bytes() == before
