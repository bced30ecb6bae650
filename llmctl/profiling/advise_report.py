"""`profile advise`: the versioned record, the ranked table and the command lines that apply the
advice.

Owns: `AdviseState` (what a run has measured so far; an interrupted run's record comes from it),
the record layout (schema `llmctl.profile.advise`), the table rows (ranked by the objective's
gain, skipped trials last with their reason), the `llmctl run-batch` / `llmctl quantize` lines of
the recommended combination, and the memory estimate of what fits on this machine.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.engine.config import EngineConfig, format_bytes
from llmctl.profiling import advise_trials as t
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.environment import environment

ADVISE_SCHEMA = "llmctl.profile.advise"
ADVISE_SCHEMA_VERSION = 1
LEFT = ("technique", "note")
COLUMNS = ("rank", "technique", "objective", "vs baseline", "TTFT p50", "TPOT p50", "tok/s",
           "peak mem", "KL", "note")  # fmt: skip


@dataclass
class AdviseState:
    req: Any
    ctx: Any
    baseline: Any = None  # TrialResult
    noise: float | None = None
    results: list = field(default_factory=list)
    chosen: list = field(default_factory=list)
    combined: Any = None
    combined_skipped: str | None = None
    confirmed: Any = None  # advise_confirm.Confirmation: the printed command, in fresh processes
    confirm_skipped: str | None = None
    interrupted: bool = False
    elapsed_s: float = 0.0

    def ranked(self) -> list[Any]:
        """Measured trials, best gain first; skipped ones after, in trial order."""
        base = self.baseline.measurement if self.baseline else None
        measured = [r for r in self.results if r.measurement is not None and base is not None]
        measured.sort(key=lambda r: -(t.gain(self.req.objective, base, r.measurement) or 0))
        return measured + [r for r in self.results if r.measurement is None]

    def record(self) -> dict[str, Any]:
        rt, work = self.ctx.runtime, self.ctx.work
        share = t.shared_prefix_tokens(work.prompts, EngineConfig().block_size)
        base = self.baseline.measurement if self.baseline else None
        return {
            "schema": ADVISE_SCHEMA,
            "schema_version": ADVISE_SCHEMA_VERSION,
            "model": rt.model_name,
            "environment": environment(rt.device, canonical_dtype(rt.dtype)),
            "settings": {k: v for k, v in self.req.__dict__.items()},
            "workload": {
                "requests": len(work.prompts),
                "rows_refused": work.rows_refused,
                "prompt_tokens": work.prompt_tokens,
                "shared_prefix_tokens": share,
                "shared_prefix_share": share / work.prompt_tokens,
                "concurrency": self.ctx.concurrency,
            },
            "baseline": None if base is None else base.to_dict(),
            "baseline_kv_cache_bytes": self.ctx.base_config.kv_cache_memory,
            "noise": self.noise,
            "trials": [r.to_dict() for r in self.ranked()],
            "recommended": [r.trial.key for r in self.chosen],
            "combined": None if self.combined is None else self.combined.to_dict(),
            "combined_skipped": self.combined_skipped,
            "confirmed": None if self.confirmed is None else self.confirmed.to_dict(),
            "confirm_skipped": self.confirm_skipped,
            "commands": commands(self),
            "memory_fit": memory_fit(self.ctx),
            "interrupted": self.interrupted,
            "elapsed_s": self.elapsed_s,
        }


def _ms(summary: dict | None) -> str:
    return "-" if not summary else f"{summary['p50'] * 1e3:.2f} ms"


def _value(objective: str, m: Any) -> str:
    v = t.objective_value(objective, m)
    if v is None:
        return "-"
    if objective == "throughput":
        return f"{v:.1f} tok/s"
    return format_bytes(v) if objective == "memory" else f"{v * 1e3:.2f} ms"


def _row(rank: str, name: str, objective: str, base: Any, r: Any, max_kl: float) -> list[str]:
    m = r.measurement
    g = t.gain(objective, base, m)
    kl = "-" if r.kl is None else f"{r.kl:.4f}"
    note = f"KL above --max-kl {max_kl}: not advised" if r.kl is not None and r.kl > max_kl else ""
    if r.trial.group == "kv_dtype" and r.agreement is not None:  # its quality cost
        low = r.agreement < t.MIN_AGREEMENT
        said = f"greedy tokens {r.agreement:.1%} the baseline's" + (": not advised" * low)
        note = "; ".join(x for x in (note, said) if x)
    if m.preemptions:  # the KV cache ran full: sequences were recomputed
        note = "; ".join(x for x in (note, f"{m.preemptions} preemption(s)") if x)
    mem = "-" if m.peak_memory_bytes is None else format_bytes(m.peak_memory_bytes)
    tps = "-" if m.output_tokens_per_s is None else f"{m.output_tokens_per_s:.1f}"
    ratio = "-" if g is None else f"{g:.2f}x"
    return [rank, name, _value(objective, m), ratio, _ms(m.ttft_s), _ms(m.tpot_s), tps, mem, kl,
            note]  # fmt: skip


def table_rows(state: AdviseState) -> list[list[str]]:
    """Baseline, the ranked trials, skipped trials with their reason, the combination."""
    if state.baseline is None:
        return []
    obj, base, max_kl = state.req.objective, state.baseline.measurement, state.req.max_kl
    rows = [_row("-", "baseline", obj, base, state.baseline, max_kl)]
    n = 0
    for r in state.ranked():
        if r.measurement is None:
            rows.append(["-", r.trial.name] + ["-"] * 7 + [f"skipped: {r.skipped}"])
        else:
            n += 1
            rows.append(_row(str(n), r.trial.name, obj, base, r, max_kl))
    if state.combined is not None and state.combined.measurement is not None:
        label = "together, not advised: " if state.combined_skipped else "recommended: "
        rows.append(_row("*", label + state.combined.trial.name, obj, base, state.combined,
                         max_kl))  # fmt: skip
    return rows


def notes(state: AdviseState) -> list[str]:
    """The lines under the table: the workload, the noise, the advice and the memory fit."""
    rec = state.record()
    w = rec["workload"]
    lines = [
        f"objective {state.req.objective}; {w['requests']} requests, {w['concurrency']} at once; "
        f"a shared prefix covers {w['shared_prefix_share']:.1%} of the prompt tokens",
    ]
    if state.noise is not None:
        lines.append(f"noise (two baseline measurements, each the best of {state.req.repeats} "
                     f"passes): +/-{state.noise:.1%}; gains within it are not advised")  # fmt: skip
    if state.interrupted:
        lines.append("interrupted: the trials measured so far")
    if state.combined_skipped:
        lines.append(state.combined_skipped)
    lines += _confirm_lines(state)
    if not state.chosen and not state.interrupted:
        lines.append("no trial beat the baseline beyond the noise: keep the baseline")
    fit = rec["memory_fit"]
    if fit.get("max_sequences") is not None:
        lines.append(f"memory: {fit['max_sequences']} sequences of {fit['seq_len']} tokens fit "
                     f"in {format_bytes(fit['memory_bytes'])} next to the weights "
                     f"({fit['max_sequences_kv_fp8']} with --kv-cache-dtype fp8)")  # fmt: skip
    return lines


def _confirm_lines(state: AdviseState) -> list[str]:
    c = state.confirmed
    if state.confirm_skipped:
        return [f"not confirmed with the printed command: {state.confirm_skipped}"]
    if c is None:
        return []
    if c.gain is None:
        return ["the printed command's runs reported no value for the objective"]
    each = ", ".join("-" if x is None else f"{x:.2f}x" for x in c.rounds)
    spread = "one round: spread unknown" if c.noise is None else f"+/-{c.noise:.1%}"
    line = (
        f"confirmed with the printed command (the sample, fresh processes, alternated with the "
        f"baseline's): {c.gain:.2f}x ({each}), {spread}"
    )
    if c.gain <= 1 + (c.noise or 0):
        return [line + "; not a gain in fresh processes: keep the baseline"]
    return [line + "; expect this gain from it"]


def commands(state: AdviseState) -> list[str]:
    """`llmctl quantize` (when the advice quantizes) and `llmctl run-batch` lines."""
    if state.baseline is None:
        return []
    model = str(state.ctx.runtime.model_path)
    trial = t.combine(state.chosen)
    lines = []
    if trial.bits:
        out = f"{Path(model).name}-{trial.method}-w{trial.bits}"
        lines.append(shlex.join(["llmctl"] + quantize_args(model, out, trial, state.req.calib)))
        model = out
    return lines + [
        shlex.join(["llmctl"] + run_batch_args(state, trial, state.req.workload, model))
    ]


def quantize_args(model: str, out: str, trial: t.Trial, calib: str | None) -> list[str]:
    """The `llmctl quantize` words that make a quantized trial's weights."""
    args = ["quantize", model, "-o", out, f"--{trial.method}", "--bits", str(trial.bits)]
    return args + (["--calib", calib] if trial.method != "rtn" and calib else [])


def run_batch_args(state: AdviseState, trial: t.Trial, workload: str, model: str) -> list[str]:
    """The `llmctl run-batch` words that serve `workload` as `trial` was measured: greedy, the
    sample's output lengths, the trial's engine settings (the baseline's otherwise)."""
    req = state.req
    args = ["run-batch", workload, "--model", model, "--temperature", "0"]
    args += ["--max-tokens", str(req.max_tokens)]
    if req.concurrency:
        args += ["--max-in-flight", str(state.ctx.concurrency)]
    dtype = trial.dtype or (req.dtype if req.dtype != "auto" else None)
    args += ["--dtype", dtype] if dtype else []
    args += ["--device", req.device] if req.device != "auto" else []
    engine = trial.engine
    if not engine.get("enable_prefix_caching"):
        args.append("--no-prefix-caching")
    if engine.get("speculative"):
        args += ["--speculative", engine["speculative"]]
        if engine.get("draft_model"):
            args += ["--draft", engine["draft_model"]]
    if "max_num_seqs" in engine:
        args += ["--max-num-seqs", str(engine["max_num_seqs"])]
    if "max_num_batched_tokens" in engine:
        args += ["--max-num-batched-tokens", str(engine["max_num_batched_tokens"])]
    if "kv_cache_memory" in engine:
        args += ["--kv-cache-memory", str(engine["kv_cache_memory"])]
    if "kv_cache_dtype" in engine:
        args += ["--kv-cache-dtype", engine["kv_cache_dtype"]]
    if trial.reorder:
        args += ["--reorder", "prefix"]
    return args


def _machine_memory(device: str) -> int | None:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def memory_fit(ctx: Any) -> dict[str, Any]:
    """How many sequences of the workload's longest length fit on this machine (estimate)."""
    from llmctl.profiling.estimate import estimate

    rt, work = ctx.runtime, ctx.work
    seq_len = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens))
    budget = _machine_memory(rt.device)
    dtype = canonical_dtype(rt.dtype)
    est = estimate(rt.config, dtype=dtype, seq_len=seq_len, memory_budget=budget)
    fp8 = estimate(rt.config, dtype=dtype, seq_len=seq_len, memory_budget=budget, kv_dtype="fp8")
    return {
        "seq_len": seq_len,
        "memory_bytes": budget,
        "max_sequences": est.max_sequences,
        "max_sequences_kv_fp8": fp8.max_sequences,  # with --kv-cache-dtype fp8
    }


def markdown(state: AdviseState) -> str:
    rows = table_rows(state)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in notes(state)]
    lines += ["", "```sh"] + commands(state) + ["```"]
    return "\n".join(lines) + "\n"
