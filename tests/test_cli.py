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


def test_huge_pages_are_asked_for_unless_the_user_said_otherwise():
    from llmctl.cli import prefer_huge_pages

    env: dict = {}
    prefer_huge_pages(env)
    assert env == {"THP_MEM_ALLOC_ENABLE": "1"}
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    prefer_huge_pages(env)
    assert env == {"THP_MEM_ALLOC_ENABLE": "0"}


def _anon_huge_kb_after_main(env: dict) -> int:
    """AnonHugePages of a process that ran the CLI's main() and then filled a 128 MiB tensor."""
    code = (
        "from llmctl.cli import main; main(['--version']); import torch;"
        "x = torch.ones(64 << 20, dtype=torch.bfloat16);"
        "print([l.split()[1] for l in open('/proc/self/smaps_rollup') if 'AnonHuge' in l][0])"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    return int(res.stdout.strip().splitlines()[-1])


def test_main_puts_large_tensors_on_huge_pages():
    import os
    from pathlib import Path

    import pytest

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel has transparent huge pages off")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert _anon_huge_kb_after_main(env) >= 64 * 1024
    if "[madvise]" in mode.read_text():  # huge pages only where asked for: the user's 0 holds
        assert _anon_huge_kb_after_main({**env, "THP_MEM_ALLOC_ENABLE": "0"}) < 64 * 1024
