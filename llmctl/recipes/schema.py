"""The multi-stage recipe format, validated with pydantic before anything runs.

Owns: the schema (`RecipeFile`: `llmctl_recipe: 1`, an optional `model`, the `calibration`
settings quantize and sparsify share, and `stages`, a mapping of stage kinds in the order
sparsify, quantize, distill, eval, run-batch), `STAGE_ORDER`, `PATH_KEYS` (the keys that name
files) and `validate_doc`, which turns pydantic's first error into one line naming the key's
path (`recipe stages.quantize.bits: must be 2, 3, 4 or 8, got 5`). The sparsify, quantize and
calibration sections are the ones `llmctl sparsify --recipe` reads too (llmctl.recipes.sections);
distill's keys are DistillArgs' fields. The file is read with yaml.safe_load (llmctl.recipes.paths).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal, Optional, get_type_hints

from pydantic import BaseModel, Field, ValidationError, create_model

from llmctl.errors import UsageError
from llmctl.recipes.sections import CalibrationSection, QuantizeSection, Section, SparsifySection
from llmctl.train.args import DistillArgs

FORMAT_KEY = "llmctl_recipe"  # first key of ours: never mistaken for an llm-compressor recipe
FORMAT_VERSION = 1
STAGE_ORDER = ("sparsify", "quantize", "distill", "eval", "run-batch")
# keys naming files: relative ones are read beside the recipe (llmctl.recipes.paths)
PATH_KEYS = (
    ("calibration", "calib"),
    ("calibration", "eval_data"),
    ("stages", "distill", "data"),
    ("stages", "distill", "eval_data"),
    ("stages", "distill", "student_config"),
    ("stages", "distill", "cache_teacher"),
    ("stages", "eval", "data"),
    ("stages", "run-batch", "input"),
)
MODEL_KEYS = (("model",), ("stages", "distill", "student"))  # a folder beside it, or a hub id
# DistillArgs fields a recipe does not set: the recipe run does (teacher, output) or the command
DISTILL_NOT_IN_RECIPE = ("teacher", "output", "resume", "overwrite", "report_json", "device")


class SparsifyStage(SparsifySection):
    evaluate: bool | None = None  # perplexity before and after (sparsify --eval/--no-eval)


def _distill_fields() -> dict[str, Any]:
    hints = get_type_hints(DistillArgs)
    out: dict[str, Any] = {}
    for f in fields(DistillArgs):
        if f.name in DISTILL_NOT_IN_RECIPE:
            continue
        out[f.name] = (str, ...) if f.name == "data" else (Optional[hints[f.name]], None)
    # a student of this share of the teacher's layers (resolved into student_layers)
    out["student_fraction"] = (Optional[float], Field(None, gt=0, le=1))
    return out


DistillStage = create_model("DistillStage", __base__=Section, **_distill_fields())


class EvalStage(Section):
    data: str
    seq_len: int | None = Field(None, ge=2)
    stride: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=2)
    kl_to_source: bool | None = None  # mean KL(source model || this model); default true
    dtype: str | None = None


SAMPLING_KEYS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
)  # fmt: skip
ENGINE_KEYS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
    "enable_prefix_caching", "batch_invariant",
)  # fmt: skip


class RunBatchStage(Section):
    input: str
    input_format: str | None = None
    prompt_column: str | None = None
    id_column: str | None = None
    messages_column: str | None = None
    include_token_ids: bool | None = None
    unordered: bool | None = None
    max_errors: int | None = Field(None, ge=0)
    max_in_flight: int | None = Field(None, ge=1)
    dtype: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool | None = None
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    enable_prefix_caching: bool | None = None
    batch_invariant: bool | None = None


class Stages(Section):
    sparsify: SparsifyStage | None = None
    quantize: QuantizeSection | None = None
    distill: DistillStage | None = None  # type: ignore[valid-type]
    eval: EvalStage | None = None
    run_batch: RunBatchStage | None = Field(None, alias="run-batch")


class RecipeFile(Section):
    llmctl_recipe: Literal[1]
    model: str | None = None
    calibration: CalibrationSection | None = None
    stages: Stages


_WANT_TYPE = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping of keys to values",
    "model_type": "a mapping of keys to values",
    "model_attributes_type": "a mapping of keys to values",
}


def _walk(loc: tuple) -> tuple[list[str], type[BaseModel]]:
    """(the key path pydantic's `loc` names, the model holding its last key)."""
    model: type[BaseModel] = RecipeFile
    path: list[str] = []
    for part in loc:
        by_alias = {(f.alias or name): f for name, f in model.model_fields.items()}
        if not isinstance(part, str) or part not in by_alias:
            break  # a union member or a list index below the key: not named
        path.append(part)
        inner = _model_of(by_alias[part].annotation)
        if inner is None:
            break
        model = inner
    return path, model


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _keys(model: type[BaseModel]) -> str:
    return ", ".join(
        f.alias or name for name, f in model.model_fields.items() if name != "block_size"
    )


def error_line(err: dict, origins: dict[str, str]) -> str:
    """One pydantic error as `recipe KEY.PATH: what is wrong` (`origins`: our key path -> the
    key of the file the user wrote, for a translated llm-compressor recipe)."""
    loc, kind = tuple(err["loc"]), err["type"]
    path, _ = _walk(loc)
    if kind == "extra_forbidden":
        _, holder = _walk(loc[:-1])
        where = ".".join(map(str, loc))
        return f"recipe {origins.get(where, where)}: unknown key; allowed: {_keys(holder)}"
    where = ".".join(path)
    where = origins.get(where, where) or "(top level)"
    if kind == "missing":
        return f"recipe {where}: required key missing"
    if kind == "literal_error" and path == [FORMAT_KEY]:
        return f"recipe {where}: must be {FORMAT_VERSION} (the only version of the format)"
    if kind == "value_error":
        return f"recipe {where}: {err['msg'].removeprefix('Value error, ')}"
    want = _WANT_TYPE.get(kind)
    text = f"must be {want}" if want else err["msg"].replace("Input should be", "must be")
    return f"recipe {where}: {text}, got {err.get('input')!r}"


def validate_doc(doc: dict, origins: dict[str, str] | None = None) -> RecipeFile:
    """The parsed recipe, or UsageError naming the first bad key."""
    stages = doc.get("stages")
    if isinstance(stages, dict):
        kinds = [k for k in stages if k in STAGE_ORDER]
        if kinds != sorted(kinds, key=STAGE_ORDER.index):
            raise UsageError(
                f"recipe stages: {', '.join(kinds)} are out of order; stages run in the order "
                f"{', '.join(STAGE_ORDER)}: list them so"
            )
        if not stages:
            raise UsageError(f"recipe stages: empty; give at least one of {', '.join(STAGE_ORDER)}")
    try:
        return RecipeFile.model_validate(doc)
    except ValidationError as e:
        raise UsageError(error_line(e.errors()[0], origins or {})) from None
