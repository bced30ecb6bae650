"""Running `llmctl sparsify` with or without a recipe (llmctl.recipes.sparsify_recipe): the prune
step, then the recipe's quantize step when it has one, through the one-shot pipeline
(llmctl.compress.oneshot). It is also the multi-stage recipe's sparsify stage.

Owns: `RecipeReport`, `run_recipe` and `zeros_not_kept`. Both steps are checked against the
model's config before any work (a later step's bad setting is refused before pruning); the
quantize step calibrates on the pruned model and, before the output moves into place, every
pruned weight must still be exactly zero in the written files (the GPTQ mask): when one is not,
the run fails loudly and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmctl.compress.args import QuantizeArgs, SparsifyArgs
from llmctl.compress.oneshot import Oneshot, StageProgress, Step, run_oneshot
from llmctl.compress.quant.step import QuantizeStep
from llmctl.compress.quantize_job import QuantizeReport, quantize_report
from llmctl.compress.sparse.job import SparsifyReport, sparsify_report, write_recipe
from llmctl.compress.sparse.step import PruneStep
from llmctl.errors import LlmctlError
from llmctl.recipes.sparsify_recipe import Recipe


@dataclass
class RecipeReport:
    sparsify: SparsifyReport
    quantize: QuantizeReport | None
    zeros_kept: bool | None  # every pruned weight still exactly zero after quantization
    recipe: str | None

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "sparsify": self.sparsify.to_dict(),
            "quantize": None if self.quantize is None else self.quantize.to_dict(),
            "zeros_kept_after_quantization": self.zeros_kept,
        }


def quantize_args(recipe: Recipe, args: SparsifyArgs) -> QuantizeArgs:
    """The quantize step's arguments: the recipe's `quantize` section and the shared settings."""
    q = dict(recipe.quantize or {})
    return QuantizeArgs(
        model=args.model,
        output=args.output,
        method=q.pop("method", "gptq"),
        calib=args.calib,
        eval_data=args.eval_data,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        device=args.device,
        overwrite=args.overwrite,
        report_json=args.report_json,
        max_shard_size=args.max_shard_size,
        **q,
    )


def run_recipe(
    recipe: Recipe | None,
    args: SparsifyArgs,
    *,
    progress: StageProgress | None = None,
    warn: Callable[[str], None] = lambda msg: None,
) -> RecipeReport:
    """Sparsify (and quantize when the recipe says so) into args.output."""
    for note in recipe.notes if recipe is not None else ():
        warn(note)
    prune = PruneStep(args)
    steps: list[Step] = [prune]
    quantize = None
    if recipe is not None and recipe.quantize is not None:
        quantize = QuantizeStep(quantize_args(recipe, args))
        prune.keep_masks = True
        steps.append(quantize)

    def finish(folder: Path, job: Oneshot) -> None:
        if quantize is not None:
            broken = zeros_not_kept(folder, prune.masks)
            if broken:
                raise LlmctlError(
                    f"quantization refilled pruned weights in {len(broken)} layer(s) "
                    f"(first: {broken[0]}); nothing was written to {args.output}. The quantize "
                    "method must keep pruned weights at zero (GPTQ mask)"
                )
        qargs = None if quantize is None else quantize.args
        note = None if quantize is None else quantize.group_note
        write_recipe(folder / "recipe.yaml", args, qargs, note)  # the whole run, for --recipe

    inputs = (Path(recipe.path),) if recipe is not None else ()
    job = run_oneshot(args, steps, progress=progress, warn=warn, finish=finish, inputs=inputs)
    s_report = sparsify_report(job, job.outcomes[0])
    if quantize is None:
        return RecipeReport(s_report, None, None, None if recipe is None else recipe.path)
    return RecipeReport(s_report, quantize_report(job, job.outcomes[1]), True, recipe.path)


def zeros_not_kept(quantized: Path, masks: dict[str, torch.Tensor]) -> list[str]:
    """Names of the linears whose dequantized weight is non-zero somewhere the mask says pruned."""
    from llmctl.runtime.formats import read_quantized

    _, linears, dense = read_quantized(quantized)
    broken = []
    for name, mask in masks.items():
        if name in linears:
            w = linears[name].dequantize()
        else:  # left unquantized (--ignore in the quantize section): stored dense
            w = dense[f"{name}.weight"]
        if bool((w[mask] != 0).any()):
            broken.append(name)
    return broken
