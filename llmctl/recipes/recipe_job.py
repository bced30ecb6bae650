"""`llmctl recipe run|validate` below the CLI: every stage checked, then each run in order.

Owns: `RecipeRequest` (the command's values), `load_plan` (read, translate, override, validate
and build every stage's job arguments before anything runs), `validate_recipe` and
`run_recipe_file`. The run's folder OUT holds `recipe.resolved.yaml` (this run's recipe with
every default filled in and absolute paths, `llmctl_recipe: 1` first: `llmctl recipe run` repeats
it; named so it is never taken for an llm-compressor recipe), `stages/KIND/` for each stage's
artifacts and `recipe_report.json`. A rerun compares its resolved recipe with the saved one:
stages before the first difference are kept and skipped when their own job finished, an
interrupted one resumes as its job resumes (layers, checkpoint, rows); stages from the first
difference on are rerun only with --overwrite (their folders are removed first).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from llmctl.compress.args import CALIBRATION_KEYS
from llmctl.errors import UsageError
from llmctl.recipes import paths as rp
from llmctl.recipes.schema import FORMAT_KEY, FORMAT_VERSION, STAGE_ORDER, validate_doc
from llmctl.recipes.stages import (
    COMPRESS_STAGES,
    MODEL_STAGES,
    Stage,
    StageHooks,
    build_args,
    finished,
    read_report,
    resolved,
    run_stage,
)

RESOLVED = "recipe.resolved.yaml"
HEADER = "# llmctl recipe: the resolved recipe of the run in this folder; "
REPORT = "recipe_report.json"
STAGES_DIR = "stages"
StageUI = Callable[[str], AbstractContextManager[StageHooks]]


@dataclass
class RecipeRequest:
    recipe: Path
    output: str | None = None  # -o (recipe run)
    model: str | None = None  # --model: overrides the recipe's
    calibration: dict[str, Any] = field(default_factory=dict)  # --calib, --num-samples...
    sets: list[str] = field(default_factory=list)  # --set KEY.PATH=VALUE
    device: str | None = None
    overwrite: bool = False


@dataclass
class Plan:
    recipe: Path
    syntax: str  # "llmctl", "llm-compressor" or "legacy"
    out: Path
    doc: dict[str, Any]  # the resolved recipe
    stages: list[Stage]


def _document(req: RecipeRequest) -> tuple[dict, dict[str, str], str]:
    """(the recipe as our document with the command line applied, origins, syntax)."""
    from llmctl.recipes.llmcompressor import translate

    raw = rp.read_yaml(req.recipe)
    syntax = rp.syntax_of(raw, req.recipe)
    origins: dict[str, str] = {}
    if syntax == "llm-compressor":
        doc, origins = translate(raw)
    else:
        doc = rp.from_legacy(raw) if syntax == "legacy" else raw
        rp.resolve_paths(doc, req.recipe.resolve().parent)
    if req.model is not None:
        local = Path(req.model).expanduser()
        doc["model"] = str(local.resolve()) if local.exists() else req.model
    for key, value in req.calibration.items():
        here = key in ("calib", "eval_data") and value is not None
        rp.set_value(doc, f"calibration.{key}", str(Path(value).resolve()) if here else value)
    for item in req.sets:
        key, value = rp.parse_set(item)
        rp.set_value(doc, key, value)
    return doc, origins, syntax


def load_plan(req: RecipeRequest) -> Plan:
    """The validated recipe and every stage's job arguments; raises UsageError, naming the key,
    before any stage runs."""
    doc, origins, syntax = _document(req)
    parsed = validate_doc(doc, origins)
    if parsed.model is None:
        raise UsageError("recipe: no model: give --model M (or `model:` in the recipe)")
    _check_source(parsed.model)
    out = Path(os.path.abspath(req.output)) if req.output else Path(".llmctl-recipe-check")
    calibration = parsed.calibration.model_dump(exclude_none=True) if parsed.calibration else {}
    given = parsed.stages.model_dump(by_alias=True, exclude_none=True)
    stages, model = [], parsed.model
    for kind in STAGE_ORDER:
        if kind not in given:
            continue
        folder = out / STAGES_DIR / kind
        stage = Stage(kind, folder, model, given[kind], source=parsed.model)
        try:
            calib = calibration if kind in COMPRESS_STAGES else {}
            stage.args = build_args(stage, calib, req.device)
        except UsageError as e:
            where = origins.get(f"stages.{kind}", f"stages.{kind}")
            raise UsageError(f"recipe {where}: {as_keys(str(e))}") from None
        stages.append(stage)
        model = str(folder) if kind in MODEL_STAGES else model
    _check_model(stages, parsed.model, origins.get("stages.quantize", "stages.quantize"))
    return Plan(req.recipe, syntax, out, _resolved_doc(parsed.model, stages), stages)


def as_keys(message: str) -> str:
    """A job's error in recipe words: `--group-size` is the key group_size there."""
    return re.sub(r"(?<![\w-])--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), message)


def _check_source(model: str) -> None:
    """A local model folder must be one now; a hub id (org/name) is fetched by the first stage."""
    from llmctl.runtime.resolve import resolve_model_path

    text = str(model)
    if Path(text).expanduser().exists() or text.count("/") != 1 or text.startswith((".", "~")):
        try:
            resolve_model_path(text)
        except UsageError as e:
            raise UsageError(f"recipe model: {e}") from None


def _check_model(stages: list[Stage], source: str, where: str) -> None:
    """The checks the source model's config decides (its layers' shapes, which sparsify keeps),
    before the first stage: quantize's group size and format."""
    from llmctl.compress.driver import make_ignore
    from llmctl.compress.quant.step import check_format_available, check_layers
    from llmctl.models.config import ModelConfig
    from llmctl.models.layout import decoder_linears

    config = Path(source) / "config.json"
    for stage in stages:
        if stage.kind != "quantize" or not config.is_file():
            continue
        a = replace(stage.args)  # check_layers resolves group_size "auto" in the copy
        ignored = make_ignore(a.ignore)
        linears = [t for t in decoder_linears(ModelConfig.from_file(config)) if not ignored(t[0])]
        try:
            check_format_available(a.format)
            check_layers(a, linears)
        except UsageError as e:
            raise UsageError(f"recipe {where}: {as_keys(str(e))}") from None


def _resolved_doc(model: str, stages: list[Stage]) -> dict[str, Any]:
    doc: dict[str, Any] = {FORMAT_KEY: FORMAT_VERSION, "model": model}
    for stage in stages:
        if stage.kind in COMPRESS_STAGES:
            doc["calibration"] = {k: getattr(stage.args, k) for k in CALIBRATION_KEYS}
    doc["stages"] = {stage.kind: resolved(stage) for stage in stages}
    return doc


def validate_recipe(req: RecipeRequest) -> Plan:
    """`recipe validate`: the whole plan, nothing run or written."""
    return load_plan(req)


def _previous(out: Path) -> dict | None:
    """The resolved recipe an earlier run left in `out` (None: a new folder); a folder that holds
    anything else is refused."""
    import yaml

    if not out.exists():
        return None
    if not out.is_dir():
        raise UsageError(f"-o {out} is a file, not a folder")
    saved = out / RESOLVED
    if saved.is_file() and saved.read_text(encoding="utf-8").startswith(HEADER):
        return yaml.safe_load(saved.read_text(encoding="utf-8"))
    if any(out.iterdir()):
        raise UsageError(
            f"-o {out} is not empty and holds no earlier `llmctl recipe run`; choose another -o"
        )
    return None


def _first_difference(prev: dict, doc: dict) -> tuple[int, str] | None:
    """(index of the first stage the change reaches, what changed), or None when unchanged."""
    kinds = list(doc["stages"])
    if prev.get("model") != doc["model"]:
        return 0, f"model: {prev.get('model')} -> {doc['model']}"
    old = list((prev.get("stages") or {}).items())
    for i, (kind, settings) in enumerate(doc["stages"].items()):
        if i >= len(old) or old[i][0] != kind:
            return i, f"stages: {', '.join(k for k, _ in old)} -> {', '.join(kinds)}"
        if kind in COMPRESS_STAGES and prev.get("calibration") != doc.get("calibration"):
            return i, _diff("calibration", prev.get("calibration") or {}, doc["calibration"])
        if old[i][1] != settings:
            return i, _diff(f"stages.{kind}", old[i][1] or {}, settings)
    return None


def _diff(where: str, old: dict, new: dict) -> str:
    for key in list(new) + [k for k in old if k not in new]:
        if old.get(key) != new.get(key):
            return f"{where}.{key}: {old.get(key)!r} -> {new.get(key)!r}"
    return where


def _write_resolved(plan: Plan) -> None:
    import yaml

    from llmctl.runtime.output_dir import writing

    text = HEADER + f"rerun with: llmctl recipe run {RESOLVED} -o FOLDER\n"
    text += f"# from {plan.recipe} ({plan.syntax} syntax)\n"
    text += yaml.safe_dump(plan.doc, sort_keys=False)
    with writing(f"-o {plan.out}"):
        (plan.out / STAGES_DIR).mkdir(parents=True, exist_ok=True)
        tmp = plan.out / f".{RESOLVED}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, plan.out / RESOLVED)


def _prepare(plan: Plan, overwrite: bool, info: Callable[[str], None]) -> None:
    """Keep what an earlier run of the same recipe finished; clear what a changed one must redo."""
    from llmctl.runtime.output_dir import check_disjoint

    source = Path(plan.doc["model"]).expanduser()
    if source.exists():
        check_disjoint(source, plan.out)
    prev = _previous(plan.out)
    change = None if prev is None else _first_difference(prev, plan.doc)
    if change is not None:
        first, what = change
        redo = [s for s in plan.stages[first:] if s.folder.exists()]
        if redo and not overwrite:
            raise UsageError(
                f"{plan.out} holds a run of another recipe ({what}); pass --overwrite to rerun "
                f"from stage {plan.stages[first].kind}, or choose another -o"
            )
        for stage in redo:
            info(f"stage {stage.kind}: the recipe changed ({what}); running it again")
            shutil.rmtree(stage.folder)
    _write_resolved(plan)


def run_recipe_file(
    req: RecipeRequest,
    stage_ui: StageUI | None = None,
    info: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Run every stage of the recipe in order into req.output; returns the run's report."""
    plan = load_plan(req)
    _prepare(plan, req.overwrite, info)
    entries = []
    for stage in plan.stages:
        if finished(stage):
            info(f"stage {stage.kind}: finished earlier ({stage.folder}); skipped")
            entries.append(_entry(stage, "finished earlier", read_report(stage)))
            continue
        stage.folder.mkdir(parents=True, exist_ok=True)
        with (stage_ui or (lambda kind: nullcontext(StageHooks())))(stage.kind) as hooks:
            report = run_stage(stage, hooks)
        status = "finished earlier" if report.get("already_complete") else "ran"
        entries.append(_entry(stage, status, report))
    doc = {
        "schema": "llmctl.recipe",
        "schema_version": 1,
        "recipe": str(plan.recipe),
        "output": str(plan.out),
        "resolved_recipe": str(plan.out / RESOLVED),
        "stages": entries,
    }
    (plan.out / REPORT).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def _entry(stage: Stage, status: str, report: dict | None) -> dict[str, Any]:
    return {"stage": stage.kind, "folder": str(stage.folder), "status": status, "report": report}
