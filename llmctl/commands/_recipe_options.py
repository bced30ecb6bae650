"""CLI options of `llmctl recipe run|validate`, as option records.

Owns: the records `RunTarget` and `ValidateTarget` (the recipe, -o, --model), `OverrideFlags`
(--set, --device), `RunOutputFlags` (run's --overwrite, --report-json, --quiet) and `QuietFlag`
(validate's), with the recipe argument and --model, which both sub-commands take, as aliases
(`RecipeArg`, `RecipeModelOpt`). The calibration flags are quantize's and sparsify's
(`CalibFlags` of `_compress_options`); every value defaults to None, so only what a user
set overrides the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from llmctl.commands._options import DeviceOpt, QuietOpt, ReportJsonOpt

RecipeArg = Annotated[
    Path,
    typer.Argument(
        metavar="RECIPE",
        help="YAML recipe: llmctl's (llmctl_recipe: 1) or llm-compressor's (*_stage:).",
        show_default=False,
    ),
]
RecipeModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m", help="Model folder or hub id (overrides the recipe's `model`).",
        show_default=False,
    ),
]  # fmt: skip


@dataclass(frozen=True)
class RunTarget:
    """`recipe run`'s recipe, output folder and model."""

    recipe: RecipeArg
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="Folder of the run: stages/NAME/ for each stage's artifacts."
        ),
    ]
    model: RecipeModelOpt = None


@dataclass(frozen=True)
class ValidateTarget:
    """`recipe validate`'s recipe and model."""

    recipe: RecipeArg
    model: RecipeModelOpt = None


@dataclass(frozen=True)
class OverrideFlags:
    """Recipe values set on the command line (besides the calibration flags)."""

    sets: Annotated[
        Optional[List[str]],
        typer.Option(
            "--set",
            help="Override one recipe value, KEY.PATH=VALUE (YAML), e.g. stages.quantize.bits=8 "
            "(repeatable).",
            show_default=False,
        ),
    ] = None
    device: DeviceOpt = None


@dataclass(frozen=True)
class RunOutputFlags:
    """`recipe run`'s overwrite, report and quiet."""

    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Rerun the stages a changed recipe reaches, replacing their folders.",
        ),
    ] = False
    report_json: ReportJsonOpt = None
    quiet: QuietOpt = False


@dataclass(frozen=True)
class QuietFlag:
    """`recipe validate`'s --quiet."""

    quiet: QuietOpt = False
