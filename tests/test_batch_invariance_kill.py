"""Issue 20's end-to-end check: a bfloat16 run-batch job on the demo model with batch-invariant
engine arithmetic, killed with SIGKILL and rerun, writes exactly the bytes of the uninterrupted
run, although the resumed rows are batched and chunked differently. The rows sample with a seed
each: a small difference in a logit moves the sampled token more readily than the argmax, so
without the switch the same kill and rerun measured different bytes (twice in two tries)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from llmctl.batch.journal import state_path
from tests.test_run_batch_kill import COMMIT_EVERY_8_AND_RUN, ROOT, wait_for_commits

# The child runs the real command (with --batch-invariant) on the embedded demo model; it only
# makes it commit every 8 rows, so that the kill lands between commits.
CHILD = COMMIT_EVERY_8_AND_RUN
ARGS = [
    "--batch-invariant",
    "--dtype",
    "bfloat16",
    "--device",
    "cpu",
    "--max-num-seqs",
    "6",
    "--max-num-batched-tokens",
    "24",  # prompts are chunked, and a resumed row meets other batch-mates and chunk boundaries
    "--kv-cache-memory",
    "16MiB",
    "--include-token-ids",
    "-q",
]


def child(args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, "run-batch", *args, *ARGS],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_killed_bf16_job_resumes_to_the_uninterrupted_bytes(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [
        {
            "prompt": f"ROMEO {i}: " + "O, " * (i % 13),
            "max_tokens": 4 + (i * 5) % 9,
            "temperature": 1.0,
            "seed": i,
        }
        for i in range(72)
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    p = child([str(inp), "-o", str(ref)])
    assert p.wait(timeout=300) == 0, p.stderr.read()

    p = child([str(inp), "-o", str(out)])
    wait_for_commits(out, 16, p, timeout=120)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    state = json.loads(state_path(out).read_text())
    assert 16 <= state["stats"]["rows"] < len(rows) and not state["complete"]

    p = child([str(inp), "-o", str(out)])
    assert p.wait(timeout=300) == 0, p.stderr.read()
    assert out.read_bytes() == ref.read_bytes()
