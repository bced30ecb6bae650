"""One stage of a recipe: its typed arguments, whether its own job says it finished, and its run.

Owns: `Stage`, `StageHooks` (what the command lends a stage: warnings, progress, run-batch's UI),
`build_args` (the recipe's values as the job's own arguments: SparsifyArgs, QuantizeArgs,
DistillArgs, EvalRequest, BatchOptions, each checked by the job's own rules), `resolved` (those
arguments back in recipe form, defaults filled in), `finished` (read from what each job leaves:
quantize's and sparsify's completed folder with its recipe.yaml, distill's report; eval's record;
run-batch decides for itself from its state file) and `run_stage`, which calls the function the
command calls. Each stage writes into OUT/stages/KIND/; every stage but distill (which writes
distill_report.json itself) leaves its report there as report.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from llmctl.batch.options import BatchOptions, default_sampling
from llmctl.compress.args import QuantizeArgs, SparsifyArgs
from llmctl.errors import LlmctlError, UsageError
from llmctl.profiling.eval_job import EvalRequest
from llmctl.recipes.schema import (
    DISTILL_NOT_IN_RECIPE,
    ENGINE_KEYS,
    SAMPLING_KEYS,
    EvalStage,
    RunBatchStage,
    SparsifyStage,
)
from llmctl.recipes.sections import QuantizeSection
from llmctl.train.args import DistillArgs

REPORT = "report.json"
BATCH_OUTPUT = "output.jsonl"
MODEL_STAGES = ("sparsify", "quantize", "distill")  # the stages that write a model
COMPRESS_STAGES = ("sparsify", "quantize")  # they read the shared calibration settings


@dataclass
class StageHooks:
    """What the command lends one stage (all optional: silent by default)."""

    warn: Callable[[str], None] = lambda message: None
    progress: Callable[[str, int, int], None] | None = None  # (label, done, total)
    train: Callable[[int, int, dict], None] | None = None  # distill's (step, steps, metrics)
    batch_ui: Any = None  # llmctl.batch.session.BatchUI for run-batch


@dataclass
class Stage:
    kind: str  # one of llmctl.recipes.schema.STAGE_ORDER
    folder: Path  # OUT/stages/KIND
    model: str  # the model it reads: the source, or the folder of the model stage before it
    settings: dict[str, Any]  # the recipe's values (unset keys left out)
    args: Any = None  # the job's typed arguments (build_args)
    source: str = ""  # the recipe's input model (eval's KL reference)
    notes: list[str] = field(default_factory=list)


def build_args(stage: Stage, calibration: dict[str, Any], device: str | None) -> Any:
    """The job's arguments from the recipe's values, checked by the job's own rules."""
    s, dev = dict(stage.settings), ({"device": device} if device else {})
    out, kind = str(stage.folder), stage.kind
    if kind == "sparsify":
        old = s.pop("block_size", None)
        if old is not None:
            s.setdefault("column_block", old)
            stage.notes.append("recipe stages.sparsify.block_size is deprecated; use column_block")
        return SparsifyArgs(model=stage.model, output=out, **calibration, **s, **dev).resolve()
    if kind == "quantize":
        method = s.pop("method", "gptq")
        return QuantizeArgs(stage.model, out, method, **calibration, **s, **dev).resolve()
    if kind == "distill":
        fraction = s.pop("student_fraction", None)
        if fraction is not None:
            s["student_layers"] = _student_layers(stage.source, fraction, s)
        return DistillArgs(teacher=stage.model, output=out, **s, **dev).resolve()
    if kind == "eval":
        return _eval_request(stage, s, dev)
    return _batch_options(stage, s, dev)


def _student_layers(source: str, fraction: float, s: dict[str, Any]) -> int:
    """student_fraction of the source model's layers, at least one (sparsify and quantize keep
    the layer count, so the teacher has as many)."""
    from llmctl.models.config import ModelConfig

    if "student_layers" in s or "student" in s or "student_config" in s:
        raise UsageError("student_fraction chooses the student: drop student_layers/student")
    config = Path(source) / "config.json"
    if not config.is_file():
        raise UsageError(f"student_fraction needs the model's config.json ({config} not found)")
    return max(1, round(ModelConfig.from_file(config).num_layers * fraction))


def _eval_request(stage: Stage, s: dict[str, Any], dev: dict) -> EvalRequest:
    from llmctl.runtime.output_dir import check_input_file

    check_input_file(s["data"], "data")
    kl = s.pop("kl_to_source", True)
    return EvalRequest(data=Path(s.pop("data")), reference=stage.source if kl else None, **s, **dev)


def _batch_options(stage: Stage, s: dict[str, Any], dev: dict) -> BatchOptions:
    from llmctl.engine.config import EngineConfig
    from llmctl.runtime.output_dir import check_input_file

    check_input_file(s["input"], "input")
    sampling = {k: s.pop(k) for k in SAMPLING_KEYS if k in s}
    engine = {k: s.pop(k) for k in ENGINE_KEYS if k in s}
    ordered = not s.pop("unordered", False)
    include = s.pop("include_token_ids", False)
    opts = BatchOptions(
        output=str(stage.folder / BATCH_OUTPUT), model=stage.model, ordered=ordered,
        include_token_ids=include, sampling=sampling, engine=engine, **s, **dev,
    )  # fmt: skip
    default_sampling(opts)  # a bad sampling value: UsageError
    EngineConfig(**opts.engine)
    return opts


def resolved(stage: Stage) -> dict[str, Any]:
    """The stage's settings in recipe form, every default filled in (the resolved recipe)."""
    a, kind = stage.args, stage.kind
    if kind in COMPRESS_STAGES:
        section = SparsifyStage if kind == "sparsify" else QuantizeSection
        keys = [k for k in section.model_fields if k != "block_size"]
        return {k: getattr(a, k) for k in keys if getattr(a, k) is not None}
    if kind == "distill":
        d = dataclasses.asdict(a)
        return {k: v for k, v in d.items() if k not in DISTILL_NOT_IN_RECIPE and v is not None}
    if kind == "eval":
        d = {k: getattr(a, k) for k in EvalStage.model_fields if hasattr(a, k)}
        d.update(data=str(a.data), kl_to_source=a.reference is not None)
        return {k: v for k, v in d.items() if v is not None}
    sampling = dataclasses.asdict(default_sampling(a))
    d = {k: getattr(a, k) for k in RunBatchStage.model_fields if hasattr(a, k)}
    d.update({k: sampling[k] for k in SAMPLING_KEYS}, **a.engine)
    d.update(unordered=not a.ordered, include_token_ids=a.include_token_ids)
    d.pop("device", None)
    return {k: v for k, v in d.items() if v is not None}


def finished(stage: Stage) -> bool:
    """Whether the stage's own job left a finished result (run-batch: always asked to run; its
    state file decides)."""
    from llmctl.runtime.output_dir import RECIPE_FILE, RECIPE_HEADER

    f = stage.folder
    if stage.kind in COMPRESS_STAGES:
        try:
            with open(f / RECIPE_FILE, encoding="utf-8") as recipe:
                ours = recipe.readline().startswith(RECIPE_HEADER)
        except (OSError, UnicodeDecodeError):
            return False
        return ours and (f / "config.json").is_file()  # config.json moves into place last
    if stage.kind == "distill":
        from llmctl.train.output import REPORT as DISTILL_REPORT

        return (f / DISTILL_REPORT).is_file() and (f / "config.json").is_file()
    if stage.kind == "eval":
        return (f / REPORT).is_file()
    return False


def read_report(stage: Stage) -> dict | None:
    from llmctl.train.output import REPORT as DISTILL_REPORT

    path = stage.folder / (DISTILL_REPORT if stage.kind == "distill" else REPORT)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_report(folder: Path, doc: dict) -> None:
    """folder/report.json, replaced atomically (its presence is eval's finished mark)."""
    from llmctl.runtime.output_dir import writing

    with writing(f"{folder / REPORT}"):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{REPORT}.tmp"
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        os.replace(tmp, folder / REPORT)


def run_stage(stage: Stage, hooks: StageHooks) -> dict:
    """Run the stage's job (resuming its own interrupted work); returns its report."""
    for note in stage.notes:
        hooks.warn(note)
    if stage.kind == "sparsify":
        report = _sparsify(stage, hooks)
    elif stage.kind == "quantize":
        report = _quantize(stage, hooks)
    elif stage.kind == "distill":
        return _distill(stage, hooks)
    elif stage.kind == "eval":
        report = _eval(stage, hooks)
    else:
        report = _run_batch(stage, hooks)
    write_report(stage.folder, report)
    return report


def _labelled(hooks: StageHooks, label: str):
    if hooks.progress is None:
        return None
    progress = hooks.progress
    return lambda done, total: progress(label, done, total)


def _sparsify(stage: Stage, hooks: StageHooks) -> dict:
    from llmctl.recipes.sparsify_run import run_recipe

    a = stage.args
    layers = _labelled(hooks, f"sparsify {a.method} {a.pattern or a.sparsity}")
    progress = None if layers is None else (lambda kind, d, t: layers(d, t))
    return run_recipe(None, a, progress=progress, warn=hooks.warn).to_dict()


def _quantize(stage: Stage, hooks: StageHooks) -> dict:
    from llmctl.compress.quantize_job import run_quantize

    a = stage.args
    finish = _zeros_check(Path(stage.model), a.output)
    progress = _labelled(hooks, f"quantize {a.method} layers")
    return run_quantize(a, progress=progress, warn=hooks.warn, finish=finish).to_dict()


def _zeros_check(model: Path, output: str):
    """For a pruned input (sparsity_config in its config.json): a check that every weight pruned
    there is still exactly zero in the quantized files, as `sparsify --recipe` checks."""
    from llmctl.recipes.sparsify_run import zeros_not_kept
    from llmctl.runtime.tensors import iter_tensors

    config = model / "config.json"
    if not config.is_file():
        return None
    layers = (json.loads(config.read_text()).get("sparsity_config") or {}).get("layers") or {}
    if not layers:
        return None
    masks = {
        name.removesuffix(".weight"): t == 0
        for _, name, t in iter_tensors(model)
        if name.removesuffix(".weight") in layers and name.endswith(".weight")
    }

    def finish(folder: Path) -> None:
        broken = zeros_not_kept(folder, masks)
        if broken:
            raise LlmctlError(
                f"quantization refilled pruned weights in {len(broken)} layer(s) "
                f"(first: {broken[0]}); nothing was written to {output}"
            )

    return finish


def _distill(stage: Stage, hooks: StageHooks) -> dict:
    from llmctl.runtime.output_dir import WORK_DIR
    from llmctl.train.checkpoint import has_checkpoint
    from llmctl.train.job import run_distill

    a = stage.args
    a.resume = has_checkpoint(stage.folder / WORK_DIR / "checkpoint")  # an interrupted run
    report = run_distill(a, progress=hooks.train, warn=hooks.warn)
    if report is None:  # another rank of a torchrun job
        raise UsageError("recipe run does not run under torchrun; run `llmctl distill` there")
    return report


def _eval(stage: Stage, hooks: StageHooks) -> dict:
    from llmctl.profiling.eval_job import run_eval
    from llmctl.runtime.loader import load_runtime

    return run_eval(stage.model, stage.args, load_runtime, _labelled(hooks, "eval windows"))


def _run_batch(stage: Stage, hooks: StageHooks) -> dict:
    from llmctl.batch.runner import run_batch
    from llmctl.runtime.loader import load_runtime

    def load(model, dtype="auto", device="auto", model_impl="auto"):
        return load_runtime(model, dtype=dtype, device=device, model_impl=model_impl)

    result = run_batch(stage.args, load, hooks.batch_ui)
    summary = result.stats.summary()
    return {**summary, "output": result.output, "already_complete": result.already_complete}
