"""Option records: the one way a command declares its options.

Owns: `record_command`, which turns a command body taking option records into the function Typer
reads. An option record is a frozen dataclass whose fields are typed
`Annotated[T, typer.Option(...)]` (or `typer.Argument`) with a default: the field names the
parameter, the annotation carries the flag names and help, the default is the value when the flag
is not given. A record is declared once and shared by every command taking it.

Typer reads an ordinary signature: `record_command` builds it from the records' fields (and any
plain parameter of the body), so Typer needs nothing special, and the body receives typed record
instances instead of one long parameter list.
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, Callable, get_type_hints

_KW = inspect.Parameter.KEYWORD_ONLY  # keyword-only: a required argument may follow a default


def record_parameters(record: type) -> list[inspect.Parameter]:
    """The fields of option record `record` as signature parameters (annotation: the
    `Annotated[T, typer.Option(...)]` of the field)."""
    hints = get_type_hints(record, include_extras=True)
    params = []
    for f in fields(record):
        if f.default_factory is not MISSING:
            raise TypeError(f"{record.__name__}.{f.name}: an option record takes plain defaults")
        default = inspect.Parameter.empty if f.default is MISSING else f.default
        params.append(inspect.Parameter(f.name, _KW, default=default, annotation=hints[f.name]))
    return params


def _expand(fn: Callable[..., Any]) -> tuple[list[inspect.Parameter], dict[str, Any]]:
    """`fn`'s parameters with each record-typed one replaced by the record's fields, and which
    body parameter is a record (name -> record class, or None for a plain parameter)."""
    hints = get_type_hints(fn, include_extras=True)
    params: list[inspect.Parameter] = []
    plan: dict[str, Any] = {}
    for name, p in inspect.signature(fn).parameters.items():
        annotation = hints.get(name, p.annotation)
        if isinstance(annotation, type) and is_dataclass(annotation):
            params += record_parameters(annotation)
            plan[name] = annotation
        else:
            params.append(p.replace(kind=_KW, annotation=annotation))
            plan[name] = None
    names = [p.name for p in params]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise TypeError(f"{fn.__name__}: option {', '.join(clashes)} declared twice")
    return params, plan


def record_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator: the command Typer registers for body `fn`, whose parameters are option
    records (dataclasses, expanded into their fields) or plain Typer parameters. Each call
    gathers the parsed values back into the records and calls `fn` with them."""
    params, plan = _expand(fn)

    def command(**values: Any) -> Any:
        args = {}
        for name, record in plan.items():
            if record is None:
                args[name] = values[name]
            else:
                args[name] = record(**{f.name: values[f.name] for f in fields(record)})
        return fn(**args)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__, command.__name__ = fn.__doc__, fn.__name__.lstrip("_")
    command.__module__ = fn.__module__
    return command
