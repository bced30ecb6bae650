"""Content fingerprints that let a resumed job prove it reads the input and output it left.

Owns: `PrefixHasher`, a running BLAKE2b of a JSONL input's bytes as they are read, able to give
the digest of the prefix that ends at any line boundary not yet committed (the reader runs ahead
of the commits, so a copy of the hash is kept per line until a commit passes it; only while a
state file is kept), and `file_digest` (BLAKE2b of a whole file, for Parquet inputs and finished
outputs). A rerun re-reads the committed prefix, from a file or a pipe alike, and compares.
"""

from __future__ import annotations

import hashlib
from collections import deque
from pathlib import Path

DIGEST_SIZE = 16  # bytes: collisions are not a concern between two versions of one input


def _new():
    return hashlib.blake2b(digest_size=DIGEST_SIZE)


class PrefixHasher:
    def __init__(self) -> None:
        self._hash = _new()
        self._marks: deque[tuple[int, "hashlib._Hash"]] = deque()  # (line end offset, hash copy)
        self.tracking = False  # set by whoever will ask for digests (the state file's writer)

    def update(self, data: bytes) -> None:
        self._hash.update(data)

    def mark(self, position: int) -> None:
        """A line ends at byte `position`: keep the digest there until a commit passes it."""
        if self.tracking:
            self._marks.append((position, self._hash.copy()))

    def current(self) -> str:
        return self._hash.hexdigest()

    def digest_at(self, position: int) -> str:
        """The digest of the input's first `position` bytes (a line boundary already read)."""
        while self._marks and self._marks[0][0] < position:
            self._marks.popleft()
        if self._marks and self._marks[0][0] == position:
            return self._marks[0][1].hexdigest()
        if position == 0:
            return _new().hexdigest()
        raise RuntimeError(f"no input digest kept at byte {position}")  # a bug, not a user error


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    h = _new()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            h.update(data)
    return h.hexdigest()
