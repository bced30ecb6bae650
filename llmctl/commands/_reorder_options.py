"""run-batch's admission-order options (`--reorder`, `--reorder-window`): the option record
`ReorderFlags`.

Owns: the two flags' names and help, and `reorder_fields`, the `BatchOptions` fields a user set
(values are checked by `batch.options.check_reorder`, with the rest of the job's options).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmctl.commands._options import given


@dataclass(frozen=True)
class ReorderFlags:
    """The order rows are handed to the engine in."""

    reorder: Annotated[
        Optional[str],
        typer.Option(
            "--reorder",
            help="none (the default: input order) or prefix: rows sharing a prompt prefix are "
            "admitted together, within --reorder-window rows read ahead, so the prefix cache "
            "serves them; the output keeps input order, resume is unchanged.",
            show_default=False,
        ),
    ] = None
    reorder_window: Annotated[
        Optional[int],
        typer.Option(
            "--reorder-window",
            min=1,
            help="--reorder prefix: rows read ahead and grouped, held as token ids; it also "
            "bounds the reorder buffer (default: 4 x --max-in-flight).",
            show_default=False,
        ),
    ] = None


def reorder_fields(flags: ReorderFlags) -> dict[str, Any]:
    """The `BatchOptions` fields of the flags the user set."""
    return given(reorder=flags.reorder, reorder_window=flags.reorder_window)
