"""Resumable training state: tensors as safetensors, everything else as JSON, never pickle.

Owns: `save_checkpoint` / `load_checkpoint` for a folder holding
- `student.safetensors`: the student's parameters;
- `optimizer.safetensors`: AdamW's per-parameter state (`{index}.{key}`, e.g. `3.exp_avg`);
- `rng.safetensors`: the CPU (and CUDA) generator states;
- `state.json`: the step, the data position (sequences consumed), the loss history, the
  scheduler's state, AdamW's param_groups and the run's fingerprint.
A checkpoint is written to a sibling folder and renamed into place, so an interrupted save leaves
the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmctl.errors import UsageError

STATE_FILE = "state.json"


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs."""

    step: int = 0
    sequences: int = 0  # global data position: packed sequences consumed by all ranks
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    tokens: int = 0  # target tokens trained on (all ranks)
    on_policy_steps: int = 0  # steps trained on the student's own samples


def _optimizer_tensors(optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = optimizer.state_dict()
    tensors = {
        f"{index}.{key}": value.detach().clone().contiguous()
        for index, state in sd["state"].items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, groups


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def save_checkpoint(
    folder: Path, student, optimizer, scheduler, state: TrainState, fingerprint: str
) -> None:
    from llmctl.runtime.tensors import save_safetensors

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in student.state_dict().items()}
    save_safetensors(unique_tensors(weights), tmp / "student.safetensors")
    tensors, groups = _optimizer_tensors(optimizer)
    save_safetensors({k: v.cpu() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    save_safetensors(_rng_tensors(), tmp / "rng.safetensors")
    doc = {
        "fingerprint": fingerprint,
        "train": state.__dict__,
        "scheduler": scheduler.state_dict(),  # LambdaLR keeps lr_lambdas None for a function
        "param_groups": groups,
    }
    (tmp / STATE_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def unique_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied tensors once (safetensors refuses shared storage): the first name of each storage."""
    out, seen = {}, set()
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v
    return out


def has_checkpoint(folder: Path) -> bool:
    return (folder / STATE_FILE).is_file()


def load_checkpoint(folder: Path, student, optimizer, scheduler, fingerprint: str) -> TrainState:
    """Restore a checkpoint into the student, optimizer, scheduler and RNG; returns its state."""
    from safetensors.torch import load_file

    doc = json.loads((folder / STATE_FILE).read_text())
    if doc.get("fingerprint") != fingerprint:
        raise UsageError(
            f"the checkpoint in {folder} is from a run with other training options; "
            "rerun with the same options, or remove the folder to start again"
        )
    device = next(student.parameters()).device
    weights = load_file(str(folder / "student.safetensors"), device=str(device))
    result = student.load_state_dict(weights, strict=False)  # tied weights are stored once
    tied = {"lm_head.weight"} if student.config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise UsageError(f"the checkpoint in {folder} does not fit this student; remove it")
    tensors = load_file(str(folder / "optimizer.safetensors"))  # load_state_dict moves them
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in doc["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    scheduler.load_state_dict(doc["scheduler"])
    rng = load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return TrainState(**doc["train"])
