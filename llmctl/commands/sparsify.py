"""`llmctl sparsify`: prune a model's linear layers to 2:4, 4:8 or an unstructured sparsity with
magnitude, Wanda or SparseGPT, optionally followed by quantization (a recipe).

The work is in llmctl.compress.sparse (job.py, recipe.py); this file parses options, shows progress
and prints the report (a table, and JSON with --report-json).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from llmctl.commands._options import Device, Quiet

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


def register(app: typer.Typer) -> None:
    @app.command("sparsify", help=HELP, no_args_is_help=True)
    def sparsify(
        model: str = typer.Argument(..., help="Model folder (or hub id) to prune."),
        output: Path = typer.Option(
            ..., "--output", "-o", help="Output folder for the pruned model."
        ),
        pattern: Optional[str] = typer.Option(
            None,
            "--pattern",
            help="N:M semi-structured pattern: 2:4 (default) or 4:8.",
            show_default=False,
        ),
        sparsity: Optional[float] = typer.Option(
            None,
            "--sparsity",
            help="Unstructured fraction of zeros instead, e.g. 0.5.",
            show_default=False,
        ),
        method: Optional[str] = typer.Option(
            None, "--method", help="magnitude, wanda or sparsegpt (default).", show_default=False
        ),
        calib: Optional[Path] = typer.Option(
            None, "--calib", help="Calibration data: .jsonl, .parquet or text."
        ),
        eval_data: Optional[Path] = typer.Option(
            None, "--eval-data", help="Held-out data for perplexity (same formats)."
        ),
        num_samples: Optional[int] = typer.Option(
            None, "--num-samples", help="Calibration sequences (default 128).", show_default=False
        ),
        seq_len: Optional[int] = typer.Option(
            None,
            "--seq-len",
            help="Tokens per calibration sequence (default 512).",
            show_default=False,
        ),
        ignore: Optional[List[str]] = typer.Option(
            None, "--ignore", help="Linear layers to keep dense (repeatable)."
        ),
        dampening: Optional[float] = typer.Option(
            None,
            "--dampening",
            help="SparseGPT: fraction of the mean Hessian diagonal added (default 0.01).",
            show_default=False,
        ),
        block_size: Optional[int] = typer.Option(
            None,
            "--block-size",
            help="SparseGPT: columns per mask/update block (default 128).",
            show_default=False,
        ),
        recipe: Optional[Path] = typer.Option(
            None,
            "--recipe",
            help="YAML recipe (sparsify, then optionally quantize); flags given here override it.",
        ),
        evaluate: bool = typer.Option(
            True, "--eval/--no-eval", help="Measure perplexity before and after."
        ),
        device: str = Device,
        report_json: Optional[Path] = typer.Option(
            None, "--report-json", help="Also write the report as JSON here."
        ),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Replace an earlier llmctl output in -o."
        ),
        quiet: bool = Quiet,
    ) -> None:
        from llmctl.compress.sparse.recipe import load_recipe, merge_args, run_recipe

        loaded = load_recipe(recipe) if recipe is not None else None
        args = merge_args(
            loaded,
            {
                "model": model,
                "output": str(output),
                "pattern": pattern,
                "sparsity": sparsity,
                "method": method,
                "calib": str(calib) if calib else None,
                "eval_data": str(eval_data) if eval_data else None,
                "num_samples": num_samples,
                "seq_len": seq_len,
                "ignore": list(ignore) if ignore else None,
                "dampening": dampening,
                "block_size": block_size,
                "device": device,
                "evaluate": evaluate,
                "overwrite": overwrite,
                "report_json": str(report_json) if report_json else None,
            },
        ).resolve()
        report = _run_with_progress(loaded, args, run_recipe, quiet)
        if report_json:
            from llmctl.compress.output_dir import write_report

            write_report(report_json, report.to_dict())
        if not quiet:
            _print_report(report)


def _run_with_progress(recipe, args, run_recipe, quiet: bool):
    from llmctl.commands._output import stage_progress

    with stage_progress(quiet) as (progress, warn):
        if progress is None:
            return run_recipe(recipe, args, warn=warn)
        sparsify = f"{args.method} {args.pattern or args.sparsity}"

        def by_stage(stage: str, done: int, total: int) -> None:
            progress(sparsify if stage == "sparsify" else "quantize", done, total)

        return run_recipe(recipe, args, progress=by_stage, warn=warn)


def _print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    r = report.sparsify
    ppl = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    out = report.quantize.output if report.quantize is not None else r.output
    summary = Table(title=f"llmctl sparsify: {out}", show_header=False)
    rows = [
        ("method", f"{r.method}, pattern {r.pattern}"),
        (
            "sparsity",
            f"{r.global_sparsity:.2%} of pruned linears, {r.model_sparsity:.2%} of all decoder linears",
        ),
        (
            "perplexity",
            "not measured (--no-eval)"
            if r.perplexity_after is None
            else f"{ppl(r.perplexity_before)} -> {ppl(r.perplexity_after)} ({r.eval_tokens} held-out tokens)",
        ),
        ("wall time", f"{r.wall_time_s:.1f} s"),
    ]
    if report.quantize is not None:
        q = report.quantize
        rows += [
            ("then quantized", f"{q.method} {q.bits}-bit, group {q.group_size}, {q.format}"),
            (
                "perplexity",
                f"{ppl(q.perplexity_before)} (sparse) -> {ppl(q.perplexity_after)} (sparse + quantized)",
            ),
            ("zeros kept", "yes, every pruned weight is exactly zero after quantization"),
        ]
    rows.append(("speed", r.speed_note))
    for k, v in rows:
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
