"""`llmctl sparsify`: prune a model's linear layers to 2:4, 4:8 or an unstructured sparsity with
magnitude, Wanda or SparseGPT, optionally followed by quantization (a recipe).

The work is in llmctl.recipes.sparsify_run (through llmctl.compress.oneshot). Owns: sparsify's
option records (`SparsifyJob`, `PruneFlags`; the calibration and run flags are
`_compress_options`'), defaulting to None (SparsifyArgs, then the recipe, own the defaults), the
progress and the report (a table, or JSON with --report-json; `-` for stdout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmctl.commands._compress_options import (
    CalibFlags,
    ColumnBlockOpt,
    CompressRunFlags,
    DampeningOpt,
    IgnoreOpt,
    calib_given,
    option,
)
from llmctl.commands._options import default_of, given, path_str
from llmctl.commands._output import fmt_ppl
from llmctl.commands._records import record_command
from llmctl.compress.args import SparsifyArgs

HELP = """Prune MODEL's decoder linears; write a dense checkpoint storing the zeros.

\b
Examples (on the embedded demo model; use your own model folder or hub id):
  llmctl sparsify llmctl/data/demo-model -o demo-2of4 \\
      --pattern 2:4 --method sparsegpt --num-samples 8 --seq-len 64
  llmctl sparsify llmctl/data/demo-model -o demo-50 --sparsity 0.5 \\
      --method wanda --calib examples/prompts.jsonl --num-samples 4 --seq-len 16
  llmctl sparsify llmctl/data/demo-model -o demo-2of4-w4 \\
      --recipe recipes/sparse-2of4-gptq-w4.yaml --num-samples 8 --seq-len 64

Speed, plainly: there is NO sparse speedup on the CPU. The output is an
ordinary dense model with zeros and runs at dense speed by default.
vLLM dropped its 2:4 sparse kernels in 2026. On NVIDIA Ampere or newer,
2:4 weights can use PyTorch's semi-structured sparse matmuls, but "up to
2x" holds only for large compatible matmuls; end-to-end gains measured
elsewhere are near 1.1x. Pruning mainly buys a model that compresses and
quantizes well (see --recipe).

Methods: magnitude (|W|, no data); wanda (|W| x input-channel norm, no
weight update); sparsegpt (default: OBS-style pruning that updates the
remaining weights through the inverse Hessian).

--pattern N:M keeps at most N non-zeros in every M consecutive inputs
(default 2:4; M a power of two up to 128); --sparsity F prunes the
fraction F, unstructured.
Embeddings and lm_head are never pruned; --ignore takes module names,
globs or re:REGEX. --calib: JSONL, Parquet or plain text, as in quantize.
Perplexity before/after uses --eval-data or the last 10% of the
calibration data. config.json gets a sparsity_config entry (pattern,
method, per-layer sparsity), which transformers ignores. The output is
written in OUTPUT/.llmctl-work and moved into place at the end; an
interrupted run resumes from its last finished layer when rerun with the
same arguments. --overwrite replaces only an earlier llmctl output.
"""


BLOCK_SIZE_DEPRECATED = "--block-size is deprecated for sparsify; use --column-block"


@dataclass(frozen=True)
class SparsifyJob:
    """The model, the output folder and what to prune."""

    model: Annotated[str, typer.Argument(help="Model folder (or hub id) to prune.")]
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Output folder for the pruned model.")
    ]
    pattern: Annotated[
        Optional[str],
        option("--pattern", help="N:M semi-structured pattern: 2:4 (default) or 4:8."),
    ] = None
    sparsity: Annotated[
        Optional[float],
        option("--sparsity", help="Unstructured fraction of zeros instead, e.g. 0.5."),
    ] = None
    method: Annotated[
        Optional[str],
        option(
            "--method",
            help="magnitude, wanda or sparsegpt" + default_of(SparsifyArgs, "method") + ".",
        ),
    ] = None


@dataclass(frozen=True)
class PruneFlags:
    """The layers left alone, SparseGPT's knobs, the recipe and the evaluation."""

    ignore: IgnoreOpt = None
    dampening: DampeningOpt = None
    column_block: ColumnBlockOpt = None
    block_size: Annotated[  # the old name of --column-block, hidden
        Optional[int], option("--block-size", help=BLOCK_SIZE_DEPRECATED + ".", hidden=True)
    ] = None
    recipe: Annotated[
        Optional[Path],
        option(
            "--recipe",
            help="YAML recipe (sparsify, then optionally quantize); flags given here override it.",
        ),
    ] = None
    evaluate: Annotated[
        Optional[bool], option("--eval/--no-eval", help="Measure perplexity before and after.")
    ] = None


def register(app: typer.Typer) -> None:
    app.command("sparsify", help=HELP, no_args_is_help=True)(record_command(_sparsify))


def _sparsify(
    job: SparsifyJob, calibration: CalibFlags, prune: PruneFlags, run: CompressRunFlags
) -> None:
    from llmctl.recipes.sparsify_recipe import load_recipe, merge_args

    notes = [BLOCK_SIZE_DEPRECATED] if prune.block_size is not None else []
    loaded = load_recipe(prune.recipe) if prune.recipe is not None else None
    column_block = prune.column_block if prune.column_block is not None else prune.block_size
    cli = given(
        pattern=job.pattern,
        sparsity=job.sparsity,
        method=job.method,
        **calib_given(calibration),
        ignore=list(prune.ignore or []),
        dampening=prune.dampening,
        column_block=column_block,
        device=run.device,
        evaluate=prune.evaluate,
        report_json=path_str(run.report_json),
        max_shard_size=run.max_shard_size,
    )
    fixed = {"model": job.model, "output": str(job.output), "overwrite": run.overwrite}
    args = merge_args(loaded, {**fixed, **cli}).resolve()
    _run(loaded, args, notes, run.quiet)


def _run(recipe, args: SparsifyArgs, notes: list[str], quiet: bool) -> None:
    """Run the job with progress on stderr; the report as JSON (--report-json) and a table."""
    from llmctl.commands._output import emit_json, json_to_stdout, stage_progress
    from llmctl.recipes.sparsify_run import run_recipe

    with stage_progress(quiet) as (progress, warn):
        for note in notes:
            warn(note)
        by_stage = None
        if progress is not None:
            sparsify = f"{args.method} {args.pattern or args.sparsity}"

            def by_stage(stage: str, done: int, total: int) -> None:
                progress(sparsify if stage == "sparsify" else "quantize", done, total)

        report = run_recipe(recipe, args, progress=by_stage, warn=warn)
    emit_json(args.report_json, report.to_dict())
    if not quiet and not json_to_stdout(args.report_json):
        _print_report(report)


def _summary_rows(report) -> list[tuple[str, str]]:
    r = report.sparsify
    measured = (
        f"{fmt_ppl(r.perplexity_before)} -> {fmt_ppl(r.perplexity_after)} "
        f"({r.eval_tokens} held-out tokens)"
    )
    rows = [
        ("method", f"{r.method}, pattern {r.pattern}"),
        (
            "sparsity",
            f"{r.global_sparsity:.2%} of pruned linears, "
            f"{r.model_sparsity:.2%} of all decoder linears",
        ),
        ("perplexity", "not measured (--no-eval)" if r.perplexity_after is None else measured),
        ("wall time", f"{r.wall_time_s:.1f} s"),
    ]
    if report.quantize is not None:
        q = report.quantize
        rows += [
            ("then quantized", f"{q.method} {q.bits}-bit, group {q.group_size}, {q.format}"),
            (
                "perplexity",
                f"{fmt_ppl(q.perplexity_before)} (sparse) -> "
                f"{fmt_ppl(q.perplexity_after)} (sparse + quantized)",
            ),
            ("zeros kept", "yes, every pruned weight is exactly zero after quantization"),
        ]
    rows.append(("speed", r.speed_note))
    return rows


def _print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    r = report.sparsify
    out = report.quantize.output if report.quantize is not None else r.output
    summary = Table(title=f"llmctl sparsify: {out}", show_header=False)
    for k, v in _summary_rows(report):
        summary.add_row(k, v)
    con.print(summary)
    layers = Table(title="per layer")
    for col in ("layer", "linear", "shape", "sparsity", "pattern ok", "rel. output error"):
        layers.add_column(col, justify="left" if col == "linear" else "right")
    for line in r.layers:
        err = line.get("rel_output_error")
        layer, linear = _split(line["name"])
        layers.add_row(
            layer,
            linear,
            "x".join(map(str, line["shape"])),
            f"{line['sparsity']:.2%}",
            "yes" if line["pattern_ok"] else "NO",
            "-" if err is None else f"{err:.4g}",
        )
    con.print(layers)
    for name, why in r.skipped.items():
        con.print(f"dense: {name} ({why})")


def _split(name: str) -> tuple[str, str]:
    """model.layers.3.mlp.up_proj -> ("3", "mlp.up_proj"); other names unchanged."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers":
        return parts[2], ".".join(parts[3:])
    return "", name
