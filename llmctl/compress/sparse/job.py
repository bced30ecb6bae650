"""The whole `llmctl sparsify` job, below the CLI: load, calibrate, prune, evaluate, write.

Owns: `SparsifyArgs` (the resolved arguments; recipe.py saves them as the output's recipe.yaml), `SparsifyReport`
and `run_sparsify`. The command module only parses options and prints the report. The output is a
dense checkpoint (zeros stored as zeros) in the source dtype: smaller only after compression or
quantization, faster only where a sparse kernel runs (2:4 on NVIDIA Ampere+; never on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.compress.sparse.masks import parse_pattern
from llmctl.compress.sparse.prune import METHODS, needs_calibration
from llmctl.errors import UsageError
from llmctl.runtime.evaluate import HELDOUT_MAX_TOKENS, HELDOUT_METHOD, heldout_perplexity

TMP_DIR = ".llmctl-sparsify-tmp"
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

    def resolve(self) -> "SparsifyArgs":
        if self.method not in METHODS:
            raise UsageError(f"unknown --method {self.method!r}; choose one of {', '.join(METHODS)}")
        pattern = parse_pattern(self.pattern, self.sparsity)  # raises UsageError on bad input
        if pattern.structured:
            self.pattern, self.sparsity = pattern.label(), None
        if self.num_samples < 1 or self.seq_len < 2:
            raise UsageError("--num-samples must be >= 1 and --seq-len >= 2")
        if not 0 < self.dampening < 1:
            raise UsageError("--dampening must be in (0, 1)")
        if pattern.structured and self.block_size % pattern.m:  # type: ignore[operator]
            raise UsageError(f"--block-size {self.block_size} must be a multiple of the group width {pattern.m}")
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
    for k in ("overwrite", "evaluate", "eval_data", "output"):
        d.pop(k)
    d["model_path"] = str(model_path.resolve())
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _prepare_output(out: Path, overwrite: bool) -> None:
    from llmctl.compress.quantize_job import prepare_output_folder

    prepare_output_folder(out, overwrite, TMP_DIR)


def _decoder_sparsity(model) -> float:
    zeros = total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            zeros += int((module.weight == 0).sum())
            total += module.weight.numel()
    return zeros / max(1, total)


def _load_data(args: SparsifyArgs, rt) -> tuple[Any, torch.Tensor | None, list[str]]:
    """(calibration set or None, held-out token ids or None, warnings) for this run."""
    from llmctl.compress.calib_data import DEFAULT_WARNING, load_calibration, read_token_stream

    if needs_calibration(args.method) or (args.evaluate and args.eval_data is None):
        calib = load_calibration(
            Path(args.calib) if args.calib else None, rt, num_samples=args.num_samples, seq_len=args.seq_len,
            eval_data=Path(args.eval_data) if args.eval_data else None,
            separator=rt.eos_token_ids[0] if rt.eos_token_ids else None,
        )
        # magnitude pruning only evaluates on this data: the "calibrating on built-in text" warning does not apply
        warnings = [w for w in calib.warnings if needs_calibration(args.method) or w != DEFAULT_WARNING]
        return calib, calib.heldout, warnings
    if args.evaluate:
        return None, torch.tensor(read_token_stream(Path(args.eval_data), rt), dtype=torch.long), []
    return None, None, []


def run_sparsify(
    args: SparsifyArgs,
    *,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] = lambda msg: None,
) -> SparsifyReport:
    """Prune args.model into args.output (a dense HF folder) and report what was reached.

    progress(done, total) follows decoder layers (linears for magnitude); warn(msg) gets warnings."""
    from llmctl.compress.sparse.export import save_dense_model, sparsity_config
    from llmctl.compress.sparse.pipeline import SparsifySettings, sparsify_model, target_linears
    from llmctl.runtime.loader import load_runtime
    from llmctl.runtime.resolve import resolve_device

    args.resolve()
    t0 = time.perf_counter()
    out = Path(args.output)
    pattern = parse_pattern(args.pattern, args.sparsity)
    rt = load_runtime(args.model, dtype="float32", device="cpu")  # calibrate in float32, layer by layer on --device
    if rt.config.raw.get("quantization_config"):
        raise UsageError(f"{rt.model_path} is quantized; sparsify the unquantized model, then quantize the result")
    if rt.config.raw.get("sparsity_config"):
        warn(f"{rt.model_path} is already sparse ({rt.config.raw['sparsity_config'].get('pattern')}); pruning it again")
    settings = SparsifySettings(pattern, args.method, tuple(args.ignore), args.dampening, args.block_size)
    model = rt.model
    targets = target_linears(model, settings)
    if not targets.names:
        raise UsageError("no linear layer left to prune (--ignore, or no layer width divisible by the group width)")
    _prepare_output(out, args.overwrite)
    warnings: list[str] = []
    for name, why in targets.skipped.items():
        if not why.startswith("ignored"):
            warnings.append(f"{name} stays dense: {why}")

    calib, heldout, data_warnings = _load_data(args, rt)
    warnings += data_warnings
    for w in warnings:
        warn(w)
    ppl_before = heldout_perplexity(model, heldout) if args.evaluate else None

    result = sparsify_model(
        model, settings, calib.input_ids if calib is not None else None, progress,
        device=resolve_device(args.device), checkpoint_dir=out / TMP_DIR, fingerprint=_fingerprint(args, rt.model_path),
        warn=warn,
    )
    lines = result.lines
    if result.resumed_layers:
        warn(f"resumed after layer {result.resumed_layers} of an interrupted run in {out / TMP_DIR}")
    ppl_after = heldout_perplexity(model, heldout) if args.evaluate else None

    pruned = sum(line.sparsity * line.shape[0] * line.shape[1] for line in lines)
    weights = sum(line.shape[0] * line.shape[1] for line in lines)
    global_sparsity = pruned / max(1, weights)
    meta = sparsity_config(pattern, args.method, {l.name: l.sparsity for l in lines}, list(args.ignore), global_sparsity)
    save_dense_model(model, rt.config.raw, rt.model_path, out, {"sparsity_config": meta})
    shutil.rmtree(out / TMP_DIR, ignore_errors=True)
    return SparsifyReport(
        method=args.method, pattern=pattern.label(), output=str(out), wall_time_s=round(time.perf_counter() - t0, 3),
        global_sparsity=round(global_sparsity, 6), model_sparsity=round(_decoder_sparsity(model), 6),
        perplexity_before=ppl_before, perplexity_after=ppl_after,
        eval_tokens=0 if heldout is None or not args.evaluate else min(heldout.numel(), HELDOUT_MAX_TOKENS),
        perplexity_method=HELDOUT_METHOD,
        calibration=None if calib is None or not needs_calibration(args.method) else {
            "source": calib.source, "num_samples": int(calib.input_ids.shape[0]), "seq_len": int(calib.input_ids.shape[1])},
        layers=[line.to_dict() for line in lines], skipped=targets.skipped, resumed_layers=result.resumed_layers, warnings=warnings,
    )

