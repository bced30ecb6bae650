"""The whole `llmctl quantize` job, below the CLI: load, calibrate, quantize, evaluate, write.

Owns: `QuantizeArgs` (the resolved arguments, saved as recipe.yaml), `QuantizeReport` and
`run_quantize`. The command module only parses options and prints the report.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from llmctl.runtime.formats import FORMATS
from llmctl.errors import UsageError
from llmctl.runtime.evaluate import HELDOUT_MAX_TOKENS, HELDOUT_METHOD, heldout_perplexity

METHODS = ("awq", "gptq", "rtn")
TMP_DIR = ".llmctl-quantize-tmp"
COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


@dataclass
class QuantizeArgs:
    model: str | None
    output: str
    method: str
    bits: int = 4
    group_size: int = 128
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

    def resolve(self) -> "QuantizeArgs":
        if self.method not in METHODS:
            raise UsageError(f"unknown method {self.method!r}; use --awq, --gptq or --rtn")
        if self.format not in FORMATS:
            raise UsageError(f"unknown --format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.format == "awq" and self.bits != 4:
            raise UsageError("--format awq stores 4-bit weights only; use --bits 4 or --format compressed-tensors")
        if self.num_samples < 1 or self.seq_len < 2:
            raise UsageError("--num-samples must be >= 1 and --seq-len >= 2")
        if not 0 < self.dampening < 1:
            raise UsageError("--dampening must be in (0, 1)")
        if self.symmetric is None:
            self.symmetric = self.method != "awq"
        return self


@dataclass
class QuantizeReport:
    method: str
    bits: int
    group_size: int
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

    def to_dict(self) -> dict:
        return asdict(self)


def _fingerprint(args: QuantizeArgs, model_path: Path) -> str:
    d = asdict(args)
    d.pop("overwrite")
    d["model_path"] = str(model_path.resolve())
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def prepare_output_folder(out: Path, overwrite: bool, tmp_dir: str) -> None:
    """Create the output folder -o; refuse a file, or a non-empty folder (other than our resume
    folder `tmp_dir`) unless overwrite. Shared by quantize and sparsify."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out} is a file; give a folder")
    if out.is_dir():
        others = [p.name for p in out.iterdir() if p.name != tmp_dir]
        if others and not overwrite:
            raise UsageError(f"output folder {out} is not empty; choose another -o or pass --overwrite")
    out.mkdir(parents=True, exist_ok=True)


def _prepare_output(out: Path, overwrite: bool) -> None:
    prepare_output_folder(out, overwrite, TMP_DIR)


def _quantized_linears(model, ignored) -> list[tuple[str, int]]:
    names = []
    for i, layer in enumerate(model.model.layers):
        for rel in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{rel}"
            if not ignored(name):
                names.append((name, layer.get_submodule(rel).in_features))
    return names


def _check_shapes(linears: list[tuple[str, int]], args: QuantizeArgs, model) -> None:
    """Refuse, before any work, group sizes that do not divide a layer and formats' packing limits."""
    from llmctl.runtime.formats.spec import working_group_sizes

    bad = [(n, k) for n, k in linears if k % args.group_size]
    if bad:
        ok = working_group_sizes([k for _, k in linears])
        hint = f"group sizes that work for every layer: {', '.join(map(str, ok))}" if ok else "no common group size fits"
        raise UsageError(
            f"{bad[0][0]}: {bad[0][1]} input features are not a multiple of --group-size {args.group_size}"
            f" ({len(bad)} layers affected); {hint}"
        )
    if args.format in ("awq", "gptq"):
        per = 32 // args.bits
        for n, _ in linears:
            out_f = model.get_submodule(n).out_features
            if out_f % per:
                raise UsageError(f"{n}: {out_f} output features are not a multiple of {per}, which --format {args.format} needs")


def _method(args: QuantizeArgs, spec):
    from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method, rtn_method

    if args.method == "gptq":
        return gptq_method(spec, act_order=args.act_order, percdamp=args.dampening)
    if args.method == "awq":
        return AwqMethod(spec)
    return rtn_method(spec)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _write_output(out: Path, model_path: Path, model, records: dict, spec, args: QuantizeArgs, out_dtype) -> None:
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
    config = json.loads((model_path / "config.json").read_text())
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (model_path / name).is_file():
            shutil.copy2(model_path / name, out / name)
    _write_recipe(out / "recipe.yaml", args, model_path)


def _write_recipe(path: Path, args: QuantizeArgs, model_path: Path) -> None:
    import yaml

    d = asdict(args)
    d.pop("overwrite")
    d["model"] = str(model_path)
    path.write_text("# llmctl quantize: resolved arguments of the run that wrote this folder\n"
                    + yaml.safe_dump({"quantize": d}, sort_keys=False))


def run_quantize(
    args: QuantizeArgs,
    *,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] = lambda msg: None,
) -> QuantizeReport:
    from llmctl.compress.calib_data import DEFAULT_WARNING, load_calibration
    from llmctl.compress.driver import calibrate_layers, make_ignore
    from llmctl.runtime.formats.spec import QuantSpec
    from llmctl.runtime.loader import load_runtime
    from llmctl.runtime.resolve import resolve_device, resolve_dtype

    args.resolve()
    t0 = time.perf_counter()
    out = Path(args.output)
    rt = load_runtime(args.model, dtype="float32", device="cpu")  # calibrate in float32, layer by layer on --device
    if rt.config.raw.get("quantization_config"):
        raise UsageError(f"{rt.model_path} is already quantized")
    device = resolve_device(args.device)
    out_dtype = resolve_dtype("auto", rt.config, "cuda")  # the checkpoint's own dtype (float16 stays float16)
    model = rt.model
    ignored = make_ignore(args.ignore)
    targets = _quantized_linears(model, ignored)
    if not targets:
        raise UsageError("--ignore leaves no layer to quantize")
    _check_shapes(targets, args, model)
    _prepare_output(out, args.overwrite)
    scale_dtype = torch.float16 if args.format in ("awq", "gptq") else out_dtype
    spec = QuantSpec(args.bits, args.group_size, bool(args.symmetric), scale_dtype)

    calib = load_calibration(
        Path(args.calib) if args.calib else None, rt, num_samples=args.num_samples, seq_len=args.seq_len,
        eval_data=Path(args.eval_data) if args.eval_data else None,
        separator=rt.eos_token_ids[0] if rt.eos_token_ids else None,
    )
    if args.method == "rtn":  # RTN reads only the weights: the data only scores perplexity
        calib.warnings = [w for w in calib.warnings if w != DEFAULT_WARNING]
    for w in calib.warnings:
        warn(w)
    ppl_before = heldout_perplexity(model, calib.heldout)

    result = calibrate_layers(
        model, calib.input_ids, _method(args, spec), device=device, ignore=ignored,
        checkpoint_dir=out / TMP_DIR, fingerprint=_fingerprint(args, rt.model_path), progress=progress,
        warn=warn,
    )
    if result.resumed_layers:
        warn(f"resumed after layer {result.resumed_layers} of an interrupted run in {out / TMP_DIR}")
    ppl_after = heldout_perplexity(model, calib.heldout)
    _write_output(out, rt.model_path, model, result.records, spec, args, out_dtype)
    shutil.rmtree(out / TMP_DIR, ignore_errors=True)
    layers = [result.records[n].to_dict() for n, _ in targets]
    return QuantizeReport(
        method=args.method, bits=args.bits, group_size=args.group_size, symmetric=bool(args.symmetric),
        format=args.format, output=str(out), wall_time_s=round(time.perf_counter() - t0, 3),
        size_before_bytes=_size(rt.model_path), size_after_bytes=_size(out),
        perplexity_before=ppl_before, perplexity_after=ppl_after,
        eval_tokens=0 if calib.heldout is None else min(calib.heldout.numel(), HELDOUT_MAX_TOKENS),
        calibration={"source": calib.source, "num_samples": int(calib.input_ids.shape[0]),
                     "seq_len": int(calib.input_ids.shape[1])},
        layers=layers, resumed_layers=result.resumed_layers, warnings=calib.warnings,
    )
