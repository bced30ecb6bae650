"""A command group with a default command: how a command that became sub-commands keeps its old
one-command spelling.

Owns: `DefaultGroup`, a Typer group that hands a command line whose first word names none of its
sub-commands (an option, a model, nothing at all, or --help) to its `DefaultCommand`, and
`DefaultCommand`, which usage lines and help show under the group's own name (`llmctl profile`,
not `llmctl profile <hidden name>`), as before the split.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup

# typer bundles its own click: its Context class is reached through the command class.
_Context: Any = TyperCommand.context_class


class _GroupPathContext(_Context):
    """The default command's context: its path is the group's."""

    @property
    def command_path(self) -> str:
        return self.parent.command_path if self.parent is not None else super().command_path


class DefaultCommand(TyperCommand):
    """The group's default command (register it hidden, with `cls=DefaultCommand`)."""

    context_class = _GroupPathContext


class DefaultGroup(TyperGroup):
    """Sub-commands by name; any other command line goes to the one `DefaultCommand`."""

    def _default(self) -> str:
        names = [n for n, c in self.commands.items() if isinstance(c, DefaultCommand)]
        if len(names) != 1:
            raise RuntimeError(f"{self.name}: a DefaultGroup needs one DefaultCommand")
        return names[0]

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        default = self._default()
        named = bool(args) and args[0] in self.commands and args[0] != default
        return super().parse_args(ctx, args if named else [default, *args])
