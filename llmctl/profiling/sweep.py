"""The measured sweep: batch sizes x prompt lengths x generation lengths through the serving engine.

Owns: running one sweep point (random-token prompts, greedy, `ignore_eos` so every request produces
exactly `gen_len` tokens) on an already-built engine, and turning its request timings into the
metrics of a point record (see `FORMULAS`, written into every sweep JSON). The engine is anything
with the LLMEngine interface: `add_request(id, prompt_token_ids, params)`, `step() -> finished
RequestOutputs`, `has_unfinished_requests()`; weights are loaded once by the caller and reused for
every point.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from llmctl.engine.params import RequestOutput, SamplingParams
from llmctl.profiling.environment import peak_memory, reset_peak_memory

SWEEP_SCHEMA = "llmctl.profile.sweep"
SWEEP_SCHEMA_VERSION = 1
PERCENTILES = (50, 90, 99)

# Metric -> which direction is better; `compare` uses this.
LOWER_IS_BETTER = ("ttft_s", "tpot_s", "e2e_s", "wall_s")
HIGHER_IS_BETTER = (
    "decode_tokens_per_s_per_sequence",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "output_tokens_per_s",
)
METRICS = LOWER_IS_BETTER + HIGHER_IS_BETTER

FORMULAS = {
    "prompts": "batch_size requests of prompt_len uniformly random token ids (new ones every "
    "repeat), greedy, ignore_eos=True, max_tokens=gen_len, all added at once to the engine",
    "ttft_s": "first_token_time - arrival_time, per request",
    "tpot_s": "(finish_time - first_token_time) / (output_tokens - 1), per request (end-to-end "
    "minus TTFT)",
    "e2e_s": "finish_time - arrival_time, per request",
    "decode_tokens_per_s_per_sequence": "1 / tpot_s, per request",
    "decode_tokens_per_s": "sum over requests of (output_tokens - 1) / (last finish_time - "
    "earliest first_token_time), per repeat",
    "prefill_tokens_per_s": "batch_size x prompt_len / (latest first_token_time - earliest "
    "arrival_time), per repeat",
    "output_tokens_per_s": "batch_size x gen_len / wall_s, per repeat",
    "wall_s": "time from adding the first request to the engine reporting the last finished, "
    "per repeat",
    "percentiles": "per-request metrics pool every request of every repeat; per-repeat metrics "
    "pool the repeats; linear interpolation between closest ranks (numpy's default)",
    "peak_memory_bytes": "CUDA: torch.cuda.max_memory_allocated over the point's repeats; "
    "CPU: peak resident set size (VmHWM, reset per point when /proc/self/clear_refs allows)",
    "kv_blocks_used": "most KV-cache blocks in use during any engine step of the point (the "
    "engine's peak counter, reset per repeat)",
    "mbu": "(weight_bytes + batch_size x (prompt_len + gen_len / 2) x kv_bytes_per_token) / "
    "tpot_s.p50 / machine memory_bandwidth",
    "mfu": "batch_size x (prompt_len x flops_per_token(prompt_len / 2) + gen_len x "
    "flops_per_token(prompt_len + gen_len / 2)) / wall_s.p50 / machine compute_peak(dtype) "
    "(float32's matmul peak for float32 models, the larger of bfloat16's and float32's for "
    "16-bit ones); flops_per_token(c) = 2 x matmul weights + 4 x layers x c x q_size",
}


class Engine(Protocol):
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...


@dataclass(frozen=True)
class SweepPoint:
    batch_size: int
    prompt_len: int
    gen_len: int

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.batch_size, self.prompt_len, self.gen_len)


@dataclass
class RepeatResult:
    """One repeat of a point: the finished requests and the engine-level observations."""

    outputs: list[RequestOutput]
    wall_s: float
    kv_blocks_used: int | None


@dataclass(frozen=True)
class ModelFacts:
    """What MBU/MFU need about the model being profiled."""

    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: Callable[[int], float]  # context length -> forward FLOPs of one token
    # the model's (float32, bfloat16, float16): which matmul peak MFU divides by
    dtype: str = "bfloat16"


@dataclass
class SweepSettings:
    points: list[SweepPoint]
    repeat: int = 3
    warmup: int = 1
    seed: int = 0
    vocab_size: int = 32000
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


def grid(batch_sizes: list[int], prompt_lens: list[int], gen_lens: list[int]) -> list[SweepPoint]:
    """Every combination, in batch-size-major order."""
    return [SweepPoint(b, p, g) for b in batch_sizes for p in prompt_lens for g in gen_lens]


def random_prompts(
    rng: random.Random, batch_size: int, prompt_len: int, vocab_size: int
) -> list[list[int]]:
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]


def kv_blocks_in_use(engine: Any) -> int | None:
    """Blocks allocated in the engine's paged KV cache right now, when the engine exposes them."""
    manager = getattr(engine, "block_manager", None)
    value = getattr(manager, "num_used_blocks", None)
    value = value() if callable(value) else value
    return value if isinstance(value, int) else None


def _reset_engine_peak(engine: Any) -> bool:
    """Zero the engine's own peak-blocks counter (LLMEngine.stats.peak_used_blocks, updated inside a
    step, before finished requests free their blocks); False when the engine has none."""
    stats = getattr(engine, "stats", None)
    if isinstance(getattr(stats, "peak_used_blocks", None), int):
        stats.peak_used_blocks = 0
        return True
    return False


def run_repeat(
    engine: Engine, point: SweepPoint, rng: random.Random, vocab_size: int, tag: str
) -> RepeatResult:
    """Add the point's requests at once and step the engine until all finish."""
    params = SamplingParams(max_tokens=point.gen_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(rng, point.batch_size, point.prompt_len, vocab_size)
    engine_peak = _reset_engine_peak(engine)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    outputs: list[RequestOutput] = []
    most_blocks: int | None = None
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
        used = kv_blocks_in_use(
            engine
        )  # after the step: finished requests have already freed theirs
        if used is not None:
            most_blocks = used if most_blocks is None else max(most_blocks, used)
    wall = time.perf_counter() - start
    if engine_peak:
        most_blocks = max(most_blocks or 0, engine.stats.peak_used_blocks)
    return RepeatResult(outputs, wall, most_blocks)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float] | None:
    """{'mean', 'p50', 'p90', 'p99', 'n'} of the values, None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    out = {"mean": sum(values) / len(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    out["n"] = len(values)
    return out


def repeat_rates(rep: RepeatResult, point: SweepPoint) -> dict[str, float | None]:
    """Per-repeat throughputs (see FORMULAS)."""
    outs = rep.outputs
    firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
    arrival = min(o.arrival_time for o in outs)
    prefill_span = max(firsts) - arrival if firsts else 0.0
    decode_span = max(o.finish_time for o in outs) - min(firsts) if firsts else 0.0
    decode_tokens = sum(max(len(o.output_token_ids) - 1, 0) for o in outs)
    n_out = sum(len(o.output_token_ids) for o in outs)
    return {
        "prefill_tokens_per_s": point.batch_size * point.prompt_len / prefill_span
        if prefill_span > 0
        else None,
        "decode_tokens_per_s": decode_tokens / decode_span
        if decode_span > 0 and decode_tokens
        else None,
        "output_tokens_per_s": n_out / rep.wall_s if rep.wall_s > 0 else None,
        "wall_s": rep.wall_s,
    }


def point_record(
    point: SweepPoint,
    repeats: list[RepeatResult],
    peak: tuple[int | None, str],
    facts: ModelFacts | None,
    peaks: Any | None,
) -> dict[str, Any]:
    """The JSON record of one point: settings, metric summaries, memory, KV blocks, MBU/MFU."""
    outs = [o for rep in repeats for o in rep.outputs]
    tpots = [o.tpot for o in outs]
    per_repeat = [repeat_rates(rep, point) for rep in repeats]
    record: dict[str, Any] = {
        "batch_size": point.batch_size,
        "prompt_len": point.prompt_len,
        "gen_len": point.gen_len,
        "repeats": len(repeats),
        "output_tokens_min": min(len(o.output_token_ids) for o in outs),
        "output_tokens_max": max(len(o.output_token_ids) for o in outs),
        "ttft_s": summarize([o.ttft for o in outs]),
        "tpot_s": summarize(tpots),
        "e2e_s": summarize([o.finish_time - o.arrival_time for o in outs]),
        "decode_tokens_per_s_per_sequence": summarize([1 / t for t in tpots if t]),
    }
    for name in ("decode_tokens_per_s", "prefill_tokens_per_s", "output_tokens_per_s", "wall_s"):
        record[name] = summarize([r[name] for r in per_repeat])
    blocks = [r.kv_blocks_used for r in repeats if r.kv_blocks_used is not None]
    record["kv_blocks_used"] = max(blocks) if blocks else None
    record["peak_memory_bytes"], record["peak_memory_kind"] = peak
    record["mbu"], record["mfu"] = utilization(point, record, facts, peaks)
    return record


def utilization(
    point: SweepPoint, record: dict[str, Any], facts: ModelFacts | None, peaks: Any | None
) -> tuple[float | None, float | None]:
    """(MBU, MFU) of a point against the machine's measured peaks (None without peaks)."""
    if facts is None or peaks is None:
        return None, None
    mbu = mfu = None
    tpot = (record.get("tpot_s") or {}).get("p50")
    if tpot:
        context = point.prompt_len + point.gen_len / 2
        step_bytes = facts.weight_bytes + point.batch_size * context * facts.kv_bytes_per_token
        mbu = step_bytes / tpot / peaks.memory_bandwidth
    wall = (record.get("wall_s") or {}).get("p50")
    if wall:
        flops = point.batch_size * (
            point.prompt_len * facts.flops_per_token(point.prompt_len // 2)
            + point.gen_len * facts.flops_per_token(point.prompt_len + point.gen_len // 2)
        )
        mfu = flops / wall / peaks.compute_peak(facts.dtype)
    return mbu, mfu


def run_sweep(
    engine: Engine,
    settings: SweepSettings,
    facts: ModelFacts | None = None,
    peaks: Any | None = None,
    progress: Callable[[int, int, SweepPoint], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every point (warm-up repeats first, not recorded) and return the point records."""
    rng = random.Random(settings.seed)
    records = []
    for n, point in enumerate(settings.points):
        if progress:
            progress(n, len(settings.points), point)
        for w in range(settings.warmup):
            run_repeat(engine, point, rng, settings.vocab_size, f"warmup-{n}-{w}")
        reset_peak_memory(settings.device)
        repeats = [
            run_repeat(engine, point, rng, settings.vocab_size, f"point-{n}-{r}")
            for r in range(settings.repeat)
        ]
        records.append(point_record(point, repeats, peak_memory(settings.device), facts, peaks))
    if progress:
        progress(len(settings.points), len(settings.points), None)
    return records


def model_facts(model: Any, config: Any, kv_dtype: str) -> ModelFacts:
    """Weight bytes as loaded (every parameter's storage, tied weights once) and the config's
    KV/FLOP sizes."""
    from llmctl.profiling.estimate import flops_per_token, kv_bytes_per_token

    seen, weight_bytes = set(), 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            weight_bytes += p.numel() * p.element_size()
    for (
        name,
        b,
    ) in model.named_buffers():  # quantized formats keep packed weights and scales in buffers
        if "rotary" not in name and id(b) not in seen:
            seen.add(id(b))
            weight_bytes += b.numel() * b.element_size()
    return ModelFacts(
        weight_bytes,
        kv_bytes_per_token(config, kv_dtype),
        lambda ctx: flops_per_token(config, ctx),
        kv_dtype,
    )
