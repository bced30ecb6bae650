"""Training data for distill: records streamed from a file, tokenized with loss masks, packed.

Owns: reading JSONL and Parquet rows (`text`; `prompt` + `completion`, loss on the completion only;
`messages` through the chat template, loss on the assistant tokens only) and plain text (in blocks
of lines), `Packer` (fixed-length sequences across record boundaries), and `SequenceStream`: the
packed sequences in file order, epoch after epoch, never the whole file in memory, addressed by a
global sequence index so a resumed run skips exactly what it had consumed. A record is followed by
the end-of-sequence token (a target), so packed documents do not run into each other. Anything
wrong with a row is a one-line UsageError naming the file and row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from llmctl.errors import RequestError, UsageError

TEXT_BLOCK_CHARS = 1 << 16  # plain text is tokenized in blocks of whole lines of about this size
COLUMNS = ("text", "prompt", "completion", "messages")
PROMPT_MASK, TARGET_MASK = 0, 1


@dataclass(frozen=True)
class Sequence:
    ids: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor  # [seq_len] bool: token t is a training target (predicted from t - 1)


def _read_lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield from f
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text; use .jsonl, .parquet or UTF-8 text") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(_read_lines(path), 1):
        if line.strip():
            try:
                yield f"{path.name}:{n}", json.loads(line)
            except (ValueError, RecursionError) as e:
                raise UsageError(
                    f"{path.name}:{n}: invalid JSON ({getattr(e, 'msg', e)})"
                ) from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{path.name}: not a readable Parquet file ({e})") from None
    cols = [c for c in COLUMNS if c in pf.schema_arrow.names]
    if not cols:
        raise UsageError(f"{path.name}: no column named one of {', '.join(COLUMNS)}")
    row = 0
    for batch in pf.iter_batches(batch_size=256, columns=cols):
        for rec in batch.to_pylist():
            yield f"{path.name} row {row}", rec
            row += 1


def _text_blocks(path: Path) -> Iterator[str]:
    block: list[str] = []
    size = 0
    for line in _read_lines(path):
        block.append(line)
        size += len(line)
        if size >= TEXT_BLOCK_CHARS:
            yield "".join(block)
            block, size = [], 0
    if block:
        yield "".join(block)


class Tokenize:
    """Records -> (ids, mask) lists with the model's tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, eos_id: int | None):
        self.tok = tokenizer
        self.eos = [] if eos_id is None else [eos_id]
        self._template: Any = None

    def text(self, text: str, special: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def record(self, rec: Any, where: str) -> tuple[list[int], list[int]]:
        if not isinstance(rec, dict):
            raise UsageError(
                f"{where}: expected a JSON object with text, prompt + completion or messages"
            )
        try:
            if rec.get("messages") is not None:
                return self._chat(rec["messages"])
            if isinstance(rec.get("prompt"), str) or isinstance(rec.get("completion"), str):
                if not (
                    isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str)
                ):
                    raise UsageError(f"{where}: prompt and completion must both be strings")
                p, c = self.text(rec["prompt"], True), self.text(rec["completion"], False)
                c += self.eos
                return p + c, [PROMPT_MASK] * len(p) + [TARGET_MASK] * len(c)
            if isinstance(rec.get("text"), str):
                ids = self.text(rec["text"], True) + self.eos
                return ids, [TARGET_MASK] * len(ids)
        except RequestError as e:
            raise UsageError(f"{where}: {e.message}") from None
        except UsageError as e:
            raise UsageError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
        except Exception as e:  # the tokenizer or the chat template refused the row
            raise UsageError(f"{where}: cannot tokenize ({type(e).__name__}: {e})") from None
        raise UsageError(
            f"{where}: no usable field; expected text, prompt + completion or messages"
        )

    def _chat(self, messages: Any) -> tuple[list[int], list[int]]:
        """The conversation through the chat template; targets: the tokens that start inside an
        assistant message's span of the rendered text (its content and the template's closing
        marks up to the next message)."""
        from llmctl.engine.requests import validate_messages
        from llmctl.runtime.chat_template import ChatTemplate

        messages = validate_messages(messages)
        if not getattr(self.tok, "chat_template", None):
            raise UsageError("the teacher's tokenizer has no chat template; use text or prompt")
        if self._template is None:
            self._template = ChatTemplate(self.tok)
        full = self._template.render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                start = (
                    len(self._template.render(messages[:i], add_generation_prompt=True)) if i else 0
                )
                end = len(self._template.render(messages[: i + 1], add_generation_prompt=False))
                spans.append((start, end))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a <= begin < b for a, b in spans)) for begin, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask


def token_records(path: Path, tokenize: Tokenize) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, mask) of every record of `path`, in file order."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        for where, rec in _jsonl_records(path):
            yield tokenize.record(rec, where)
    elif suffix == ".parquet":
        for where, rec in _parquet_records(path):
            yield tokenize.record(rec, where)
    else:
        for block in _text_blocks(path):
            try:
                ids = tokenize.text(block, False)
            except Exception as e:
                raise UsageError(
                    f"{path.name}: cannot tokenize ({type(e).__name__}: {e})"
                ) from None
            yield ids, [TARGET_MASK] * len(ids)


def packed(path: Path, tokenize: Tokenize, seq_len: int) -> Iterator[Sequence]:
    """One pass over `path` as sequences of seq_len tokens (the last partial one is dropped)."""
    ids: list[int] = []
    mask: list[int] = []
    for rec_ids, rec_mask in token_records(path, tokenize):
        ids.extend(rec_ids)
        mask.extend(rec_mask)
        while len(ids) >= seq_len:
            yield Sequence(
                torch.tensor(ids[:seq_len], dtype=torch.long),
                torch.tensor(mask[:seq_len], dtype=torch.bool),
            )
            del ids[:seq_len], mask[:seq_len]


def count_sequences(path: Path, tokenize: Tokenize, seq_len: int) -> int:
    return sum(1 for _ in packed(path, tokenize, seq_len))


class SequenceStream:
    """Sequences [0, limit) of `path` (None: all) repeated epoch after epoch, from index `start`.
    `position` is the global index of the next sequence (epoch * limit + index in the epoch)."""

    def __init__(
        self,
        path: Path,
        tokenize: Tokenize,
        seq_len: int,
        limit: int | None = None,
        on_wrap: Callable[[int], None] | None = None,
    ):
        self.path, self.tokenize, self.seq_len, self.limit = path, tokenize, seq_len, limit
        self.on_wrap = on_wrap  # called with the sequences per epoch when the data first repeats
        self.position = 0
        self.last_index = 0  # index within its epoch of the sequence next() returned last
        self._it: Iterator[Sequence] | None = None
        self._in_epoch = 0

    def _epoch(self) -> Iterator[Sequence]:
        for i, seq in enumerate(packed(self.path, self.tokenize, self.seq_len)):
            if self.limit is not None and i >= self.limit:
                return
            yield seq

    def next(self) -> Sequence:
        for _ in range(2):
            if self._it is None:
                self._it, self._in_epoch = self._epoch(), 0
            seq = next(self._it, None)
            if seq is not None:
                self.position += 1
                self.last_index = self._in_epoch
                self._in_epoch += 1
                return seq
            if self._in_epoch == 0:
                break
            if self.on_wrap is not None and self.position == self._in_epoch:
                self.on_wrap(self._in_epoch)
            self._it = None  # the epoch ended: start the file again
        raise UsageError(f"--data {self.path} gives no sequence of --seq-len {self.seq_len} tokens")

    def skip(self, count: int) -> None:
        """Consume `count` sequences (a resumed run catching up with its checkpoint)."""
        for _ in range(count):
            self.next()


def file_tokens(path: Path, tokenize: Tokenize, cap: int) -> torch.Tensor:
    """The first `cap` token ids of `path` (records joined as in training): --eval-data."""
    out: list[int] = []
    for ids, _ in token_records(path, tokenize):
        out.extend(ids)
        if len(out) >= cap:
            break
    return torch.tensor(out[:cap], dtype=torch.long)


def tail_tokens(path: Path, tokenize: Tokenize, seq_len: int, first: int, cap: int) -> torch.Tensor:
    """Token ids of the packed sequences from index `first` on, at most `cap`: the held-out tail
    of --data when there is no --eval-data (training then stops at sequence `first`)."""
    out: list[int] = []
    for i, seq in enumerate(packed(path, tokenize, seq_len)):
        if i >= first:
            out.extend(seq.ids.tolist())
            if len(out) >= cap:
                break
    return torch.tensor(out[:cap], dtype=torch.long)
