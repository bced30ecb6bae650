"""`llmctl eval`: sliding-window perplexity of a model on a text file, optionally KL against a
reference.

Owns: the options (None defaults: `EvalRequest` owns them) and what is printed: progress on
stderr, the table on stdout, --report-json. The work is `llmctl.profiling.eval_job`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

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

ModelArg = Annotated[
    Optional[str], typer.Argument(metavar="MODEL", help=MODEL_HELP, show_default=False)
]
DataOpt = Annotated[
    Path,
    typer.Option(
        "--data", help='Plain-text file, or JSONL with a "text" field.', show_default=False
    ),
]
SeqLenOpt = Annotated[
    Optional[int],
    typer.Option(
        "--seq-len",
        help="Tokens per window (at most the model's context)" + default_of(EvalRequest, "seq_len"),
        show_default=False,
    ),
]
StrideOpt = Annotated[
    Optional[int],
    typer.Option(
        "--stride", help="Tokens between window starts (default: seq-len / 2).", show_default=False
    ),
]
ReferenceOpt = Annotated[
    Optional[str],
    typer.Option(
        "--reference",
        help="Reference model for KL(reference || model); same tokenizer.",
        show_default=False,
    ),
]
MaxTokensOpt = Annotated[
    Optional[int],
    typer.Option(
        "--max-tokens",
        min=2,
        help="Evaluate only the first N tokens of the data.",
        show_default=False,
    ),
]
OldJsonOpt = Annotated[
    bool, typer.Option("--json", hidden=True, help="Old spelling of --report-json -.")
]


def register(app: typer.Typer) -> None:
    @app.command("eval", help=HELP)
    def eval(
        data: DataOpt,
        model: ModelArg = None,
        seq_len: SeqLenOpt = None,
        stride: StrideOpt = None,
        reference: ReferenceOpt = None,
        max_tokens: MaxTokensOpt = None,
        report_json: ReportJsonOpt = None,
        as_json: OldJsonOpt = False,
        dtype: DtypeOpt = None,
        device: DeviceOpt = None,
        quiet: QuietOpt = False,
    ) -> None:
        from llmctl.profiling.eval_job import eval_rows, run_eval
        from llmctl.runtime.loader import load_runtime

        report = report_json_of(report_json, "-" if as_json else None, "--json", "--report-json -")
        options = given(
            seq_len=seq_len,
            stride=stride,
            reference=reference,
            max_tokens=max_tokens,
            dtype=dtype,
            device=device,
        )
        req = EvalRequest(data=data, **options)

        def progress(done: int, total: int) -> None:
            if done == total or done % max(1, total // 10) == 0:
                info(f"window {done}/{total}", quiet)

        record = run_eval(model, req, load_runtime, progress)
        if not json_to_stdout(report):
            print_table(f"eval {record['model']} on {record['data']}", eval_rows(record))
        emit_json(report, record)
