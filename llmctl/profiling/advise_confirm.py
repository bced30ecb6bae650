"""`profile advise`: the advice confirmed with the command it prints.

Owns: `Confirmation` and `confirm`. The sample is written as rows of token ids; the printed
`llmctl run-batch` line (after its `llmctl quantize` line, into a temporary folder) and the
baseline's line run alternately in fresh processes, `rounds` times. The confirmed gain is the
median of the rounds' ratios and its noise their whole range relative to it (at least the noise
floor; fresh processes differ more than passes in one process: BENCHMARKS.md, run A21c): what a
user gets from the printed line, process start and first calls included, which the in-process
measurements (warm engines, each request's best pass) leave out.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.profiling import advise_report as rep
from llmctl.profiling import advise_trials as t


@dataclass
class Confirmation:
    gain: float | None  # median over the rounds of advised vs baseline (> 1: better)
    noise: float | None  # (largest - smallest round) / median; None: under two rounds
    rounds: list[float | None]  # each round's gain
    baseline: list[float | None]  # the objective's value per baseline run
    advised: list[float | None]  # ... per run of the printed line

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _value(objective: str, report: dict, peak: int | None) -> float | None:
    """The objective's value from a run-batch --report-json record and the process's peak."""
    if objective == "memory":
        return peak
    if objective == "throughput":
        return report.get("output_tokens_per_s")
    summary = report.get(f"{objective}_s")
    return None if not summary else summary.get("p50")


def write_sample(work: Any, path: Path) -> None:
    """The measured sample as run-batch rows: its token ids and each request's output length."""
    rows = ({"prompt_token_ids": p, "max_tokens": n} for p, n in zip(work.prompts, work.max_tokens))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def confirm(state: Any, rounds: int) -> Confirmation:
    """Run the advised and the baseline run-batch lines alternately on the sample (baseline
    first in each round: load drifts touch both alike)."""
    ctx, objective = state.ctx, state.req.objective
    trial = t.combine(state.chosen)
    with tempfile.TemporaryDirectory(prefix="llmctl-confirm-") as tmp:
        folder = Path(tmp)
        sample = folder / "sample.jsonl"
        write_sample(ctx.work, sample)
        model = str(ctx.runtime.model_path)
        advised_model = model
        if trial.bits:
            advised_model = str(folder / "weights")
            ctx.tools.quantize(model, advised_model, trial.bits, trial.method, ctx.calib)
        base_words = rep.run_batch_args(state, t.Trial("baseline", "baseline", "baseline"),
                                        str(sample), model)  # fmt: skip
        advised_words = rep.run_batch_args(state, trial, str(sample), advised_model)
        values: dict[str, list] = {"base": [], "advised": []}
        for r in range(rounds):
            for key, words in (("base", base_words), ("advised", advised_words)):
                out = folder / f"{key}{r}.jsonl"
                report, peak = ctx.tools.run_line(words + ["-o", str(out)])
                values[key].append(_value(objective, report, peak))
    ratios = [t.ratio(objective, b, a) for b, a in zip(values["base"], values["advised"])]
    known = [x for x in ratios if x is not None]
    gain = statistics.median(known) if known else None
    noise = None
    if gain and len(known) > 1:
        noise = max(t.NOISE_FLOOR, (max(known) - min(known)) / gain)
    return Confirmation(gain, noise, ratios, values["base"], values["advised"])
