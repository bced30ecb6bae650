"""`llmctl quantize`: not available yet (see the project's issue tracker)."""

from __future__ import annotations

import typer

from llmctl.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command("quantize", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def quantize(ctx: typer.Context) -> None:
        """Not available yet in this release."""
        raise NotImplementedYet("'llmctl quantize' is not implemented yet in this release")
