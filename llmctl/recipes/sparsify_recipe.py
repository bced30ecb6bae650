"""`llmctl sparsify --recipe FILE`: the single-run recipe that sparsifies and then (optionally)
quantizes.

Owns: its document (`RecipeDoc`: unknown keys, wrong types and bad values are refused with one
line naming the field path, e.g. `recipe sparsify.pattern: ...`), `Recipe` / `load_recipe` and
`merge_args` (recipe values as defaults, explicit command-line flags win). Its sections are
llmctl.recipes.sections; running it is llmctl.recipes.sparsify_run; the defaults live in
llmctl.compress.args; the run's resolved settings are written back in this form by the sparsify
job (llmctl.compress.sparse.job.write_recipe). `llmctl recipe run` reads the same file as two
stages (llmctl.recipes.paths).

Format (see recipes/sparse-2of4-gptq-w4.yaml):
    calibration: {calib: FILE, eval_data: FILE, num_samples: 128, seq_len: 512}   # shared
    sparsify:    {method: sparsegpt, pattern: "2:4" | sparsity: 0.5, ignore: [...],
                  dampening, column_block}
    quantize:    {method: gptq, bits: 4, group_size: 64, symmetric, format, ignore: [...],
                  act_order, dampening, column_block}
`block_size` (the old name of column_block) still works in `sparsify`, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmctl.compress.args import SparsifyArgs
from llmctl.errors import UsageError
from llmctl.recipes.paths import read_yaml
from llmctl.recipes.schema import FORMAT_KEY
from llmctl.recipes.sections import (
    DEPRECATED,
    CalibrationSection,
    QuantizeSection,
    Section,
    SparsifySection,
    keys,
)

SECTIONS = ("calibration", "sparsify", "quantize")


class RecipeDoc(Section):
    calibration: CalibrationSection | None = None
    sparsify: SparsifySection
    quantize: QuantizeSection | None = None


_WANT_KEY = {"ignore": "a list of strings", "group_size": "a power of two, auto or channel"}
_WANT_TYPE = {  # what a value must be, by pydantic's error type
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
}
_SECTIONS = {
    "calibration": CalibrationSection,
    "sparsify": SparsifySection,
    "quantize": QuantizeSection,
}


def _message(err: dict) -> str:
    """One pydantic error as `recipe SECTION.KEY: what is wrong`."""
    loc, kind = err["loc"], err["type"]
    where = ".".join(str(p) for p in loc[:2])  # a list index or union member below: not named
    if loc[:1] == ("sparsify",) and (kind == "missing" or err.get("input") is None):
        return "a recipe needs a `sparsify` section"
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return f"recipe {where}: unknown section; allowed: {', '.join(SECTIONS)}"
        return f"recipe {where}: unknown key; allowed: {', '.join(keys(_SECTIONS[loc[0]]))}"
    if len(loc) == 1:
        return f"recipe {where}: must be a mapping of keys to values"
    if kind == "value_error":
        return f"recipe {where}: {err['msg'].removeprefix('Value error, ')}"
    if kind.endswith("_type") and (str(loc[1]) in _WANT_KEY or kind in _WANT_TYPE):
        want = f"must be {_WANT_KEY.get(str(loc[1])) or _WANT_TYPE[kind]}"
    else:
        want = err["msg"].replace("Input should be", "must be")
    return f"recipe {where}: {want}, got {err.get('input')!r}"


@dataclass
class Recipe:
    path: str
    calibration: dict[str, Any] = field(default_factory=dict)
    sparsify: dict[str, Any] = field(default_factory=dict)
    quantize: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # deprecation warnings, for the run to show


def _given(section: Section | None) -> dict[str, Any] | None:
    return None if section is None else section.model_dump(exclude_none=True)  # null: default


def load_recipe(path: Path) -> Recipe:
    """The recipe at `path`, validated; UsageError (one line, naming the field) when it is not."""
    doc = read_yaml(path)
    if not isinstance(doc, dict):
        raise UsageError(
            f"{path}: expected a mapping with `sparsify` (and optionally `quantize`, `calibration`)"
        )
    multi = FORMAT_KEY in doc or any(str(k).endswith("_stage") for k in doc)
    if multi:  # a multi-stage recipe, ours (llmctl.recipes.schema) or llm-compressor's
        raise UsageError(f"{path} is a multi-stage recipe: run it with `llmctl recipe run`")
    try:
        parsed = RecipeDoc.model_validate(doc)
    except ValidationError as e:
        raise UsageError(f"{path}: {_message(e.errors()[0])}") from None
    sparsify = _given(parsed.sparsify) or {}
    notes = []
    for old, new in DEPRECATED.items():
        if old in sparsify:
            value = sparsify.pop(old)
            sparsify.setdefault(new, value)
            notes.append(f"{path}: recipe sparsify.{old} is deprecated; use {new}")
    return Recipe(
        str(path), _given(parsed.calibration) or {}, sparsify, _given(parsed.quantize), notes
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
