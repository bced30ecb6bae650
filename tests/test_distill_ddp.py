"""distill under torchrun with no code change: two gloo processes on the CPU with batch B each
follow the loss curve of one process with batch 2B."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmctl.cli import main
from llmctl.runtime.resolve import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "llmctl" / "compress" / "data" / "calib_default.txt"


def argv(out: Path, batch: int) -> list[str]:
    return [
        "distill", "--teacher", str(DEMO_MODEL_DIR), "-o", str(out), "--data", str(DATA),
        "--student-layers", "2", "--steps", "4", "--batch-size", str(batch), "--seq-len", "16",
        "--dtype", "float32", "--device", "cpu", "--warmup", "1", "-q",
        "--report-json", str(out.parent / f"{out.name}.json"),
    ]  # fmt: skip


def test_two_gloo_ranks_match_one_process_with_twice_the_batch(tmp_path, capsys):
    assert main(argv(tmp_path / "one", 4)) == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        cmd + ["-m", "llmctl.cli"] + argv(tmp_path / "two", 2),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["sequences"] == one["sequences"] == 4 * 4
    assert two["target_tokens"] == one["target_tokens"]
    for a, b in zip(one["history"], two["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3, abs=1e-5)
    from llmctl.runtime.tensors import read_tensors

    w1, w2 = read_tensors(tmp_path / "one"), read_tensors(tmp_path / "two")
    assert w1.keys() == w2.keys()
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-4, atol=1e-5) for k in w1)
    capsys.readouterr()
