"""The one folder llmctl caches things in: compiled kernels, kernel timings, machine peaks.

`$LLMCTL_CACHE_DIR` where set, else `$XDG_CACHE_HOME/llmctl`, else `~/.cache/llmctl`. Each user
of it keeps a subfolder of its own (kernels/, autotune/, machine.json).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "LLMCTL_CACHE_DIR"


def cache_root() -> Path:
    """The cache folder (not created here)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmctl"
