"""run-batch's backend options (`--backend`, and vLLM's engine arguments): `BackendFlags`.

Owns: the flags that choose the engine serving a job and pass arguments through to vLLM, and
`backend_fields`, their mapping to the `BatchOptions` fields `backend` and `engine_args`. The
refusal of llmctl-only options under vLLM and the vLLM mapping are in `llmctl.batch.backends`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmctl.batch.backends import BACKENDS, DEFAULT_BACKEND
from llmctl.errors import UsageError


@dataclass(frozen=True)
class BackendFlags:
    """The engine that generates, and vLLM's engine arguments."""

    backend: Annotated[
        Optional[str],
        typer.Option(
            "--backend",
            help=f"Engine that generates: {' or '.join(BACKENDS)} (vLLM's offline engine, an "
            f"optional extra; same inputs, outputs and resume) (default: {DEFAULT_BACKEND}).",
            show_default=False,
        ),
    ] = None
    tensor_parallel_size: Annotated[
        Optional[int],
        typer.Option(
            "--tensor-parallel-size",
            min=1,
            help="--backend vllm: GPUs each layer is split across (vLLM's tensor parallelism).",
            show_default=False,
        ),
    ] = None
    pipeline_parallel_size: Annotated[
        Optional[int],
        typer.Option(
            "--pipeline-parallel-size",
            min=1,
            help="--backend vllm: pipeline stages the layers are split into.",
            show_default=False,
        ),
    ] = None
    engine_args: Annotated[
        Optional[str],
        typer.Option(
            "--engine-args",
            metavar="JSON",
            help="--backend vllm: a JSON object of vLLM engine arguments (EngineArgs fields), e.g. "
            '\'{"gpu_memory_utilization": 0.8, "quantization": "gptq"}\'; they win over the flags.',
            show_default=False,
        ),
    ] = None


def _engine_args(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--engine-args is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise UsageError("--engine-args must be a JSON object of vLLM engine arguments")
    return value


def backend_fields(a: BackendFlags) -> dict[str, Any]:
    """`backend` and `engine_args` for BatchOptions from the command's flags (only those set)."""
    backend = a.backend or DEFAULT_BACKEND
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    flags = {
        "--tensor-parallel-size": ("tensor_parallel_size", a.tensor_parallel_size),
        "--pipeline-parallel-size": ("pipeline_parallel_size", a.pipeline_parallel_size),
        "--engine-args": (None, a.engine_args),
    }
    if backend != "vllm":
        for flag, (_, value) in flags.items():
            if value is not None:
                raise UsageError(f"{flag} is for --backend vllm")
    args = {name: v for name, v in flags.values() if name is not None and v is not None}
    return {"backend": backend, "engine_args": {**args, **_engine_args(a.engine_args)}}
