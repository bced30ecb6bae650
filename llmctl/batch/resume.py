"""Resume decisions for a run-batch job on a file: start afresh, continue, or refuse.

Owns: reading the state beside an output and deciding, before any write, whether the rerun is the
same job (settings fingerprint), on the same input (its consumed prefix re-hashed) and the same
output (its committed prefix re-hashed); a finished job's output must still be the file it
finished. A refusal is a one-line UsageError that names --overwrite.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.batch.digests import (
    FileHasher,
    PrefixChanged,
    StreamHasher,
    hash_file_prefix,
    new_hasher,
    parquet_hasher,
)
from llmctl.batch.journal import (
    STATE_VERSION,
    JobState,
    fingerprint_mismatch,
    load_state,
    state_path,
)
from llmctl.batch.uris import is_uri
from llmctl.errors import UsageError

OVERWRITE = "pass --overwrite to start over"


@dataclass
class Plan:
    state: JobState
    input_hasher: Any = None  # FileHasher or StreamHasher: digest_at(position)
    output_hasher: Any = None  # hash of the sink file's first state.output_bytes bytes


@dataclass(frozen=True)
class Target:
    """The files of a job on an output: `out`, and `sink` (the file rows are appended to: `out`,
    or the journal of a Parquet output)."""

    out: Path
    sink: Path
    parquet: bool


def input_hasher(input_path: str, source_format: str, stream: StreamHasher | None):
    if stream is not None:
        return stream
    path = input_path if is_uri(input_path) else Path(input_path)  # Path() would drop a '/'
    if source_format == "parquet":
        return parquet_hasher(path)
    return FileHasher(path)


def plan(
    input_path: str,
    overwrite: bool,
    target: Target,
    fp: dict,
    source_format: str,
    stream: StreamHasher | None,
    info,
) -> Plan:
    """What to continue from; a fresh state when nothing was committed. Refuses unsafe reruns."""
    out = target.out
    state = None if overwrite else load_state(state_path(out))
    if (
        state is not None
        and not state.complete
        and state.stats.get("rows", 0) == 0
        and state.output_bytes == 0
    ):
        state = None  # nothing was committed (e.g. the model failed to load): start afresh
    if state is None:
        foreign = out.exists() and out.stat().st_size > 0 and not state_path(out).exists()
        if foreign and not overwrite:
            raise UsageError(
                f"{out} exists and has no run-batch state beside it; pass --overwrite to replace it"
            )
        hasher = input_hasher(input_path, source_format, stream)
        fresh = JobState(
            fingerprint=fp,
            created=int(time.time()),
            input_hash={"position": 0, "blake2b": hasher.digest_at(0)},
        )
        return Plan(fresh, hasher, new_hasher())
    diff = fingerprint_mismatch(state.fingerprint, fp)
    if diff is not None:
        raise UsageError(
            f"cannot resume {out}: {diff}; rerun with the same settings, or {OVERWRITE}"
        )
    if state.complete:
        verify_finished(out, target.parquet, state)
        return Plan(state)
    if state.output_bytes > 0 and not target.sink.exists():
        raise UsageError(f"cannot resume {out}: its partial output is gone; {OVERWRITE}")
    if state.legacy:
        info(
            f"{state_path(out)} is from an older llmctl: the input and output contents "
            f"cannot be checked, only their sizes; resuming"
        )
        state.version = STATE_VERSION
    hasher = verify_input(input_hasher(input_path, source_format, stream), out, stream, state)
    return Plan(state, hasher, verify_output(target.sink, state))


def verify_input(hasher, out: Path, stream: StreamHasher | None, state: JobState):
    """The input hasher, after checking the input starts with the bytes the job consumed."""
    if state.input_hash is None:
        return hasher
    position, digest = state.input_hash["position"], state.input_hash["blake2b"]
    if stream is not None:
        stream.expect(position, digest)  # checked as the stream is read again (before any commit)
        return stream
    try:
        same = hasher.digest_at(position) == digest
    except PrefixChanged:
        same = False
    if not same:
        raise UsageError(
            f"cannot resume {out}: the input changed since the job started (the rows "
            f"already served are not the same); rerun with that input, or {OVERWRITE}"
        )
    return hasher


def verify_output(sink: Path, state: JobState):
    """The hash of the sink file's committed prefix, after checking it against the state."""
    size = sink.stat().st_size if sink.exists() else 0
    if size < state.output_bytes:
        raise UsageError(
            f"cannot resume: {sink} is shorter ({size} bytes) than its state file "
            f"says ({state.output_bytes}); it was changed by hand: {OVERWRITE}"
        )
    hasher = hash_file_prefix(sink, state.output_bytes)
    if state.output_blake2b is not None and hasher.hexdigest() != state.output_blake2b:
        raise UsageError(
            f"cannot resume: the first {state.output_bytes} bytes of {sink} (the "
            f"rows committed) were changed since; {OVERWRITE}"
        )
    return hasher


def verify_finished(out: Path, parquet: bool, state: JobState) -> None:
    """A finished output must still be the file the job finished."""
    again = "pass --overwrite to run the job again"
    if not out.is_file():
        raise UsageError(f"{out} is gone although its job finished; {again}")
    size = out.stat().st_size
    want = state.final_bytes
    if want is None and not parquet:  # a legacy state: a JSONL output is its committed bytes
        want = state.output_bytes
    if want is not None and size != want:
        raise UsageError(
            f"{out} was changed since its job finished ({size} bytes, was {want}); {again}"
        )
    if (
        state.final_blake2b is not None
        and hash_file_prefix(out, size).hexdigest() != state.final_blake2b
    ):
        raise UsageError(
            f"{out} was changed since its job finished (same size, other bytes); {again}"
        )
