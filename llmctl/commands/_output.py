"""What commands print: progress and warnings on stderr, tables for humans, JSON for programs.

Owns: `stage_progress`, the progress callback and warning printer a long job is given: a Rich bar
per stage on a terminal, one plain line per update when stderr is not a terminal (logs, CI), and
only warnings with --quiet; `info`/`warn`/`deprecated` (one line on stderr); `print_table` (Rich
tables on stdout, or stderr while stdout carries JSON); `emit_json`, the one writer of
--report-json (a file, or standard output for '-'), and `report_json_of`, which maps a command's
old JSON spelling onto it. run-batch's progress bar and summary live in `_batch_ui`.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

ProgressFn = Callable[[str, int, int], None]  # (stage label, done, total)


def _plain_warn(message: str) -> None:
    print(f"llmctl: warning: {message}", file=sys.stderr)


def warn(message: str) -> None:
    """One warning line on stderr (shown with --quiet too)."""
    _plain_warn(message)


def info(message: str, quiet: bool = False) -> None:
    """One progress or status line on stderr; nothing with --quiet."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def deprecated(old: str, new: str) -> None:
    """The one-line notice an old spelling of an option prints (it still works)."""
    warn(f"{old} is deprecated; use {new}")


def report_json_of(
    report_json: str | Path | None, old: str | Path | None, old_spelling: str, new_spelling: str
) -> str | None:
    """The --report-json target ('-': stdout) from the new option or an old spelling of it
    (which prints a deprecation line); both given: a usage error."""
    from llmctl.errors import UsageError

    if old is None:
        return None if report_json is None else str(report_json)
    if report_json is not None:
        raise UsageError(f"{old_spelling} and --report-json name the same output; pass only one")
    deprecated(old_spelling, new_spelling)
    return str(old)


def json_to_stdout(report_json: str | Path | None) -> bool:
    """Whether --report-json writes standard output (then no human table goes there)."""
    return report_json is not None and str(report_json) == "-"


def fmt_ppl(value: float | None) -> str:
    """A perplexity for a report table ('-' when not measured)."""
    return "-" if value is None else f"{value:.3f}"


def console(min_width: int = 80, stderr: bool = False):
    """A Rich console at least `min_width` wide, so wide tables stay whole in CI logs and pipes."""
    from rich.console import Console

    out = Console(stderr=stderr)
    if out.width < min_width:
        out = Console(width=min_width, stderr=stderr)
    return out


def print_table(
    title: str,
    rows: list[tuple[str, ...]],
    columns: tuple[str, ...] | None = None,
    *,
    min_width: int = 80,
    stderr: bool = False,
    left: tuple[str, ...] = (),
) -> None:
    """A Rich table: `columns` None: a two-column key / value table without header (keys bold,
    values right-aligned); else one header per column, right-aligned unless named in `left`.
    Cells are plain text except Rich markup such as [red]...[/red] that callers add."""
    from rich.table import Table

    table = Table(title=title, show_header=columns is not None, title_justify="left")
    if columns is None:
        table.add_column(style="bold", no_wrap=True)
        table.add_column(justify="right", overflow="fold")
    else:
        for c in columns:
            table.add_column(c, justify="left" if c in left else "right")
    for row in rows:
        table.add_row(*row)
    console(min_width, stderr).print(table)


def print_lines(lines: list[str], *, min_width: int = 80, stderr: bool = False) -> None:
    """Notes under a table, on the same stream and width."""
    out = console(min_width, stderr)
    for line in lines:
        out.print(line)


@contextmanager
def stage_progress(quiet: bool) -> Iterator[tuple[ProgressFn | None, Callable[[str], None]]]:
    """(progress, warn) for the duration of a job; progress is None with --quiet."""
    if quiet:
        yield None, _plain_warn
        return
    if not sys.stderr.isatty():

        def plain(label: str, done: int, total: int) -> None:
            print(f"{label}: {done}/{total}", file=sys.stderr, flush=True)

        yield plain, _plain_warn
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done, total=total)

        yield progress, lambda message: err.print(f"[yellow]warning:[/yellow] {message}")


def emit_json(path: str | Path | None, doc: dict, flag: str = "--report-json") -> None:
    """Write `doc` as indented JSON to `path` ('-': stdout; None: nothing); OS errors: one line."""
    if path is None:
        return
    text = json.dumps(doc, indent=2) + "\n"
    if json_to_stdout(path):
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from llmctl.runtime.output_dir import writing

    with writing(f"{flag} {path}"):
        Path(path).write_text(text)
