"""Checks on a run-batch job's paths before any work: nothing is read or written until they pass.

Owns: where the default output lies (beside the input), every file a job writes, and the refusals:
an output that is a folder, a dangling link or not a regular file; a missing or read-only folder;
any written file (output, state, journal, --report-json) that is the input under another name;
column options given for a non-Parquet input.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from llmctl.batch.journal import journal_path, state_path, temp_path
from llmctl.batch.uris import is_uri
from llmctl.errors import UsageError

REPORT_FLAG = "--report-json"


def default_output(input_path: str, source_format: str) -> Path:
    """prompts.jsonl -> prompts.out.jsonl; a Parquet input -> NAME.out.parquet, beside the input."""
    if is_uri(input_path):
        raise UsageError(f"input {input_path} is a URI: pass -o for the (local) output")
    p = Path(input_path)
    return p.with_name(p.stem + (".out.parquet" if source_format == "parquet" else ".out.jsonl"))


def check_source_options(
    source_format: str, prompt_column: str, id_column: str | None, messages_column: str | None
) -> None:
    """The column options are for Parquet input; refuse them (set to other than their defaults)
    for the other formats, whose rows name their fields."""
    if source_format == "parquet":
        return
    for flag, value, default in (
        ("--prompt-column", prompt_column, "prompt"),
        ("--id-column", id_column, None),
        ("--messages-column", messages_column, None),
    ):
        if value != default:
            raise UsageError(
                f"{flag} is for Parquet input; this input is {source_format} "
                f"(its rows name their fields: id, prompt, messages, ...)"
            )


def written_paths(out: Path, parquet: bool) -> list[Path]:
    """Every file a job on `out` writes or replaces."""
    state = state_path(out)
    paths = [out, state, temp_path(state)]
    if parquet:
        paths += [journal_path(out), temp_path(out)]
    return paths


def _file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the input file, or of stdin when it is a file; None when unknown."""
    try:
        st = os.fstat(sys.stdin.fileno()) if path == "-" else os.stat(path)
    except (OSError, ValueError, AttributeError):
        return None
    return st.st_dev, st.st_ino


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): the same name is the same file
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_input_overwrite(input_path: str, paths: list[Path]) -> None:
    """The hard link, symlink or other name under which a file we write is the input."""
    ident = _file_id(input_path)
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if ident is not None and (st.st_dev, st.st_ino) == ident:
            raise UsageError(
                f"refusing to write {p}: it is the input file (the same file under "
                f"another name or through a link); choose another output"
            )


def _writable(path: Path) -> bool:
    """Whether path can be created or replaced (the folder) and written (an existing file)."""
    folder_ok = os.access(path.parent, os.W_OK | os.X_OK)
    return folder_ok and (not path.exists() or os.access(path, os.W_OK))


def check_output(input_path: str, out: Path, parquet: bool) -> None:
    """The output must be a writable regular file (or a new one) in an existing folder, and none
    of the job's files may be the input."""
    if out.is_dir():
        raise UsageError(f"output {out} is a folder; pass a file path")
    if out.is_symlink() and not out.exists():
        raise UsageError(f"output {out} is a link to a missing file; pass a file path")
    if out.exists() and not out.is_file():
        raise UsageError(
            f"output {out} is not a regular file (run-batch keeps resume state beside "
            f"its output); to discard the rows, use -o - > {out}"
        )
    if not out.parent.is_dir():
        raise UsageError(f"output folder {out.parent} does not exist")
    if not _writable(out):
        raise UsageError(f"cannot write {out}: permission denied")
    refuse_input_overwrite(input_path, written_paths(out, parquet))


def check_report_path(
    input_path: str, report: str | None, out: Path | None, parquet: bool, flag: str = REPORT_FLAG
) -> None:
    """--report-json FILE is written after the job: check it before (its folder exists, it is
    writable, it is neither the input nor one of the job's files). '-' (stdout) needs an output
    file, since rows to stdout would mix with it."""
    if report is None:
        return
    if report == "-":
        if out is None:
            raise UsageError(
                f"{flag} - writes standard output, where the rows go without -o FILE; "
                f"pass -o FILE or {flag} FILE"
            )
        return
    path = Path(report)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; pass a file path")
    if not path.parent.is_dir():
        raise UsageError(f"{flag}: folder {path.parent} does not exist")
    if not _writable(path):
        raise UsageError(f"{flag}: cannot write {path}: permission denied")
    refuse_input_overwrite(input_path, [path])
    if out is not None and any(_same_file(path, p) for p in written_paths(out, parquet)):
        raise UsageError(f"{flag} {path} is one of the job's own files; choose another")
