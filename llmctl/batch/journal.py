"""The resume state of a run-batch job: a small JSON file beside the output, replaced atomically.

Owns: `JobState` (what was committed: output size and hash, where to continue reading, which rows
past that point are already written, the hash of the input consumed, running totals; once
complete, the finished output's size and hash), its atomic save (tmp + fsync + rename + directory
fsync) and load, the settings fingerprint that decides whether a rerun may continue, and the file
names (state file; the JSONL journal of a Parquet output).

Invariant: every row before `next_index`, and every row in `done_after`, is in the output's first
`output_bytes` bytes (BLAKE2b `output_blake2b`) exactly once; nothing else is; and they were read
from an input whose first `input_hash["position"]` bytes (JSONL) or row groups (Parquet) hash to
`input_hash["blake2b"]`. A rerun checks both hashes, truncates the output to `output_bytes` and
continues reading at `next_index`/`next_position`.

Schema versions: 2 adds the hashes. A version 1 state (from an older llmctl) is still resumed,
with a warning that the contents cannot be checked (its size checks still apply); a state from a
newer llmctl is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmctl.errors import UsageError

STATE_VERSION = 2
LEGACY_VERSIONS = (1,)  # resumed without content checks


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".llmctl-state.json")


def journal_path(output: Path) -> Path:
    """Where a Parquet output's rows are appended (JSONL) until the job ends and converts them."""
    return output.with_name(output.name + ".llmctl-journal.jsonl")


def temp_path(path: Path) -> Path:
    """Where a file is written before it atomically replaces path."""
    return path.with_name(path.name + ".tmp")


@dataclass
class JobState:
    fingerprint: dict
    created: int  # unix time the job first started (OpenAI `created`, same across resumes)
    next_index: int = 0  # first row not known to be written
    next_position: int = 0  # where that row starts in the input
    done_after: list[int] = field(
        default_factory=list
    )  # rows > next_index already written (unordered)
    output_bytes: int = 0
    stats: dict = field(default_factory=dict)
    complete: bool = False
    output_blake2b: str | None = None  # hash of the first output_bytes bytes (None: legacy state)
    input_hash: dict | None = None  # {"position": P, "blake2b": hex} of the input consumed
    final_bytes: int | None = None  # complete: size and hash of the finished output file
    final_blake2b: str | None = None
    version: int = STATE_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": STATE_VERSION,
                "complete": self.complete,
                "created": self.created,
                "next_index": self.next_index,
                "next_position": self.next_position,
                "done_after": self.done_after,
                "output_bytes": self.output_bytes,
                "output_blake2b": self.output_blake2b,
                "input_hash": self.input_hash,
                "final_bytes": self.final_bytes,
                "final_blake2b": self.final_blake2b,
                "fingerprint": self.fingerprint,
                "stats": self.stats,
            },
            separators=(",", ":"),
        )

    @property
    def legacy(self) -> bool:
        return self.version in LEGACY_VERSIONS


def save_state(path: Path, state: JobState) -> None:
    """Write the state so that a crash at any instant leaves either the old or the new file."""
    tmp = temp_path(path)
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
    """The state saved at path, None when there is none; UsageError when it cannot be used."""
    if not path.exists() and not path.is_symlink():
        return None
    hint = "pass --overwrite to start over"
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        version = d.get("version") if isinstance(d, dict) else None
        if isinstance(version, int) and version > STATE_VERSION:
            raise UsageError(
                f"{path} was written by a newer llmctl (state version {version}); "
                f"resume with that version, or {hint}"
            )
        if version != STATE_VERSION and version not in LEGACY_VERSIONS:
            raise ValueError(f"unknown version {version!r}")
        return _state_from_dict(d, version)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else e
        raise UsageError(f"cannot read {path} ({why}); {hint}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{path} is not a readable run-batch state file ({e}); {hint}") from None


def _state_from_dict(d: dict, version: int) -> JobState:
    counts = {k: int(d[k]) for k in ("created", "next_index", "next_position", "output_bytes")}
    if any(v < 0 for v in counts.values()):
        raise ValueError("negative position")
    if not isinstance(d["fingerprint"], dict) or not isinstance(d["stats"], dict):
        raise ValueError("fingerprint and stats must be objects")
    input_hash = d.get("input_hash")
    if input_hash is not None:
        input_hash = {
            "position": int(input_hash["position"]),
            "blake2b": str(input_hash["blake2b"]),
        }
    final_bytes = d.get("final_bytes")
    return JobState(
        fingerprint=d["fingerprint"],
        done_after=[int(i) for i in d["done_after"]],
        stats=dict(d["stats"]),
        complete=bool(d["complete"]),
        version=version,
        output_blake2b=_opt_str(d.get("output_blake2b")),
        input_hash=input_hash,
        final_bytes=None if final_bytes is None else int(final_bytes),
        final_blake2b=_opt_str(d.get("final_blake2b")),
        **counts,
    )


def _opt_str(v: object) -> str | None:
    return None if v is None else str(v)


def fingerprint_mismatch(saved: dict, current: dict) -> str | None:
    """A one-line description of the first setting that differs, or None when a rerun may
    continue."""
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a != b:
            if key == "input_bytes":
                return f"the input changed since the job started ({a} bytes, now {b})"
            return f"{key} was {_show(a)}, now {_show(b)}"
    return None


def _show(v: object) -> str:
    return "unset" if v is None else json.dumps(v, sort_keys=True)
