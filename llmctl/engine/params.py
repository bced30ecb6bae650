"""Typed values passed between the engine and its callers: sampling settings and finished results.

Owns: `SamplingParams` (per-request decoding settings, validated), the seeds of the n
completions of one request (`derived_seed`), and the results in vLLM's shapes: `RequestOutput`
(with our own fields too), `CompletionOutput` and `Logprob`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.engine.requests import show
from llmctl.engine.structured import StructuredOutputsParams
from llmctl.errors import RequestError

MAX_STOP_STRINGS = 64  # each is searched for after every generated token
MAX_LOGPROBS = 20  # top alternatives per position, as OpenAI allows
MAX_N = 128  # completions per request
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """Per-request decoding settings; `temperature == 0` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut (-1 and 0 mean the same: vLLM's convention)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1  # completions of the prompt, prefilled once; completion i: derived_seed(seed, i)
    logprobs: int | None = None  # per output token: its logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # decoding constrained to a schema, pattern, choice or grammar (engine/structured.py); an
    # object with vLLM's field names is taken too
    structured_outputs: StructuredOutputsParams | Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.top_k in (0, -1) and not isinstance(self.top_k, bool):
            self.top_k = None  # vLLM's spellings of "no top-k cut"
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(msg: str) -> RequestError:
            return RequestError("invalid_parameter", msg)

        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise bad(f"max_tokens must be a positive integer, got {show(self.max_tokens)}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(f"{name} must be a number, got {show(v)}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise bad(f"top_k must be a positive integer, -1 or 0 (no cut), got {show(self.top_k)}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of integers")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad(f"seed must be an integer, got {show(self.seed)}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise bad(f"seed must be between -2**63 and 2**64 - 1, got {show(self.seed)}")
        self._validate_outputs(bad)

    def _validate_outputs(self, bad) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer from 1 to {MAX_N}, got {show(self.n)}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {show(v)}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def derived_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of a request seeded `seed`: the seed itself for the first,
    so n=1 draws what it always drew; a 64-bit mix for the others, so they are independent of
    each other and of the next row's `seed + 1` (run-batch's per-row seeds)."""
    if seed is None or index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


@dataclass
class Logprob:
    """One token's log-probability at a position (vLLM's shape): `rank` 1 is the likeliest."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the top alternatives by rank and the chosen token.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's n completions (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    # constrained requests: "valid", "incomplete" (ended before the constraint was complete) or
    # "invalid" (checked after decoding; engine/grammar.py), and why where not valid
    structured_output: str | None = None
    structured_output_error: str | None = None


@dataclass
class RequestOutput:
    """A finished request. Times are `time.perf_counter()` seconds. `output_token_ids`, `text`
    and `finish_reason` are the first completion's; `outputs` holds all n (vLLM's shape; built
    from the first when not given)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None first: nothing predicts it
    prompt: str | None = None  # the text prompt, when one was given (the Python API sets it)
    finished: bool = True

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [
                CompletionOutput(0, self.text, self.output_token_ids, self.finish_reason)
            ]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (end-to-end - TTFT) / (output tokens - 1)."""
        n = len(self.output_token_ids)
        if self.first_token_time is None or n < 2:
            return None
        return (self.finish_time - self.first_token_time) / (n - 1)
