"""`llmctl eval`: sliding-window perplexity of a model on a text file, optionally KL against a
reference.

Owns: the option records `EvalFlags` and `EvalRunFlags` (None defaults: `EvalRequest` owns
them) and what is printed: progress on stderr, the table on stdout, --report-json. The work is
`llmctl.profiling.eval_job`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.commands._options import (
    MODEL_HELP,
    DeviceOpt,
    DtypeOpt,
    QuietOpt,
    ReportJsonOpt,
    default_of,
    given,
)
from llmctl.commands._output import emit_json, info, json_to_stdout, print_table, report_json_of
from llmctl.commands._records import record_command
from llmctl.profiling.eval_job import EvalRequest

# Prose lines are joined here, not in the source: the help keeps the newlines it is given.
HELP = (
    "Perplexity of MODEL on a text file (sliding window), and with --reference the mean "
    "per-token KL(reference || model).\n"
    """
\b
Examples:
  llmctl eval --data llmctl/compress/data/calib_default.txt --seq-len 128
"""
    "  llmctl eval llmctl/data/demo-model --data llmctl/compress/data/calib_default.txt"
    " --seq-len 128 --reference llmctl/data/demo-model --report-json -\n"
    "\n"
    '--data is plain text, or JSONL (.jsonl) whose rows have a "text" field (documents joined by '
    "a blank line).\n"
    "Scored tokens: windows of --seq-len tokens every --stride tokens (default seq-len / 2); each "
    "token is scored once, from its own window's earlier tokens (Hugging Face's strided "
    "perplexity); the first token of the text is never scored (nor, when --stride equals "
    "--seq-len, the first of each window).\n"
    "--report-json - prints the JSON record instead of the table.\n"
)


def _opt(*decls: str, help: str, **kw: Any) -> Any:
    """A typer.Option without a shown default (EvalRequest owns it)."""
    return typer.Option(*decls, help=help, show_default=False, **kw)


@dataclass(frozen=True)
class EvalFlags:
    """The data, the model, the windows and the reference."""

    data: Annotated[Path, _opt("--data", help='Plain-text file, or JSONL with a "text" field.')]
    model: Annotated[
        Optional[str], typer.Argument(metavar="MODEL", help=MODEL_HELP, show_default=False)
    ] = None
    seq_len: Annotated[
        Optional[int],
        _opt(
            "--seq-len",
            help="Tokens per window (at most the model's context)"
            + default_of(EvalRequest, "seq_len"),
        ),
    ] = None
    stride: Annotated[
        Optional[int], _opt("--stride", help="Tokens between window starts (default: seq-len / 2).")
    ] = None
    reference: Annotated[
        Optional[str],
        _opt("--reference", help="Reference model for KL(reference || model); same tokenizer."),
    ] = None
    max_tokens: Annotated[
        Optional[int],
        _opt("--max-tokens", min=2, help="Evaluate only the first N tokens of the data."),
    ] = None


@dataclass(frozen=True)
class EvalRunFlags:
    """The report, the engine's dtype and device, and quiet."""

    report_json: ReportJsonOpt = None
    as_json: Annotated[
        bool, typer.Option("--json", hidden=True, help="Old spelling of --report-json -.")
    ] = False
    dtype: DtypeOpt = None
    device: DeviceOpt = None
    quiet: QuietOpt = False


def register(app: typer.Typer) -> None:
    app.command("eval", help=HELP)(record_command(_eval))


def _eval(flags: EvalFlags, run: EvalRunFlags) -> None:
    from llmctl.profiling.eval_job import eval_rows, run_eval
    from llmctl.runtime.loader import load_runtime

    report = report_json_of(
        run.report_json, "-" if run.as_json else None, "--json", "--report-json -"
    )
    options = given(
        seq_len=flags.seq_len,
        stride=flags.stride,
        reference=flags.reference,
        max_tokens=flags.max_tokens,
        dtype=run.dtype,
        device=run.device,
    )
    req = EvalRequest(data=flags.data, **options)

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            info(f"window {done}/{total}", run.quiet)

    record = run_eval(flags.model, req, load_runtime, progress)
    if not json_to_stdout(report):
        print_table(f"eval {record['model']} on {record['data']}", eval_rows(record))
    emit_json(report, record)
