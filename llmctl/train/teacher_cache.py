"""The teacher's top-k logits cache of distill (--cache-teacher FILE): made once, then read.

Owns: `fingerprint` (what a cache must match: the teacher's files, the data's bytes, --seq-len,
--cache-top-k, the teacher's dtype and the held-out split), `build_cache` (one pass of the
teacher over the training sequences) and `TeacherCache` (the reader). FILE is a JSON index; the
tensors are safetensors shards beside it (`<FILE stem>-00000.safetensors`, ...), never pickle.
Each shard holds, for a run of consecutive packed sequences of seq_len S, at every position
0 .. S - 2 (the ones that predict a next token):
- `values` float32 [n, S - 1, k]: the k largest teacher log-probabilities (temperature 1);
- `indices` int32 [n, S - 1, k]: their token ids;
- `rest` float32 [n, S - 1]: log of the probability mass of the other V - k tokens.
losses.teacher_from_top_k turns them back into a full distribution. The index is written last,
so an interrupted pass leaves no usable cache. Sequences are numbered within an epoch of --data
(the stream repeats them in the same order), so a cache covers min(epoch, what the run needs).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from llmctl.errors import UsageError

SCHEMA = "llmctl.teacher_cache"
SHARD_SEQUENCES = 512  # sequences per shard
TEACHER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _teacher_files(folder: Path) -> dict:
    """The teacher's config and tokenizer by content; its weights by name, size and mtime (hashing
    a large teacher's weights would take minutes; rewriting them changes the mtime)."""
    doc: dict[str, Any] = {}
    for name in TEACHER_FILES:
        if (folder / name).is_file():
            doc[name] = _sha256(folder / name)
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name.endswith((".safetensors", ".bin")):
            st = f.stat()
            doc[f.name] = [st.st_size, st.st_mtime_ns]
    return doc


def fingerprint(teacher_path: Path, args, dtype: torch.dtype, limit: int | None) -> dict:
    """What a cache must match to be used by this run (see the module docstring)."""
    return {
        "teacher": _teacher_files(teacher_path),
        "teacher_dtype": str(dtype).replace("torch.", ""),
        "data_sha256": _sha256(Path(args.data)),
        "seq_len": args.seq_len,
        "top_k": args.cache_top_k,
        "epoch_limit": limit,
    }


def shard_path(index: Path, i: int) -> Path:
    return index.with_name(f"{index.stem}-{i:05d}.safetensors")


@torch.no_grad()
def _top_k(teacher, ids: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Teacher top-k of a batch ids [B, S]: values, indices [B, S - 1, k] and rest [B, S - 1]."""
    logp = torch.log_softmax(teacher.forward_dense(ids)[:, :-1].float(), dim=-1)  # [B, S - 1, V]
    values, indices = logp.topk(k, dim=-1)
    if k == logp.shape[-1]:
        rest = torch.full(logp.shape[:-1], float("-inf"))
    else:
        rest = torch.logsumexp(logp.scatter(-1, indices, float("-inf")), dim=-1)
    return {
        "values": values.cpu().contiguous(),
        "indices": indices.to(torch.int32).cpu().contiguous(),
        "rest": rest.cpu().contiguous(),
    }


def _write_shard(index: Path, i: int, parts: list[dict]) -> None:
    from llmctl.runtime.tensors import save_safetensors

    tensors = {key: torch.cat([p[key] for p in parts]) for key in ("values", "indices", "rest")}
    tmp = shard_path(index, i).with_suffix(".tmp")
    save_safetensors(tensors, tmp)
    os.replace(tmp, shard_path(index, i))


def build_cache(
    index: Path, teacher, sequences: Iterator, needed: int, batch_size: int, fp: dict,
    note: Callable[[str], None] | None = None,
) -> None:  # fmt: skip
    """Run the teacher over the first `needed` sequences of `sequences` (Sequence objects) and
    write the shards and the index."""
    device = next(teacher.parameters()).device
    shards: list[dict] = []
    parts: list[dict] = []
    done, pending, exhausted = 0, 0, False
    while done < needed:
        batch = [s.ids for _, s in zip(range(min(batch_size, needed - done)), sequences)]
        exhausted = len(batch) < min(batch_size, needed - done)
        if batch:
            parts.append(_top_k(teacher, torch.stack(batch).to(device), fp["top_k"]))
            done, pending = done + len(batch), pending + len(batch)
        if parts and (pending >= SHARD_SEQUENCES or exhausted or done >= needed):
            _write_shard(index, len(shards), parts)
            shards.append({"file": shard_path(index, len(shards)).name, "count": pending})
            parts, pending = [], 0
        if exhausted:
            break
    doc = {
        "schema": SCHEMA, "schema_version": 1, "fingerprint": fp, "sequences": done,
        "whole_epoch": exhausted, "shards": shards,
    }  # fmt: skip
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, index)
    if note is not None:
        note(f"--cache-teacher: wrote the teacher's top-{fp['top_k']} of {done} sequences")


class TeacherCache:
    """Reads the cache at `index` (checked against the run's fingerprint by `open`)."""

    def __init__(self, index: Path, doc: dict):
        self.index, self.doc = index, doc
        self.top_k = doc["fingerprint"]["top_k"]
        self._starts: list[int] = []
        first = 0
        for shard in doc["shards"]:
            self._starts.append(first)
            first += shard["count"]
        self._open: dict[int, Any] = {}

    @classmethod
    def open(cls, index: Path, fp: dict, needed: int) -> "TeacherCache":
        """The cache at `index`; a one-line UsageError when it is not one, was made from other
        data, teacher or options, or covers fewer sequences than the run needs."""
        try:
            doc = json.loads(index.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            raise UsageError(f"--cache-teacher {index} is not a readable cache index") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise UsageError(f"--cache-teacher {index} is not an llmctl teacher cache")
        theirs = doc.get("fingerprint", {})
        changed = [k for k in fp if theirs.get(k) != fp[k]]
        if changed:
            raise UsageError(
                f"--cache-teacher {index} was made from another {changed[0].replace('_', ' ')} "
                "than this run's; remove it (and its shards) or give another FILE"
            )
        if not doc["whole_epoch"] and doc["sequences"] < needed:
            raise UsageError(
                f"--cache-teacher {index} covers {doc['sequences']} sequences; this run needs "
                f"{needed}: remove it (and its shards) to cache again"
            )
        return cls(index, doc)

    def _shard(self, i: int):
        from safetensors import safe_open

        if i not in self._open:
            self._open[i] = safe_open(
                str(self.index.with_name(self.doc["shards"][i]["file"])), "pt"
            )
        return self._open[i]

    def rows(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values [B, S - 1, k], indices [B, S - 1, k] int64, rest [B, S - 1]) of the in-epoch
        sequence numbers `seqs`."""
        import bisect

        out: dict[str, list[torch.Tensor]] = {"values": [], "indices": [], "rest": []}
        for n in seqs:
            if n >= self.doc["sequences"]:
                raise UsageError(f"--cache-teacher {self.index} has no sequence {n}")
            i = bisect.bisect_right(self._starts, n) - 1
            row = n - self._starts[i]
            f = self._shard(i)
            for key in out:
                out[key].append(f.get_slice(key)[row : row + 1])
        v, ix, r = (torch.cat(out[k]) for k in ("values", "indices", "rest"))
        return v, ix.long(), r
