"""The whole `llmctl sparsify` job, below the CLI: one prune step through the one-shot pipeline
(llmctl.compress.oneshot) and its report.

Owns: `SparsifyReport`, `sparsify_report` (built from a finished one-shot run, also for a
recipe's sparsify step), `write_recipe` (the run's resolved settings, saved as recipe.yaml in the
form `llmctl sparsify --recipe` reads) and `run_sparsify`. The arguments and their defaults are
`llmctl.compress.args.SparsifyArgs`; the checks and the pass are `llmctl.compress.sparse.step`.
The output is a dense checkpoint (zeros stored as zeros) in the source dtype: smaller only after
compression or quantization, faster only where a sparse kernel runs (2:4 on NVIDIA Ampere+;
never on the CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from llmctl.compress.args import (
    CALIBRATION_KEYS,
    QUANTIZE_KEYS,
    SPARSIFY_KEYS,
    QuantizeArgs,
    SparsifyArgs,
)
from llmctl.compress.job_common import calibration_summary, eval_tokens
from llmctl.compress.oneshot import Finish, Oneshot, StepOutcome, run_oneshot
from llmctl.compress.sparse.step import PruneStep
from llmctl.runtime.evaluate import HELDOUT_METHOD

__all__ = [
    "SPEED_NOTE",
    "SparsifyArgs",
    "SparsifyReport",
    "run_sparsify",
    "sparsify_report",
    "write_recipe",
]

SPEED_NOTE = (
    "dense checkpoint with zeros: no speedup on the CPU; on NVIDIA Ampere+ GPUs 2:4 matmuls can "
    "run through PyTorch semi-structured sparsity (up to 2x per compatible matmul, ~1.1x end to "
    "end measured elsewhere); vLLM dropped its 2:4 kernels in 2026 and runs it dense"
)


@dataclass
class SparsifyReport:
    method: str
    pattern: str
    output: str
    wall_time_s: float
    global_sparsity: float  # zeros / weights over the pruned linears
    model_sparsity: float  # zeros / weights over every decoder linear (skipped ones included)
    perplexity_before: float | None
    perplexity_after: float | None
    eval_tokens: int
    perplexity_method: str
    calibration: dict | None
    layers: list[dict]
    skipped: dict[str, str]
    resumed_layers: int = 0
    speed_note: str = SPEED_NOTE
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def sparsify_report(job: Oneshot, outcome: StepOutcome) -> SparsifyReport:
    """The report of a finished run's prune step."""
    step: PruneStep = outcome.step  # type: ignore[assignment]
    args, result = step.args, outcome.result
    return SparsifyReport(
        method=args.method,
        pattern=step.settings.pattern.label(),
        output=str(job.output),
        wall_time_s=outcome.wall_time_s,
        global_sparsity=round(step.global_sparsity, 6),
        model_sparsity=round(step.model_sparsity, 6),
        perplexity_before=outcome.perplexity_before if args.evaluate else None,
        perplexity_after=outcome.perplexity_after if args.evaluate else None,
        eval_tokens=eval_tokens(job.heldout) if args.evaluate else 0,
        perplexity_method=HELDOUT_METHOD,
        calibration=calibration_summary(job.calib) if step.calibrates else None,
        layers=[line.to_dict() for line in result.lines],
        skipped=step.targets.skipped,
        resumed_layers=result.resumed_layers,
        warnings=job.notes.items,
    )


def write_recipe(
    path: Path, args: SparsifyArgs, qargs: QuantizeArgs | None, note: str | None = None
) -> None:
    """The resolved settings of this run (its quantize step's too, when it had one) in recipe
    form: `llmctl sparsify MODEL -o OUT --recipe path` repeats it."""
    import yaml

    doc: dict[str, Any] = {
        "calibration": {k: getattr(args, k) for k in CALIBRATION_KEYS},
        "sparsify": {k: getattr(args, k) for k in SPARSIFY_KEYS},
    }
    if qargs is not None:
        doc["quantize"] = {k: getattr(qargs, k) for k in QUANTIZE_KEYS}
    header = (
        "# llmctl sparsify: resolved settings of the run that wrote this folder "
        f"(model: {args.model})\n"
    )
    path.write_text(header + (f"# {note}\n" if note else "") + yaml.safe_dump(doc, sort_keys=False))


def run_sparsify(
    args: SparsifyArgs,
    *,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] = lambda msg: None,
    finish: Finish | None = None,
) -> SparsifyReport:
    """Prune args.model into args.output (a dense HF folder) and report what was reached.

    progress(done, total) follows decoder layers (linears for magnitude); warn(msg) gets warnings;
    finish(result folder) runs after the files are written and before they move into place (it
    may add files, or raise to stop); by default it writes the run's recipe.yaml."""
    step = PruneStep(args)

    def done(folder: Path, job: Oneshot) -> None:
        if finish is None:
            write_recipe(folder / "recipe.yaml", args, None)
        else:
            finish(folder)

    stage = (lambda kind, d, t: progress(d, t)) if progress else None
    job = run_oneshot(args, [step], progress=stage, warn=warn, finish=done)
    return sparsify_report(job, job.outcomes[0])
