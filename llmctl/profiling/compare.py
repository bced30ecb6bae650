"""Compare two sweep records (A = baseline, B = candidate) point by point, for CI regression checks.

Owns: matching points by (batch size, prompt length, generation length), the B/A ratio of each
metric's statistic (p50 by default), and the regression rule: B regresses when a lower-is-better
metric (latency) rises by more than the threshold, B/A > 1 + t, or a higher-is-better metric
(throughput) falls by more than the threshold, B/A < 1 - t.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmctl.errors import UsageError
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.sweep import HIGHER_IS_BETTER, LOWER_IS_BETTER

COMPARE_SCHEMA = "llmctl.profile.compare"
DEFAULT_THRESHOLD = "5%"  # allowed change before B counts as a regression
DEFAULT_STAT = "p50"
STATS = ("mean", "p50", "p90", "p99")
COMPARED = (
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "output_tokens_per_s",
)


def parse_threshold(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", str(text))
    if not m:
        raise UsageError(
            f"cannot read threshold {text!r}; use a percentage such as 5% (or a fraction such as "
            "0.05)"
        )
    value = float(m.group(1)) / (100 if m.group(2) else 1)
    if not 0 <= value < 1:
        raise UsageError(f"threshold must be between 0% and 100%, got {text!r}")
    return value


@dataclass(frozen=True)
class MetricDelta:
    point: tuple[int, int, int]  # (batch_size, prompt_len, gen_len)
    metric: str
    a: float | None
    b: float | None
    lower_is_better: bool
    regression: bool

    @property
    def ratio(self) -> float | None:
        """B / A (None when either is missing or A is 0)."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a


@dataclass(frozen=True)
class Comparison:
    deltas: list[MetricDelta]
    only_in_a: list[tuple[int, int, int]]
    only_in_b: list[tuple[int, int, int]]
    threshold: float
    stat: str

    @property
    def regressions(self) -> list[MetricDelta]:
        return [d for d in self.deltas if d.regression]

    def to_dict(self) -> dict[str, Any]:
        """The comparison as JSON-ready data (a point is [batch_size, prompt_len, gen_len])."""
        return {
            "schema": COMPARE_SCHEMA,
            "schema_version": 1,
            "stat": self.stat,
            "threshold": self.threshold,
            "regressions": len(self.regressions),
            "deltas": [
                {
                    "point": list(d.point),
                    "metric": d.metric,
                    "a": d.a,
                    "b": d.b,
                    "ratio": d.ratio,
                    "lower_is_better": d.lower_is_better,
                    "regression": d.regression,
                }
                for d in self.deltas
            ],
            "only_in_a": [list(k) for k in self.only_in_a],
            "only_in_b": [list(k) for k in self.only_in_b],
        }


def _is_regression(
    a: float | None, b: float | None, lower_is_better: bool, threshold: float
) -> bool:
    if a is None or b is None or a <= 0:
        return False
    ratio = b / a
    return ratio > 1 + threshold if lower_is_better else ratio < 1 - threshold


def _points(record: dict[str, Any]) -> dict[tuple[int, int, int], dict[str, Any]]:
    return {(p["batch_size"], p["prompt_len"], p["gen_len"]): p for p in record["points"]}


def compare_records(
    a: dict[str, Any],
    b: dict[str, Any],
    threshold: float | None = None,
    stat: str = DEFAULT_STAT,
    metrics: tuple[str, ...] = COMPARED,
) -> Comparison:
    """Every compared metric of every point present in both records (threshold None:
    DEFAULT_THRESHOLD)."""
    if threshold is None:
        threshold = parse_threshold(DEFAULT_THRESHOLD)
    if stat not in STATS:
        raise UsageError(f"unknown statistic {stat!r}; choose mean, p50, p90 or p99")
    pa, pb = _points(a), _points(b)
    deltas = []
    for key in sorted(pa.keys() & pb.keys()):
        for metric in metrics:
            lower = metric in LOWER_IS_BETTER
            if not lower and metric not in HIGHER_IS_BETTER:
                raise UsageError(f"unknown metric {metric!r}")
            va = (pa[key].get(metric) or {}).get(stat)
            vb = (pb[key].get(metric) or {}).get(stat)
            deltas.append(
                MetricDelta(key, metric, va, vb, lower, _is_regression(va, vb, lower, threshold))
            )
    return Comparison(
        deltas, sorted(pa.keys() - pb.keys()), sorted(pb.keys() - pa.keys()), threshold, stat
    )


ENVIRONMENT_KEYS = (
    "device",
    "gpu_name",
    "cpu_model",
    "cpu_threads",
    "dtype",
    "torch_version",
    "llmctl_version",
)


def environment_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """'dtype: bfloat16 -> float32' for each environment fact that differs between the records."""
    ea, eb = dict(a.get("environment") or {}), dict(b.get("environment") or {})
    for env in (ea, eb):  # a record written before dtypes had one spelling may say bf16
        if env.get("dtype"):
            env["dtype"] = canonical_dtype(env["dtype"])
    return [f"{k}: {ea.get(k)} -> {eb.get(k)}" for k in ENVIRONMENT_KEYS if ea.get(k) != eb.get(k)]
