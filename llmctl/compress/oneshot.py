"""The one-shot compression pipeline: one job skeleton that runs a list of steps on one model.

Owns: `Step` (what a step of the list provides: `llmctl.compress.quant.step.QuantizeStep`,
`llmctl.compress.sparse.step.PruneStep`), `RunContext` (what a step's layer-by-layer pass gets),
`Oneshot` (what a finished run hands back to build reports) and `run_oneshot`, the skeleton that
`quantize`, `sparsify` and recipes all use:

    check (each step, then the model's config) -> fingerprint -> prepare the output -> load
    -> perplexity before -> each step in order -> perplexity after each -> write -> finish

Steps run one after another, each in its own pass through the calibration driver, on the model
in memory: each calibrates on the outputs of the model the steps before it produced. Between two
steps the weights are rounded to the checkpoint's dtype, as a saved intermediate folder would
store them, so a step sees exactly what it would read from such a folder. Step i>0 keeps its
resume state in `resume/step-<i>` inside the first step's, which a changed run clears with it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from llmctl.compress.job_common import (
    JobArgs,
    Notes,
    Prepared,
    load_job_calibration,
    prepare,
    settle,
)
from llmctl.runtime.output_dir import writing

Finish = Callable[[Path], None]  # called with the finished result folder before it moves into place
WriteHook = Callable[[Path, "Oneshot"], None]  # a Finish that also gets the run
StageProgress = Callable[[str, int, int], None]  # (step kind, done, total)
SHARED_FIELDS = ("calib", "eval_data", "num_samples", "seq_len", "device")  # what calibration reads
NOT_FINGERPRINTED = ("model", "output", "overwrite", "report_json", "evaluate", "max_shard_size")


@dataclass
class RunContext:
    """What a step's pass gets from the pipeline."""

    device: str
    checkpoint_dir: Path
    fingerprint: str
    progress: Callable[[int, int], None] | None
    warn: Callable[[str], None]
    out_dtype: torch.dtype  # the checkpoint's own dtype, which the output is written in
    # held-out perplexity of a model, as before/after are scored; None when nothing is measured
    score: Callable[[torch.nn.Module], float | None] | None = None


class Step(Protocol):
    kind: str  # "sparsify" or "quantize": the progress stage and the report's key
    args: Any  # the step's resolved arguments (QuantizeArgs, SparsifyArgs)
    calibrates: bool  # reads the layers' inputs (else only weights)
    needs_data: bool  # loads the calibration set (to calibrate, or to report it)
    measures: bool  # perplexity before and after it

    def resolve(self) -> None:
        """The checks that need no model (UsageError naming the flag)."""

    def check(self, prep: Prepared) -> list[str]:
        """The checks the model's config decides, before loading; returns notes to show."""

    def plan(self, model: torch.nn.Module, warn: Callable[[str], None]) -> None:
        """After loading, before any data: what the step will change (warnings go to `warn`)."""

    def run(self, model: torch.nn.Module, calib_ids: torch.Tensor | None, ctx: RunContext) -> Any:
        """Change `model` in place; returns a result with a `resumed_layers` count."""

    def config_entry(self) -> dict[str, Any]:
        """What the step adds to the output's config.json (after `run`)."""

    def write(self, folder: Path, rt, extra_config: dict[str, Any], out_dtype) -> None:
        """Write the model into `folder` (only the last step's `write` runs)."""

    def review(self, perplexity_after: float | None) -> list[str]:
        """Warnings on the step's outcome, given the held-out perplexity after it."""


@dataclass
class StepOutcome:
    step: Step
    result: Any  # what step.run returned
    perplexity_before: float | None
    perplexity_after: float | None
    wall_time_s: float


@dataclass
class Oneshot:
    """A finished run: what the reports are built from."""

    prep: Prepared
    model_path: Path
    notes: Notes
    calib: Any | None  # llmctl.compress.calib_data.Calibration, when it was loaded
    heldout: torch.Tensor | None  # the held-out token ids perplexity read
    outcomes: list[StepOutcome] = field(default_factory=list)

    @property
    def output(self) -> Path:
        return self.prep.out.final


def fingerprint(args: JobArgs, steps: list[Step], model_path: Path) -> str:
    """What a step's resume state depends on: the model, the data and every step up to it."""
    doc = {
        "model_path": str(model_path.resolve()),
        "data": {k: getattr(args, k) for k in SHARED_FIELDS},
        "steps": [
            {"kind": s.kind}
            | {
                k: v
                for k, v in asdict(s.args).items()
                if k not in (*SHARED_FIELDS, *NOT_FINGERPRINTED)
            }
            for s in steps
        ],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _check(args: JobArgs, steps: list[Step], inputs: tuple[Path, ...], notes: Notes) -> Prepared:
    """Every check before the model loads: each step's own, the shared ones, then the config's."""
    for step in steps:
        step.resolve()
    prep = prepare(args, inputs)
    later = [note for step in steps for note in step.check(prep)]
    settle(args, prep, notes, [s.args.ignore for s in steps])
    for step in steps:
        step.args.seq_len = args.seq_len  # capped at the model's context by settle
    for note in later:
        notes(note)
    return prep


def _load_data(args: JobArgs, steps: list[Step], rt, warn: Callable[[str], None]):
    """(calibration set or None, held-out token ids or None) for this run."""
    from llmctl.compress.calib_data import read_token_stream

    measures = any(s.measures for s in steps)
    if any(s.needs_data for s in steps) or (measures and args.eval_data is None):
        # a step that only scores perplexity on the data: the built-in-text warning does not apply
        calibrates = any(s.calibrates for s in steps)
        calib = load_job_calibration(args, rt, warn, calibrates=calibrates)
        return calib, calib.heldout
    if measures:
        ids = read_token_stream(Path(args.eval_data), rt, vocab_size=rt.config.vocab_size)
        return None, torch.tensor(ids, dtype=torch.long)
    return None, None


def _round_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every weight to `dtype` and back in place (what saving and reloading would do)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype))


def run_oneshot(
    args: JobArgs,
    steps: list[Step],
    *,
    progress: StageProgress | None = None,
    warn: Callable[[str], None] = lambda msg: None,
    finish: WriteHook | None = None,
    inputs: tuple[Path, ...] = (),
) -> Oneshot:
    """Run `steps` in order on args.model and write args.output (see the module docstring).

    `args` holds the settings the steps share (data, device, output); `inputs`: more files of
    the run (a recipe) that --report-json may not overwrite; finish(result folder, run), if given,
    runs after the files are written and before they move into place (it may add files, or
    raise to stop)."""
    from llmctl.runtime.resolve import resolve_dtype

    notes, t0 = Notes(warn), time.perf_counter()
    prep = _check(args, steps, inputs, notes)
    rt = _load(prep, notes)
    out_dtype = resolve_dtype("auto", rt.config, "cuda")  # the checkpoint's own dtype
    for step in steps:
        step.plan(rt.model, notes)
    calib, heldout = _load_data(args, steps, rt, notes)
    job = Oneshot(prep, rt.model_path, notes, calib, heldout)
    ppl = _perplexity(rt.model, heldout, steps[0].measures)
    mark = t0
    for i, step in enumerate(steps):
        if i and out_dtype != torch.float32:  # in float32 rounding changes nothing
            _round_to(rt.model, out_dtype)
            ppl = None
        if i and (ppl is None or not step.measures):  # else the last step's "after" stands
            ppl = _perplexity(rt.model, heldout, step.measures)
        ctx = RunContext(
            prep.device,
            prep.out.resume_dir / f"step-{i}" if i else prep.out.resume_dir,
            fingerprint(args, steps[: i + 1], rt.model_path),
            (lambda d, t, k=step.kind: progress(k, d, t)) if progress else None,
            notes,
            out_dtype,
            (lambda m, w=step.measures: _perplexity(m, heldout, w)) if step.measures else None,
        )
        result = step.run(rt.model, None if calib is None else calib.input_ids, ctx)
        if result.resumed_layers:
            notes(
                f"resumed after layer {result.resumed_layers} of an interrupted run in "
                f"{ctx.checkpoint_dir}"
            )
        after = _perplexity(rt.model, heldout, step.measures)
        for message in step.review(after):
            notes(message)
        job.outcomes.append(StepOutcome(step, result, ppl, after, _since(mark)))
        ppl, mark = after, time.perf_counter()
    _write(job, rt, out_dtype, finish)
    job.outcomes[-1].wall_time_s += _since(mark)  # the last step's time includes writing
    return job


def _load(prep: Prepared, notes: Notes):
    """The model to calibrate, in float32 on the CPU (one layer at a time goes to --device): the
    Llama family on our own layers (its fixed layout), every other family (the native Gemma and
    MoE ones included) on transformers' model, whose layers the driver discovers."""
    from llmctl.models.linears import prepare_for_compression
    from llmctl.runtime.loader import load_runtime

    impl = "llmctl" if prep.config.llama_layout else "transformers"
    rt = load_runtime(prep.model_path, dtype="float32", device="cpu", model_impl=impl)
    prepare_for_compression(rt.model, notes)
    return rt


def _perplexity(model, heldout: torch.Tensor | None, wanted: bool) -> float | None:
    from llmctl.runtime.evaluate import heldout_perplexity

    return heldout_perplexity(model, heldout) if wanted and heldout is not None else None


def _since(mark: float) -> float:
    """Seconds since `mark`: a step's wall time (the first one's includes checks and loading)."""
    return round(time.perf_counter() - mark, 3)


def _write(job: Oneshot, rt, out_dtype, finish: WriteHook | None) -> None:
    """The last step writes the model (with every step's config.json entry) into the work folder;
    `finish` runs; the folder moves into place."""
    steps = [outcome.step for outcome in job.outcomes]
    extra: dict[str, Any] = {}
    for step in steps:
        extra.update(step.config_entry())
    out = job.prep.out
    folder = out.fresh_result()
    with writing(f"-o {out.final}"):
        steps[-1].write(folder, rt, extra, out_dtype)
        if finish is not None:
            finish(folder, job)
    out.commit()
