"""One request inside the engine: its tokens, how many of them have K/V in the cache, its blocks.

Owns: `Sequence`. vLLM v1 style: there are no prefill and decode phases, only
`num_computed_tokens` catching up with `len(token_ids)` under the scheduler's token budget.
"""

from __future__ import annotations

import enum
import time

from llmctl.engine.detokenizer import IncrementalText
from llmctl.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "params",
        "status",
        "max_len",
        "arrival_time",
        "first_token_time",
        "finish_reason",
        "text",
        "stopped_on_text",
        "generator",
        "num_preemptions",
        "spec_token_ids",
        "index",
        "logprobs",
        "prompt_logprobs",
        "matcher",
        "lora",
    )

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_len: int
    ):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks cached so far, in order
        self.params = params
        self.status = Status.WAITING
        self.max_len = max_len  # total tokens allowed (context and KV capacity)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        self.text = IncrementalText()  # output text so far, kept only when stop strings are set
        self.stopped_on_text = False  # finished because a stop string appeared
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.num_preemptions = 0
        self.spec_token_ids: list[
            int
        ] = []  # draft tokens proposed for the next step, not yet verified
        self.index = 0  # which of the request's n completions (children of a fork count from 1)
        # Per output token / per prompt token after the first, when asked: logprobs.Entry tuples
        self.logprobs: list | None = None if params.logprobs is None else []
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else []
        self.matcher = None  # structured outputs: the grammar's state (engine/grammar.py)
        self.lora = None  # its LoRA adapter (engine/lora.Adapter); None: the base model

    def step_token_ids(self, start: int, n: int) -> list[int]:
        """The n tokens from position `start` that a step computes, speculative drafts included."""
        if self.spec_token_ids:
            return (self.token_ids + self.spec_token_ids)[start : start + n]
        return self.token_ids[start : start + n]

    @property
    def key(self) -> str:
        """Unique among running sequences: the request id, with the completion index after a
        fork (what proposers key their state by)."""
        return self.request_id if not self.index else f"{self.request_id}\x1f{self.index}"

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked and some are still to compute (a prefix-cache hit would
        skip their positions)."""
        done = self.prompt_logprobs
        return done is not None and len(done) < self.num_prompt_tokens - 1

    @property
    def cache_root(self):
        """What its first block's prefix-cache hash chains from: None for the base model, the
        adapter's content digest under an adapter (a prefix computed under one adapter is never
        reused under another)."""
        return None if self.lora is None else self.lora.cache_root

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
