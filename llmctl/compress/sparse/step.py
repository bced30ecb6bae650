"""The prune step of the one-shot pipeline (llmctl.compress.oneshot): magnitude, Wanda, SparseGPT.

Owns: `PruneStep` (checks against the model's config, the whole-model pass of
llmctl.compress.sparse.model, the `sparsity_config` entry and the dense output), and
`check_targets` (a run that would prune nothing is refused before loading).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.compress.args import SparsifyArgs
from llmctl.compress.driver import make_ignore
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.compress.sparse.model import (
    SparsifyResult,
    SparsifySettings,
    Targets,
    sparsify_model,
    target_linears,
)
from llmctl.compress.sparse.prune import needs_calibration
from llmctl.errors import UsageError
from llmctl.models.linears import weights_root


def check_targets(args: SparsifyArgs, linears: list[tuple[str, int, int]]) -> None:
    """Refuse, before loading, a run that would prune nothing (from the config's layer shapes)."""
    pattern = parse_pattern(args.pattern, args.sparsity)
    ignored = make_ignore(args.ignore)
    if not any(not ignored(name) and pattern.fits(k) for name, _, k in linears):
        raise UsageError(
            "no linear layer left to prune (--ignore, or no layer width divisible by "
            "the group width)"
        )


def decoder_sparsity(model: torch.nn.Module) -> float:
    """Zeros / weights over every decoder linear (pruned or not)."""
    from llmctl.models.linears import decoder_modules

    zeros = total = 0
    for _, module, _ in decoder_modules(weights_root(model)):
        zeros += int((module.weight == 0).sum())
        total += module.weight.numel()
    return zeros / max(1, total)


class PruneStep:
    """Pruning of the decoder linears to args.pattern (or args.sparsity), not args.ignore's."""

    kind = "sparsify"

    def __init__(self, args: SparsifyArgs):
        self.args = args
        self.calibrates = self.needs_data = needs_calibration(args.method)
        self.measures = args.evaluate
        self.targets = Targets(names=[])
        self.result: SparsifyResult | None = None
        self.model_sparsity = 0.0  # zeros / weights over every decoder linear, after `run`
        self.keep_masks = False  # keep `masks` (a later step must keep the zeros)
        self.masks: dict[str, torch.Tensor] = {}  # pruned linear -> bool [out, in], True = zero
        self.kept_dense: list[str] = []  # never pruned whatever --ignore says (after `plan`)
        self.spelled: dict[str, str] = {}  # decoder linear -> its checkpoint name (after `plan`)

    @property
    def settings(self) -> SparsifySettings:
        a = self.args
        pattern = parse_pattern(a.pattern, a.sparsity)
        return SparsifySettings(pattern, a.method, tuple(a.ignore), a.dampening, a.column_block)

    def resolve(self) -> None:
        self.args.resolve()

    def check(self, prep) -> list[str]:
        check_targets(self.args, prep.linears)
        raw = prep.config.raw
        if raw.get("quantization_config"):
            raise UsageError(
                f"{prep.model_path} is quantized; sparsify the unquantized model, "
                "then quantize the result"
            )
        if raw.get("sparsity_config"):
            return [
                f"{prep.model_path} is already sparse ({raw['sparsity_config'].get('pattern')}); "
                "pruning it again"
            ]
        return []

    def plan(self, model: torch.nn.Module, warn: Callable[[str], None]) -> None:
        from llmctl.models.linears import checkpoint_names, decoder_modules, kept_dense

        self.kept_dense = kept_dense(model)  # routers, gates, fused experts: the ignore list
        root = weights_root(model)
        # module name -> checkpoint name (mixtral's block_sparse_moe), for sparsity_config
        self.spelled = checkpoint_names(root, [n for n, _, _ in decoder_modules(root)])
        self.targets = target_linears(model, self.settings)
        for name, why in self.targets.skipped.items():
            if not why.startswith("ignored"):
                warn(f"{name} stays dense: {why}")

    def run(self, model: torch.nn.Module, calib_ids, ctx) -> SparsifyResult:
        self.result = sparsify_model(
            model,
            self.settings,
            calib_ids if self.calibrates else None,
            ctx.progress,
            device=ctx.device,
            checkpoint_dir=ctx.checkpoint_dir,
            warn=ctx.warn,
            fingerprint=ctx.fingerprint,
        )
        self.model_sparsity = decoder_sparsity(model)  # before a later step changes the model
        if self.keep_masks:
            modules = dict(weights_root(model).named_modules())
            self.masks = {
                line.name: (modules[line.name].weight == 0).cpu() for line in self.result.lines
            }
        return self.result

    @property
    def global_sparsity(self) -> float:
        """Zeros / weights over the pruned linears (after `run`)."""
        lines = self.result.lines if self.result is not None else []
        pruned = sum(line.sparsity * line.shape[0] * line.shape[1] for line in lines)
        return pruned / max(1, sum(line.shape[0] * line.shape[1] for line in lines))

    def review(self, perplexity_after: float | None) -> list[str]:
        return []

    def config_entry(self) -> dict[str, Any]:
        from llmctl.compress.sparse.export import sparsity_config

        a = self.args
        ignore = [*a.ignore, *self.kept_dense]
        lines = self.result.lines if self.result is not None else []
        per_layer = {self.spelled.get(line.name, line.name): line.sparsity for line in lines}
        meta = sparsity_config(
            self.settings.pattern, a.method, per_layer, ignore, self.global_sparsity
        )
        return {"sparsity_config": meta}

    def write(self, folder: Path, rt, extra_config: dict[str, Any], out_dtype) -> None:
        """A dense HF folder in the source dtype, the zeros stored as zeros."""
        from llmctl.compress.sparse.export import save_dense_model

        save_dense_model(
            rt.model, rt.config.raw, rt.model_path, folder, extra_config, self.args.max_shard_size
        )
