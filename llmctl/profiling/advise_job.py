"""`profile advise MODEL`: one advise run end to end, minus the terminal.

Owns: loading the model and the workload, the baseline (measured twice, each measurement the best
of `repeats` passes: the second is the baseline, the difference between the two is the noise the
output states), the trials under the
time budget, the recommended combination measured together, and the versioned record
(`advise_report.advise_record`). Ctrl-C ends the trials and returns the record of what was
measured so far, marked interrupted.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from llmctl.engine.config import EngineConfig
from llmctl.errors import UsageError
from llmctl.profiling import advise_report as rep
from llmctl.profiling import advise_trials as t
from llmctl.profiling.advise import (
    AdviseRequest,
    AdviseTools,
    agreement,
    parse_duration,
    prime,
    read_rows,
    tokenize,
)
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.estimate import kv_bytes_per_sequence

Progress = Callable[[str], None]  # one line per stage
QUALITY_TOKENS = 4096  # tokens of quality data the KL is measured on, at most


def quality_tokens(
    req: AdviseRequest, runtime: Any, prompts: list[list[int]], tools: AdviseTools
) -> list[int]:
    """--quality-data (text, or rows in the workload formats) or the workload's own prompts."""
    if req.quality_data is None:
        ids = [i for p in prompts for i in p]
    elif Path(req.quality_data).suffix.lower() in (".jsonl", ".parquet", ".json"):
        rows, _ = read_rows(tools.open_input, req.quality_data, 10**6)
        ids = [i for p in tokenize(rows, runtime, 1).prompts for i in p]
    else:
        try:
            ids = runtime.encode(Path(req.quality_data).read_text(encoding="utf-8"))
        except OSError as e:
            raise UsageError(f"cannot read --quality-data {req.quality_data}: {e}") from None
    if len(ids) < 2:
        raise UsageError("the quality data has fewer than 2 tokens; KL needs more")
    return list(ids[:QUALITY_TOKENS])


def _noise(objective: str, a: Any, b: Any) -> float:
    g = t.gain(objective, a, b)
    return max(t.NOISE_FLOOR, abs(g - 1) if g is not None else 0.0)


def _context(req: AdviseRequest, target: str | None, tools: AdviseTools):
    rows, refused = read_rows(
        tools.open_input, req.workload, req.sample
    )  # before loading: bad input fails fast
    runtime = tools.load_runtime(target, dtype=req.dtype, device=req.device)
    work = tokenize(rows, runtime, req.max_tokens)
    work.rows_refused = refused
    longest = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens))
    if longest > runtime.config.max_position_embeddings:
        raise UsageError(
            f"a workload prompt plus its output ({longest} tokens) exceeds the model's context "
            f"({runtime.config.max_position_embeddings})"
        )
    concurrency = min(req.concurrency or len(work.prompts), len(work.prompts))
    block = EngineConfig().block_size
    dtype = canonical_dtype(runtime.dtype)
    kv = concurrency * kv_bytes_per_sequence(runtime.config, longest + block, dtype, block)
    base = EngineConfig(  # the KV cache holds every in-flight request, as profile's sweep sizes it
        kv_cache_memory=kv,
        enable_prefix_caching=False,
        max_num_seqs=max(concurrency, EngineConfig().max_num_seqs),
        seed=req.seed,
    )
    ids = quality_tokens(req, runtime, work.prompts, tools)
    return t.TrialContext(runtime, work, concurrency, base, ids, tools, req.repeats, req.calib)


def run_advise(
    req: AdviseRequest,
    target: str | None,
    tools: AdviseTools,
    progress: Progress = lambda line: None,
) -> rep.AdviseState:
    """Baseline, trials, the combination: the state whose `record()` is the JSON (interrupted:
    what was measured so far)."""
    req.check()
    started = time.monotonic()
    deadline = started + parse_duration(req.budget)
    ctx = _context(req, target, tools)
    state = rep.AdviseState(req, ctx)
    try:
        progress("priming: the sample's shapes once, untimed")
        prime(ctx.runtime.start_engine(ctx.base_config), ctx.work, ctx.concurrency)
        progress(f"baseline (prefix caching off, no speculation), twice, {req.repeats} passes each")
        first = t.run_trial(ctx, t.Trial("baseline", "baseline", "baseline"))
        state.baseline = t.run_trial(ctx, t.Trial("baseline", "baseline", "baseline"))
        state.noise = _noise(req.objective, first.measurement, state.baseline.measurement)
        walls = (first.measurement.wall_s, state.baseline.measurement.wall_s)
        estimate_s = max(walls) + 0.5 * req.repeats  # + each pass's engine start and warm-up

        def done(result: t.TrialResult) -> None:
            if result.measurement is not None:
                result.agreement = agreement(state.baseline.measurement, result.measurement)
            state.results.append(result)
            progress(f"{result.trial.name}: " + (result.skipped or "measured"))

        dtype = canonical_dtype(ctx.runtime.dtype)
        trials = t.candidate_trials(req.draft, req.calib, dtype, ctx.base_config.kv_cache_memory)
        t.run_trials(ctx, trials, deadline, estimate_s, done)
        _combination(state, deadline, estimate_s, progress)
        _confirm(state, deadline, progress)
    except KeyboardInterrupt:
        state.interrupted = True
    state.elapsed_s = time.monotonic() - started
    return state


def _combination(state: Any, deadline: float, estimate_s: float, progress: Progress) -> None:
    """Measure the recommended trials together when there is more than one of them."""
    req, base = state.req, state.baseline.measurement
    state.chosen = t.recommended(state.results, req.objective, base, state.noise, req.max_kl)
    if len(state.chosen) < 2:
        state.combined = state.chosen[0] if state.chosen else None
        return
    trial = t.combine(state.chosen)
    if time.monotonic() + estimate_s * (3 if trial.bits else 1.2) > deadline:
        state.combined_skipped = "over the --budget"
        return
    progress(f"recommended combination: {trial.name}")
    combined = t.run_trial(state.ctx, replace(trial))
    g_best = t.gain(req.objective, base, state.chosen[0].measurement) or 0.0
    g_all = t.gain(req.objective, base, combined.measurement) or 0.0
    state.combined = combined
    if g_all < g_best:  # together they do worse than the best alone: advise that one
        state.combined_skipped = (
            f"{trial.name} measured together: {g_all:.2f}x, below "
            f"{state.chosen[0].trial.name} alone ({g_best:.2f}x): advising it alone"
        )
        state.chosen = state.chosen[:1]


def _confirm(state: Any, deadline: float, progress: Progress) -> None:
    """The advice run as the user will run it: the printed command against the baseline's, in
    fresh processes (advise_confirm)."""
    from llmctl.profiling.advise_confirm import confirm

    req = state.req
    if not state.chosen or req.confirm_rounds == 0:
        return
    if time.monotonic() > deadline:
        state.confirm_skipped = "over the --budget"
        return
    progress(f"confirming with the printed command: {req.confirm_rounds} alternated rounds")
    state.confirmed = confirm(state, req.confirm_rounds)
