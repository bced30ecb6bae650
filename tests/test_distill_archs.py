"""`llmctl distill` beyond the Llama family (issue 36): mixture-of-experts teachers and students
taken from their layers (Qwen3-MoE on our own model code, GPT-OSS on transformers'), and a fresh
GPT-2 student from a config; every output loads in run-batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from archs import build

from llmctl import LLM, SamplingParams
from llmctl.cli import main
from llmctl.runtime.resolve import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "llmctl" / "compress" / "data" / "calib_default.txt"
TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dtype", "float32", "-q"]
VOCAB = 2048  # the demo model's tokenizer, which the teacher speaks


def teacher(folder: Path, arch: str) -> Path:
    build(arch, vocab_size=VOCAB).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    return folder


def generates(folder: Path, path: str = "TransformersCausalLM") -> bool:
    llm = LLM(str(folder), dtype="float32", device="cpu")
    assert type(llm.runtime.model).__name__ == path
    out = llm.generate(["To be"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "arch, path", [("qwen3_moe", "LlamaForCausalLM"), ("gpt_oss", "TransformersCausalLM")]
)
def test_moe_student_from_the_teacher_layers(tmp_path, capsys, arch, path):
    """A native MoE family and one served by transformers' code."""
    moe = teacher(tmp_path / "teacher", arch)
    out = tmp_path / "student"
    argv = ["distill", "--teacher", str(moe), "-o", str(out), "--data", str(DATA)]
    assert main([*argv, "--student-layers", "1", *TINY]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["num_hidden_layers"] == 1
    assert generates(out, path)
    capsys.readouterr()


def test_fresh_gpt2_student_from_a_config(tmp_path, capsys):
    gpt2 = teacher(tmp_path / "teacher", "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    config.update(n_layer=1)
    (tmp_path / "c.json").write_text(json.dumps(config))
    out = tmp_path / "student"
    argv = ["distill", "--teacher", str(gpt2), "-o", str(out), "--data", str(DATA)]
    assert main([*argv, "--student-config", str(tmp_path / "c.json"), *TINY]) == 0
    assert json.loads((out / "config.json").read_text())["n_layer"] == 1
    assert generates(out)
    capsys.readouterr()
