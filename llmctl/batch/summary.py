"""Counters and latency percentiles of a run-batch job, in memory that does not grow with the input.

Owns: `LogHistogram` (fixed-resolution latency histogram: percentiles within 1% without keeping
every sample), `BatchStats` (rows, errors, tokens, elapsed time, TTFT/TPOT histograms) with its
state-file round trip, so a resumed job reports totals over all of its sessions, and `Progress`,
the snapshot handed to progress callbacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class LogHistogram:
    """Counts of positive values in log-spaced buckets [lo * r**i, lo * r**(i+1)).

    With r = 1.01 a percentile is off by at most 1%, and the bucket count is bounded by the range
    (1 microsecond to 10,000 s -> at most ~2,300 buckets), whatever the number of samples.
    """

    def __init__(self, lo: float = 1e-6, ratio: float = 1.01, counts: dict[int, int] | None = None):
        self.lo = lo
        self.ratio = ratio
        self._log_ratio = math.log(ratio)
        self.counts: dict[int, int] = dict(counts or {})
        self.n = sum(self.counts.values())

    def add(self, value: float) -> None:
        i = 0 if value <= self.lo else int(math.log(value / self.lo) / self._log_ratio)
        self.counts[i] = self.counts.get(i, 0) + 1
        self.n += 1

    def percentile(self, q: float) -> float | None:
        """The value below which a fraction q (0..1) of the samples lie; None without samples."""
        if self.n == 0:
            return None
        rank = max(1, math.ceil(q * self.n))
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen >= rank:
                return self.lo * self.ratio ** (i + 0.5)  # geometric middle of the bucket
        return None  # unreachable: counts sum to n

    def to_state(self) -> dict[str, int]:
        return {str(k): v for k, v in self.counts.items()}

    @classmethod
    def from_state(cls, d: dict[str, int] | None) -> "LogHistogram":
        return cls(counts={int(k): int(v) for k, v in (d or {}).items()})


@dataclass
class BatchStats:
    """Totals over every session of one job (restored from the state file on resume)."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0  # wall time of earlier sessions plus this one, up to the last commit
    errors_by_code: dict[str, int] = field(default_factory=dict)
    ttft: LogHistogram = field(default_factory=LogHistogram)
    tpot: LogHistogram = field(default_factory=LogHistogram)
    spec_proposed: int = 0  # speculative decoding: draft tokens verified, and accepted
    spec_accepted: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens the prefix cache served, of those looked up
    prefix_query_tokens: int = 0
    input_format: str | None = None  # the format the input was read as (detected or given)
    # structured outputs: rows constrained, and how many ended valid / incomplete / invalid
    structured: dict[str, int] = field(default_factory=dict)

    def add_row(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        error_code: str | None,
        ttft: float | None = None,
        tpot: float | None = None,
        structured: str | None = None,
    ) -> None:
        self.rows += 1
        if structured is not None:
            for key in ("constrained", structured):
                self.structured[key] = self.structured.get(key, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.output_tokens += completion_tokens
        if error_code is not None:
            self.errors += 1
            self.errors_by_code[error_code] = self.errors_by_code.get(error_code, 0) + 1
        if ttft is not None:
            self.ttft.add(ttft)
        if tpot is not None:
            self.tpot.add(tpot)

    def to_state(self) -> dict:
        return {
            "rows": self.rows,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "elapsed_s": self.elapsed_s,
            "errors_by_code": dict(self.errors_by_code),
            "ttft": self.ttft.to_state(),
            "tpot": self.tpot.to_state(),
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_query_tokens": self.prefix_query_tokens,
            "input_format": self.input_format,
            "structured": dict(self.structured),
        }

    @classmethod
    def from_state(cls, d: dict) -> "BatchStats":
        return cls(
            rows=int(d.get("rows", 0)),
            errors=int(d.get("errors", 0)),
            prompt_tokens=int(d.get("prompt_tokens", 0)),
            output_tokens=int(d.get("output_tokens", 0)),
            elapsed_s=float(d.get("elapsed_s", 0.0)),
            errors_by_code={str(k): int(v) for k, v in d.get("errors_by_code", {}).items()},
            ttft=LogHistogram.from_state(d.get("ttft")),
            tpot=LogHistogram.from_state(d.get("tpot")),
            spec_proposed=int(d.get("spec_proposed", 0)),
            spec_accepted=int(d.get("spec_accepted", 0)),
            prefix_hit_tokens=int(d.get("prefix_hit_tokens", 0)),
            prefix_query_tokens=int(d.get("prefix_query_tokens", 0)),
            input_format=d.get("input_format"),
            structured={str(k): int(v) for k, v in d.get("structured", {}).items()},
        )

    def copy(self) -> "BatchStats":
        return BatchStats.from_state(self.to_state())

    def summary(self) -> dict:
        """The end-of-job report (also written by --report-json). Times in seconds."""
        t = self.elapsed_s

        def pct(h: LogHistogram) -> dict[str, float | None]:
            return {f"p{q}": _round(h.percentile(q / 100)) for q in (50, 90, 99)}

        return {
            "input_format": self.input_format,
            "rows": self.rows,
            "ok": self.rows - self.errors,
            "errors": self.errors,
            "errors_by_code": dict(sorted(self.errors_by_code.items())),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(t, 3),
            "requests_per_s": round(self.rows / t, 3) if t > 0 else None,
            "output_tokens_per_s": round(self.output_tokens / t, 3) if t > 0 else None,
            "ttft_s": pct(self.ttft),
            "tpot_s": pct(self.tpot),
            "structured_outputs": {
                k: self.structured.get(k, 0)
                for k in ("constrained", "valid", "incomplete", "invalid")
            },
            "speculative": {
                "proposed_tokens": self.spec_proposed,
                "accepted_tokens": self.spec_accepted,
                "acceptance_rate": round(self.spec_accepted / self.spec_proposed, 4)
                if self.spec_proposed
                else None,
            },
            "prefix_cache": {
                "hit_tokens": self.prefix_hit_tokens,
                "looked_up_tokens": self.prefix_query_tokens,
                "hit_rate": round(self.prefix_hit_tokens / self.prefix_query_tokens, 4)
                if self.prefix_query_tokens
                else None,
            },
        }


def _round(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.4g}")


@dataclass(frozen=True)
class Progress:
    """What a progress callback sees; totals include earlier sessions of a resumed job."""

    rows_done: int
    rows_total: int | None  # None when unknown (stdin)
    errors: int
    prompt_tokens: int
    output_tokens: int
    session_output_tokens: int  # this session only, for a tokens/s rate
    session_elapsed_s: float
    finished: bool = False

    @classmethod
    def of(
        cls,
        st: "BatchStats",
        rows_total: int | None,
        session_tokens: int,
        elapsed_s: float,
        finished: bool,
    ) -> "Progress":
        """The progress line's values from a job's running totals and this session's counts."""
        return cls(
            rows_done=st.rows,
            rows_total=rows_total,
            errors=st.errors,
            prompt_tokens=st.prompt_tokens,
            output_tokens=st.output_tokens,
            session_output_tokens=session_tokens,
            session_elapsed_s=elapsed_s,
            finished=finished,
        )
