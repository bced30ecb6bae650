"""KernelConfig (llmctl/kernels/config.py): every kernel choice in one record, read from
LLMCTL_KERNELS once where an engine configuration is made, refused in one line when wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine.config import EngineConfig
from llmctl.errors import UsageError
from llmctl.kernels.config import KernelConfig, from_env


def test_parse_reads_fields_and_booleans():
    config = KernelConfig.parse(" native=0, decode_attention=generic ,prefill_attention=sdpa")
    assert config == KernelConfig(
        native=False, decode_attention="generic", prefill_attention="sdpa"
    )
    assert KernelConfig.parse("autotune=off,merge_linears=no") == KernelConfig(
        autotune=False, merge_linears=False
    )
    assert KernelConfig.parse("") == KernelConfig() == from_env({})


@pytest.mark.parametrize(
    "text, words",
    [
        ("natve=0", "unknown setting 'natve=0'"),
        ("native", "unknown setting 'native'"),
        ("native=maybe", "native takes 1 or 0"),
        ("decode_attention=amx", "decode_attention: one of auto, dpbf16, generic"),
        ("prefill_attention=fast", "prefill_attention: one of auto, amx, dpbf16, sdpa"),
    ],
)
def test_a_wrong_setting_is_one_usage_error(text, words):
    with pytest.raises(UsageError, match=words):
        from_env({"LLMCTL_KERNELS": text})


def test_an_engine_config_reads_the_environment_when_made(monkeypatch):
    monkeypatch.setenv("LLMCTL_KERNELS", "decode_program=0")
    made = EngineConfig()
    monkeypatch.setenv("LLMCTL_KERNELS", "native=0")
    assert made.kernels == KernelConfig(decode_program=False)  # read once, at construction
    assert EngineConfig().kernels == KernelConfig(native=False)
    given = KernelConfig(merge_linears=False)
    assert EngineConfig(kernels=given).kernels is given  # an explicit record wins


def test_no_autotune_turns_the_kernel_choice_off():
    assert EngineConfig(autotune=False, kernels=KernelConfig()).kernels.autotune is False
    assert EngineConfig(kernels=KernelConfig()).kernels.autotune is True


def test_the_command_line_refuses_a_wrong_setting_in_one_line(monkeypatch, capsys, tmp_path):
    from llmctl.cli import main

    monkeypatch.setenv("LLMCTL_KERNELS", "nativ=0")
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "ROMEO:"}\n')
    assert main(["run-batch", str(rows), "-o", str(tmp_path / "out.jsonl"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LLMCTL_KERNELS: unknown setting 'nativ=0'" in err[0]
    assert not (tmp_path / "out.jsonl").exists()


def test_a_wrong_setting_fails_in_one_line_in_a_fresh_process(tmp_path):
    """Nothing reads LLMCTL_KERNELS while the CLI imports (a module-level EngineConfig() once did,
    so a typo was a traceback): a fresh process says it in one line, exit 2, and writes nothing."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt": "ROMEO:"}\n')
    env = {**os.environ, "LLMCTL_KERNELS": "bogus", "PYTHONPATH": str(repo)}
    code = "import sys; from llmctl.cli import main; sys.exit(main(sys.argv[1:]))"
    for args in (["run-batch", str(rows), "-o", str(tmp_path / "out.jsonl")], ["profile", "-q"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=repo
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert "LLMCTL_KERNELS: unknown setting 'bogus'" in lines[0]
    assert not (tmp_path / "out.jsonl").exists()
