"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`, the same engine as the
CLI. `LLM(model, batch_invariant=True)`: each output independent of its batch-mates (issue 20)."""

from __future__ import annotations

from typing import Any, Callable

from llmctl.engine.config import EngineConfig
from llmctl.engine.params import RequestOutput, SamplingParams
from llmctl.runtime.loader import load_runtime


class LLM:
    """A loaded model with its engine. Engine keywords: see `EngineConfig` (block_size,
    kv_cache_memory, batch_invariant, ...)."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        **engine_kwargs: Any,
    ):
        self.runtime = load_runtime(model, dtype=dtype, device=device)
        self.engine = self.runtime.start_engine(EngineConfig(**engine_kwargs))

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_finish: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Text prompts or token-id lists in; outputs in input order. Bad prompts raise
        RequestError."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per = params if isinstance(params, list) else [params] * len(prompts)
        engine = self.engine
        for i, (p, sp) in enumerate(zip(prompts, per)):
            ids = self.runtime.encode(p) if isinstance(p, str) else list(p)
            engine.add_request(str(i), ids, sp)
        results: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out
                if on_finish:
                    on_finish(out)
        return [results[str(i)] for i in range(len(prompts))]

    def chat(
        self, conversations: list[list[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        return self.generate([self.runtime.apply_chat_template(c) for c in conversations], params)
