"""The whole `llmctl sparsify` job, below the CLI: check, load, calibrate, prune, evaluate, write.

Owns: `SparsifyArgs` (the resolved arguments; recipe.py saves them as the output's recipe.yaml), `SparsifyReport`
and `run_sparsify`. Every option is checked before the model loads (llmctl.compress.job_common);
the output is written into the output folder's work folder and moved into place at the end
(llmctl.compress.output_dir). The command module only parses options and prints the report.
The output is a
dense checkpoint (zeros stored as zeros) in the source dtype: smaller only after compression or
quantization, faster only where a sparse kernel runs (2:4 on NVIDIA Ampere+; never on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.compress.job_common import (
    Notes,
    Prepared,
    calibration_summary,
    check_common_options,
    eval_tokens,
    load_job_calibration,
    prepare,
    settle,
)
from llmctl.compress.output_dir import writing
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.compress.sparse.prune import METHODS, needs_calibration
from llmctl.errors import UsageError
from llmctl.runtime.evaluate import HELDOUT_METHOD, heldout_perplexity

Finish = Callable[[Path], None]  # called with the finished result folder before it moves into place
SPEED_NOTE = (
    "dense checkpoint with zeros: no speedup on the CPU; on NVIDIA Ampere+ GPUs 2:4 matmuls can run "
    "through PyTorch semi-structured sparsity (up to 2x per compatible matmul, ~1.1x end to end "
    "measured elsewhere); vLLM dropped its 2:4 kernels in 2026 and runs it dense"
)


@dataclass
class SparsifyArgs:
    model: str | None
    output: str
    pattern: str | None = None  # "2:4", "4:8"; None with sparsity None means 2:4
    sparsity: float | None = None  # unstructured fraction instead of a pattern
    method: str = "sparsegpt"
    calib: str | None = None
    eval_data: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    ignore: list[str] = field(default_factory=list)
    device: str = "auto"
    dampening: float = 0.01
    block_size: int = 128
    evaluate: bool = True
    overwrite: bool = False
    report_json: str | None = None

    def resolve(self) -> "SparsifyArgs":
        """Every check that needs no model; raises UsageError naming the flag."""
        if self.method not in METHODS:
            raise UsageError(
                f"unknown --method {self.method!r}; choose one of {', '.join(METHODS)}"
            )
        pattern = parse_pattern(self.pattern, self.sparsity)  # raises UsageError on bad input
        if pattern.structured:
            self.pattern, self.sparsity = pattern.label(), None
        check_common_options(self)
        if self.block_size < 1:
            raise UsageError(
                f"--block-size must be a positive number of columns, got {self.block_size}"
            )
        if pattern.structured and self.block_size % pattern.m:  # type: ignore[operator]
            raise UsageError(
                f"--block-size {self.block_size} must be a multiple of the pattern's "
                f"group width {pattern.m} (--pattern {pattern.label()})"
            )
        return self


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


def _fingerprint(args: SparsifyArgs, model_path: Path) -> str:
    d = asdict(args)
    for k in ("overwrite", "evaluate", "eval_data", "output", "report_json"):
        d.pop(k)
    d["model_path"] = str(model_path.resolve())
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _decoder_sparsity(model) -> float:
    zeros = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            zeros += int((module.weight == 0).sum())
            total += module.weight.numel()
    return zeros / max(1, total)


def _load_data(
    args: SparsifyArgs, rt, warn: Callable[[str], None]
) -> tuple[Any, torch.Tensor | None]:
    """(calibration set or None, held-out token ids or None) for this run; warnings go to `warn`."""
    from llmctl.compress.calib_data import read_token_stream

    if needs_calibration(args.method) or (args.evaluate and args.eval_data is None):
        # magnitude pruning only evaluates on this data: the built-in-text warning does not apply
        calib = load_job_calibration(args, rt, warn, calibrates=needs_calibration(args.method))
        return calib, calib.heldout
    if args.evaluate:
        ids = read_token_stream(Path(args.eval_data), rt, vocab_size=rt.config.vocab_size)
        return None, torch.tensor(ids, dtype=torch.long)
    return None, None


def check_targets(args: SparsifyArgs, linears: list[tuple[str, int, int]]) -> None:
    """Refuse, before loading, a run that would prune nothing (from the config's layer shapes)."""
    from llmctl.compress.driver import make_ignore

    pattern = parse_pattern(args.pattern, args.sparsity)
    ignored = make_ignore(args.ignore)
    if not any(not ignored(name) and pattern.fits(k) for name, _, k in linears):
        raise UsageError(
            "no linear layer left to prune (--ignore, or no layer width divisible by "
            "the group width)"
        )


@dataclass
class _Job:
    """One run between its checks and its report."""

    args: SparsifyArgs
    prep: Prepared
    warn: Notes
    t0: float


def _check(args: SparsifyArgs, warn: Callable[[str], None]) -> _Job:
    """Every check, before the model loads; warnings go to `warn` and into the report."""
    note = Notes(warn)
    t0 = time.perf_counter()
    args.resolve()
    prep = prepare(args)
    check_targets(args, prep.linears)
    raw = prep.config.raw
    if raw.get("quantization_config"):
        raise UsageError(
            f"{prep.model_path} is quantized; sparsify the unquantized model, "
            "then quantize the result"
        )
    settle(args, prep, note)
    if raw.get("sparsity_config"):
        note(
            f"{prep.model_path} is already sparse ({raw['sparsity_config'].get('pattern')}); "
            "pruning it again"
        )
    return _Job(args, prep, note, t0)


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
    from llmctl.compress.sparse.pipeline import SparsifySettings, sparsify_model, target_linears
    from llmctl.runtime.loader import load_runtime

    job = _check(args, warn)
    out = job.prep.out
    pattern = parse_pattern(args.pattern, args.sparsity)
    # calibrate in float32 on the CPU, one layer at a time on --device
    rt = load_runtime(job.prep.model_path, dtype="float32", device="cpu")
    settings = SparsifySettings(
        pattern, args.method, tuple(args.ignore), args.dampening, args.block_size
    )
    targets = target_linears(rt.model, settings)
    for name, why in targets.skipped.items():
        if not why.startswith("ignored"):
            job.warn(f"{name} stays dense: {why}")
    calib, heldout = _load_data(args, rt, job.warn)
    ppl_before = heldout_perplexity(rt.model, heldout) if args.evaluate else None
    result = sparsify_model(
        rt.model,
        settings,
        calib.input_ids if calib is not None else None,
        progress,
        device=job.prep.device,
        checkpoint_dir=out.resume_dir,
        warn=job.warn,
        fingerprint=_fingerprint(args, rt.model_path),
    )
    if result.resumed_layers:
        job.warn(
            f"resumed after layer {result.resumed_layers} of an interrupted run in {out.resume_dir}"
        )
    ppl_after = heldout_perplexity(rt.model, heldout) if args.evaluate else None
    global_sparsity = _write(out, rt, args, pattern, result.lines, finish)
    return SparsifyReport(
        method=args.method,
        pattern=pattern.label(),
        output=str(out.final),
        wall_time_s=round(time.perf_counter() - job.t0, 3),
        global_sparsity=round(global_sparsity, 6),
        model_sparsity=round(_decoder_sparsity(rt.model), 6),
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        eval_tokens=eval_tokens(heldout) if args.evaluate else 0,
        perplexity_method=HELDOUT_METHOD,
        calibration=(
            calibration_summary(calib)
            if calib is not None and needs_calibration(args.method)
            else None
        ),
        layers=[line.to_dict() for line in result.lines],
        skipped=targets.skipped,
        resumed_layers=result.resumed_layers,
        warnings=job.warn.items,
    )


def _write(out, rt, args: SparsifyArgs, pattern, lines, finish: Finish | None) -> float:
    """Write the pruned model into the work folder, run `finish` (default: write recipe.yaml),
    move it into place; returns the global sparsity of the pruned linears."""
    from llmctl.compress.sparse.export import save_dense_model, sparsity_config

    if finish is None:
        from llmctl.compress.sparse.recipe import write_recipe

        finish = lambda folder: write_recipe(folder / "recipe.yaml", args, None)  # noqa: E731
    pruned = sum(line.sparsity * line.shape[0] * line.shape[1] for line in lines)
    weights = sum(line.shape[0] * line.shape[1] for line in lines)
    global_sparsity = pruned / max(1, weights)
    per_layer = {line.name: line.sparsity for line in lines}
    meta = sparsity_config(pattern, args.method, per_layer, list(args.ignore), global_sparsity)
    folder = out.fresh_result()
    with writing(f"-o {out.final}"):
        save_dense_model(rt.model, rt.config.raw, rt.model_path, folder, {"sparsity_config": meta})
        finish(folder)
    out.commit()
    return global_sparsity
