"""The examples in `llmctl profile --help` and `llmctl eval --help` run on the embedded demo model
(run-batch's, quantize's and sparsify's have their own tests), in the order written, in a fresh
folder where `llmctl/` is the checkout's package folder."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from llmctl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def examples(command: str) -> list[list[str]]:
    """The Examples block of the command's help text (as written: the terminal may wrap it)."""
    import importlib

    module = importlib.import_module(f"llmctl.commands.{command}")
    lines = module.HELP.split("Examples:", 1)[1].strip("\n").splitlines()
    out = []
    for line in lines:
        if not line.strip():
            break
        words = shlex.split(line)
        assert words[0] == "llmctl" and words[1] == command, line
        out.append(words[1:])
    return out


@pytest.mark.parametrize("command", ["profile", "eval"])
def test_help_examples_run_on_the_demo_model(command, tmp_path, monkeypatch, capsys):
    cases = examples(command)
    assert len(cases) >= 2
    (tmp_path / "llmctl").symlink_to(ROOT / "llmctl")
    monkeypatch.chdir(tmp_path)
    for argv in cases:
        assert main(argv) == 0, argv
    capsys.readouterr()
