"""CLI options shared by several commands, declared once (Typer `Option` objects and help text)."""

from __future__ import annotations

import typer

MODEL_HELP = "Local folder or hub id of a Llama-family model (default: the embedded demo model)."

Model = typer.Option(None, "--model", "-m", help=MODEL_HELP, show_default=False)
Dtype = typer.Option(
    "auto",
    "--dtype",
    help="Weights and activations: auto, bfloat16, float16 or float32. auto: the checkpoint's dtype; on a CPU, bfloat16 for half precision, or float32 when the CPU has no native bf16 (AVX2 only), where it is several times faster.",
)
Device = typer.Option("auto", "--device", help="auto (cuda when present, else cpu), cpu or cuda.")
Quiet = typer.Option(False, "--quiet", "-q", help="No progress output on stderr.")
