"""run-batch in a child process on a slow fake engine: kill -9, SIGINT, SIGTERM, then resume; stdin
to stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmctl.batch.journal import state_path

# The end of a child script: commit every 8 rows (a kill lands between commits), run the CLI.
COMMIT_EVERY_8_AND_RUN = """
import sys
import llmctl.batch.runner as runner
_run = runner.run_batch

def run_batch(opts, *a, **k):
    opts.commit_rows = 8
    return _run(opts, *a, **k)

runner.run_batch = run_batch
from llmctl.cli import main
sys.exit(main(sys.argv[1:]))
"""

CHILD = (
    """
import os, sys
import llmctl.batch.runner as runner
import llmctl.commands.run_batch as rb
from llmctl.batch import outputs
from tests.fakes import FakeEngine, FakeRuntime

_write = outputs.FileSink.write

def write(self, data):
    half = len(data) // 2
    for part in (data[:half], data[half:]):
        _write(self, part)
        self._f.flush()

outputs.FileSink.write = write

delay = float(os.environ.get("FAKE_STEP_DELAY", "0"))
rb._load_runtime = lambda *a, **k: FakeRuntime(FakeEngine(max_num_seqs=4, step_delay_s=delay))
"""
    + COMMIT_EVERY_8_AND_RUN
)

ROOT = Path(__file__).resolve().parent.parent


def child(args, delay=0.0, **kw):
    env = dict(os.environ, FAKE_STEP_DELAY=str(delay), PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "run-batch", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def run_child(args, delay=0.0, stdin_bytes=None):
    p = child(args, delay, stdin=subprocess.PIPE if stdin_bytes is not None else subprocess.DEVNULL)
    out, err = p.communicate(stdin_bytes, timeout=120)
    return p.returncode, out, err


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """An input of 300 rows (one bad) and the output of an uninterrupted run."""
    d = tmp_path_factory.mktemp("kill")
    inp = d / "in.jsonl"
    rows = [
        json.dumps({"prompt": f"ROMEO {i}:", "max_tokens": 1 + (i * 7) % 5}) for i in range(300)
    ]
    rows[150] = '{"prompt": '
    inp.write_text("\n".join(rows) + "\n")
    ref = d / "ref.jsonl"
    rc, _, err = run_child([str(inp), "-o", str(ref), "-q"])
    assert rc == 0, err
    return inp, ref


def wait_for_commits(out: Path, rows: int, proc, timeout=60.0) -> dict:
    sp = state_path(out)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, (
            "child finished before it could be interrupted; slow the fake engine down"
        )
        try:
            state = json.loads(sp.read_text())
            if state["stats"].get("rows", 0) >= rows:
                return state
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.02)
    raise AssertionError("no commit in time")


@pytest.mark.parametrize(
    "how,extra",
    [
        (signal.SIGKILL, []),
        (signal.SIGKILL, ["--unordered"]),
        (signal.SIGINT, []),
        (signal.SIGTERM, ["--unordered"]),
    ],
)
def test_killed_run_resumes_to_the_uninterrupted_output(job, tmp_path, how, extra):
    inp, ref = job
    out = tmp_path / "out.jsonl"
    proc = child([str(inp), "-o", str(out), "-q", *extra], delay=0.01)
    state = wait_for_commits(out, 40, proc)
    proc.send_signal(how)
    _, err = proc.communicate(timeout=60)
    if how == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130, err
        assert b"rerun the same command to continue" in err
    state = json.loads(state_path(out).read_text())
    assert 40 <= state["stats"]["rows"] < 300 and not state["complete"]
    assert out.stat().st_size >= state["output_bytes"]

    rc, _, err = run_child([str(inp), "-o", str(out), "-q", *extra])
    assert rc == 0, err
    got = [
        json.loads(line) for line in out.read_bytes().splitlines()
    ]  # no torn line: every line parses
    ids = sorted(r["id"] for r in got)
    assert ids == list(range(1, 301))  # every row exactly once
    if extra:
        key = lambda r: r["id"]
        want = [json.loads(line) for line in ref.read_bytes().splitlines()]
        assert sorted(got, key=key) == sorted(want, key=key)
    else:
        assert out.read_bytes() == ref.read_bytes()
    final = json.loads(state_path(out).read_text())
    assert final["complete"] and final["stats"]["rows"] == 300 and final["stats"]["errors"] == 1


def test_stdin_to_stdout(job):
    inp, ref = job
    rc, out, err = run_child(["-", "-o", "-", "-q"], stdin_bytes=inp.read_bytes())
    assert rc == 0, err
    assert out == ref.read_bytes()
    assert err == b""  # --quiet: nothing on stderr


@pytest.mark.parametrize("quiet", [True, False])
def test_reader_closing_stdout_stops_the_job_like_a_unix_filter(tmp_path, quiet):
    inp = tmp_path / "big.jsonl"
    inp.write_text(
        "".join(json.dumps({"prompt": f"row {i}", "max_tokens": 3}) + "\n" for i in range(3000))
    )
    p = child([str(inp), "-o", "-"] + (["-q"] if quiet else []), stdin=subprocess.DEVNULL)
    first = p.stdout.readline()  # like `| head -1`
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141  # 128 + SIGPIPE: what `set -o pipefail` sees from `cat`
    assert json.loads(first)["id"] == 1
    assert (
        b"Traceback" not in err and b"Exception ignored" not in err and b"llmctl: error" not in err
    )
    if quiet:
        assert err == b""
    else:
        assert b"stdout was closed" in err
