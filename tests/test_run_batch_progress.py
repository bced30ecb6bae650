"""run-batch's progress where stderr is not a terminal (plain lines every --log-interval), the
--progress modes, and the engine's log events (--log-level / -v)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from test_run_batch_cli import engines, write_jsonl  # noqa: F401

from llmctl.batch.summary import Progress
from llmctl.cli import main
from llmctl.commands._batch_ui import LinesUI, RichUI, make_ui, progress_line
from tests.fakes import FakeEngine

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(
    r"run-batch: (\d+)/(\d+) rows \([\d.]+%\), (\d+) errors, [\d.]+ output tok/s, "
    r"elapsed \d+:\d\d:\d\d, ETA (\d+:\d\d:\d\d|-)$"
)


def test_progress_line_gives_rows_errors_rate_and_eta():
    p = Progress(50, 200, 2, 0, 1000, 1000, 10.0)
    line = progress_line(p)
    assert "50/200 rows (25.0%)" in line and "2 errors" in line
    assert "100.0 output tok/s" in line  # 1000 tokens in 10 s
    assert line.endswith("ETA 0:00:30")  # 150 rows to go at 5 rows/s
    # a resumed job's ETA counts only this session's rows (40 in 10 s: 4 rows/s)
    assert progress_line(p, rows_at_start=10).endswith("ETA 0:00:37")
    assert progress_line(Progress(7, None, 0, 0, 0, 0, 1.0)).startswith("run-batch: 7 rows, 0")


def test_progress_modes_pick_the_ui(capsys):
    assert isinstance(make_ui(False, "auto", 5.0), LinesUI)  # stderr is captured: not a tty
    assert isinstance(make_ui(False, "lines", 5.0), LinesUI)
    bar, none, quiet = (
        make_ui(False, "bar", 5.0),
        make_ui(False, "none", 5.0),
        make_ui(True, "x", 1),
    )
    assert type(bar) is RichUI and bar._show_bar and not bar.quiet
    assert type(none) is RichUI and not none._show_bar and not none.quiet
    assert quiet.quiet
    none.start(10, 0)
    assert none._bar is None  # no bar, but messages and the summary still print


def test_lines_are_printed_in_process_while_rows_finish(tmp_path, engines, capsys):
    engines.append(FakeEngine(max_num_seqs=2, max_model_len=64, step_delay_s=0.01))
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 8} for i in range(24)]
    )
    argv = ["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--log-interval", "0.1"]
    assert main(argv) == 0
    lines = [m for m in map(LINE.match, capsys.readouterr().err.splitlines()) if m]
    assert len(lines) >= 2 and all(m.group(2) == "24" for m in lines)
    assert [int(m.group(1)) for m in lines] == sorted(int(m.group(1)) for m in lines)
    assert main([*argv, "--overwrite", "--progress", "none"]) == 0
    assert not any(map(LINE.match, capsys.readouterr().err.splitlines()))


def test_a_job_with_stderr_in_a_file_shows_progress_lines_while_it_runs(tmp_path):
    """The CLI in a subprocess, stderr to a file, on the demo model: lines appear before the job
    ends, with rows done/total, errors, output tok/s and ETA; -v adds engine statistics."""
    n = 24  # 12 waves of 32 steps: over a second even on an idle machine
    rows = [{"prompt": f"ROMEO {i}:", "max_tokens": 32, "ignore_eos": True} for i in range(n)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    err_path = tmp_path / "stderr.txt"
    argv = [sys.executable, "-m", "llmctl.cli", "run-batch", str(inp), "-o", str(tmp_path / "o")]
    argv += ["--dtype", "float32", "--max-num-seqs", "2", "--kv-cache-memory", "16MiB"]
    argv += ["--log-interval", "0.2", "-v"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path)
        seen_while_running = False
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if any(LINE.match(x) for x in err_path.read_text().splitlines()):
                seen_while_running = proc.poll() is None
                break
            time.sleep(0.05)
        assert proc.wait(timeout=300) == 0, err_path.read_text()
    text = err_path.read_text()
    assert seen_while_running, text
    progress = [m for m in map(LINE.match, text.splitlines()) if m]
    assert len(progress) >= 2, text
    done = [int(m.group(1)) for m in progress]
    assert done == sorted(done) and done[0] < n and {m.group(2) for m in progress} == {str(n)}
    assert all(m.group(3) == "0" for m in progress)
    assert re.search(r"INFO llmctl\.engine: engine: \d+ steps .* prefix cache hit rate", text)
    assert len(json.loads((tmp_path / "o").read_text().splitlines()[0])["text"]) > 0


def test_engine_logs_preemptions_statistics_and_steps(caplog):
    from llmctl.engine.config import EngineConfig
    from llmctl.engine.params import SamplingParams
    from llmctl.runtime.loader import load_runtime

    rt = load_runtime(None, dtype="float32", device="cpu")
    # 6 blocks of 4 tokens: two sequences of 15 tokens (4 blocks each) cannot both stay
    kv = 6 * 4 * 3072  # float32 K and V of 6 layers x 2 heads x 32 = 3072 bytes a token
    config = EngineConfig(block_size=4, kv_cache_memory=kv, max_num_seqs=2, log_stats_interval_s=0)
    engine = rt.start_engine(config)
    for i in range(2):
        ids = rt.encode(f"ROMEO {i}:")
        params = SamplingParams(max_tokens=15 - len(ids), temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), ids, params)
    with caplog.at_level(logging.DEBUG, logger="llmctl.engine"):
        while engine.has_unfinished_requests():
            engine.step()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert engine.scheduler.num_preemptions > 0
    assert sum("preempted" in m for m in info) == 1  # the first at INFO, later ones at DEBUG
    stats = [m for m in info if m.startswith("engine: ")]
    assert len(stats) == engine.stats.steps and "prefix cache hit rate" in stats[-1]
    assert f"{engine.scheduler.num_preemptions} preemptions" in stats[-1]
    assert sum(m.startswith("step ") for m in debug) == engine.stats.steps


def test_engine_is_silent_at_the_default_level(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "ROMEO:", "max_tokens": 2}])
    argv = ["run-batch", str(inp), "-o", str(tmp_path / "o.jsonl"), "--dtype", "float32"]
    argv += ["--kv-cache-memory", "16MiB"]
    assert main([*argv, "--log-interval", "0.01", "--progress", "none"]) == 0
    assert "llmctl.engine" not in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--log-level", "debug", "-q"]) == 0
    assert "DEBUG llmctl.engine: step 1:" in capsys.readouterr().err
    assert logging.getLogger("llmctl").handlers == []  # removed when the command ends
