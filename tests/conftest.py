"""Shared fixtures: paths to ../shared material and tiny random models of each architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests use tiny models, where one thread is as fast as two and never oversubscribes the CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Kernel choices by timing would make two engines of one test differ in the last bits (tests
# comparing outputs exactly): static rules, except where a test asks for them (KernelConfig).
os.environ.setdefault("LLMCTL_KERNELS", "autotune=0")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def shared_path(rel: str) -> Path:
    """A file under ../shared, or a skip naming it when this checkout has no ../shared."""
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"needs ../shared/{rel} (shared material not present)")
    return p


@pytest.fixture(scope="session")
def shakespeare_model() -> Path:
    return shared_path("models/tinyshakespeare-5m")


@pytest.fixture(scope="session")
def stories_model() -> Path:
    return shared_path("models/stories260k")


def make_random_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny randomly initialised HF model of `arch` (any of tests/archs.py: two layers,
    hidden 64, weights of std 0.2 unless overridden) to `folder`."""
    from tests.archs import build

    model = build(arch, seed, **{"initializer_range": 0.2, **overrides})
    model.save_pretrained(folder, safe_serialization=True)
    return folder
