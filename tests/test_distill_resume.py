"""Checkpoints of distill: Ctrl-C saves one, --save-every writes them, and --resume continues
exactly: 2N steps in one run equal N steps, stop, resume, N steps, bit for bit (CPU, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmctl.errors import UsageError
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.tensors import read_tensors
from llmctl.train.args import DistillArgs
from llmctl.train.job import TrainingInterrupted, run_distill

DATA = Path(__file__).resolve().parent.parent / "llmctl" / "compress" / "data" / "calib_default.txt"
N = 3


def args(out: Path, **kw) -> DistillArgs:
    base = dict(
        teacher=str(DEMO_MODEL_DIR), output=str(out), data=str(DATA), student_layers=2,
        steps=2 * N, batch_size=2, grad_accum=2, seq_len=16, warmup=2, dtype="float32",
        device="cpu", alpha_ce=0.3, temperature=2.0,
    )  # fmt: skip
    return DistillArgs(**{**base, **kw})


def stop_after(step: int):
    def progress(done: int, total: int, metrics: dict) -> None:
        if done == step:
            raise KeyboardInterrupt  # what Ctrl-C does between two steps

    return progress


def test_stop_and_resume_equals_one_run_bit_for_bit(tmp_path):
    whole = run_distill(args(tmp_path / "whole"))
    with pytest.raises(TrainingInterrupted, match=f"after step {N} of {2 * N}"):
        run_distill(args(tmp_path / "split"), progress=stop_after(N))
    state = json.loads((tmp_path / "split/.llmctl-work/checkpoint/state.json").read_text())
    assert state["train"]["step"] == N and not (tmp_path / "split/config.json").exists()
    resumed = run_distill(args(tmp_path / "split", resume=True))
    a, b = read_tensors(tmp_path / "whole"), read_tensors(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in whole["history"]] == [h["loss"] for h in resumed["history"]]
    assert whole["sequences"] == resumed["sequences"] == 2 * N * 2 * 2


def test_save_every_writes_checkpoints_and_a_rerun_needs_resume(tmp_path):
    seen = []

    def progress(done: int, total: int, metrics: dict) -> None:
        state = tmp_path / "out/.llmctl-work/checkpoint/state.json"
        seen.append(json.loads(state.read_text())["train"]["step"] if state.exists() else None)
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        run_distill(args(tmp_path / "out", save_every=2), progress=progress)
    assert seen == [None, 2, 2]
    with pytest.raises(UsageError, match="pass --resume"):
        run_distill(args(tmp_path / "out"))
    with pytest.raises(UsageError, match="other training options"):
        run_distill(args(tmp_path / "out", lr=0.01, resume=True))


def test_a_real_sigint_finishes_the_step_saves_and_stops(tmp_path):
    import signal

    def progress(done: int, total: int, metrics: dict) -> None:
        if done == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: the handler only sets a flag

    with pytest.raises(TrainingInterrupted, match="after step 2 of"):
        run_distill(args(tmp_path / "out"), progress=progress)
    state = json.loads((tmp_path / "out/.llmctl-work/checkpoint/state.json").read_text())
    assert state["train"]["step"] == 2 and state["train"]["sequences"] == 2 * 2 * 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
