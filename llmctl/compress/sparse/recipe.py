"""Recipes: a YAML file that sparsifies and then (optionally) quantizes in one run.

Owns: `Recipe` / `load_recipe` (keys and value types, with one-line errors), `merge_args` (recipe
values as defaults, explicit command-line flags win), and `run_recipe`: check both stages against
the model's config before any work (a later stage's bad setting is refused before pruning), prune
into a staging folder inside the output's work folder, quantize that into the output with the
quantize job, and check that every pruned weight is still exactly zero after quantization (the
GPTQ mask) before the output moves into place, failing loudly (and writing nothing) when it is not.

Format (see recipes/sparse-2of4-gptq-w4.yaml):
    calibration: {calib: FILE, eval_data: FILE, num_samples: 128, seq_len: 512}   # shared
    sparsify:    {method: sparsegpt, pattern: "2:4" | sparsity: 0.5, ignore: [...], dampening, block_size}
    quantize:    {method: gptq, bits: 4, group_size: 64, symmetric, format, ignore: [...], act_order, dampening}
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.compress.sparse.job import SparsifyArgs, SparsifyReport, run_sparsify
from llmctl.errors import LlmctlError, UsageError

CALIBRATION_KEYS = ("calib", "eval_data", "num_samples", "seq_len")
SPARSIFY_KEYS = ("method", "pattern", "sparsity", "ignore", "dampening", "block_size")
QUANTIZE_KEYS = (
    "method",
    "bits",
    "group_size",
    "symmetric",
    "format",
    "ignore",
    "act_order",
    "dampening",
)
STAGE_DIR = "sparse-stage"  # inside the output's work folder
_TYPES: dict[str, tuple[type, ...]] = {
    "calib": (str,),
    "eval_data": (str,),
    "num_samples": (int,),
    "seq_len": (int,),
    "method": (str,),
    "pattern": (str,),
    "sparsity": (float, int),
    "ignore": (list,),
    "dampening": (float, int),
    "block_size": (int,),
    "bits": (int,),
    "group_size": (int, str),
    "symmetric": (bool,),
    "format": (str,),
    "act_order": (bool,),
}


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
    unknown = sorted(set(sec) - set(allowed), key=str)
    if unknown:
        raise UsageError(
            f"{path}: unknown key {unknown[0]!r} in `{name}`; allowed: {', '.join(allowed)}"
        )
    if isinstance(sec.get("pattern"), int):  # YAML 1.1 reads an unquoted 2:4 as 124 (base 60)
        raise UsageError(f'{path}: quote the pattern, for example pattern: "2:4"')
    for key, value in sec.items():
        _check_type(path, f"{name}.{key}", value, _TYPES[key])
    return {k: v for k, v in sec.items() if v is not None}  # null: the default


def _check_type(path: Path, key: str, value: Any, types: tuple[type, ...]) -> None:
    if value is None:
        return
    ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
    if ok and types == (list,):
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        want = "a list of strings" if types == (list,) else " or ".join(t.__name__ for t in types)
        raise UsageError(f"{path}: `{key}` must be {want}, got {value!r}")


def load_recipe(path: Path) -> Recipe:
    import yaml

    if not path.is_file():
        raise UsageError(f"recipe {path} not found")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise UsageError(
            f"{path}: expected a mapping with `sparsify` (and optionally `quantize`, `calibration`)"
        )
    unknown = sorted(set(doc) - {"calibration", "sparsify", "quantize"})
    if unknown:
        raise UsageError(
            f"{path}: unknown section {unknown[0]!r}; allowed: calibration, sparsify, quantize"
        )
    sparsify = _section(doc, "sparsify", SPARSIFY_KEYS, path)
    if sparsify is None:
        raise UsageError(f"{path}: a recipe needs a `sparsify` section")
    return Recipe(
        str(path),
        _section(doc, "calibration", CALIBRATION_KEYS, path) or {},
        sparsify,
        _section(doc, "quantize", QUANTIZE_KEYS, path),
    )


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
    stage_progress = (
        (lambda stage: lambda d, t: progress(stage, d, t)) if progress else (lambda stage: None)
    )
    warn = _once(warn)
    if recipe is not None:
        from llmctl.compress.output_dir import check_output_file

        check_output_file(
            args.report_json, "--report-json", (Path(recipe.path),), create_parents=True
        )
    if recipe is None or recipe.quantize is None:
        report = run_sparsify(args, progress=stage_progress("sparsify"), warn=warn)
        return RecipeReport(report, None, None, None if recipe is None else recipe.path)

    from llmctl.compress.output_dir import OutputFolder
    from llmctl.compress.quantize_job import run_quantize

    qargs, note = _check_quantize_stage(recipe, args, warn)
    stage = OutputFolder.at(args.output).work / STAGE_DIR
    qargs.model = str(stage)
    sparse_args = SparsifyArgs(
        **{**args.__dict__, "output": str(stage), "overwrite": True, "report_json": None}
    )
    s_report = run_sparsify(sparse_args, progress=stage_progress("sparsify"), warn=warn)
    pruned_masks = _pruned_masks(stage, [line["name"] for line in s_report.layers])

    def finish(folder: Path) -> None:
        broken = zeros_not_kept(folder, pruned_masks)
        if broken:
            raise LlmctlError(
                f"quantization refilled pruned weights in {len(broken)} layer(s) "
                f"(first: {broken[0]}); nothing was written to {args.output}. The quantize "
                "method must keep pruned weights at zero (GPTQ mask)"
            )
        write_recipe(folder / "recipe.yaml", args, qargs, note)  # the whole run, for --recipe

    q_report = run_quantize(qargs, progress=stage_progress("quantize"), warn=warn, finish=finish)
    q_report.group_size_note = note
    return RecipeReport(s_report, q_report, True, recipe.path)


def _once(warn: Callable[[str], None]) -> Callable[[str], None]:
    """warn, skipping repeats (both stages check the same data and options)."""
    seen: set[str] = set()

    def once(msg: str) -> None:
        if msg not in seen:
            seen.add(msg)
            warn(msg)

    return once


def _check_quantize_stage(recipe: Recipe, args: SparsifyArgs, warn: Callable[[str], None]):
    """Both stages' checks against the model's config, before pruning: returns the quantize
    stage's resolved arguments and its group-size note."""
    from llmctl.compress.driver import make_ignore
    from llmctl.compress.job_common import prepare, settle
    from llmctl.compress.quantize_job import QuantizeArgs, check_format_available, check_layers

    args.resolve()
    q = dict(recipe.quantize or {})
    qargs = QuantizeArgs(
        model=None,
        output=args.output,
        method=q.pop("method", "gptq"),
        calib=args.calib,
        eval_data=args.eval_data,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        device=args.device,
        overwrite=args.overwrite,
        report_json=args.report_json,
        **q,
    ).resolve()
    prep = prepare(args)  # the output folder, inputs and model
    check_format_available(qargs.format)
    ignored = make_ignore(qargs.ignore)
    note = check_layers(qargs, [t for t in prep.linears if not ignored(t[0])])
    settle(args, prep, warn)
    qargs.seq_len = args.seq_len
    if note:
        warn(note)
    return qargs, note


def write_recipe(
    path: Path, args: SparsifyArgs, qargs: Any | None, note: str | None = None
) -> None:
    """The resolved settings of this run in recipe form: `llmctl sparsify MODEL -o OUT --recipe path` repeats it."""
    import yaml

    doc: dict[str, Any] = {
        "calibration": {k: getattr(args, k) for k in CALIBRATION_KEYS},
        "sparsify": {k: getattr(args, k) for k in SPARSIFY_KEYS},
    }
    if qargs is not None:
        doc["quantize"] = {k: getattr(qargs, k) for k in QUANTIZE_KEYS}
    header = f"# llmctl sparsify: resolved settings of the run that wrote this folder (model: {args.model})\n"
    path.write_text(header + (f"# {note}\n" if note else "") + yaml.safe_dump(doc, sort_keys=False))


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
