"""The resume state of a run-batch job: a small JSON file beside the output, replaced atomically.

Owns: `JobState` (what was committed: output size in bytes, where to continue reading, which rows
past that point are already written, running totals), its atomic save (tmp + fsync + rename +
directory fsync) and load, the settings fingerprint that decides whether a rerun may continue,
and the file names (state file; the JSONL journal of a Parquet output).

Invariant: every row before `next_index`, and every row in `done_after`, is in the output's first
`output_bytes` bytes exactly once; nothing else is. A rerun truncates the output to
`output_bytes` and continues reading at `next_index`/`next_position`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.errors import UsageError

STATE_VERSION = 1


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".llmctl-state.json")


def journal_path(output: Path) -> Path:
    """Where a Parquet output's rows are appended (JSONL) until the job ends and converts them."""
    return output.with_name(output.name + ".llmctl-journal.jsonl")


@dataclass
class JobState:
    fingerprint: dict
    created: int  # unix time the job first started (OpenAI `created`, same across resumes)
    next_index: int = 0  # first row not known to be written
    next_position: int = 0  # where that row starts in the input
    done_after: list[int] = field(default_factory=list)  # rows > next_index already written (unordered)
    output_bytes: int = 0
    stats: dict = field(default_factory=dict)
    complete: bool = False
    version: int = STATE_VERSION

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "complete": self.complete, "created": self.created,
                           "next_index": self.next_index, "next_position": self.next_position,
                           "done_after": self.done_after, "output_bytes": self.output_bytes,
                           "fingerprint": self.fingerprint, "stats": self.stats}, separators=(",", ":"))


def save_state(path: Path, state: JobState) -> None:
    """Write the state so that a crash at any instant leaves either the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(state.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; the rename is still atomic
    finally:
        os.close(fd)


def load_state(path: Path) -> JobState | None:
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"version {d.get('version')}")
        return JobState(fingerprint=d["fingerprint"], created=int(d["created"]), next_index=int(d["next_index"]),
                        next_position=int(d["next_position"]), done_after=[int(i) for i in d["done_after"]],
                        output_bytes=int(d["output_bytes"]), stats=dict(d["stats"]), complete=bool(d["complete"]))
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is not a readable run-batch state file ({e}); pass --overwrite to start over") from None


def fingerprint_mismatch(saved: dict, current: dict) -> str | None:
    """A one-line description of the first setting that differs, or None when a rerun may continue."""
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a != b:
            if key == "input_bytes":
                return f"the input changed since the job started ({a} bytes, now {b})"
            return f"{key} was {_show(a)}, now {_show(b)}"
    return None


def _show(v: object) -> str:
    return "unset" if v is None else json.dumps(v, sort_keys=True)
