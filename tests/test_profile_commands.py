"""`profile`'s sub-commands (sweep, estimate, compare, advise, machine): each mean what the
one-command spelling of its form means, their --help examples run on the embedded demo model,
and the old spellings still reach the same forms."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from llmctl.cli import main
from llmctl.commands import profile
from llmctl.profiling import machine

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "llmctl" / "data" / "demo-model" / "config.json")


def _examples(help_text: str) -> list[list[str]]:
    lines = help_text.split("Examples:", 1)[1].strip("\n").splitlines()
    out = []
    for line in lines:
        if not line.strip():
            break
        words = shlex.split(line)
        assert words[:2] == ["llmctl", "profile"], line
        out.append(words[1:])
    return out


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A fresh folder holding the checkout's llmctl/ and examples/, and its own peaks cache."""
    for name in ("llmctl", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("name", sorted(profile.HELPS))
def test_each_sub_command_help_examples_run_on_the_demo_model(name, project, capsys):
    cases = _examples(profile.HELPS[name])
    assert cases and any(argv[1] == name for argv in cases)
    for argv in cases:
        assert main(argv) == 0, argv
    capsys.readouterr()


@pytest.mark.parametrize("name", sorted(profile.HELPS))
def test_sub_command_help_names_itself(name, capsys):
    assert main(["profile", name, "--help"]) == 0
    text = capsys.readouterr().out
    assert f"llmctl profile {name}" in text and "Examples:" in text


def test_profile_help_is_the_one_command_help_and_lists_the_sub_commands(capsys):
    assert main(["profile", "-h"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Usage: llmctl profile [OPTIONS]" in text and "forms" not in text
    for name in profile.HELPS:
        assert f"llmctl profile {name}" in text, name


def _json_out(argv, capsys) -> tuple[int, dict]:
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_estimate_equals_the_estimate_switch(capsys):
    flags = ["--dtype", "int4", "--seq-len", "256", "--batch", "8", "--bandwidth", "1000"]
    flags += ["--report-json", "-"]
    rc_new, new = _json_out(["profile", "estimate", CONFIG, *flags], capsys)
    rc_old, old = _json_out(["profile", "--estimate", CONFIG, *flags], capsys)
    assert rc_new == rc_old == 0 and new == old


def test_estimate_needs_its_model_or_config(capsys):
    assert main(["profile", "estimate"]) == 2
    assert "MODEL_OR_CONFIG" in capsys.readouterr().err


def _fake_peaks(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    peaks = machine.MachinePeaks(machine.machine_key("cpu"), "cpu", 5e10, 1e12, 2e12, "now", {})
    monkeypatch.setattr(machine, "measure_machine", lambda device: peaks)


def test_machine_equals_measure_machine(tmp_path, monkeypatch, capsys):
    _fake_peaks(monkeypatch, tmp_path)
    assert main(["profile", "machine", "--device", "cpu"]) == 0
    new = capsys.readouterr().out
    assert main(["profile", "--measure-machine", "--device", "cpu"]) == 0
    assert new == capsys.readouterr().out and "50.0 GB/s" in new
    assert machine.cached_peaks("cpu") is not None


def _captured_sweeps(monkeypatch) -> list:
    import llmctl.profiling.sweep_job as sj

    seen = []

    def fake_sweep(req, target, load_runtime, progress):
        seen.append((req, target))
        raise KeyboardInterrupt  # stop before any model is loaded (main answers 130)

    monkeypatch.setattr(sj, "profile_sweep", fake_sweep)
    return seen


def test_sweep_equals_the_one_command_sweep(monkeypatch):
    seen = _captured_sweeps(monkeypatch)
    flags = ["--batch-sizes", "1,2", "--prompt-lens", "8", "--gen-lens", "4", "--repeat", "2"]
    flags += ["--warmup", "0", "--seed", "7", "--dtype", "float32", "--device", "cpu"]
    flags += ["--no-autotune", "-q"]
    for argv in (["profile", "sweep", "M", *flags], ["profile", "M", *flags]):
        assert main(argv) == 130
    (new, new_target), (old, old_target) = seen
    assert new == old and new_target == old_target == "M"
    assert tuple(new.batch_sizes) == (1, 2) and new.seed == 7 and new.autotune is False
    assert main(["profile", "sweep", "-q"]) == 130 and seen[-1][1] is None  # the demo model


def test_a_model_named_like_the_hidden_default_command_is_a_model(monkeypatch):
    seen = _captured_sweeps(monkeypatch)
    assert main(["profile", "forms", "-q"]) == 130 and seen[-1][1] == "forms"


def test_sweep_takes_one_model_and_keeps_the_output_checks(capsys):
    assert main(["profile", "sweep", "a", "b"]) == 2
    assert main(["profile", "sweep", "--markdown", "--report-json", "-", "-q"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_compare_sub_command_keeps_its_errors_and_json(tmp_path, capsys):
    from test_profile_compare import BASE, _write

    a = _write(tmp_path, "a.json", BASE)
    rc, doc = _json_out(["profile", "compare", a, a, "--report-json", "-"], capsys)
    assert rc == 0 and doc["regressions"] == 0
    assert main(["profile", "compare", a]) == 2
    assert "usage: llmctl profile compare A.json B.json" in capsys.readouterr().err
    assert main(["profile", "--threshold", "5%", "compare", a, a]) == 0  # options first: old form


def test_advise_sub_command_errors_before_any_work(capsys):
    assert main(["profile", "advise", "-q"]) == 2
    assert "needs --workload" in capsys.readouterr().err
    assert main(["profile", "advise", "a", "b", "--workload", "w.jsonl"]) == 2
    assert "takes one MODEL" in capsys.readouterr().err


def test_usage_errors_name_the_command_as_typed(capsys):
    assert main(["profile", "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "llmctl profile -h" in err and "forms" not in err
    assert main(["profile", "machine", "--batch-sizes", "1"]) == 2  # not a flag of machine
    assert "llmctl profile machine" in capsys.readouterr().err
