"""The whole `llmctl quantize` job, below the CLI: one quantize step through the one-shot
pipeline (llmctl.compress.oneshot), its report and its recipe.yaml.

Owns: `QuantizeReport`, `quantize_report` (built from a finished one-shot run, also for a
recipe's quantize step), `write_recipe` (the resolved arguments, saved as recipe.yaml) and
`run_quantize`. The arguments and their defaults are `llmctl.compress.args.QuantizeArgs`; the
checks, the method and the output's layout are `llmctl.compress.quant.step`. The command module
only parses options and prints the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from llmctl.compress.args import QuantizeArgs
from llmctl.compress.job_common import calibration_summary, eval_tokens
from llmctl.compress.oneshot import Finish, Oneshot, StepOutcome, run_oneshot
from llmctl.compress.quant.step import QuantizeStep
from llmctl.runtime.evaluate import HELDOUT_METHOD

__all__ = ["QuantizeArgs", "QuantizeReport", "quantize_report", "run_quantize", "write_recipe"]


@dataclass
class QuantizeReport:
    method: str
    bits: int
    group_size: int | str  # the size used, or "channel"
    symmetric: bool
    format: str
    output: str
    wall_time_s: float
    size_before_bytes: int
    size_after_bytes: int
    perplexity_before: float | None
    perplexity_after: float | None
    eval_tokens: int
    calibration: dict
    layers: list[dict]
    resumed_layers: int = 0
    warnings: list[str] = field(default_factory=list)
    perplexity_method: str = HELDOUT_METHOD
    group_size_note: str | None = None  # why --group-size auto did not choose 128
    # held-out perplexity round-to-nearest reaches with the same settings (GPTQ/AWQ, when
    # perplexity is measured): a warning says when perplexity_after is worse
    perplexity_rtn_probe: float | None = None
    scheme: str | None = None  # "w8a8": int8 activations per token too (perplexity_after with them)
    smoothquant_strength: float | None = None  # SmoothQuant's strength when it ran, else None

    def to_dict(self) -> dict:
        return asdict(self)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def quantize_report(job: Oneshot, outcome: StepOutcome) -> QuantizeReport:
    """The report of a finished run's quantize step."""
    step: QuantizeStep = outcome.step  # type: ignore[assignment]
    args = step.args
    return QuantizeReport(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=bool(args.symmetric),
        format=args.format,
        output=str(job.output),
        wall_time_s=outcome.wall_time_s,
        size_before_bytes=_size(job.model_path),
        size_after_bytes=_size(job.output),
        perplexity_before=outcome.perplexity_before,
        perplexity_after=outcome.perplexity_after,
        eval_tokens=eval_tokens(job.heldout),
        calibration=calibration_summary(job.calib),
        layers=[step.records[n].to_dict() for n, _, _ in job.prep.linears if n in step.records],
        resumed_layers=outcome.result.resumed_layers,
        warnings=job.notes.items,
        group_size_note=step.group_note,
        perplexity_rtn_probe=step.rtn_probe,
        scheme=args.scheme,
        smoothquant_strength=args.smoothquant_strength if args.smoothquant else None,
    )


def write_recipe(path: Path, args: QuantizeArgs, model_path: Path, note: str | None = None) -> None:
    """The resolved arguments of this run, under `quantize:`."""
    import yaml

    d = asdict(args)
    for k in ("overwrite", "report_json"):
        d.pop(k)
    d["model"] = str(model_path)
    comment = f"# {note}\n" if note else ""
    header = "# llmctl quantize: resolved arguments of the run that wrote this folder\n"
    path.write_text(header + comment + yaml.safe_dump({"quantize": d}, sort_keys=False))


def run_quantize(
    args: QuantizeArgs,
    *,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] = lambda msg: None,
    finish: Finish | None = None,
) -> QuantizeReport:
    """Quantize args.model into args.output. finish(result folder), when given, runs after the
    files are written and before they move into place (it may add files, or raise to stop)."""
    step = QuantizeStep(args)

    def done(folder: Path, job: Oneshot) -> None:
        write_recipe(folder / "recipe.yaml", args, job.model_path, step.group_note)
        if finish is not None:
            finish(folder)

    stage = (lambda kind, d, t: progress(d, t)) if progress else None
    job = run_oneshot(args, [step], progress=stage, warn=warn, finish=done)
    return quantize_report(job, job.outcomes[0])
