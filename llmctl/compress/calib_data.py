"""Calibration and evaluation token data for quantize and sparsify.

Owns: reading JSONL (the run-batch record shapes: `prompt_token_ids`, `prompt`, `messages`, or
`text`), Parquet (the same columns) and plain text files into one token stream, cutting it into
`num_samples` sequences of `seq_len` tokens, and holding out the stream's last tokens for
perplexity. Without a file, the built-in default is `llmctl/compress/data/calib_default.txt`: a few
KB of mixed English prose, code, dialogue and arithmetic, written for this project; it is small and
generic, so callers warn that data from the user's own domain is better. Anything wrong with a
file or a row (not UTF-8, bad JSON, a token id outside the vocabulary, a text the tokenizer
refuses, too little data) is a one-line UsageError naming the file and row; a UTF-8 BOM is skipped.
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


def _record_tokens(
    rec: Any, tok: Tokenizes, where: str, vocab_size: int | None = None
) -> list[int]:
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: expected a JSON object with one of {', '.join(TEXT_COLUMNS)}")
    if rec.get("prompt_token_ids") is not None:
        ids = rec["prompt_token_ids"]
        ints = isinstance(ids, list) and all(type(i) is int for i in ids)  # bool is no token id
        if not ints:
            raise UsageError(f"{where}: prompt_token_ids must be a list of integers")
        bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
        if bad:
            top = (vocab_size or 1) - 1
            raise UsageError(f"{where}: token id {bad[0]} is outside the vocabulary (0 to {top})")
        return ids
    try:
        if rec.get("messages") is not None:
            return tok.apply_chat_template(rec["messages"])
        for key in ("prompt", "text"):
            if isinstance(rec.get(key), str):
                return tok.encode(rec[key])
    except RequestError as e:
        raise UsageError(f"{where}: {e.message}") from None
    except Exception as e:  # the tokenizer or chat template refused the row
        raise UsageError(f"{where}: cannot tokenize ({type(e).__name__}: {e})") from None
    raise UsageError(f"{where}: no usable field; expected one of {', '.join(TEXT_COLUMNS)}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading BOM is skipped
    except UnicodeDecodeError:
        raise UsageError(
            f"{path}: not UTF-8 text; use .jsonl, .parquet or a UTF-8 text file"
        ) from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


def _jsonl_records(path: Path) -> list[tuple[str, Any]]:
    records = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            try:
                records.append((f"{path.name}:{n}", json.loads(line)))
            except (ValueError, RecursionError) as e:  # bad JSON, over-long integers, deep nesting
                why = getattr(e, "msg", None) or e
                raise UsageError(f"{path.name}:{n}: invalid JSON ({why})") from None
    return records


def _parquet_records(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{path.name}: not a readable Parquet file ({e})") from None
    cols = [c for c in TEXT_COLUMNS if c in table.column_names]
    if not cols:
        raise UsageError(f"{path.name}: no column named one of {', '.join(TEXT_COLUMNS)}")
    return [(f"{path.name} row {i}", r) for i, r in enumerate(table.select(cols).to_pylist())]


def read_token_stream(
    path: Path, tok: Tokenizes, separator: int | None = None, vocab_size: int | None = None
) -> list[int]:
    """All records of `path` tokenized and concatenated (records joined by `separator` if given)."""
    if not path.is_file():
        raise UsageError(f"calibration file {path} not found")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        records = _jsonl_records(path)
    elif suffix == ".parquet":
        records = _parquet_records(path)
    else:
        return _encode_text(_read_text(path), tok, path.name)
    stream: list[int] = []
    for where, rec in records:
        stream.extend(_record_tokens(rec, tok, where, vocab_size))
        if separator is not None:
            stream.append(separator)
    return stream


def _encode_text(text: str, tok: Tokenizes, name: str) -> list[int]:
    try:
        return tok.encode(text)
    except RequestError as e:
        raise UsageError(
            f"{name}: {e.message}; give --calib as JSONL with prompt_token_ids"
        ) from None
    except Exception as e:  # the tokenizer refused the text
        raise UsageError(f"{name}: cannot tokenize ({type(e).__name__}: {e})") from None


def cut_sequences(
    stream: list[int], num_samples: int, seq_len: int, source: str = "calibration data"
) -> tuple[torch.Tensor, list[str]]:
    """Up to num_samples non-overlapping windows of seq_len, spread evenly over the stream."""
    warnings = []
    n_windows = len(stream) // seq_len
    if n_windows == 0:
        raise UsageError(
            f"{source} has {len(stream)} tokens for calibration, fewer than one "
            f"sequence of --seq-len {seq_len}; give more data or a smaller --seq-len"
        )
    ids = torch.tensor(stream[: n_windows * seq_len], dtype=torch.long).reshape(n_windows, seq_len)
    if n_windows < num_samples:
        warnings.append(
            f"calibration data gives only {n_windows} sequences of {seq_len} tokens (asked for "
            f"{num_samples})"
        )
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
    vocab_size: int | None = None,
) -> CalibrationSet:
    """Calibration sequences plus held-out tokens (the last `heldout_fraction` of the calibration
    stream, or all of `eval_data` when given)."""
    warnings = []
    if calib is None:
        warnings.append(DEFAULT_WARNING)
        path = DEFAULT_CALIB_FILE
    else:
        path = Path(calib)
    stream = read_token_stream(path, tok, separator, vocab_size)
    if eval_data is not None:
        held = read_token_stream(Path(eval_data), tok, separator, vocab_size)
        heldout = torch.tensor(held, dtype=torch.long)
    else:
        cut = int(len(stream) * (1 - heldout_fraction))
        heldout = torch.tensor(stream[cut:], dtype=torch.long)
        stream = stream[:cut]
    ids, more = cut_sequences(stream, num_samples, seq_len, str(path))
    return CalibrationSet(ids, heldout if heldout.numel() > 1 else None, str(path), warnings + more)
