"""Errors the user can cause, each carrying the exit code the CLI returns for it.

Everything below `commands/` raises these; `llmctl.cli.main` turns them into one line on stderr.
"""

from __future__ import annotations


class LlmctlError(Exception):
    """A known failure: printed as one line, no traceback."""

    exit_code = 1


class UsageError(LlmctlError):
    """Bad arguments, missing files, unsupported models: the user must change the command."""

    exit_code = 2


class ModelLoadError(UsageError):
    """The model folder, hub id or checkpoint cannot be used."""


class NotImplementedYet(UsageError):
    """A subcommand whose issue has not landed."""


class AbortedError(LlmctlError):
    """The job stopped on purpose (for example `--max-errors`); completed work is kept."""

    exit_code = 3


class RequestError(Exception):
    """One request (one input row) cannot be served; it becomes an error row, never a crash."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param  # the request field at fault, where there is one (OpenAI's `param`)

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message}
