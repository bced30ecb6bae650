"""`profile advise`: which trials apply to a workload, running them under the time budget, and
ranking them by the objective.

Owns: `Trial` (one change to the baseline: engine settings, the KV-cache size, the dtype,
quantized weights: RTN, or GPTQ/AWQ with --calib, or run-batch's prefix-aware admission order),
the skip rules
(trials that cannot pay on this workload, with the reason), the quality cost of quantized
weights (mean KL to the base model, `runtime.evaluate.perplexity`), `gain` (ratio to the baseline,
above 1 is better for every objective) and the recommended combination. The measured pass itself
is `advise.measure`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from llmctl.engine.config import AUTO_SPEC_MAX_BATCH, EngineConfig, defaults
from llmctl.engine.prefix_order import prefix_order
from llmctl.profiling.advise import (
    AdviseTools,
    Measurement,
    Workload,
    measure,
    shared_prefix_tokens,
)

DEFAULT = defaults()
NOISE_FLOOR = 0.02  # two measurements never agree better than this: a smaller gain is not advised
# Below this share of the prompt tokens a prefix cache has too little to reuse to pay.
MIN_PREFIX_SHARE = 0.05
HALF_SEQS, DOUBLE_SEQS = DEFAULT.max_num_seqs // 2, DEFAULT.max_num_seqs * 2
# A trial that changes the numbers without a KL (the fp8 KV cache) is advised only where at least
# this share of the baseline's greedy tokens stays the same.
MIN_AGREEMENT = 0.9


@dataclass(frozen=True)
class Trial:
    """One change to the baseline (prefix caching off, no speculation, the loaded weights)."""

    key: str
    name: str
    group: str  # one trial per group joins the recommended combination
    engine: dict = field(default_factory=dict)  # EngineConfig fields set on top of the baseline
    bits: int | None = None  # weight bits; None: the loaded weights
    method: str = "rtn"  # how weights are quantized when bits is set: rtn, gptq or awq
    dtype: str | None = None  # the model loaded in another dtype; None: the baseline's
    reorder: bool = False  # the sample admitted in prefix order (run-batch --reorder prefix)


@dataclass
class TrialResult:
    trial: Trial
    measurement: Measurement | None = None
    kl: float | None = None
    skipped: str | None = None  # why the trial did not run
    agreement: float | None = None  # greedy tokens equal to the baseline's (see advise.agreement)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.trial.key,
            "name": self.trial.name,
            "group": self.trial.group,
            "engine": self.trial.engine,
            "bits": self.trial.bits,
            "method": self.trial.method if self.trial.bits else None,
            "dtype": self.trial.dtype,
            "reorder": "prefix" if self.trial.reorder else None,
            "measurement": None if self.measurement is None else self.measurement.to_dict(),
            "mean_kl": self.kl,
            "greedy_agreement": self.agreement,
            "skipped": self.skipped,
        }


def other_dtype(dtype: str) -> str:
    """The dtype trial: bfloat16 for a float32 model, float32 for a 16-bit one (which is faster
    depends on the CPU's bf16 units: measured, not assumed)."""
    return "bfloat16" if dtype == "float32" else "float32"


def candidate_trials(
    draft: str | None, calib: str | None, dtype: str, kv_bytes: int | None
) -> list[Trial]:
    """Every trial advise knows, in the order they run; `skip_reason` drops those that cannot
    pay. dtype: the loaded model's; kv_bytes: the baseline's KV cache."""
    trials = [
        Trial("prefix_caching", "prefix caching", "prefix", {"enable_prefix_caching": True}),
        Trial(
            "reorder_prefix",
            "prefix caching, rows grouped by prefix",
            "prefix",
            {"enable_prefix_caching": True},
            reorder=True,
        ),
        Trial("ngram", "speculative n-gram", "speculative", {"speculative": "ngram"}),
    ]
    if draft:
        engine = {"speculative": "draft", "draft_model": draft}
        trials.append(Trial("draft", "speculative draft", "speculative", engine))
    trials += [
        Trial("budget_512", "token budget 512", "budget", {"max_num_batched_tokens": 512}),
        Trial("budget_8192", "token budget 8192", "budget", {"max_num_batched_tokens": 8192}),
        Trial("seqs_half", f"max-num-seqs {HALF_SEQS}", "seqs", {"max_num_seqs": HALF_SEQS}),
        Trial("seqs_double", f"max-num-seqs {DOUBLE_SEQS}", "seqs", {"max_num_seqs": DOUBLE_SEQS}),
        Trial("int8", "int8 RTN weights", "quantization", bits=8),
        Trial("int4", "int4 RTN weights", "quantization", bits=4),
    ]
    if calib:
        trials += [
            Trial("gptq4", "int4 GPTQ weights", "quantization", bits=4, method="gptq"),
            Trial("awq4", "int4 AWQ weights", "quantization", bits=4, method="awq"),
        ]
    other = other_dtype(dtype)
    trials.append(Trial(f"dtype_{other}", f"dtype {other}", "dtype", dtype=other))
    if kv_bytes:
        half = {"kv_cache_memory": kv_bytes // 2}
        trials.append(Trial("kv_half", "KV cache halved", "kv", half))
    # half the bytes per cached token (twice the tokens in the same memory); its quality cost is
    # the greedy agreement with the baseline
    trials.append(Trial("kv_fp8", "fp8 KV cache", "kv_dtype", {"kv_cache_dtype": "fp8"}))
    return trials


def skip_reason(trial: Trial, work: Workload, concurrency: int) -> str | None:
    """Why `trial` cannot pay on this workload, or None when it is worth measuring."""
    if trial.group == "prefix":
        share = shared_prefix_tokens(work.prompts, DEFAULT.block_size) / work.prompt_tokens
        if share < MIN_PREFIX_SHARE:
            return f"no shared prefixes: {share:.1%} of the prompt tokens are reusable"
        if trial.reorder and prefix_order(work.prompts, DEFAULT.block_size) == sorted(
            range(len(work.prompts))
        ):
            return "the sample is in prefix order already: grouping changes no admission"
    if trial.group == "speculative" and concurrency > AUTO_SPEC_MAX_BATCH:
        return (
            f"batch already large for speculation: {concurrency} requests at once "
            f"(pays at <= {AUTO_SPEC_MAX_BATCH})"
        )
    seqs = trial.engine.get("max_num_seqs")
    if seqs is not None and concurrency <= min(seqs, DEFAULT.max_num_seqs):
        return (
            f"{concurrency} request(s) at once fit in {min(seqs, DEFAULT.max_num_seqs)} "
            "sequences: the same steps as the default"
        )
    in_flight = sum(sorted((len(p) for p in work.prompts), reverse=True)[:concurrency])
    budget = trial.engine.get("max_num_batched_tokens")
    if budget is not None and budget > DEFAULT.max_num_batched_tokens:
        if in_flight <= DEFAULT.max_num_batched_tokens:
            return f"every step's prefill ({in_flight} tokens) already fits the default budget"
    if budget is not None and budget < DEFAULT.max_num_batched_tokens and concurrency == 1:
        return "one request at a time: a smaller budget only splits its prefill"
    if trial.group == "kv" and concurrency == 1:
        return "one request at a time: the KV cache holds only it already"
    return None


def gain(objective: str, base: Measurement, m: Measurement) -> float | None:
    """How many times better than the baseline (> 1: better), on the objective's value."""
    return ratio(objective, objective_value(objective, base), objective_value(objective, m))


def ratio(objective: str, base: float | None, value: float | None) -> float | None:
    """`value` against `base` for the objective, > 1 when better: throughput is better higher,
    times and memory lower; None when either is missing or not positive."""
    if base is None or value is None or base <= 0 or value <= 0:
        return None
    return value / base if objective == "throughput" else base / value


def objective_value(objective: str, m: Measurement) -> float | None:
    """throughput: output tokens/s; ttft/tpot: p50 seconds; memory: peak bytes."""
    if objective == "throughput":
        return m.output_tokens_per_s
    if objective == "memory":
        return m.peak_memory_bytes
    summary = m.ttft_s if objective == "ttft" else m.tpot_s
    return None if summary is None else summary["p50"]


def trial_runtime(ctx: TrialContext, trial: Trial, folder: str) -> Any:
    """The runtime a trial measures: the baseline's, the model in another dtype, or its weights
    quantized into `folder` (quantize's one-shot pipeline, on --calib for GPTQ and AWQ)."""
    rt = ctx.runtime
    if trial.bits:
        calib = ctx.calib if trial.method != "rtn" else None
        ctx.tools.quantize(str(rt.model_path), folder, trial.bits, trial.method, calib)
        return ctx.tools.load_runtime(folder, dtype=trial.dtype or "auto", device=rt.device)
    if trial.dtype:
        return ctx.tools.load_runtime(str(rt.model_path), dtype=trial.dtype, device=rt.device)
    return rt


def mean_kl(base: Any, model: Any, quality_ids: list[int], max_len: int) -> float:
    """Mean per-token KL(base || model) in nats over the quality tokens."""
    from llmctl.runtime.evaluate import perplexity

    seq_len = max(2, min(256, max_len, len(quality_ids)))
    return perplexity(model, quality_ids, seq_len, seq_len, reference=base).mean_kl


@dataclass
class TrialContext:
    """What every trial needs: the loaded model, the sample and the baseline engine settings."""

    runtime: Any
    work: Workload
    concurrency: int
    base_config: EngineConfig
    quality_ids: list[int]
    tools: AdviseTools
    repeats: int = 1  # fresh-engine passes per measurement
    calib: str | None = None  # --calib, for the GPTQ and AWQ trials


def run_trial(ctx: TrialContext, trial: Trial) -> TrialResult:
    """Measure one trial (quantized ones in a temporary folder, removed afterwards); trials that
    change the weights (bits, dtype) also get their KL to the baseline model."""
    config = replace(ctx.base_config, **trial.engine)
    with tempfile.TemporaryDirectory(prefix="llmctl-advise-") as folder:
        rt = trial_runtime(ctx, trial, folder)
        if rt.dtype != ctx.runtime.dtype and config.kv_cache_memory:  # as many tokens as before
            kv = config.kv_cache_memory * rt.dtype.itemsize // ctx.runtime.dtype.itemsize
            config = replace(config, kv_cache_memory=kv)
        kl = None
        if rt is not ctx.runtime:
            max_len = ctx.runtime.config.max_position_embeddings
            kl = mean_kl(ctx.runtime.model, rt.model, ctx.quality_ids, max_len)
        work = grouped(ctx.work, config.block_size) if trial.reorder else ctx.work
        m = measure(lambda: rt.start_engine(config), work, ctx.concurrency,
                    ctx.runtime.device, ctx.repeats)  # fmt: skip
        return TrialResult(trial, m, kl)


def grouped(work: Workload, block_size: int) -> Workload:
    """The sample in the order run-batch --reorder prefix admits it (the sample fits its
    window)."""
    order = prefix_order(work.prompts, block_size)
    return Workload(
        [work.prompts[i] for i in order],
        [work.max_tokens[i] for i in order],
        work.rows_read,
        work.rows_refused,
    )


def run_trials(
    ctx: TrialContext,
    trials: list[Trial],
    deadline: float,
    estimate_s: float,
    done: Callable[[TrialResult], None],
) -> None:
    """Each trial that applies, unless it would end past the deadline; `done` gets each result
    (measured or skipped) as it comes, so an interrupted run keeps what was measured."""
    for trial in trials:
        reason = skip_reason(trial, ctx.work, ctx.concurrency)
        cost = estimate_s * (3 if trial.bits or trial.dtype else 1.2)  # loads and the KL pass
        if reason is None and time.monotonic() + cost > deadline:
            reason = f"over the --budget: it would take about {cost:.0f} s more"
        done(TrialResult(trial, skipped=reason) if reason else run_trial(ctx, trial))


def recommended(
    results: list[TrialResult], objective: str, base: Measurement, noise: float, max_kl: float
) -> list[TrialResult]:
    """The best trial of each group whose gain beats the noise (and, for quantization, whose KL
    is within --max-kl; for the KV cache's dtype, whose greedy agreement is at least
    MIN_AGREEMENT); grouping rows by prefix only where it beats plain prefix caching by more
    than the noise too (the same cache hits otherwise: no reason to change the order)."""
    best: dict[str, tuple[float, TrialResult]] = {}
    for r in results:
        if r.measurement is None or (r.kl is not None and r.kl > max_kl):
            continue
        if r.trial.group == "kv_dtype" and (r.agreement or 0.0) < MIN_AGREEMENT:
            continue
        g = gain(objective, base, r.measurement)
        if g is None or g <= 1 + noise:
            continue
        held = best.get(r.trial.group)
        if held is None or g * _handicap(r, held[1], noise) > held[0]:
            best[r.trial.group] = (g, r)
    return [r for _, r in sorted(best.values(), key=lambda x: -x[0])]


def _handicap(new: TrialResult, held: TrialResult, noise: float) -> float:
    """The factor `new`'s gain is weighed by against `held`'s: a reordering trial must win by
    more than the noise, and loses to a plain one within it."""
    if new.trial.reorder and not held.trial.reorder:
        return 1 / (1 + noise)
    if held.trial.reorder and not new.trial.reorder:
        return 1 + noise
    return 1.0


def combine(chosen: list[TrialResult]) -> Trial:
    """The chosen trials as one trial (their engine settings together, the weights' bits and
    method, the dtype)."""
    engine: dict = {}
    weights: dict = {}
    for r in chosen:
        engine.update(r.trial.engine)
        weights["reorder"] = weights.get("reorder", False) or r.trial.reorder
        if r.trial.bits is not None:
            weights.update(bits=r.trial.bits, method=r.trial.method)
        if r.trial.dtype is not None:
            weights["dtype"] = r.trial.dtype
    name = " + ".join(r.trial.name for r in chosen)
    return Trial("combined", name, "combined", engine, **weights)
