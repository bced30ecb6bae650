"""`llmctl quantize`: weight-only AWQ, GPTQ or RTN quantization into compressed-tensors, AWQ or
GPTQ folders.

The work is in llmctl.compress.quantize_job; this file parses options (defaults: QuantizeArgs),
shows progress and prints the report (a table, or JSON with --report-json; `-` for stdout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmctl.commands._compress_options import (
    ColumnBlockOpt,
    DampeningOpt,
    IgnoreOpt,
    MaxShardSizeOpt,
    NumSamplesOpt,
    SeqLenOpt,
    option,
)
from llmctl.commands._options import (
    CalibOpt,
    DeviceOpt,
    EvalDataOpt,
    OverwriteOpt,
    QuietOpt,
    ReportJsonOpt,
    default_of,
    given,
    path_str,
)
from llmctl.commands._output import fmt_ppl
from llmctl.compress.args import QuantizeArgs

HELP = """Quantize MODEL's linear layers to 2, 3, 4 or 8 bits (weights only) with AWQ, GPTQ or RTN.

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


def _opt(name: str, *decls: str, help: str, **kw):
    """An option whose help quotes QuantizeArgs' default for `name`."""
    return option(*decls, help=help + default_of(QuantizeArgs, name) + ".", **kw)


BitsOpt = Annotated[Optional[int], _opt("bits", "--bits", help="2, 3, 4 or 8 (--format awq: 4)")]
GroupSizeOpt = Annotated[
    Optional[str],
    _opt(
        "group_size",
        "--group-size",
        help="Input columns per scale/zero group: auto, channel, or a power of two >= 16",
    ),
]
SymmetricOpt = Annotated[
    Optional[bool],
    option(
        "--symmetric/--asymmetric",
        help="Zero point fixed at the middle (default for GPTQ/RTN) or fitted (AWQ).",
    ),
]
FormatOpt = Annotated[
    Optional[str], _opt("format", "--format", help="compressed-tensors, awq or gptq")
]
ActOrderOpt = Annotated[
    Optional[bool],
    option(
        "--act-order/--no-act-order",
        help="GPTQ: columns by decreasing Hessian diagonal (default: --no-act-order, which "
        "measured better held-out).",
    ),
]
ObserverOpt = Annotated[
    Optional[str],
    option(
        "--observer",
        help="Each group's range: mse (a shrink search minimising its error; with AWQ, for "
        "q/k_proj, which its clip search skips) or minmax (default: mse).",
    ),
]


def register(app: typer.Typer) -> None:
    @app.command("quantize", help=HELP, no_args_is_help=True)
    def quantize(
        model: Annotated[str, typer.Argument(help="Model folder (or hub id) to quantize.")],
        output: Annotated[
            Path, typer.Option("--output", "-o", help="Output folder for the quantized model.")
        ],
        awq: Annotated[
            bool, typer.Option("--awq", help="Activation-aware weight quantization.")
        ] = False,
        gptq: Annotated[
            bool, typer.Option("--gptq", help="GPTQ (second-order error feedback, act-order).")
        ] = False,
        rtn: Annotated[
            bool, typer.Option("--rtn", help="Round to nearest (no calibration needed).")
        ] = False,
        bits: BitsOpt = None,
        group_size: GroupSizeOpt = None,
        symmetric: SymmetricOpt = None,
        calib: CalibOpt = None,
        eval_data: EvalDataOpt = None,
        num_samples: NumSamplesOpt = None,
        seq_len: SeqLenOpt = None,
        fmt: FormatOpt = None,
        ignore: IgnoreOpt = None,
        act_order: ActOrderOpt = None,
        observer: ObserverOpt = None,
        dampening: DampeningOpt = None,
        column_block: ColumnBlockOpt = None,
        device: DeviceOpt = None,
        report_json: ReportJsonOpt = None,
        max_shard_size: MaxShardSizeOpt = None,
        overwrite: OverwriteOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        args = QuantizeArgs(
            model=model,
            output=str(output),
            method=_one_method(awq=awq, gptq=gptq, rtn=rtn),
            overwrite=overwrite,
            **given(
                bits=bits,
                group_size=group_size,
                symmetric=symmetric,
                calib=path_str(calib),
                eval_data=path_str(eval_data),
                num_samples=num_samples,
                seq_len=seq_len,
                format=fmt,
                ignore=list(ignore or []),
                device=device,
                act_order=act_order,
                observer=observer,
                dampening=dampening,
                column_block=column_block,
                report_json=path_str(report_json),
                max_shard_size=max_shard_size,
            ),
        )
        _run(args, quiet)


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
    return [
        ("method", f"{r.method} {r.bits}-bit, group {r.group_size}, {kind}"),
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
