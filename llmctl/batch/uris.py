"""Inputs named by a pyarrow filesystem URI (s3://, gs://, hdfs://, file://...), read in place.

Owns: what counts as a URI (a scheme and `://`, and no local file of that name), opening one as
a seekable binary stream with `readline` (pyarrow's files have none), its size, and the refusals
(missing, a folder). A run-batch job on a URI input reads, detects, hashes and resumes it as it
does a local file; only its output is local.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

from llmctl.errors import UsageError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(name: str | os.PathLike) -> bool:
    name = str(name)
    return bool(_SCHEME.match(name)) and not Path(name).exists()


def _locate(uri: str) -> tuple[Any, str]:
    """(filesystem, path) of an existing file; a one-line UsageError otherwise."""
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot open input {uri}: {str(e).splitlines()[0]}") from None
    if info.type == pafs.FileType.NotFound:
        raise UsageError(f"input {uri} not found")
    if info.type == pafs.FileType.Directory:
        raise UsageError(f"input {uri} is a folder; pass a .jsonl or .parquet file")
    return fs, path


class _Raw(io.RawIOBase):
    """A pyarrow random-access file as a raw stream, for io.BufferedReader."""

    def __init__(self, f: Any):
        self._f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()
        super().close()


def open_uri(uri: str) -> BinaryIO:
    fs, path = _locate(uri)
    return io.BufferedReader(_Raw(fs.open_input_file(path)), 1 << 20)  # type: ignore[return-value]


def open_binary(name: str | os.PathLike) -> BinaryIO:
    """A local file or a URI, opened for reading bytes."""
    return open_uri(str(name)) if is_uri(name) else open(name, "rb")


def input_size(name: str) -> int:
    if not is_uri(name):
        return os.path.getsize(name)
    fs, path = _locate(name)
    return fs.get_file_info(path).size
