"""The student of a distillation run, and the check that it speaks the teacher's tokenizer.

Owns: `layer_plan` (N evenly spaced teacher layers, first and last kept, DistilBERT style),
`student_from_layers` (a copy of the teacher with those layers; embeddings, final norm and lm_head
copied), `student_from_config` (a fresh model of a config.json, initialised from --seed),
`load_student` (an existing model folder) and `check_same_tokenizer`. Students are float32 and
trainable; their config dicts are what the output's config.json is written from. A student of an
architecture our model code does not run is transformers' model of it
(models/transformers_backend.py), initialised by transformers' own rules from --seed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.config import ModelConfig

# a decoder layer's tensor: (the layer list's name, index, the rest); `h` is GPT-2's list
LAYER_KEY = re.compile(r"(.+\.(?:layers|h))\.(\d+)\.(.+)")


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


def _build(raw: dict, device: str, seed: int = 0):
    """A float32 model of config dict `raw`, and its ModelConfig: ours with uninitialised
    weights, or transformers' initialised by its own rules from `seed`."""
    from llmctl.models.llama import LlamaForCausalLM

    config = ModelConfig.from_dict(raw)
    if not config.native or config.fused_checkpoint:  # our names must be the checkpoint's
        return _build_transformers(raw, config, device, seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.float(), config


def _build_transformers(raw: dict, config: ModelConfig, device: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmctl.models import transformers_backend as backend

    backend.register()
    hf_config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "auto_map"})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(
        hf_config, dtype=torch.float32, attn_implementation=backend.IMPLEMENTATION
    )
    model = backend.TransformersCausalLM.wrap(hf.to(device), config)
    return model, model.config


def _trainable(model):
    return model.train().requires_grad_(True)


def student_from_layers(teacher_path: Path, teacher_raw: dict, n: int, device: str):
    """(model, config, raw config, kept layers): the teacher's layers `layer_plan(L, n)`."""
    from llmctl.runtime.tensors import iter_tensors

    if teacher_raw.get("quantization_config") is not None:
        raise UsageError("--student-layers needs a dense teacher; this one is quantized")
    teacher_config = ModelConfig.from_dict(teacher_raw)
    keep = layer_plan(teacher_config.num_layers, n)
    raw = dict(teacher_raw, num_hidden_layers=n)
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = [raw["layer_types"][i] for i in keep]
    if not teacher_config.native or teacher_config.fused_checkpoint:
        return (*_layers_of_transformers_teacher(teacher_path, raw, keep, device), keep)
    model, config = _build(raw, device)
    new_index = {old: new for new, old in enumerate(keep)}
    params = dict(model.named_parameters())
    seen = set()
    for _, name, tensor in iter_tensors(teacher_path):
        m = LAYER_KEY.fullmatch(name)
        if m:
            if int(m.group(2)) not in new_index:
                continue
            name = f"{m.group(1)}.{new_index[int(m.group(2))]}.{m.group(3)}"
        if name in params:
            with torch.no_grad():
                params[name].copy_(tensor.float())
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ModelLoadError(f"{teacher_path}: the teacher has no tensor {missing[0]}")
    return _trainable(model), config, raw, keep


def _layers_of_transformers_teacher(teacher_path: Path, raw: dict, keep: list[int], device: str):
    """(model, config, raw config): the teacher loaded by transformers (its checkpoint names may
    differ from its modules', as fused experts do), its decoder list cut to `keep`."""
    from torch import nn

    from llmctl.models import transformers_backend as backend
    from llmctl.models.linears import decoder_layer_list
    from llmctl.runtime.weights import load_model

    teacher, _ = load_model(teacher_path, "float32", device, "transformers")
    full, layers = decoder_layer_list(teacher.hf)
    parent, _, name = full.rpartition(".")
    setattr(teacher.hf.get_submodule(parent), name, nn.ModuleList(layers[i] for i in keep))
    text = teacher.hf.config.get_text_config()
    text.num_hidden_layers = len(keep)
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = raw["layer_types"]
    model = backend.TransformersCausalLM.wrap(teacher.hf, ModelConfig.from_dict(raw))
    return _trainable(model), model.config, raw


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
    model, config = _build(raw, device, seed)
    if hasattr(model, "hf"):  # initialised by transformers' rules for its family
        return _trainable(model), config, raw
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
