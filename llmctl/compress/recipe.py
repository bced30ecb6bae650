"""Recipes: a YAML file that sparsifies and then (optionally) quantizes in one run.

Owns: the recipe's schema (pydantic models: unknown keys, wrong types and bad values are refused
with one line naming the field path, e.g. `recipe sparsify.pattern: ...`), `Recipe` /
`load_recipe`, `merge_args` (recipe values as defaults, explicit command-line flags win) and
`write_recipe` (a run's resolved settings in recipe form). Running one is
llmctl.compress.recipe_run; the defaults live in llmctl.compress.args.

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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmctl.compress.args import OBSERVERS, PRUNE_METHODS, QUANT_METHODS, SparsifyArgs
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.errors import UsageError
from llmctl.runtime.formats import FORMATS
from llmctl.runtime.formats.spec import BITS, BITS_TEXT, parse_group_size

SECTIONS = ("calibration", "sparsify", "quantize")
DEPRECATED = {"block_size": "column_block"}  # old key -> new key (sparsify section)


def _one_of(value: Any, allowed: tuple, what: str = "value") -> Any:
    if value is not None and value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(map(str, allowed))}")
    return value


def _rule(check, value: Any) -> Any:
    """A shared rule's UsageError as the ValueError pydantic reports with the field path."""
    if value is None:
        return value
    try:
        check(value)
    except UsageError as e:
        raise ValueError(str(e)) from None
    return value


class _Section(BaseModel):
    # strict: YAML's types are kept as written (no "8" for 8, no 1 for true)
    model_config = ConfigDict(extra="forbid", strict=True)


class CalibrationSection(_Section):
    calib: str | None = None
    eval_data: str | None = None
    num_samples: int | None = Field(None, ge=1)
    seq_len: int | None = Field(None, ge=2)


class SparsifySection(_Section):
    method: str | None = None
    pattern: str | None = None
    sparsity: float | None = None
    ignore: list[str] | None = None
    dampening: float | None = Field(None, gt=0, lt=1)
    column_block: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)  # deprecated: column_block

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        return _one_of(v, PRUNE_METHODS, "method")

    @field_validator("pattern", mode="before")
    @classmethod
    def _quoted(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):  # YAML 1.1 reads 2:4 as 124 (base 60)
            raise ValueError('quote the pattern, for example pattern: "2:4"')
        return v

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v):
        return _rule(lambda p: parse_pattern(p, None), v)

    @field_validator("sparsity")
    @classmethod
    def _sparsity(cls, v):
        return _rule(lambda s: parse_pattern(None, s), v)


class QuantizeSection(_Section):
    method: str | None = None
    bits: int | None = None
    group_size: int | str | None = None
    symmetric: bool | None = None
    format: str | None = None
    ignore: list[str] | None = None
    act_order: bool | None = None
    observer: str | None = None
    dampening: float | None = Field(None, gt=0, lt=1)
    column_block: int | None = Field(None, ge=1)

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        return _one_of(v, QUANT_METHODS, "method")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v):
        if v is not None and v not in BITS:
            raise ValueError(f"must be {BITS_TEXT}, got {v}")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v):
        return _one_of(v, FORMATS, "format")

    @field_validator("observer")
    @classmethod
    def _observer(cls, v):
        return _one_of(v, OBSERVERS, "observer")

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v):
        return _rule(parse_group_size, v)


class RecipeDoc(_Section):
    calibration: CalibrationSection | None = None
    sparsify: SparsifySection
    quantize: QuantizeSection | None = None


def keys(section: type[_Section]) -> tuple[str, ...]:
    """The keys a section takes (deprecated ones left out)."""
    return tuple(k for k in section.model_fields if k not in DEPRECATED)


CALIBRATION_KEYS = keys(CalibrationSection)
SPARSIFY_KEYS = keys(SparsifySection)
QUANTIZE_KEYS = keys(QuantizeSection)
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


def _given(section: _Section | None) -> dict[str, Any] | None:
    return None if section is None else section.model_dump(exclude_none=True)  # null: default


def load_recipe(path: Path) -> Recipe:
    """The recipe at `path`, validated; UsageError (one line, naming the field) when it is not."""
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
    multi = "llmctl_recipe" in doc or any(str(k).endswith("_stage") for k in doc)
    if multi:  # a multi-stage (llmctl.pipelines) or llm-compressor recipe
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


def write_recipe(path: Path, args: Any, qargs: Any | None, note: str | None = None) -> None:
    """The resolved settings of this run (SparsifyArgs, then QuantizeArgs or None) in recipe form:
    `llmctl sparsify MODEL -o OUT --recipe path` repeats it."""
    import yaml

    doc: dict[str, Any] = {
        "calibration": {k: getattr(args, k) for k in CALIBRATION_KEYS},
        "sparsify": {k: getattr(args, k) for k in SPARSIFY_KEYS},
    }
    if qargs is not None:
        doc["quantize"] = {k: getattr(qargs, k) for k in QUANTIZE_KEYS}
    header = (
        "# llmctl sparsify: resolved settings of the run that wrote this folder "
        f"(model: {args.model})\n"
    )
    path.write_text(header + (f"# {note}\n" if note else "") + yaml.safe_dump(doc, sort_keys=False))
