"""A deterministic stand-in for the engine and runtime, for testing the run-batch I/O layer.

Imported as `tests.fakes` (a child process gets the repo root on PYTHONPATH).

Owns: `FakeRuntime` (byte-level "tokenizer", role-checked chat template) and `FakeEngine`
(continuous batching of at most `max_num_seqs` requests, one token per running request per step,
up to max_tokens or the context length, like the engine).
A request's output depends only on its prompt and max_tokens, never on batching or timing, so a
resumed job can be compared byte for byte with an uninterrupted one. Requests with a larger
max_tokens finish later, which makes completion order differ from input order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmctl.engine.params import RequestOutput, SamplingParams
from llmctl.engine.requests import validate_messages
from llmctl.errors import RequestError


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 256


class FakeRuntime:
    """Tokens are UTF-8 bytes; decode maps them back (output tokens are letters a-z)."""

    config = FakeConfig()
    model_name = "fake-model"

    def __init__(self, engine: "FakeEngine | None" = None):
        self._engine = engine

    def start_engine(self, engine_config=None) -> "FakeEngine":
        """The engine given at construction (a default FakeEngine without one); settings ignored."""
        if self._engine is None:
            self._engine = FakeEngine()
        return self._engine

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        messages = validate_messages(messages)
        return self.encode(
            "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        )


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    out: list[int]
    first: float | None = None


class FakeEngine:
    """`add_request` / `step` / `has_unfinished_requests`, like LLMEngine, without a model."""

    def __init__(self, max_num_seqs: int = 8, max_model_len: int = 4096, step_delay_s: float = 0.0):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.kv_cache_bytes = 1 << 20
        self.num_kv_blocks = 64
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self.max_unfinished = 0  # high-water mark, for boundedness tests
        self.steps = 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise RequestError(
                "prompt_too_long",
                f"prompt has {len(prompt_token_ids)} tokens; the model's "
                f"context is {self.max_model_len}",
            )
        self._waiting.append(
            _Req(request_id, list(prompt_token_ids), params, time.perf_counter(), [])
        )
        self.max_unfinished = max(self.max_unfinished, self.num_unfinished_requests())

    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.pop(0))
        now = time.perf_counter()
        done, still = [], []
        for r in self._running:
            k = len(r.out)
            r.out.append(ord("a") + (sum(r.prompt) + 7 * k + (r.params.seed or 0)) % 26)
            r.first = r.first or now
            full = len(r.prompt) + len(r.out) >= self.max_model_len
            if len(r.out) >= r.params.max_tokens or full:
                done.append(
                    RequestOutput(
                        request_id=r.rid,
                        prompt_token_ids=r.prompt,
                        output_token_ids=r.out,
                        text=bytes(r.out).decode("ascii"),
                        finish_reason="length",
                        arrival_time=r.arrival,
                        first_token_time=r.first,
                        finish_time=now,
                    )
                )
            else:
                still.append(r)
        self._running = still
        return done
