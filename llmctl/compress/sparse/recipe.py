"""Recipes: a YAML file that sparsifies and then (optionally) quantizes in one run.

Owns: `Recipe` / `load_recipe` (validation with one-line errors), `merge_args` (recipe values as
defaults, explicit command-line flags win), and `run_recipe`: prune into a staging folder, quantize
that folder into the output with the quantize job, then check that every pruned weight is still
exactly zero after quantization (the GPTQ mask), failing loudly when it is not.

Format (see recipes/sparse-2of4-gptq-w4.yaml):
    calibration: {calib: FILE, eval_data: FILE, num_samples: 128, seq_len: 512}   # shared
    sparsify:    {method: sparsegpt, pattern: "2:4" | sparsity: 0.5, ignore: [...], dampening, block_size}
    quantize:    {method: gptq, bits: 4, group_size: 64, symmetric, format, ignore: [...], act_order, dampening}
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.compress.sparse.job import SparsifyArgs, SparsifyReport, run_sparsify
from llmctl.errors import LlmctlError, UsageError

CALIBRATION_KEYS = ("calib", "eval_data", "num_samples", "seq_len")
SPARSIFY_KEYS = ("method", "pattern", "sparsity", "ignore", "dampening", "block_size")
QUANTIZE_KEYS = ("method", "bits", "group_size", "symmetric", "format", "ignore", "act_order", "dampening")
STAGE_DIR = ".llmctl-sparse-stage"


@dataclass
class Recipe:
    path: str
    calibration: dict[str, Any] = field(default_factory=dict)
    sparsify: dict[str, Any] = field(default_factory=dict)
    quantize: dict[str, Any] | None = None


def _section(doc: dict, name: str, allowed: tuple[str, ...], path: Path) -> dict[str, Any] | None:
    sec = doc.get(name)
    if sec is None:
        return None
    if not isinstance(sec, dict):
        raise UsageError(f"{path}: `{name}` must be a mapping")
    unknown = sorted(set(sec) - set(allowed))
    if unknown:
        raise UsageError(f"{path}: unknown key {unknown[0]!r} in `{name}`; allowed: {', '.join(allowed)}")
    return dict(sec)


def load_recipe(path: Path) -> Recipe:
    import yaml

    if not path.is_file():
        raise UsageError(f"recipe {path} not found")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a mapping with `sparsify` (and optionally `quantize`, `calibration`)")
    unknown = sorted(set(doc) - {"calibration", "sparsify", "quantize"})
    if unknown:
        raise UsageError(f"{path}: unknown section {unknown[0]!r}; allowed: calibration, sparsify, quantize")
    sparsify = _section(doc, "sparsify", SPARSIFY_KEYS, path)
    if sparsify is None:
        raise UsageError(f"{path}: a recipe needs a `sparsify` section")
    if isinstance(sparsify.get("pattern"), int):  # YAML 1.1 reads an unquoted 2:4 as 124 (base 60)
        raise UsageError(f'{path}: quote the pattern, for example pattern: "2:4"')
    return Recipe(str(path), _section(doc, "calibration", CALIBRATION_KEYS, path) or {}, sparsify,
                  _section(doc, "quantize", QUANTIZE_KEYS, path))


def merge_args(recipe: Recipe | None, cli: dict[str, Any]) -> SparsifyArgs:
    """SparsifyArgs from the recipe, overridden by every command-line value that is not None."""
    values: dict[str, Any] = {}
    if recipe is not None:
        values.update(recipe.calibration)
        values.update(recipe.sparsify)
    given = {k: v for k, v in cli.items() if v is not None}
    if "pattern" in given or "sparsity" in given:  # a flag picks the kind of sparsity outright
        values.pop("pattern", None)
        values.pop("sparsity", None)
    values.update(given)
    names = {f.name for f in fields(SparsifyArgs)}
    return SparsifyArgs(**{k: v for k, v in values.items() if k in names})


@dataclass
class RecipeReport:
    sparsify: SparsifyReport
    quantize: Any | None  # llmctl.compress.quantize_job.QuantizeReport
    zeros_kept: bool | None  # every pruned weight still exactly zero after quantization
    recipe: str | None

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "sparsify": self.sparsify.to_dict(),
            "quantize": None if self.quantize is None else self.quantize.to_dict(),
            "zeros_kept_after_quantization": self.zeros_kept,
        }


def run_recipe(
    recipe: Recipe | None,
    args: SparsifyArgs,
    *,
    progress: Callable[[str, int, int], None] | None = None,
    warn: Callable[[str], None] = lambda msg: None,
) -> RecipeReport:
    """Sparsify (and quantize when the recipe says so) into args.output."""
    stage_progress = (lambda stage: (lambda d, t: progress(stage, d, t))) if progress else (lambda stage: None)
    if recipe is None or recipe.quantize is None:
        report = run_sparsify(args, progress=stage_progress("sparsify"), warn=warn)
        write_recipe(Path(args.output) / "recipe.yaml", args, None)
        return RecipeReport(report, None, None, None if recipe is None else recipe.path)

    from llmctl.compress.quantize_job import QuantizeArgs, run_quantize

    out = Path(args.output)
    if out.is_dir() and any(p.name != STAGE_DIR for p in out.iterdir()) and not args.overwrite:
        raise UsageError(f"output folder {out} is not empty; choose another -o or pass --overwrite")
    stage = out / STAGE_DIR
    q = dict(recipe.quantize)
    qargs = QuantizeArgs(
        model=str(stage), output=str(out), method=q.pop("method", "gptq"), calib=args.calib, eval_data=args.eval_data,
        num_samples=args.num_samples, seq_len=args.seq_len, device=args.device, overwrite=True, **q,
    ).resolve()  # check the quantize settings before spending time on pruning
    sparse_args = SparsifyArgs(**{**args.__dict__, "output": str(stage), "overwrite": True})
    s_report = run_sparsify(sparse_args, progress=stage_progress("sparsify"), warn=warn)
    pruned_masks = _pruned_masks(stage, [line["name"] for line in s_report.layers])
    q_report = run_quantize(qargs, progress=stage_progress("quantize"), warn=warn)
    shutil.rmtree(stage, ignore_errors=True)
    broken = zeros_not_kept(out, pruned_masks)
    if broken:
        raise LlmctlError(
            f"quantization refilled pruned weights in {len(broken)} layer(s) (first: {broken[0]}); "
            f"the output in {out} is not sparse. The quantize method must keep pruned weights at zero (GPTQ mask)"
        )
    write_recipe(out / "recipe.yaml", args, qargs)  # replaces quantize's own: the whole run, loadable by --recipe
    return RecipeReport(s_report, q_report, True, recipe.path)


def write_recipe(path: Path, args: SparsifyArgs, qargs: Any | None) -> None:
    """The resolved settings of this run in recipe form: `llmctl sparsify MODEL -o OUT --recipe path` repeats it."""
    import yaml

    doc: dict[str, Any] = {
        "calibration": {k: getattr(args, k) for k in CALIBRATION_KEYS},
        "sparsify": {k: getattr(args, k) for k in SPARSIFY_KEYS},
    }
    if qargs is not None:
        doc["quantize"] = {k: getattr(qargs, k) for k in QUANTIZE_KEYS}
    header = f"# llmctl sparsify: resolved settings of the run that wrote this folder (model: {args.model})\n"
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False))


def _pruned_masks(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """name -> bool mask (True = zero) of each pruned linear in a dense safetensors folder."""
    from llmctl.runtime.tensors import read_tensors

    tensors = read_tensors(folder)
    return {n: tensors[f"{n}.weight"] == 0 for n in names}


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
