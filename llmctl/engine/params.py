"""Typed values passed between the engine and its callers: sampling settings and finished results.

Owns: `SamplingParams` (per-request decoding settings, validated) and `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.engine.requests import show
from llmctl.errors import RequestError

MAX_STOP_STRINGS = 64  # each is searched for after every generated token
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if type(self.top_k) is int and self.top_k in (-1, 0):
            self.top_k = None
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


@dataclass
class RequestOutput:
    """A finished request. Times are `time.perf_counter()` seconds."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    arrival_time: float
    first_token_time: float | None
    finish_time: float

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
