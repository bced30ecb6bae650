"""`llmctl distill`: not available yet (see the project's issue tracker)."""

from __future__ import annotations

import typer

from llmctl.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command(
        "distill", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
    )
    def distill(ctx: typer.Context) -> None:
        """Not available yet in this release."""
        raise NotImplementedYet("'llmctl distill' is not implemented yet in this release")
