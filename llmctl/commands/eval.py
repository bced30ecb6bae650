"""`llmctl eval`: sliding-window perplexity of a model on a text file, optionally KL against a reference.

The math is in llmctl.runtime.evaluate (shared with the quantize and sparsify reports); this file
reads the data, loads the model(s) and prints a table or JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from llmctl.commands._options import MODEL_HELP, Device, Dtype, Quiet
from llmctl.errors import UsageError

HELP = """Perplexity of MODEL on a text file (sliding window), and with --reference the mean per-token KL(reference || model).

\b
Examples:
  llmctl eval --data llmctl/compress/data/calib_default.txt --seq-len 128
  llmctl eval llmctl/data/demo-model --data llmctl/compress/data/calib_default.txt --seq-len 128 --reference llmctl/data/demo-model --json

--data is plain text, or JSONL (.jsonl) whose rows have a "text" field (documents joined by a blank line).
Scored tokens: windows of --seq-len tokens every --stride tokens (default seq-len / 2); each token is scored once, from its own window's earlier tokens (Hugging Face's strided perplexity); the first token of the text is never scored (nor, when --stride equals --seq-len, the first of each window).
"""


def read_text(path: Path) -> str:
    """Plain text, or the "text" fields of a JSONL file joined by blank lines."""
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --data {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--data {path} is not UTF-8 text") from None
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return raw
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UsageError(f"{path}:{n}: each JSONL row needs a string \"text\" field")
        docs.append(row["text"])
    return "\n\n".join(docs)


def register(app: typer.Typer) -> None:
    @app.command("eval", help=HELP)
    def eval(
        model: str = typer.Argument(None, metavar="MODEL", help=MODEL_HELP, show_default=False),
        data: Path = typer.Option(
            ...,
            "--data",
            help="Plain-text file, or JSONL with a \"text\" field.",
            show_default=False,
        ),
        seq_len: int = typer.Option(
            512, "--seq-len", help="Tokens per window (at most the model's context)."
        ),
        stride: int = typer.Option(
            None,
            "--stride",
            help="Tokens between window starts (default: seq-len / 2).",
            show_default=False,
        ),
        reference: str = typer.Option(
            None,
            "--reference",
            help="Reference model for KL(reference || model); same tokenizer.",
            show_default=False,
        ),
        max_tokens: int = typer.Option(
            None,
            "--max-tokens",
            min=2,
            help="Evaluate only the first N tokens of the data.",
            show_default=False,
        ),
        as_json: bool = typer.Option(
            False, "--json", help="Print one JSON object instead of the table."
        ),
        dtype: str = Dtype,
        device: str = Device,
        quiet: bool = Quiet,
    ) -> None:
        from llmctl.profiling.environment import environment
        from llmctl.runtime.evaluate import METHOD, perplexity
        from llmctl.runtime.loader import load_runtime
        from llmctl.runtime.resolve import resolve_model_path
        from llmctl.runtime.weights import load_model

        text = read_text(data)
        runtime = load_runtime(model, dtype=dtype, device=device)
        if runtime.tokenizer is None:
            raise UsageError(
                f"{runtime.model_name} has no tokenizer; eval needs one to read --data"
            )
        if seq_len > runtime.config.max_position_embeddings:
            raise UsageError(
                f"--seq-len {seq_len} exceeds the model's context ({runtime.config.max_position_embeddings})"
            )
        ids = runtime.encode(text)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        ref_model = None
        if reference is not None:
            ref_model, ref_config = load_model(resolve_model_path(reference), dtype, runtime.device)
            if ref_config.vocab_size != runtime.config.vocab_size:
                raise UsageError(
                    f"--reference has vocabulary {ref_config.vocab_size}, the model {runtime.config.vocab_size}; "
                    "KL needs the same tokenizer"
                )

        def progress(done: int, total: int) -> None:
            if not quiet and (done == total or done % max(1, total // 10) == 0):
                typer.echo(f"window {done}/{total}", err=True)

        result = perplexity(runtime.model, ids, seq_len, stride, ref_model, progress)
        record = {
            "schema": "llmctl.eval",
            "schema_version": 1,
            "model": runtime.model_name,
            "reference": reference,
            "data": str(data),
            "method": METHOD,
            "environment": environment(runtime.device, str(runtime.dtype).replace("torch.", "")),
            "result": result.to_dict(),
        }
        if as_json:
            typer.echo(json.dumps(record, indent=2))
            return
        _print(record)


def _print(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    r = record["result"]
    table = Table(
        title=f"eval {record['model']} on {record['data']}", show_header=False, title_justify="left"
    )
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("perplexity", f"{r['perplexity']:.4f}")
    table.add_row("mean NLL (nats/token)", f"{r['mean_nll']:.5f}")
    if r["mean_kl"] is not None:
        table.add_row("mean KL(reference || model)", f"{r['mean_kl']:.6f} nats")
        table.add_row("reference perplexity", f"{r['reference_perplexity']:.4f}")
    table.add_row("scored tokens / tokens", f"{r['num_scored_tokens']:,} / {r['num_tokens']:,}")
    table.add_row(
        "windows (seq-len, stride)", f"{r['num_windows']} ({r['seq_len']}, {r['stride']})"
    )
    table.add_row(
        "dtype, device", f"{record['environment']['dtype']}, {record['environment']['device']}"
    )
    Console().print(table)
