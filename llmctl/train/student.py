"""The student of a distillation run, and the check that it speaks the teacher's tokenizer.

Owns: `layer_plan` (N evenly spaced teacher layers, first and last kept, DistilBERT style),
`student_from_layers` (a copy of the teacher with those layers; embeddings, final norm and lm_head
copied), `student_from_config` (a fresh model of a config.json, initialised from --seed),
`load_student` (an existing model folder) and `check_same_tokenizer`. Students are float32 and
trainable; their config dicts are what the output's config.json is written from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.config import ModelConfig

LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def layer_plan(teacher_layers: int, n: int) -> list[int]:
    """Indices of n evenly spaced layers of a teacher of `teacher_layers` (first, last kept)."""
    if not 1 <= n <= teacher_layers:
        raise UsageError(
            f"--student-layers {n}: the teacher has {teacher_layers} layers; "
            f"choose 1 to {teacher_layers}"
        )
    if n == 1:
        return [0]
    return [round(i * (teacher_layers - 1) / (n - 1)) for i in range(n)]


def _build(raw: dict, device: str):
    """A float32 model of config dict `raw` with uninitialised weights, and its ModelConfig."""
    from llmctl.models.llama import LlamaForCausalLM

    config = ModelConfig.from_dict(raw)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.float(), config


def _trainable(model):
    return model.train().requires_grad_(True)


def student_from_layers(teacher_path: Path, teacher_raw: dict, n: int, device: str):
    """(model, config, raw config, kept layers): the teacher's layers `layer_plan(L, n)`."""
    from llmctl.runtime.tensors import iter_tensors

    if teacher_raw.get("quantization_config") is not None:
        raise UsageError("--student-layers needs a dense teacher; this one is quantized")
    keep = layer_plan(int(teacher_raw["num_hidden_layers"]), n)
    raw = dict(teacher_raw, num_hidden_layers=n)
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = [raw["layer_types"][i] for i in keep]
    model, config = _build(raw, device)
    new_index = {old: new for new, old in enumerate(keep)}
    params = dict(model.named_parameters())
    seen = set()
    for _, name, tensor in iter_tensors(teacher_path):
        m = LAYER_KEY.fullmatch(name)
        if m:
            if int(m.group(1)) not in new_index:
                continue
            name = f"model.layers.{new_index[int(m.group(1))]}.{m.group(2)}"
        if name in params:
            with torch.no_grad():
                params[name].copy_(tensor.float())
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ModelLoadError(f"{teacher_path}: the teacher has no tensor {missing[0]}")
    return _trainable(model), config, raw, keep


def student_from_config(path: Path, teacher_raw: dict, seed: int, device: str):
    """(model, config, raw config): a fresh model of the config.json at `path` (a file or a
    folder holding one), normal(0, initializer_range) weights, norms at one."""
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--student-config {path}: not a readable JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--student-config {path}: expected a JSON object")
    raw = {k: v for k, v in raw.items() if k not in ("quantization_config", "auto_map")}
    _check_vocab(raw.get("vocab_size"), teacher_raw["vocab_size"], f"--student-config {path}")
    model, config = _build(raw, device)
    std = float(raw.get("initializer_range", 0.02))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return _trainable(model), config, raw


def load_student(path: Path, teacher_raw: dict, device: str):
    """(model, config, raw config) of an existing dense model folder."""
    from llmctl.runtime.weights import load_model

    model, config = load_model(path, "float32", device)
    if config.raw.get("quantization_config") is not None:
        raise UsageError(f"--student {path} is quantized; distill trains dense students only")
    _check_vocab(config.vocab_size, teacher_raw["vocab_size"], f"--student {path}")
    return _trainable(model), config, dict(config.raw)


def _check_vocab(student: Any, teacher: int, what: str) -> None:
    if student != teacher:
        raise UsageError(
            f"{what} has vocabulary size {student}, the teacher {teacher}: "
            "the student must use the teacher's tokenizer"
        )


def check_same_tokenizer(teacher_tok: Any, student_tok: Any, student: str) -> None:
    """Refuse a student whose tokenizer maps any token differently from the teacher's."""
    if teacher_tok is None or student_tok is None:
        return
    same = teacher_tok.get_vocab() == student_tok.get_vocab() and (
        teacher_tok.all_special_tokens == student_tok.all_special_tokens
    )
    if not same:
        raise UsageError(
            f"--student {student} has a different tokenizer from the teacher's; "
            "distillation needs the same tokenizer"
        )
