"""`llmctl recipe run|validate`: a multi-stage compression pipeline from one YAML file.

Owns: the two subcommands (their options are the records of `_recipe_options`), each stage's
terminal (compress and eval progress, distill's bar, run-batch's UI) and the summary table. The
work is `llmctl.recipes.recipe_job`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer

from llmctl.commands._compress_options import CalibFlags, calib_given
from llmctl.commands._options import path_str
from llmctl.commands._recipe_options import (
    OverrideFlags,
    QuietFlag,
    RunOutputFlags,
    RunTarget,
    ValidateTarget,
)
from llmctl.commands._records import record_command

HELP = """Run or check a multi-stage recipe: sparsify, quantize, distill, eval, run-batch.

\b
Examples (from the project folder, on the embedded demo model):
  llmctl recipe validate recipes/w4a16-gptq.yaml -m llmctl/data/demo-model
  llmctl recipe run recipes/w4a16-gptq.yaml -m llmctl/data/demo-model \\
      -o demo-recipe --num-samples 4 --seq-len 64
  llmctl recipe run recipes/llmcompressor-w4a16-gptq.yaml \\
      -m llmctl/data/demo-model -o demo-lc --num-samples 4 --seq-len 64

\b
A recipe starts with `llmctl_recipe: 1` and lists `stages` in the order
sparsify, quantize, distill, eval, run-batch (each optional); llm-compressor
recipes (`*_stage:` with SparseGPTModifier, WandaPruningModifier,
GPTQModifier, AWQModifier, QuantizationModifier) are read too. Every stage is
checked before the first runs; unknown keys and wrong types name the key.
Relative paths in a recipe are read beside it. Flags override the recipe:
--model, --calib, --eval-data, --num-samples, --seq-len, --device, and any
value with --set KEY.PATH=VALUE.
OUT holds recipe.resolved.yaml (every value resolved: `recipe run` repeats it),
stages/NAME/ (each stage's artifacts) and recipe_report.json. Rerun the same
command to resume: finished stages are skipped, an interrupted one resumes.
A changed recipe reruns the stages it reaches only with --overwrite.
"""

app = typer.Typer(
    name="recipe",
    help=HELP,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _request(recipe, output, model, calibration: CalibFlags, overrides: OverrideFlags, ow: bool):
    from llmctl.recipes.recipe_job import RecipeRequest

    sets, device = list(overrides.sets or []), overrides.device
    return RecipeRequest(
        recipe, path_str(output), model, calib_given(calibration), sets, device, ow
    )


def _run(
    target: RunTarget, calibration: CalibFlags, overrides: OverrideFlags, out: RunOutputFlags
) -> None:
    from llmctl.commands._output import emit_json, info, json_to_stdout
    from llmctl.recipes.recipe_job import run_recipe_file
    from llmctl.runtime.output_dir import check_output_file

    report_json, quiet = out.report_json, out.quiet
    if report_json is not None and not json_to_stdout(report_json):
        check_output_file(report_json, "--report-json", inputs=(target.recipe,))
    req = _request(
        target.recipe, target.output, target.model, calibration, overrides, out.overwrite
    )
    doc = run_recipe_file(req, lambda kind: _stage_ui(kind, quiet), lambda m: info(m, quiet))
    emit_json(report_json, doc)
    if not quiet and not json_to_stdout(report_json):
        _print_summary(doc)


def _validate(
    target: ValidateTarget, calibration: CalibFlags, overrides: OverrideFlags, quiet: QuietFlag
) -> None:
    import yaml

    from llmctl.recipes.recipe_job import validate_recipe

    req = _request(target.recipe, None, target.model, calibration, overrides, False)
    plan = validate_recipe(req)
    if not quiet.quiet:
        kinds = ", ".join(s.kind for s in plan.stages)
        typer.echo(f"# {target.recipe}: valid ({plan.syntax} syntax); stages: {kinds}")
        typer.echo(yaml.safe_dump(plan.doc, sort_keys=False), nl=False)


app.command("run", help="Run RECIPE's stages in order into -o (a rerun resumes).")(
    record_command(_run)
)
app.command("validate", help="Check RECIPE (every stage) without running it.")(
    record_command(_validate)
)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="recipe")


@contextmanager
def _stage_ui(kind: str, quiet: bool) -> Iterator:
    """The stage's hooks: run-batch's UI, distill's bar, or the layer/window progress."""
    from llmctl.recipes.stages import StageHooks

    if kind == "run-batch":
        from llmctl.commands._batch_ui import RichUI

        ui = RichUI(quiet)
        try:
            yield StageHooks(warn=ui.info, batch_ui=ui)
        finally:
            ui.stop()
        return
    if kind == "distill":
        from llmctl.commands.distill import train_progress

        with train_progress(quiet) as (train, warn):
            yield StageHooks(warn=warn, train=train)
        return
    from llmctl.commands._output import stage_progress

    with stage_progress(quiet) as (progress, warn):
        yield StageHooks(warn=warn, progress=progress)


def _headline(entry: dict) -> str:
    """One line of what the stage measured."""
    from llmctl.commands._output import fmt_ppl

    r, kind = entry.get("report") or {}, entry["stage"]
    if kind in ("sparsify", "quantize"):
        part = r.get(kind, r) if kind == "sparsify" else r
        return f"perplexity {fmt_ppl(part.get('perplexity_before'))} -> " + fmt_ppl(
            part.get("perplexity_after")
        )
    if kind == "distill":
        ev = r.get("final_eval") or {}
        return f"{r.get('steps')} steps, held-out perplexity {fmt_ppl(ev.get('perplexity'))}"
    if kind == "eval":
        res = r.get("result") or {}
        kl = res.get("mean_kl")
        return f"perplexity {fmt_ppl(res.get('perplexity'))}" + (
            "" if kl is None else f", KL to the source {kl:.4f}"
        )
    return f"{r.get('rows')} rows, {r.get('errors')} errors -> {r.get('output')}"


def _print_summary(doc: dict) -> None:
    from llmctl.commands._output import print_lines, print_table

    rows = [(e["stage"], e["status"], _headline(e)) for e in doc["stages"]]
    print_table(
        f"llmctl recipe: {doc['output']}", rows, ("stage", "status", "result"),
        left=("stage", "status", "result"),
    )  # fmt: skip
    print_lines([f"resolved recipe: {doc['resolved_recipe']}"])
