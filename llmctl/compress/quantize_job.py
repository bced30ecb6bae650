"""The whole `llmctl quantize` job, below the CLI: check, load, calibrate, quantize, evaluate and
write.

Owns: `QuantizeArgs` (the resolved arguments, saved as recipe.yaml), `QuantizeReport` and
`run_quantize`. Every option is checked before the model loads (llmctl.compress.job_common, and
the group size / format rules here, from the model's config); the output is written into the
output folder's work folder and moved into place at the end (llmctl.compress.output_dir). The
command module only parses options and prints the report.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

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
from llmctl.compress.output_dir import copy_side_files, output_config, writing
from llmctl.errors import UsageError
from llmctl.runtime.evaluate import HELDOUT_METHOD, heldout_perplexity
from llmctl.runtime.formats import FORMATS
from llmctl.runtime.formats.spec import BITS, parse_group_size, resolve_group_size

METHODS = ("awq", "gptq", "rtn")
Finish = Callable[[Path], None]  # called with the finished result folder before it moves into place


@dataclass
class QuantizeArgs:
    model: str | None
    output: str
    method: str
    bits: int = 4
    group_size: int | str = "auto"  # a power of two >= 16, "channel" or "auto" (resolved per model)
    symmetric: bool | None = None  # None: the method's default (AWQ asymmetric, GPTQ/RTN symmetric)
    calib: str | None = None
    eval_data: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    format: str = "compressed-tensors"
    ignore: list[str] = field(default_factory=list)
    device: str = "auto"
    act_order: bool = True
    dampening: float = 0.01
    overwrite: bool = False
    report_json: str | None = None

    def resolve(self) -> "QuantizeArgs":
        """Every check that needs no model; raises UsageError naming the flag."""
        if self.method not in METHODS:
            raise UsageError(f"unknown method {self.method!r}; use --awq, --gptq or --rtn")
        if self.format not in FORMATS:
            raise UsageError(
                f"unknown --format {self.format!r}; choose one of {', '.join(FORMATS)}"
            )
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise UsageError(f"--bits must be 4 or 8, got {self.bits!r}")
        if self.format == "awq" and self.bits != 4:
            raise UsageError(
                "--format awq stores 4-bit weights only; use --bits 4 or --format compressed-tensors"
            )
        self.group_size = parse_group_size(self.group_size)
        if self.format == "awq" and self.group_size == "channel":
            resolve_group_size("channel", [], channel_format="awq")  # raises with the one message
        check_common_options(self)
        if self.symmetric is None:
            self.symmetric = self.method != "awq"
        return self

    @property
    def spec_group_size(self) -> int | None:
        """The resolved group size as QuantSpec takes it (None: per channel)."""
        return None if self.group_size == "channel" else int(self.group_size)


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

    def to_dict(self) -> dict:
        return asdict(self)


def _fingerprint(args: QuantizeArgs, model_path: Path) -> str:
    d = asdict(args)
    for k in ("overwrite", "report_json"):
        d.pop(k)
    d["model_path"] = str(model_path.resolve())
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def check_layers(args: QuantizeArgs, linears: list[tuple[str, int, int]]) -> str | None:
    """The checks the model's shapes decide, before any work: resolves args.group_size ("auto")
    and refuses sizes and formats that cannot store these layers. Returns the group-size note."""
    if not linears:
        raise UsageError("--ignore leaves no layer to quantize")
    channel_format = "awq" if args.format == "awq" else None
    widths = [(n, k) for n, _, k in linears]
    group, note = resolve_group_size(args.group_size, widths, channel_format=channel_format)
    args.group_size = "channel" if group is None else group
    if args.format in ("awq", "gptq"):
        per = 32 // args.bits
        for n, out_f, _ in linears:
            if out_f % per:
                raise UsageError(
                    f"{n}: {out_f} output features are not a multiple of {per}, which --format {args.format} needs"
                )
    return note


def _method(args: QuantizeArgs, spec):
    from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method, rtn_method

    if args.method == "gptq":
        return gptq_method(spec, act_order=args.act_order, percdamp=args.dampening)
    if args.method == "awq":
        return AwqMethod(spec)
    return rtn_method(spec)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _write_output(
    out: Path,
    model_path: Path,
    model,
    records: dict,
    spec,
    args: QuantizeArgs,
    out_dtype,
    note: str | None,
) -> None:
    from llmctl.runtime.formats import write_quantized

    linears = {name: rec.result for name, rec in records.items()}
    dense = {
        k: v.detach().to("cpu", out_dtype)
        for k, v in model.state_dict().items()
        if k.rsplit(".", 1)[0] not in linears or not k.endswith(".weight")
    }
    if model.config.tie_word_embeddings:
        dense.pop("lm_head.weight", None)
    qcfg = write_quantized(out, args.format, dense, linears, spec, args.ignore, out_dtype)
    raw = json.loads((model_path / "config.json").read_text())
    config = output_config(raw, {"quantization_config": qcfg})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(model_path, out)
    write_recipe(out / "recipe.yaml", args, model_path, note)


def write_recipe(path: Path, args: QuantizeArgs, model_path: Path, note: str | None = None) -> None:
    import yaml

    d = asdict(args)
    for k in ("overwrite", "report_json"):
        d.pop(k)
    d["model"] = str(model_path)
    comment = f"# {note}\n" if note else ""
    header = "# llmctl quantize: resolved arguments of the run that wrote this folder\n"
    path.write_text(header + comment + yaml.safe_dump({"quantize": d}, sort_keys=False))


def check_format_available(fmt: str) -> None:
    """--format compressed-tensors needs its package: fail now, not after calibrating."""
    from llmctl.runtime.formats.ct import require_package

    if fmt == "compressed-tensors":
        require_package(UsageError, " or choose --format awq or gptq")


@dataclass
class _Job:
    """One run between its checks and its report."""

    args: QuantizeArgs
    prep: Prepared
    ignored: Callable[[str], bool]
    group_note: str | None
    warn: Notes
    t0: float


def _check(args: QuantizeArgs, warn: Callable[[str], None]) -> _Job:
    """Every check, before the model loads; warnings go to `warn` and into the report."""
    from llmctl.compress.driver import make_ignore

    note = Notes(warn)
    t0 = time.perf_counter()
    args.resolve()
    prep = prepare(args)
    if prep.config.raw.get("quantization_config"):
        raise UsageError(f"{prep.model_path} is already quantized")
    check_format_available(args.format)
    ignored = make_ignore(args.ignore)
    group_note = check_layers(args, [t for t in prep.linears if not ignored(t[0])])
    settle(args, prep, note)
    if group_note:
        note(group_note)
    return _Job(args, prep, ignored, group_note, note, t0)


def run_quantize(
    args: QuantizeArgs,
    *,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] = lambda msg: None,
    finish: Finish | None = None,
) -> QuantizeReport:
    """Quantize args.model into args.output. finish(result folder), when given, runs after the
    files are written and before they move into place (it may add files, or raise to stop)."""
    from llmctl.compress.driver import calibrate_layers
    from llmctl.runtime.formats.spec import QuantSpec
    from llmctl.runtime.loader import load_runtime
    from llmctl.runtime.resolve import resolve_dtype

    job = _check(args, warn)
    out = job.prep.out
    # calibrate in float32 on the CPU, one layer at a time on --device
    rt = load_runtime(job.prep.model_path, dtype="float32", device="cpu")
    out_dtype = resolve_dtype("auto", rt.config, "cuda")  # the checkpoint's own dtype
    scale_dtype = torch.float16 if args.format in ("awq", "gptq") else out_dtype
    spec = QuantSpec(args.bits, args.spec_group_size, bool(args.symmetric), scale_dtype)
    # RTN reads only the weights: it uses the data for perplexity alone
    calib = load_job_calibration(args, rt, job.warn, calibrates=args.method != "rtn")
    ppl_before = heldout_perplexity(rt.model, calib.heldout)
    result = calibrate_layers(
        rt.model,
        calib.input_ids,
        _method(args, spec),
        device=job.prep.device,
        ignore=job.ignored,
        warn=job.warn,
        checkpoint_dir=out.resume_dir,
        fingerprint=_fingerprint(args, rt.model_path),
        progress=progress,
    )
    if result.resumed_layers:
        job.warn(
            f"resumed after layer {result.resumed_layers} of an interrupted run in {out.resume_dir}"
        )
    ppl_after = heldout_perplexity(rt.model, calib.heldout)
    folder = out.fresh_result()
    with writing(f"-o {out.final}"):
        _write_output(
            folder, rt.model_path, rt.model, result.records, spec, args, out_dtype, job.group_note
        )
        if finish is not None:
            finish(folder)
    out.commit()
    return QuantizeReport(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=bool(args.symmetric),
        format=args.format,
        output=str(out.final),
        wall_time_s=round(time.perf_counter() - job.t0, 3),
        size_before_bytes=_size(rt.model_path),
        size_after_bytes=_size(out.final),
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        eval_tokens=eval_tokens(calib.heldout),
        calibration=calibration_summary(calib),
        layers=[result.records[n].to_dict() for n, _, _ in job.prep.linears if n in result.records],
        resumed_layers=result.resumed_layers,
        warnings=job.warn.items,
        group_size_note=job.group_note,
    )
