"""`llmctl quantize`: weight-only AWQ, GPTQ or RTN quantization into compressed-tensors, AWQ or
GPTQ folders, and W8A8 int8 (`--scheme w8a8`, optionally after SmoothQuant) into compressed-tensors.

The work is in llmctl.compress.quantize_job. Owns: quantize's option records (`QuantizeJob`,
`SchemeFlags`, `TuningFlags`; the calibration and run flags are `_compress_options`'), defaulting
to None (QuantizeArgs owns the defaults), the progress and the report (a table, or JSON with
--report-json; `-` for stdout).
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
from llmctl.compress.args import QuantizeArgs

HELP = """Quantize MODEL's linear layers to 2, 3, 4 or 8 bits (weights only) with AWQ, GPTQ or RTN,
or to W8A8 int8 (--scheme w8a8: int8 activations too, optionally after SmoothQuant).

\b
Examples (on the embedded demo model; use your own model folder or hub id):
  llmctl quantize llmctl/data/demo-model -o demo-gptq --gptq \\
      --num-samples 8 --seq-len 64
  llmctl quantize llmctl/data/demo-model -o demo-awq --awq --format awq \\
      --calib examples/prompts.jsonl --num-samples 4 --seq-len 16
  llmctl quantize llmctl/data/demo-model -o demo-w8 --rtn --bits 8 \\
      --group-size channel --num-samples 4 --seq-len 64
  llmctl quantize llmctl/data/demo-model -o demo-w8a8 --gptq --scheme w8a8 \\
      --smoothquant --num-samples 8 --seq-len 64

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


def _opt(name: str, *decls: str, help: str, **kw):
    """An option whose help quotes QuantizeArgs' default for `name`."""
    return option(*decls, help=help + default_of(QuantizeArgs, name) + ".", **kw)


@dataclass(frozen=True)
class QuantizeJob:
    """The model, the output folder and the method (exactly one of --awq, --gptq, --rtn)."""

    model: Annotated[str, typer.Argument(help="Model folder (or hub id) to quantize.")]
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Output folder for the quantized model.")
    ]
    awq: Annotated[bool, typer.Option("--awq", help="Activation-aware weight quantization.")] = (
        False
    )
    gptq: Annotated[
        bool, typer.Option("--gptq", help="GPTQ (second-order error feedback, act-order).")
    ] = False
    rtn: Annotated[
        bool, typer.Option("--rtn", help="Round to nearest (no calibration needed).")
    ] = False


@dataclass(frozen=True)
class SchemeFlags:
    """The quantized weights: bits, groups, zero point."""

    bits: Annotated[
        Optional[int], _opt("bits", "--bits", help="2, 3, 4 or 8 (--format awq: 4)")
    ] = None
    group_size: Annotated[
        Optional[str],
        _opt(
            "group_size",
            "--group-size",
            help="Input columns per scale/zero group: auto, channel, or a power of two >= 16",
        ),
    ] = None
    symmetric: Annotated[
        Optional[bool],
        option(
            "--symmetric/--asymmetric",
            help="Zero point fixed at the middle (default for GPTQ/RTN) or fitted (AWQ).",
        ),
    ] = None
    scheme: Annotated[
        Optional[str],
        option(
            "--scheme",
            help="w8a8: int8 weights per output channel (with --rtn or --gptq) and int8 "
            "activations per token at run time, as compressed-tensors int-quantized "
            "(llm-compressor's W8A8; default: weight-only).",
        ),
    ] = None
    smoothquant: Annotated[
        Optional[bool],
        option(
            "--smoothquant/--no-smoothquant",
            help="With --scheme w8a8: SmoothQuant's calibrated migration of activation "
            "outliers into the weights first (default: off).",
        ),
    ] = None
    smoothquant_strength: Annotated[
        Optional[float],
        _opt(
            "smoothquant_strength",
            "--smoothquant-strength",
            help="SmoothQuant's migration strength a in [0, 1] (implies --smoothquant)",
            metavar="A",
        ),
    ] = None


@dataclass(frozen=True)
class TuningFlags:
    """The output format, the layers left alone and the methods' knobs."""

    fmt: Annotated[
        Optional[str], _opt("format", "--format", help="compressed-tensors, awq or gptq")
    ] = None
    ignore: IgnoreOpt = None
    act_order: Annotated[
        Optional[bool],
        option(
            "--act-order/--no-act-order",
            help="GPTQ: columns by decreasing Hessian diagonal (default: --no-act-order, which "
            "measured better held-out).",
        ),
    ] = None
    observer: Annotated[
        Optional[str],
        option(
            "--observer",
            help="Each group's range: mse (a shrink search minimising its error; with AWQ, for "
            "q/k_proj, which its clip search skips) or minmax (default: mse).",
        ),
    ] = None
    dampening: DampeningOpt = None
    column_block: ColumnBlockOpt = None


def register(app: typer.Typer) -> None:
    app.command("quantize", help=HELP, no_args_is_help=True)(record_command(_quantize))


def _quantize(
    job: QuantizeJob,
    scheme: SchemeFlags,
    calibration: CalibFlags,
    tuning: TuningFlags,
    run: CompressRunFlags,
) -> None:
    _check_scheme_bits(scheme)
    smooth = scheme.smoothquant
    if smooth is None and scheme.smoothquant_strength is not None:
        smooth = True
    args = QuantizeArgs(
        model=job.model,
        output=str(job.output),
        method=_one_method(awq=job.awq, gptq=job.gptq, rtn=job.rtn),
        overwrite=run.overwrite,
        **calib_given(calibration),
        **given(
            bits=scheme.bits,
            scheme=scheme.scheme,
            smoothquant=smooth,
            smoothquant_strength=scheme.smoothquant_strength,
            group_size=scheme.group_size,
            symmetric=scheme.symmetric,
            format=tuning.fmt,
            ignore=list(tuning.ignore or []),
            device=run.device,
            act_order=tuning.act_order,
            observer=tuning.observer,
            dampening=tuning.dampening,
            column_block=tuning.column_block,
            report_json=path_str(run.report_json),
            max_shard_size=run.max_shard_size,
        ),
    )
    _run(args, run.quiet)


def _check_scheme_bits(scheme: SchemeFlags) -> None:
    """--scheme w8a8 with an explicit --bits other than 8 (QuantizeArgs cannot tell a given 4
    from its default)."""
    from llmctl.errors import UsageError

    if scheme.scheme is not None and scheme.bits not in (None, 8):
        raise UsageError(f"--scheme {scheme.scheme} stores 8-bit weights, not --bits {scheme.bits}")


def _one_method(**flags: bool) -> str:
    from llmctl.errors import UsageError

    chosen = [method for method, on in flags.items() if on]
    if len(chosen) != 1:
        raise UsageError("choose exactly one method: --awq, --gptq or --rtn")
    return chosen[0]


def _run(args: QuantizeArgs, quiet: bool) -> None:
    """Run the job with progress on stderr; the report as JSON (--report-json) and a table."""
    from llmctl.commands._output import emit_json, json_to_stdout

    report = _run_with_progress(args, quiet)
    emit_json(args.report_json, report.to_dict())
    if not quiet and not json_to_stdout(args.report_json):
        _print_report(report)


def _run_with_progress(args: QuantizeArgs, quiet: bool):
    from llmctl.commands._output import stage_progress
    from llmctl.compress.quantize_job import run_quantize

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


def _summary_rows(r) -> list[tuple[str, str]]:
    kind = "symmetric" if r.symmetric else "asymmetric"
    calib = r.calibration
    probe = r.perplexity_rtn_probe
    rtn = "" if probe is None else f"; round-to-nearest: {fmt_ppl(probe)}"
    scheme = ""
    if r.scheme:
        smooth = f", SmoothQuant {r.smoothquant_strength}" if r.smoothquant_strength else ""
        scheme = f" ({r.scheme.upper()}: int8 activations per token{smooth})"
    return [
        ("method", f"{r.method} {r.bits}-bit, group {r.group_size}, {kind}{scheme}"),
        ("format", r.format),
        ("wall time", f"{r.wall_time_s:.1f} s"),
        ("size", f"{_fmt_size(r.size_before_bytes)} -> {_fmt_size(r.size_after_bytes)}"),
        (
            "perplexity",
            f"{fmt_ppl(r.perplexity_before)} -> {fmt_ppl(r.perplexity_after)} "
            f"({r.eval_tokens} held-out tokens{rtn})",
        ),
        (
            "calibration",
            f"{calib['num_samples']} x {calib['seq_len']} tokens from {calib['source']}",
        ),
    ]


def _print_report(r) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    summary = Table(title=f"llmctl quantize: {r.output}", show_header=False)
    for k, v in _summary_rows(r):
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
