"""What commands print while they work: one place for progress and warnings on stderr.

Owns: `stage_progress`, the progress callback and warning printer a long job is given: a Rich bar
per stage on a terminal, one plain line per update when stderr is not a terminal (logs, CI), and
only warnings with --quiet; and `emit_json`, the one writer of --report-json (a file, or standard
output for '-').
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
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from llmctl.compress.output_dir import writing

    with writing(f"{flag} {path}"):
        Path(path).write_text(text)
