"""The CLI shell: instant help, one-line errors with exit codes, version."""

import subprocess
import sys

import typer

from llmctl.cli import app, main


def test_exit_codes_pass_through(capsys):
    @app.command("_exit7", hidden=True)
    def _exit7() -> None:
        raise typer.Exit(7)

    assert main(["_exit7"]) == 7


def test_missing_model_folder_is_one_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code = main(
        [
            "run-batch",
            str(prompts),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--model",
            str(tmp_path / "missing"),
            "-q",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not found" in err[0]


def test_help_does_not_import_torch():
    code = (
        "import sys; from llmctl.cli import main; main(['--help']); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout
    assert out.strip().endswith("False")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert "llmctl" in capsys.readouterr().out


def test_click_usage_errors_exit_2_without_a_traceback(capsys):
    from llmctl.cli import main

    assert main(["run-batch", "in.jsonl", "--no-such-option"]) == 2
    assert main(["no-such-command"]) == 2
    assert "internal error" not in capsys.readouterr().err
