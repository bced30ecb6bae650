"""Sparsifying a whole model: which linears, in which order, with which statistics.

Owns: `SparsifySettings`, `target_linears` (decoder-layer linears minus `--ignore` matches and
layers whose width the N:M group does not divide), and `sparsify_model`, which prunes magnitude
directly and runs Wanda/SparseGPT inside the shared layer-by-layer calibration driver
(llmctl.compress.driver), so each layer is calibrated on the outputs of the already-pruned layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from llmctl.compress.driver import (
    HessianMethod,
    SubLayerGroup,
    calibrate_layers,
    make_ignore,
    relative_name,
    starved,
)
from llmctl.compress.records import LayerSparsity
from llmctl.compress.sparse.masks import SparsityPattern
from llmctl.compress.sparse.prune import METHODS, needs_calibration, prune_linear
from llmctl.compress.sparse.wanda import InputNormAccumulator
from llmctl.models.linears import compressible_linears, weights_root


@dataclass(frozen=True)
class SparsifySettings:
    pattern: SparsityPattern
    method: str = "sparsegpt"
    # as quantize's --ignore: globs, dotted suffixes ("down_proj", "layers.0.*"), re:REGEX
    ignore: tuple[str, ...] = ()
    dampening: float = 0.01
    column_block: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}")


@dataclass
class Targets:
    names: list[str]  # linears to prune, in forward order
    skipped: dict[str, str] = field(default_factory=dict)  # linear name -> why it stays dense


def target_linears(model: torch.nn.Module, settings: SparsifySettings) -> Targets:
    """Every decoder-layer linear compression may change (llmctl.models.linears: never a
    router or gate); lm_head and embeddings are never pruned."""
    targets = Targets(names=[])
    ignored = make_ignore(list(settings.ignore))
    for name, _, in_features in compressible_linears(weights_root(model)):
        if ignored(name):
            targets.skipped[name] = "ignored (--ignore)"
        elif not settings.pattern.fits(in_features):
            targets.skipped[name] = (
                f"{in_features} inputs are not a multiple of {settings.pattern.m}"
            )
        else:
            targets.names.append(name)
    return targets


@dataclass
class SparsifyResult:
    lines: list[LayerSparsity]  # one per pruned linear, in forward order
    targets: Targets
    resumed_layers: int = 0  # decoder layers taken from an interrupted run's checkpoint


ProgressFn = Callable[[int, int], None]  # (layers done, layers total)


def sparsify_model(
    model: torch.nn.Module,
    settings: SparsifySettings,
    calib_ids: torch.Tensor | None = None,
    progress: ProgressFn | None = None,
    *,
    device: str | torch.device = "cpu",
    checkpoint_dir: Path | None = None,
    fingerprint: str = "",
    warn: Callable[[str], None] = lambda msg: None,
) -> SparsifyResult:
    """Prune `model` in place; calib_ids [num_samples, seq_len] is required for wanda/sparsegpt.

    With `checkpoint_dir`, an interrupted calibrated run with the same `fingerprint` resumes after
    its last finished decoder layer (the driver's checkpoints)."""
    targets = target_linears(model, settings)
    if not needs_calibration(settings.method):
        return SparsifyResult(_magnitude(model, settings, targets, progress), targets)
    if calib_ids is None:
        raise ValueError(f"{settings.method} needs calibration token ids")
    lines, resumed = _calibrated(
        model, settings, targets, calib_ids, progress, device, checkpoint_dir, fingerprint, warn
    )
    return SparsifyResult(lines, targets, resumed)


def _magnitude(
    model, settings: SparsifySettings, targets: Targets, progress: ProgressFn | None
) -> list[LayerSparsity]:
    modules = dict(weights_root(model).named_modules())
    lines = []
    for i, name in enumerate(targets.names):
        linear = modules[name]
        new, line = prune_linear(name, linear.weight, settings.pattern, "magnitude")
        with torch.no_grad():
            linear.weight.copy_(new)
        lines.append(line)
        if progress is not None:
            progress(i + 1, len(targets.names))
    return lines


def _calibrated(
    model: torch.nn.Module,
    settings: SparsifySettings,
    targets: Targets,
    calib_ids: torch.Tensor,
    progress: ProgressFn | None,
    device: str | torch.device = "cpu",
    checkpoint_dir: Path | None = None,
    fingerprint: str = "",
    warn: Callable[[str], None] = lambda msg: None,
) -> tuple[list[LayerSparsity], int]:
    """Wanda/SparseGPT through the shared driver: each linear sees its inputs as produced by the
    already-pruned sub-layers and layers before it. Pruning runs where the layer is (--device)."""
    method = (
        WandaMethod(settings)
        if settings.method == "wanda"
        else HessianMethod(_sparsegpt_fn(settings))
    )
    wanted = set(targets.names)
    result = calibrate_layers(
        model,
        calib_ids,
        method,
        device=device,
        ignore=lambda name: name not in wanted,
        checkpoint_dir=checkpoint_dir,
        fingerprint=fingerprint,
        progress=progress,
        warn=warn,
    )
    return [
        result.records[name] for name in targets.names if name in result.records
    ], result.resumed_layers


def _sparsegpt_fn(settings: SparsifySettings):
    def fn(name: str, linear: torch.nn.Linear, hessian: torch.Tensor) -> LayerSparsity:
        new, line = prune_linear(
            name,
            linear.weight,
            settings.pattern,
            "sparsegpt",
            hessian,
            dampening=settings.dampening,
            column_block=settings.column_block,
        )
        with torch.no_grad():
            linear.weight.copy_(new)
        return line

    return fn


class WandaMethod:
    """Driver method for Wanda: only the per-channel input norms, O(in_features) per linear
    (no in x in Hessian), then |W| * ||X_j|| pruning per sub-layer group."""

    def __init__(self, settings: SparsifySettings):
        self.settings = settings
        self.acc: dict[str, InputNormAccumulator] = {}
        self.most = 0  # the most tokens a linear of this layer has seen (driver.starved)

    def observe(self, name: str, x: torch.Tensor) -> None:
        if name not in self.acc:
            self.acc[name] = InputNormAccumulator(x.shape[-1], device=x.device)
        self.acc[name].add(x)
        self.most = max(self.most, self.acc[name].tokens)

    def process_group(
        self, layer_index: int, layer: torch.nn.Module, group: SubLayerGroup, names: list[str]
    ) -> dict:
        out = {}
        for name in names:
            linear = layer.get_submodule(relative_name(name))
            acc = self.acc.pop(name, None)
            # an expert (almost) no token reached: equal norms, i.e. magnitude pruning
            norms = torch.ones(linear.in_features) if starved(acc, self.most) else acc.norms()
            new, line = prune_linear(
                name, linear.weight, self.settings.pattern, "wanda", input_norms=norms
            )
            with torch.no_grad():
                linear.weight.copy_(new)
            out[name] = line
        return out

    def finish_layer(self, layer_index: int, layer: torch.nn.Module) -> dict:
        self.most = 0
        return {}
