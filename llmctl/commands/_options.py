"""CLI options shared by several commands, declared once as `Annotated` aliases.

Owns: the option aliases (`ModelOpt`, `ModelImplOpt`, `DtypeOpt`, `DeviceOpt`, `QuietOpt`,
`ReportJsonOpt`, ...), `default_of` (help text that quotes a dataclass's default) and `given`
(the options a user set).

Defaults live in the dataclasses below commands/ (EngineConfig, QuantizeArgs, ...): an option here
defaults to None, `given(...)` drops the Nones, and the dataclass fills in the rest, so a default
is written once and an explicit flag can be told apart from a default (recipes need that).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

MODEL_HELP = (
    "Local folder, .gguf file or hub id of a decoder-only model transformers can build (default:"
    " the embedded demo model)."
)
DTYPE_HELP = (
    "Weights and activations: auto, bfloat16, float16 or float32. auto: the checkpoint's dtype; "
    "on a CPU, bfloat16 for half precision, or float32 when the CPU has no native bf16 (AVX2 "
    "only), where it is several times faster."
)
NO_AUTOTUNE_HELP = (
    "CPU: skip timing the linear kernels when the engine starts (the choices are cached per CPU "
    "and shape) and use the built-in rules."
)
REPORT_JSON_HELP = "Also write the report as JSON to this file ('-': standard output)."


def default_of(cls: type, name: str) -> str:
    """' (default: X)' for dataclass `cls`'s field `name`, for help text."""
    for f in fields(cls):
        if f.name == name:
            factory = f.default_factory
            value = f.default if f.default is not MISSING else factory()  # type: ignore[misc]
            if isinstance(value, bool):
                return ""  # a --x/--no-x switch shows its default itself
            return f" (default: {value})"
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def given(**options: Any) -> dict[str, Any]:
    """The options the user set (not None; an empty repeatable option counts as not set)."""
    return {k: v for k, v in options.items() if v is not None and v != [] and v != ()}


def path_str(path: Optional[Path]) -> Optional[str]:
    """A path option as the string the job dataclasses take (None stays None)."""
    return None if path is None else str(path)


ModelOpt = Annotated[
    Optional[str], typer.Option("--model", "-m", help=MODEL_HELP, show_default=False)
]
DtypeOpt = Annotated[
    Optional[str], typer.Option("--dtype", help=DTYPE_HELP + " (default: auto)", show_default=False)
]
DeviceOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device",
        help="auto (cuda when present, else cpu), cpu or cuda (default: auto).",
        show_default=False,
    ),
]
ModelImplOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model-impl",
        help="Whose model code runs MODEL: auto (llmctl's own for the Llama, Mistral, Qwen, "
        "Phi-3, Gemma, Mixtral and OLMoE families, transformers' for every other "
        "architecture), llmctl or transformers (default: auto).",
        show_default=False,
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output on stderr.")]
NoAutotuneOpt = Annotated[bool, typer.Option("--no-autotune", help=NO_AUTOTUNE_HELP)]
ReportJsonOpt = Annotated[
    Optional[Path], typer.Option("--report-json", help=REPORT_JSON_HELP, show_default=False)
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace an earlier llmctl output in -o.")
]
CalibOpt = Annotated[
    Optional[Path],
    typer.Option("--calib", help="Calibration data: .jsonl, .parquet or text.", show_default=False),
]
EvalDataOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--eval-data", help="Held-out data for perplexity (same formats).", show_default=False
    ),
]
