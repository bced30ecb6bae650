"""`llmctl distill` end to end on the demo model: the output folder, its loaders, one-line errors
before any training, and the --help examples."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from llmctl.cli import main
from llmctl.runtime.resolve import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "llmctl" / "compress" / "data" / "calib_default.txt"
TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dtype", "float32", "-q"]


def distill(out: Path, *extra: str) -> int:
    argv = ["distill", "--teacher", str(DEMO_MODEL_DIR), "-o", str(out), "--data", str(DATA)]
    return main(argv + list(extra))


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distill") / "student"
    report = out.parent / "report.json"
    assert distill(out, "--student-layers", "2", *TINY, "--report-json", str(report)) == 0
    return out


def test_output_is_a_model_folder_that_eval_and_run_batch_load(student, tmp_path, capsys):
    from llmctl.runtime.loader import load_runtime

    names = {p.name for p in student.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "distill.yaml"} <= names
    assert "distill_report.json" in names and ".llmctl-work" not in names
    rt = load_runtime(str(student), dtype="float32", device="cpu")
    assert rt.config.num_layers == 2 and rt.tokenizer is not None
    recipe = (student / "distill.yaml").read_text()
    assert recipe.startswith("# llmctl distill") and "student_layers: 2" in recipe
    report = json.loads((student.parent / "report.json").read_text())
    assert report["steps"] == 2 and report["student"]["teacher_layers_kept"] == [0, 5]
    assert len(report["history"]) == 2 and report["target_tokens"] == 2 * 2 * 15
    assert main(["eval", str(student), "--data", str(DATA), "--seq-len", "32", "-q"]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The", "max_tokens": 4}\n')
    out = tmp_path / "o.jsonl"
    assert main(["run-batch", str(prompts), "-o", str(out), "--model", str(student), "-q"]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    assert row["error"] is None and row["usage"]["completion_tokens"] == 4
    capsys.readouterr()


def test_student_layers_copy_the_teacher_layers(student):
    from llmctl.runtime.tensors import read_tensors

    t, s = read_tensors(DEMO_MODEL_DIR), read_tensors(student)
    assert set(s) == {k for k in t if not k.startswith("model.layers.")} | {
        k.replace("layers.5.", "layers.1.")
        for k in t
        if k.startswith(("model.layers.0.", "model.layers.5."))
    }


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--student-layers", "7"], "the teacher has 6 layers"),
        (["--student-layers", "0"], "at least 1"),
        (["--student-layers", "2", "--seq-len", "4096"], "exceeds the teacher's context"),
        (["--student-layers", "2", "--loss", "kl"], "unknown --loss"),
        ([], "choose exactly one student"),
        (["--student-layers", "2", "--alpha-ce", "2"], "--alpha-ce must be between"),
        (["--student-layers", "2", "--resume"], "no checkpoint to resume"),
    ],
)
def test_bad_options_are_one_line_errors_before_training(extra, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert distill(out, *extra, "-q") == 2
    assert words in error_line(capsys)
    assert not (out / "model.safetensors").exists()


def test_an_earlier_output_is_not_replaced(student, capsys):
    before = (student / "model.safetensors").read_bytes()
    assert distill(student, "--student-layers", "2", *TINY) == 2
    assert "is not empty; choose another -o" in error_line(capsys)
    assert (student / "model.safetensors").read_bytes() == before


def test_empty_or_short_data_and_output_over_the_teacher(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = ["distill", "--teacher", str(DEMO_MODEL_DIR), "--student-layers", "1", "-q"]
    assert main(argv + ["-o", str(tmp_path / "a"), "--data", str(empty)]) == 2
    assert "is empty" in error_line(capsys)
    short = tmp_path / "short.txt"
    short.write_text("To be.")
    assert main(argv + ["-o", str(tmp_path / "b"), "--data", str(short)]) == 2
    assert "fewer tokens than one sequence" in error_line(capsys)
    assert main(argv + ["-o", str(DEMO_MODEL_DIR / "x"), "--data", str(DATA)]) == 2
    assert "source model folder" in error_line(capsys)


def test_a_student_with_another_tokenizer_is_refused(tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(DEMO_MODEL_DIR, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    assert distill(tmp_path / "out", "--student", str(other), *TINY) == 2
    assert "different tokenizer" in error_line(capsys)


def test_a_student_with_another_vocabulary_is_refused(tmp_path, capsys):
    from conftest import make_random_model

    other = make_random_model(tmp_path / "rand", "llama")
    capsys.readouterr()
    assert distill(tmp_path / "out", "--student", str(other), *TINY) == 2
    assert "vocabulary size 160" in error_line(capsys)


def test_fresh_student_from_a_config_trains(tmp_path, capsys):
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=96, head_dim=16)
    config.update(num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "c.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert distill(out, "--student-config", str(tmp_path / "c.json"), *TINY, "--loss", "tvd") == 0
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    capsys.readouterr()


def help_examples() -> list[list[str]]:
    from llmctl.commands.distill import HELP

    block = HELP.split("Examples", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in joined.splitlines() if line.strip()]


def test_help_examples_run_on_the_demo_model(tmp_path, monkeypatch, capsys):
    cases = help_examples()
    assert len(cases) >= 3 and all(c[0] == "distill" for c in cases)
    (tmp_path / "llmctl").symlink_to(ROOT / "llmctl")
    monkeypatch.chdir(tmp_path)
    for argv in cases:
        assert main(argv) == 0, argv
    assert json.loads((tmp_path / "demo-ce.json").read_text())["steps"] == 2
    capsys.readouterr()


def test_student_as_draft_keeps_greedy_outputs(student, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in ("The", "And so", "I")]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["run-batch", str(prompts), "--model", str(DEMO_MODEL_DIR), "--dtype", "float32", "-q"]
    assert main(base + ["-o", str(tmp_path / "plain.jsonl")]) == 0
    spec = ["--draft", str(student), "--speculative", "draft", "-o", str(tmp_path / "d.jsonl")]
    assert main(base + spec) == 0
    plain = [json.loads(x)["text"] for x in (tmp_path / "plain.jsonl").read_text().splitlines()]
    draft = [json.loads(x)["text"] for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert draft == plain and all(plain)
    capsys.readouterr()


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## distill") :]
    block = section[section.index("```bash") + len("```bash") :]
    lines = block[: block.index("```")].replace("\\\n", " ").strip().splitlines()
    assert len(lines) == 2
    (tmp_path / "llmctl").symlink_to(ROOT / "llmctl")
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "prompts.jsonl", tmp_path / "examples" / "prompts.jsonl")
    monkeypatch.chdir(tmp_path)
    for line in lines:
        words = shlex.split(line)
        assert words[0] == "llmctl" and main(words[1:] + ["-q"]) == 0, line
    assert (tmp_path / "out.jsonl").stat().st_size > 0
    capsys.readouterr()


def test_plain_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    assert distill(tmp_path / "out", "--student-layers", "1", *TINY[:-1]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["step 1/2", "step 2/2"]
    assert "loss " in err[-1] and "tok/s" in err[-1]


def test_rich_bar_on_a_terminal(monkeypatch):
    import io

    from llmctl.commands.distill import train_progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    m = {"loss": 1.5, "divergence": 0.25, "tokens_per_s": 1000.0, "eval": None}
    with train_progress(False) as (progress, warn):
        for step in (1, 2):
            progress(step, 2, m)
        warn("a warning")
    assert "a warning" in sys.stderr.getvalue()
