"""The Ray Data processor as a library call, in the shape of Ray Data LLM's `build_llm_processor`.

Owns: `ProcessorConfig` and `build_processor(config)`, whose result maps a Ray `Dataset` of rows
(`prompt`, `messages` or `prompt_token_ids`, with optional per-row sampling columns such as
`max_tokens` or `seed`, the keys of run-batch's simple JSONL rows) to the same rows with `text`,
`finish_reason`, `prompt_tokens`, `completion_tokens` and `error` (null, or the JSON text of
`{code, message}`) added. One llmctl engine per replica (a Ray actor loading the model once),
through run-batch's own replica code (`llmctl.batch.ray.processor`), so a row's output is the one
`run-batch` writes for it.

    from llmctl.ray_data import ProcessorConfig, build_processor
    processor = build_processor(ProcessorConfig(replicas=2, sampling={"max_tokens": 32}))
    out = processor(ray.data.from_items([{"prompt": "ROMEO:"}])).take_all()
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from llmctl.batch.options import BatchOptions, default_sampling
from llmctl.batch.ray.cluster import import_ray
from llmctl.batch.ray.processor import Replica, ReplicaSpec, rows_table
from llmctl.batch.rows import parse_simple
from llmctl.engine.config import EngineConfig

__all__ = ["Processor", "ProcessorConfig", "build_processor"]

RESULT_COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "error")


@dataclass(frozen=True)
class ProcessorConfig:
    """The model, the sampling defaults (SamplingParams fields; greedy unless given), engine
    settings (EngineConfig fields) and the replicas' sizing."""

    model: str | None = None  # None: the embedded demo model
    dtype: str = "auto"
    device: str = "auto"
    sampling: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1
    batch_rows: int = 16
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0


def _default_loader(model, dtype="auto", device="auto", model_impl="auto"):
    from llmctl.runtime.loader import load_runtime

    return load_runtime(model, dtype=dtype, device=device, model_impl=model_impl)


class _DatasetReplica(Replica):
    """A `Replica` over a user's rows: their columns in, the same columns plus results out."""

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        records = batch.to_pylist()
        rows = [(parse_simple(r, i, i, i + 1), i, i, False) for i, r in enumerate(records)]
        out = super().__call__(rows_table(rows)).column("data").to_pylist()
        results = [json.loads(line) for line in out]
        columns = {name: batch.column(name) for name in batch.column_names}
        columns.update(
            text=pa.array([r["text"] for r in results], pa.string()),
            finish_reason=pa.array([r["finish_reason"] for r in results], pa.string()),
            prompt_tokens=pa.array([r["usage"]["prompt_tokens"] for r in results], pa.int64()),
            completion_tokens=pa.array(
                [r["usage"]["completion_tokens"] for r in results], pa.int64()
            ),
            error=pa.array(
                [None if r["error"] is None else json.dumps(r["error"]) for r in results],
                pa.string(),
            ),
        )
        return pa.table(columns)


class Processor:
    """`processor(ds)`: a lazy Dataset of the rows with their results (see the module doc)."""

    def __init__(self, config: ProcessorConfig, load_runtime: Callable[..., Any] | None = None):
        self.config = config
        opts = BatchOptions(
            input="-",
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            sampling=dict(config.sampling),
            engine=dict(config.engine),
        )
        self._spec = ReplicaSpec(
            opts,
            EngineConfig(**config.engine),  # a bad value: UsageError now, not in a replica
            default_sampling(opts),
            "jsonl",
            0,
            load_runtime or _default_loader,
        )

    def __call__(self, ds: Any) -> Any:
        ray = import_ray()
        c = self.config
        return ds.map_batches(
            _DatasetReplica,
            fn_constructor_kwargs={"spec": self._spec},
            batch_size=c.batch_rows,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=c.replicas),
            num_cpus=c.cpus_per_replica,
            num_gpus=c.gpus_per_replica or None,
        )


def build_processor(
    config: ProcessorConfig, load_runtime: Callable[..., Any] | None = None
) -> Processor:
    """The processor for `config` (`load_runtime(model, dtype=, device=)` replaces the loader)."""
    return Processor(config, load_runtime)
