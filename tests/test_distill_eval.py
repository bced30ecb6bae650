"""--eval-every: held-out perplexity and KL(teacher || student) through runtime.evaluate, on
--eval-data or on the held-out tail of --data (which training then does not see)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.runtime.evaluate import perplexity
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.tokenizer import load_tokenizer
from llmctl.runtime.weights import load_model
from llmctl.train.args import DistillArgs
from llmctl.train.data import Tokenize, count_sequences, file_tokens
from llmctl.train.job import run_distill

DATA = Path(__file__).resolve().parent.parent / "llmctl" / "compress" / "data" / "calib_default.txt"


def args(out: Path, **kw) -> DistillArgs:
    base = dict(
        teacher=str(DEMO_MODEL_DIR), output=str(out), data=str(DATA), student_layers=1,
        steps=4, batch_size=2, seq_len=16, dtype="float32", device="cpu", eval_every=2,
    )  # fmt: skip
    return DistillArgs(**{**base, **kw})


def test_eval_every_on_eval_data_is_llmctl_eval(tmp_path):
    held = tmp_path / "held.txt"
    held.write_text(DATA.read_text()[-3000:])
    report = run_distill(args(tmp_path / "out", eval_data=str(held)))
    assert [e["step"] for e in report["evals"]] == [2, 4]
    final = report["final_eval"]
    student, _ = load_model(tmp_path / "out", "float32", "cpu")
    teacher, _ = load_model(DEMO_MODEL_DIR, "float32", "cpu")
    ids = file_tokens(held, Tokenize(load_tokenizer(DEMO_MODEL_DIR), 0), 65536)
    want = perplexity(student, ids, 16, 16, reference=teacher)
    assert final["perplexity"] == pytest.approx(want.perplexity, rel=1e-4)
    assert final["kl_teacher_student"] == pytest.approx(want.mean_kl, rel=1e-3)
    assert final["teacher_perplexity"] == pytest.approx(want.reference_perplexity, rel=1e-4)


def test_without_eval_data_the_tail_of_data_is_held_out(tmp_path):
    total = count_sequences(DATA, Tokenize(load_tokenizer(DEMO_MODEL_DIR), 0), 16)
    train = total - max(1, total // 10)
    steps = train // 2 + 1  # one step past the training part: the data repeats
    warned = []
    report = run_distill(args(tmp_path / "out", steps=steps, eval_every=steps), warn=warned.append)
    assert report["final_eval"]["scored_tokens"] > 0
    assert warned and f"gives {train} sequences" in warned[0]
