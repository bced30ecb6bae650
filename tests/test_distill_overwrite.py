"""distill --overwrite: replaces an earlier llmctl output, never the teacher or the student it
reads, nor a folder holding files llmctl did not write."""

from __future__ import annotations

import json
import shutil

from test_distill_cli import TINY, distill, error_line

from llmctl.runtime.resolve import DEMO_MODEL_DIR


def test_overwrite_replaces_an_earlier_distill_output(tmp_path, capsys):
    out = tmp_path / "out"
    assert distill(out, "--student-layers", "1", *TINY) == 0
    (out / "tokenizer_extra.json").write_text("{}")  # a side file name llmctl copies
    report = out / "report.json"
    assert (
        distill(out, "--student-layers", "2", *TINY, "--overwrite", "--report-json", str(report))
        == 0
    )
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads(report.read_text())["student"]["num_layers"] == 2
    assert not (out / "tokenizer_extra.json").exists() and not (out / ".llmctl-work").exists()
    capsys.readouterr()


def test_overwrite_refuses_folders_llmctl_did_not_write(tmp_path, capsys):
    out = tmp_path / "out"
    assert distill(out, "--student-layers", "1", *TINY) == 0
    (out / "notes.txt").write_text("mine")
    before = (out / "model.safetensors").read_bytes()
    assert distill(out, "--student-layers", "1", *TINY, "--overwrite") == 2
    assert "--overwrite refused" in error_line(capsys) and (out / "notes.txt").exists()
    assert (out / "model.safetensors").read_bytes() == before
    plain = tmp_path / "plain"
    shutil.copytree(DEMO_MODEL_DIR, plain)  # a model folder without an llmctl recipe
    assert distill(plain, "--student-layers", "1", *TINY, "--overwrite") == 2
    assert "--overwrite refused" in error_line(capsys)


def test_overwrite_never_replaces_the_student_or_the_teacher(tmp_path, capsys):
    first = tmp_path / "first"
    assert distill(first, "--student-layers", "1", *TINY) == 0
    capsys.readouterr()
    before = (first / "model.safetensors").read_bytes()
    assert distill(first, "--student", str(first), *TINY, "--overwrite") == 2
    assert "source model folder" in error_line(capsys)
    assert (first / "model.safetensors").read_bytes() == before
    # a distill output used as the teacher: an llmctl output, but the run reads it
    argv = ["--student-layers", "1", *TINY, "--overwrite"]
    from llmctl.cli import main

    data = str(DEMO_MODEL_DIR.parent.parent / "compress" / "data" / "calib_default.txt")
    assert main(["distill", "--teacher", str(first), "-o", str(first), "--data", data, *argv]) == 2
    assert "source model folder" in error_line(capsys)
    assert (first / "model.safetensors").read_bytes() == before
