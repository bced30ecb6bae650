"""Install-time promises: compressed-tensors is a dependency (with a lower bound that has the
modules we import) and is checked before any work; triton is not a dependency, and a CPU install
without it generates and quantizes."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest
import torch

from llmctl.cli import main
from llmctl.errors import ModelLoadError
from llmctl.runtime.formats.ct import MIN_VERSION
from tests.conftest import REPO, make_random_model


def _project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_compressed_tensors_is_a_dependency_and_triton_is_not():
    deps = _project()["dependencies"]
    assert f"compressed-tensors>={MIN_VERSION}" in deps
    assert not [d for d in deps if d.lower().startswith("triton")]
    test_extra = _project()["optional-dependencies"]["test"]
    assert any(d.startswith("triton") for d in test_extra)  # the TRITON_INTERPRET tests


def _hide_compressed_tensors(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "compressed_tensors"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # as if not installed


def test_missing_compressed_tensors_fails_before_loading(tmp_path, capsys, monkeypatch):
    import llmctl.runtime.loader as loader

    model = make_random_model(tmp_path / "m", "llama")
    capsys.readouterr()  # transformers' progress bar while saving the model
    _hide_compressed_tensors(monkeypatch)
    monkeypatch.setattr(loader, "load_runtime", lambda *a, **k: pytest.fail("loaded too early"))
    argv = ["quantize", str(model), "-o", str(tmp_path / "q"), "--rtn", "--group-size", "32", "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"compressed-tensors package >= {MIN_VERSION}" in err and "--format awq or gptq" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "q").exists()


def test_reading_a_compressed_tensors_checkpoint_without_the_package_is_one_line(
    tmp_path, monkeypatch
):
    from llmctl.runtime.formats import read_quantized

    config = {"quantization_config": {"quant_method": "compressed-tensors"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _hide_compressed_tensors(monkeypatch)
    with pytest.raises(ModelLoadError, match="needs the compressed-tensors package"):
        read_quantized(tmp_path)


NO_TRITON = """
import sys
sys.modules["triton"] = None  # a CPU install without triton
from llmctl.cli import main
out = sys.argv[1]
rcs = [
    main(["run-batch", "examples/prompts.jsonl", "-o", out + "/a.jsonl", "--max-tokens", "4",
          "-q"]),
    main(["quantize", "llmctl/data/demo-model", "-o", out + "/q", "--gptq", "--num-samples", "2",
          "--seq-len", "32", "-q"]),
    main(["run-batch", "examples/prompts.jsonl", "-m", out + "/q", "-o", out + "/b.jsonl",
          "--max-tokens", "4", "-q"]),
]
print("RCS", rcs, sys.modules.get("triton"))
"""


def test_a_cpu_install_without_triton_generates_and_quantizes(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", NO_TRITON, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "RCS [0, 0, 0] None" in done.stdout, done.stdout + done.stderr
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert rows and all(r["error"] is None for r in rows)
    assert torch.__version__  # the parent process is unaffected
