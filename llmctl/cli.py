"""The `llmctl` Typer application: registers one thin command module per subcommand.

Owns: the top-level app and `main()`, which turns known errors into one line on stderr and an
exit code. Heavy imports (torch, transformers) happen inside commands so `--help` stays instant.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from llmctl import __version__
from llmctl.commands import distill, profile, quantize, recipe, run_batch, sparsify
from llmctl.commands import eval as eval_cmd

MODULES = (quantize, sparsify, distill, run_batch, profile, eval_cmd, recipe)
ORDER = ("quantize", "sparsify", "distill", "run-batch", "profile", "eval", "recipe")


class _Root(TyperGroup):
    """Lists the commands in ORDER (Typer lists a command with sub-commands, such as profile or
    recipe, after the plain ones)."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


app = typer.Typer(
    cls=_Root,
    name="llmctl",
    help="Compress large language models and push millions of prompts through them offline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """llmctl: quantize, sparsify, distill, batch-serve, profile and evaluate decoder-only
    language models, alone or as the stages of a recipe."""


for module in MODULES:
    module.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    from llmctl.errors import LlmctlError

    try:
        rc = app(args=argv, prog_name="llmctl", standalone_mode=False)
    except LlmctlError as e:
        if str(e):  # an error with no message has said what it had to (e.g. a closed stdout)
            print(f"llmctl: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("llmctl: interrupted", file=sys.stderr)
        return 130
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:  # click raises this for --help in some paths
        return int(e.code or 0)
    except Exception as e:  # click usage errors and the like
        # typer may bundle its own copy of click: match the exception classes by name.
        names = {c.__name__ for c in type(e).__mro__}
        if "ClickException" in names and hasattr(e, "show"):
            e.show()
            return getattr(e, "exit_code", 2)
        if "Abort" in names:
            print("llmctl: aborted", file=sys.stderr)
            return 130
        if os.environ.get("LLMCTL_DEBUG"):
            raise
        print(
            f"llmctl: internal error: {type(e).__name__}: {e} (set LLMCTL_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 1
    return (
        rc if isinstance(rc, int) else 0
    )  # with standalone_mode=False, click returns typer.Exit codes


if __name__ == "__main__":
    sys.exit(main())
