"""`llmctl run-batch`: not available yet (see the project's issue tracker)."""

from __future__ import annotations

import typer

from llmctl.errors import NotImplementedYet


def register(app: typer.Typer) -> None:
    @app.command("run-batch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def run_batch(ctx: typer.Context) -> None:
        """Not available yet in this release."""
        raise NotImplementedYet("'llmctl run-batch' is not implemented yet in this release")
