"""Output folders of quantize, sparsify and distill: the safety rules, the work folder and the final
move.

Owns, for every job that writes a model folder (written once):
- `check_disjoint`: an output may not be the source model folder, lie inside it or contain it.
  Folders are compared by (st_dev, st_ino) of the folder and of every ancestor, so a symlink or a
  bind mount naming the source by another path is caught too.
- `OutputFolder`: `-o` and its work folder `-o/.llmctl-work`, which holds the resume state
  (`resume/`) and the files being written (`result/`). `commit()` moves the finished files into
  place at the very end, config.json last, so a crash, Ctrl-C or full disk never leaves a folder
  that looks complete, and a rerun resumes. `--overwrite` replaces only an earlier llmctl output: a
  folder holding anything llmctl does not write is refused, never emptied.
- `output_config` (the
  config.json of a derived model: no `auto_map`, whose custom code is not copied),
  `copy_side_files`, `check_output_file` / `check_input_file`, and `writing`,
  which turns OS errors while writing (disk full, read-only folder, no permission) into one line.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmctl.errors import LlmctlError, UsageError

WORK_DIR = ".llmctl-work"
# resume folders of earlier llmctl versions (inside -o): ours to replace
LEGACY_WORK_DIRS = (".llmctl-quantize-tmp", ".llmctl-sparsify-tmp", ".llmctl-sparse-stage")
RECIPE_FILE = "recipe.yaml"
RECIPE_HEADER = "# llmctl "  # first line of every recipe.yaml llmctl writes
# distill's recipe (same header) and report: an output folder of `llmctl distill`
DISTILL_FILES = ("distill.yaml", "distill_report.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
SIDE_FILE_PREFIXES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "generation_config",
    "vocab",
    "merges",
    "chat_template",
    "license",
    "notice",
)
# auto_map names custom code that is not copied; quantization_config is the source's scheme
DROPPED_CONFIG_KEYS = ("auto_map", "quantization_config")


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # follows symlinks: a link names its target
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _ancestors(path: Path) -> list[tuple[int, int]]:
    """Identities of `path` (when it exists) and of every folder above it, looked up along the path
    as written and along its resolved form."""
    ids: list[tuple[int, int]] = []
    for p in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        for q in (p, *p.parents):
            i = _identity(q)
            if i is not None and i not in ids:
                ids.append(i)
    return ids


def same_or_inside(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies anywhere below it (by inode, not by name)."""
    target = _identity(folder)
    return target is not None and target in _ancestors(path)


def check_disjoint(source: Path, out: Path, flag: str = "-o") -> None:
    """Refuse an output that is the source folder, lies inside it, or contains it."""
    if same_or_inside(out, source):
        raise UsageError(
            f"{flag} {out} is the source model folder {source} or lies inside it; "
            "writing there would destroy the source: choose another folder"
        )
    if same_or_inside(source, out):
        raise UsageError(
            f"{flag} {out} contains the source model folder {source}; choose another folder"
        )


def _is_ours(entry: Path, keep: tuple[Path, ...]) -> bool:
    """Whether `entry` of an output folder is something llmctl writes there."""
    name = entry.name
    if name in (WORK_DIR, *LEGACY_WORK_DIRS):
        return True
    if any(_identity(entry) == _identity(k) for k in keep if k.exists()):
        return True
    if not entry.is_file() or entry.is_symlink():
        return False
    if name in ("config.json", RECIPE_FILE, "model.safetensors.index.json", *DISTILL_FILES):
        return True
    if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", name):
        return True
    return name.lower().startswith(SIDE_FILE_PREFIXES) and not name.endswith(WEIGHT_SUFFIXES)


def _is_llmctl_output(folder: Path) -> bool:
    """Whether `folder` holds the recipe llmctl writes: quantize/sparsify's or distill's."""
    for recipe in (RECIPE_FILE, DISTILL_FILES[0]):
        try:
            with open(folder / recipe, encoding="utf-8") as f:
                if f.readline().startswith(RECIPE_HEADER):
                    return True
        except (OSError, UnicodeDecodeError):
            continue
    return False


def _check_writable(path: Path, flag: str) -> None:
    """The nearest existing folder at or above `path` must be writable."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{flag} {path}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(
            f"{flag} {path}: folder {probe} is not writable (read-only or no permission)"
        )


@dataclass(frozen=True)
class OutputFolder:
    """The output folder `final` and its work folder inside it (see the module docstring)."""

    final: Path

    @property
    def work(self) -> Path:
        return self.final / WORK_DIR

    @property
    def resume_dir(self) -> Path:
        return self.work / "resume"

    @property
    def result(self) -> Path:
        return self.work / "result"

    @classmethod
    def at(cls, output: str | Path) -> "OutputFolder":
        """The folder `-o` names (symlinks resolved), unchecked."""
        return cls(Path(os.path.realpath(os.path.expanduser(str(output)))))

    @classmethod
    def plan(
        cls, output: str | Path, *, overwrite: bool, keep: tuple[Path, ...] = ()
    ) -> "OutputFolder":
        """Check `-o` before any work and create nothing. `keep`: files the run itself writes into
        the folder later (a --report-json there), which an --overwrite may replace."""
        final = cls.at(output).final
        if final.exists() and not final.is_dir():
            raise UsageError(f"-o {output} is a file, not a folder; give a folder")
        if final.is_dir():
            ours = (WORK_DIR, *LEGACY_WORK_DIRS)
            entries = sorted(e for e in final.iterdir() if e.name not in ours)
            if entries and not overwrite:
                raise UsageError(
                    f"output folder {output} is not empty; choose another -o or pass --overwrite"
                )
            foreign = [e.name for e in entries if not _is_ours(e, keep)]
            if entries and (foreign or not _is_llmctl_output(final)):
                what = f"holds {foreign[0]!r}, which" if foreign else "is not an output that"
                raise UsageError(
                    f"--overwrite refused: {output} {what} llmctl did not write "
                    "(it replaces only an earlier llmctl output); choose another -o"
                )
        _check_writable(final, "-o")
        return cls(final)

    def check_source(self, source: Path) -> None:
        """check_disjoint for this output; our own staging inside the work folder is allowed."""
        if same_or_inside(source, self.work):
            return
        check_disjoint(source, self.final)

    def fresh_result(self) -> Path:
        """An empty result folder (what an interrupted write left is removed first)."""
        with writing(f"-o {self.final}"):
            shutil.rmtree(self.result, ignore_errors=True)
            self.result.mkdir(parents=True)
        return self.result

    def commit(self) -> None:
        """Move the finished result into `final`, replacing an earlier output's files; config.json
        moves last, so an interrupted move never looks like a complete folder."""
        with writing(f"-o {self.final}"):
            replaced = self.work / "replaced"
            shutil.rmtree(replaced, ignore_errors=True)  # left by a move that was interrupted
            replaced.mkdir()
            for entry in self.final.iterdir():
                if entry.name != WORK_DIR:
                    os.replace(entry, replaced / entry.name)
            names = sorted(p.name for p in self.result.iterdir())
            for name in sorted(names, key=lambda n: n == "config.json"):
                os.replace(self.result / name, self.final / name)
            shutil.rmtree(self.work, ignore_errors=True)


def check_input_file(path: str | Path | None, flag: str) -> None:
    """An input file given by `flag` must exist and be a file."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path} not found")
    if not p.is_file():
        raise UsageError(f"{flag} {path} is not a file")


def check_output_file(
    path: str | Path | None, flag: str, inputs: tuple[Path, ...] = (), create_parents: bool = False
) -> None:
    """A file the run writes at the end (--report-json, --json, --csv): refuse now, before any
    work, a missing (unless `create_parents`) or unwritable folder, a folder or device in its
    place, or one of the run's inputs."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if p.exists() and not p.is_file():
        raise UsageError(f"{flag} {path} is not a regular file")
    if not create_parents and not p.parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {p.parent} does not exist")
    _check_writable(p.parent, flag)
    for source in inputs:
        if p.exists() and same_or_inside(p, source):
            raise UsageError(
                f"{flag} {path} would overwrite the input {source}; choose another file"
            )


@contextmanager
def writing(what: str) -> Iterator[None]:
    """OS errors inside become one line naming `what`; a full disk says how to go on."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LlmctlError(
                f"disk full while writing {what}; finished layers are kept: "
                "free space and rerun the same command to resume"
            ) from None
        raise LlmctlError(
            f"cannot write {what}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
        ) from None


def output_config(raw: dict, extra: dict) -> dict:
    """config.json of a model derived from `raw`: without DROPPED_CONFIG_KEYS, plus `extra`."""
    config = {k: v for k, v in raw.items() if k not in DROPPED_CONFIG_KEYS}
    config.update(extra)
    return config


def copy_side_files(source: Path, dest: Path) -> None:
    """Tokenizer, generation config, chat template and licence files; not weights, not reports
    about the source model (a train_report.json would describe weights we changed)."""
    for f in sorted(source.iterdir()):
        name = f.name.lower()
        side = name.startswith(SIDE_FILE_PREFIXES) and not name.endswith(WEIGHT_SUFFIXES)
        if f.is_file() and side:
            shutil.copyfile(f, dest / f.name)
