"""`llmctl quantize`: weight-only AWQ, GPTQ or RTN quantization into compressed-tensors, AWQ or GPTQ folders.

The work is in llmctl.compress.quantize_job; this file parses options, shows progress and prints
the report (a table, and JSON with --report-json).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from llmctl.commands._options import Device, Quiet

HELP = """Quantize MODEL's linear layers to 4 or 8 bits (weights only) with AWQ, GPTQ or RTN.

\b
Examples (on the embedded demo model; use your own model folder or hub id):
  llmctl quantize llmctl/data/demo-model -o demo-gptq --gptq \\
      --num-samples 8 --seq-len 64
  llmctl quantize llmctl/data/demo-model -o demo-awq --awq --format awq \\
      --calib examples/prompts.jsonl --num-samples 4 --seq-len 16
  llmctl quantize llmctl/data/demo-model -o demo-w8 --rtn --bits 8 \\
      --group-size channel --num-samples 4 --seq-len 64

\b
--calib: JSONL (rows with prompt_token_ids, messages, prompt or text),
  Parquet (the same columns) or plain text, cut into --num-samples sequences
  of --seq-len tokens. Without it a small built-in text is used (a warning
  says so: data from your own domain is better).
Perplexity before/after: on --eval-data, or by default on the last 10% of the
  calibration data (then not used for calibration).
Embeddings and lm_head are never quantized; --ignore takes module names,
  globs or re:REGEX (a pattern that matches no layer gets a warning).
--group-size: auto (default: 128, or 64 or 32 when 128 does not divide every
  quantized layer's input width, else per channel; the report and recipe.yaml
  say so), channel, or a power of two of at least 16 that divides every
  layer's input width (the error names the sizes that work).
The output is written in OUTPUT/.llmctl-work and moved into place at the end;
  an interrupted run resumes from its last finished layer when rerun with the
  same arguments and output folder. --overwrite replaces only an earlier
  llmctl output, never the source model or a folder holding other files.
"""


def register(app: typer.Typer) -> None:
    @app.command("quantize", help=HELP, no_args_is_help=True)
    def quantize(
        model: str = typer.Argument(..., help="Model folder (or hub id) to quantize."),
        output: Path = typer.Option(
            ..., "--output", "-o", help="Output folder for the quantized model."
        ),
        awq: bool = typer.Option(False, "--awq", help="Activation-aware weight quantization."),
        gptq: bool = typer.Option(
            False, "--gptq", help="GPTQ (second-order error feedback, act-order)."
        ),
        rtn: bool = typer.Option(False, "--rtn", help="Round to nearest (no calibration needed)."),
        bits: int = typer.Option(4, "--bits", help="4 or 8."),
        group_size: str = typer.Option(
            "auto",
            "--group-size",
            help="Input columns per scale/zero group: auto, channel, or a power of two >= 16.",
        ),
        symmetric: Optional[bool] = typer.Option(
            None,
            "--symmetric/--asymmetric",
            help="Zero point fixed at the middle (default for GPTQ/RTN) or fitted (AWQ).",
            show_default=False,
        ),
        calib: Optional[Path] = typer.Option(
            None, "--calib", help="Calibration data: .jsonl, .parquet or text."
        ),
        eval_data: Optional[Path] = typer.Option(
            None, "--eval-data", help="Held-out data for perplexity (same formats)."
        ),
        num_samples: int = typer.Option(128, "--num-samples", help="Calibration sequences."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration sequence."),
        fmt: str = typer.Option(
            "compressed-tensors", "--format", help="compressed-tensors, awq or gptq."
        ),
        ignore: List[str] = typer.Option(
            [], "--ignore", help="Linear layers to keep unquantized (repeatable)."
        ),
        act_order: bool = typer.Option(
            True, "--act-order/--no-act-order", help="GPTQ: columns by decreasing Hessian diagonal."
        ),
        dampening: float = typer.Option(
            0.01, "--dampening", help="GPTQ: fraction of the mean Hessian diagonal added."
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
        from llmctl.compress.quantize_job import QuantizeArgs, run_quantize
        from llmctl.errors import UsageError

        chosen = [m for m, on in (("awq", awq), ("gptq", gptq), ("rtn", rtn)) if on]
        if len(chosen) != 1:
            raise UsageError("choose exactly one method: --awq, --gptq or --rtn")
        args = QuantizeArgs(
            model=model,
            output=str(output),
            method=chosen[0],
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
            calib=str(calib) if calib else None,
            eval_data=str(eval_data) if eval_data else None,
            num_samples=num_samples,
            seq_len=seq_len,
            format=fmt,
            ignore=list(ignore),
            device=device,
            act_order=act_order,
            dampening=dampening,
            overwrite=overwrite,
            report_json=str(report_json) if report_json else None,
        )
        report = _run_with_progress(args, run_quantize, quiet)
        if report_json:
            from llmctl.compress.output_dir import write_report

            write_report(report_json, report.to_dict())
        if not quiet:
            _print_report(report)


def _run_with_progress(args, run_quantize, quiet: bool):
    from llmctl.commands._output import stage_progress

    with stage_progress(quiet) as (progress, warn):
        if progress is None:
            return run_quantize(args, warn=warn)
        label = f"{args.method} layers"
        return run_quantize(
            args, progress=lambda done, total: progress(label, done, total), warn=warn
        )


def _fmt_size(n: int) -> str:
    from llmctl.engine.config import format_bytes

    return format_bytes(n)


def _print_report(r) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    ppl = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    summary = Table(title=f"llmctl quantize: {r.output}", show_header=False)
    for k, v in (
        (
            "method",
            f"{r.method} {r.bits}-bit, group {r.group_size}, {'symmetric' if r.symmetric else 'asymmetric'}",
        ),
        ("format", r.format),
        ("wall time", f"{r.wall_time_s:.1f} s"),
        ("size", f"{_fmt_size(r.size_before_bytes)} -> {_fmt_size(r.size_after_bytes)}"),
        (
            "perplexity",
            f"{ppl(r.perplexity_before)} -> {ppl(r.perplexity_after)} ({r.eval_tokens} held-out tokens)",
        ),
        (
            "calibration",
            f"{r.calibration['num_samples']} x {r.calibration['seq_len']} tokens from {r.calibration['source']}",
        ),
    ):
        summary.add_row(k, v)
    con.print(summary)
    layers = Table(title="per-layer relative output error ||X(W-Q)^T||^2 / ||XW^T||^2")
    layers.add_column("layer")
    layers.add_column("shape")
    layers.add_column("error", justify="right")
    for row in r.layers:
        layers.add_row(
            row["name"], "x".join(map(str, row["shape"])), f"{row['rel_output_error']:.2e}"
        )
    con.print(layers)
