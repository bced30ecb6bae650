"""KernelConfig (llmctl/kernels/config.py): every kernel choice in one record, read from
LLMCTL_KERNELS once where an engine configuration is made, refused in one line when wrong."""

from __future__ import annotations

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
