"""Calibration and evaluation token data for quantize and sparsify.

Owns: reading JSONL (the run-batch record shapes: `prompt_token_ids`, `prompt`, `messages`, or
`text`), Parquet (the same columns) and plain text files into one token stream, cutting it into
`num_samples` sequences of `seq_len` tokens, and holding out the stream's last tokens for
perplexity. Without a file, the built-in default is `llmctl/compress/data/calib_default.txt`: a few
KB of mixed English prose, code, dialogue and arithmetic, written for this project; it is small and
generic, so callers warn that data from the user's own domain is better.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from llmctl.errors import RequestError, UsageError

DEFAULT_CALIB_FILE = Path(__file__).resolve().parent / "data" / "calib_default.txt"
DEFAULT_WARNING = (
    "no --calib file: calibrating on llmctl's small built-in text; calibration data from your own "
    "domain (--calib FILE) gives better results"
)
TEXT_COLUMNS = ("prompt_token_ids", "messages", "prompt", "text")


class Tokenizes(Protocol):
    """What a Runtime offers: text and chat messages to token ids."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Any) -> list[int]: ...


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # [num_samples, seq_len] int64
    heldout: torch.Tensor | None  # [tokens] int64, for perplexity; None when too little data
    source: str
    warnings: list[str] = field(default_factory=list)


def _record_tokens(rec: Any, tok: Tokenizes, where: str) -> list[int]:
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: expected a JSON object with one of {', '.join(TEXT_COLUMNS)}")
    try:
        if rec.get("prompt_token_ids") is not None:
            ids = rec["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise UsageError(f"{where}: prompt_token_ids must be a list of integers")
            return ids
        if rec.get("messages") is not None:
            return tok.apply_chat_template(rec["messages"])
        for key in ("prompt", "text"):
            if isinstance(rec.get(key), str):
                return tok.encode(rec[key])
    except RequestError as e:
        raise UsageError(f"{where}: {e.message}") from None
    raise UsageError(f"{where}: no usable field; expected one of {', '.join(TEXT_COLUMNS)}")


def read_token_stream(path: Path, tok: Tokenizes, separator: int | None = None) -> list[int]:
    """All records of `path` tokenized and concatenated (records joined by `separator` if given)."""
    if not path.is_file():
        raise UsageError(f"calibration file {path} not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        records = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"{path.name}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path.name}:{n}: invalid JSON ({e.msg})") from None
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        cols = [c for c in TEXT_COLUMNS if c in table.column_names]
        if not cols:
            raise UsageError(f"{path.name}: no column named one of {', '.join(TEXT_COLUMNS)}")
        records = [(f"{path.name} row {i}", r) for i, r in enumerate(table.select(cols).to_pylist())]
    else:
        try:
            return _encode_text(path.read_text(), tok, path.name)
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not UTF-8 text; use .jsonl, .parquet or a text file") from None
    stream: list[int] = []
    for where, rec in records:
        stream.extend(_record_tokens(rec, tok, where))
        if separator is not None:
            stream.append(separator)
    return stream


def _encode_text(text: str, tok: Tokenizes, name: str) -> list[int]:
    try:
        return tok.encode(text)
    except RequestError as e:
        raise UsageError(f"{name}: {e.message}; give --calib as JSONL with prompt_token_ids") from None


def cut_sequences(stream: list[int], num_samples: int, seq_len: int) -> tuple[torch.Tensor, list[str]]:
    """Up to num_samples non-overlapping windows of seq_len, spread evenly over the stream."""
    warnings = []
    n_windows = len(stream) // seq_len
    if n_windows == 0:
        raise UsageError(f"calibration data has {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len}")
    ids = torch.tensor(stream[: n_windows * seq_len], dtype=torch.long).reshape(n_windows, seq_len)
    if n_windows < num_samples:
        warnings.append(f"calibration data gives only {n_windows} sequences of {seq_len} tokens (asked for {num_samples})")
        return ids, warnings
    pick = torch.linspace(0, n_windows - 1, num_samples).round().long().unique()
    return ids[pick], warnings


def load_calibration(
    calib: Path | None,
    tok: Tokenizes,
    *,
    num_samples: int,
    seq_len: int,
    eval_data: Path | None = None,
    heldout_fraction: float = 0.1,
    separator: int | None = None,
) -> CalibrationSet:
    """Calibration sequences plus held-out tokens (the last `heldout_fraction` of the calibration
    stream, or all of `eval_data` when given)."""
    warnings = []
    if calib is None:
        warnings.append(DEFAULT_WARNING)
        path = DEFAULT_CALIB_FILE
    else:
        path = Path(calib)
    stream = read_token_stream(path, tok, separator)
    if eval_data is not None:
        heldout = torch.tensor(read_token_stream(Path(eval_data), tok, separator), dtype=torch.long)
    else:
        cut = int(len(stream) * (1 - heldout_fraction))
        heldout = torch.tensor(stream[cut:], dtype=torch.long)
        stream = stream[:cut]
    ids, more = cut_sequences(stream, num_samples, seq_len)
    return CalibrationSet(ids, heldout if heldout.numel() > 1 else None, str(path), warnings + more)
