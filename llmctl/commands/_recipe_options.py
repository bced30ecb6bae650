"""CLI options of `llmctl recipe run|validate`, declared once as `Annotated` aliases.

Owns: the recipe argument, -o, --model and --set. The calibration flags are quantize's and
sparsify's (`_options`, `_compress_options`); every value defaults to None, so only what a user
set overrides the recipe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

RecipeArg = Annotated[
    Path,
    typer.Argument(
        metavar="RECIPE",
        help="YAML recipe: llmctl's (llmctl_recipe: 1) or llm-compressor's (*_stage:).",
        show_default=False,
    ),
]
RecipeOutputOpt = Annotated[
    Path,
    typer.Option(
        "--output", "-o", help="Folder of the run: stages/NAME/ for each stage's artifacts."
    ),
]
RecipeModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m", help="Model folder or hub id (overrides the recipe's `model`).",
        show_default=False,
    ),
]  # fmt: skip
SetOpt = Annotated[
    Optional[List[str]],
    typer.Option(
        "--set",
        help="Override one recipe value, KEY.PATH=VALUE (YAML), e.g. stages.quantize.bits=8 "
        "(repeatable).",
        show_default=False,
    ),
]
RecipeOverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="Rerun the stages a changed recipe reaches, replacing their folders."
    ),
]
