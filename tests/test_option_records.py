"""Option records (`llmctl.commands._records`): a command's options declared once as typed
dataclass fields; Typer reads the signature built from them and the body gets the records."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from llmctl.commands._records import record_command, record_parameters


@dataclass(frozen=True)
class Size:
    width: Annotated[Optional[int], typer.Option("--width", "-w", help="Width.")] = None
    tall: Annotated[bool, typer.Option("--tall", help="Tall.")] = False


@dataclass(frozen=True)
class Name:
    name: Annotated[str, typer.Option("--name", help="Name.")] = "x"


def _app(body) -> typer.Typer:
    app = typer.Typer()
    app.command("go")(record_command(body))
    app.command("other", hidden=True)(lambda: None)  # keeps "go" a sub-command
    return app


def test_the_body_receives_typed_records_and_plain_parameters():
    seen = []

    def body(
        *, path: Annotated[Optional[str], typer.Argument()] = None, size: Size, name: Name
    ) -> None:
        seen.append((path, size, name))

    result = CliRunner().invoke(_app(body), ["go", "p", "-w", "3", "--tall", "--name", "n"])
    assert result.exit_code == 0, result.output
    assert seen == [("p", Size(width=3, tall=True), Name(name="n"))]
    result = CliRunner().invoke(_app(body), ["go"])
    assert result.exit_code == 0 and seen[-1] == (None, Size(), Name())


def test_the_signature_is_the_records_fields_in_order():
    def body(size: Size, name: Name) -> None:
        """Doc."""

    command = record_command(body)
    params = inspect.signature(command).parameters
    assert list(params) == ["width", "tall", "name"]
    assert params["width"].default is None and params["name"].default == "x"
    assert command.__doc__ == "Doc." and command.__name__ == "body"
    assert [p.name for p in record_parameters(Size)] == ["width", "tall"]


@dataclass(frozen=True)
class Width:
    width: Annotated[int, typer.Option("--width")] = 1


def test_an_option_declared_twice_is_refused():
    def body(size: Size, width: Width) -> None:
        pass

    with pytest.raises(TypeError, match="width declared twice"):
        record_command(body)


def test_help_shows_the_fields_flags_and_help():
    def body(size: Size) -> None:
        pass

    result = CliRunner().invoke(_app(body), ["go", "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0
    assert "--width" in result.output and "Width." in result.output and "--tall" in result.output
