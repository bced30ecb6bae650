"""The quantize step of the one-shot pipeline (llmctl.compress.oneshot): AWQ, GPTQ or RTN.

Owns: `QuantizeStep` (checks against the model's config, the method on the calibration driver,
the quantized output in compressed-tensors, AWQ or GPTQ layout, the RTN probe and its warning
for a calibrated method: llmctl.compress.quant.probe), `check_layers` (group size and
format rules from the layer shapes) and `check_format_available`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.compress.args import QuantizeArgs
from llmctl.compress.driver import DriverResult, calibrate_layers, make_ignore
from llmctl.errors import UsageError
from llmctl.runtime.formats.gptq import check_shape as gptq_check_shape
from llmctl.runtime.formats.spec import QuantSpec, resolve_group_size
from llmctl.runtime.output_dir import copy_side_files, output_config


def check_layers(args: QuantizeArgs, linears: list[tuple[str, int, int]]) -> str | None:
    """The checks the model's shapes decide, before any work: resolves args.group_size ("auto")
    and refuses sizes and formats that cannot store these layers. Returns the group-size note."""
    if not linears:
        raise UsageError("--ignore leaves no layer to quantize")
    channel_format = "awq" if args.format == "awq" else None
    widths = [(n, k) for n, _, k in linears]
    group, note = resolve_group_size(args.group_size, widths, channel_format=channel_format)
    args.group_size = "channel" if group is None else group
    if args.format == "awq":
        per = 32 // args.bits
        for n, out_f, _ in linears:
            if out_f % per:
                raise UsageError(
                    f"{n}: {out_f} output features are not a multiple of {per}, "
                    f"which --format {args.format} needs"
                )
    if args.format == "gptq":
        for n, out_f, in_f in linears:
            gptq_check_shape(n, out_f, in_f, args.bits)
    return note


def check_format_available(fmt: str) -> None:
    """--format compressed-tensors needs its package: fail now, not after calibrating."""
    from llmctl.runtime.formats.ct import require_package

    if fmt == "compressed-tensors":
        require_package(UsageError, " or choose --format awq or gptq")


class QuantizeStep:
    """Weight-only quantization of the decoder linears not matched by args.ignore."""

    kind = "quantize"
    needs_data = True  # the report names the calibration data, RTN included
    measures = True

    def __init__(self, args: QuantizeArgs):
        self.args = args
        # RTN reads only the weights; SmoothQuant's pass reads the activations
        self.calibrates = args.method != "rtn" or bool(args.smoothquant)
        self.group_note: str | None = None
        self.spec: QuantSpec | None = None
        self.records: dict[str, Any] = {}
        self.rtn_probe: float | None = None  # held-out perplexity RTN would have scored
        self.warn: Callable[[str], None] | None = None  # the run's, for write-time warnings

    def resolve(self) -> None:
        self.args.resolve()

    def check(self, prep) -> list[str]:
        if prep.config.raw.get("quantization_config"):
            raise UsageError(f"{prep.model_path} is already quantized")
        check_format_available(self.args.format)
        if self.args.method == "awq" and not prep.config.llama_layout:
            raise UsageError(
                "--awq folds scales into the operation before each linear, which llmctl knows "
                f"for llama, mistral, qwen2 and qwen3 only, not {prep.config.model_type}; use "
                "--gptq or --rtn"
            )
        if self.args.smoothquant and not prep.config.llama_layout:
            raise UsageError(
                "--smoothquant folds scales into the norm before each linear group, which llmctl "
                f"knows for llama, mistral, qwen2 and qwen3 only, not {prep.config.model_type}"
            )
        ignored = make_ignore(self.args.ignore)
        self.group_note = check_layers(self.args, [t for t in prep.linears if not ignored(t[0])])
        return [self.group_note] if self.group_note else []

    def plan(self, model: torch.nn.Module, warn: Callable[[str], None]) -> None:
        pass

    def _method(self, spec: QuantSpec):
        from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method, rtn_method

        a = self.args
        mse = a.observer == "mse"
        if a.method == "gptq":
            return gptq_method(
                spec,
                act_order=a.act_order,
                dampening=a.dampening,
                column_block=a.column_block,
                mse=mse,
            )
        if a.method == "awq":
            return AwqMethod(spec, unclipped_mse=mse)
        return rtn_method(spec, mse=mse)

    def run(self, model: torch.nn.Module, calib_ids, ctx) -> DriverResult:
        a = self.args
        scale_dtype = torch.float16 if a.format in ("awq", "gptq") else ctx.out_dtype
        w8a8 = a.scheme == "w8a8"
        self.spec = QuantSpec(a.bits, a.spec_group_size, bool(a.symmetric), scale_dtype, w8a8)
        if a.smoothquant:
            self._smooth(model, calib_ids, ctx)
        # the probe is weight-only: against W8A8's perplexity (int8 activations) it would mislead
        if a.method != "rtn" and not w8a8 and ctx.score is not None:
            from llmctl.compress.quant.probe import rtn_probe

            ignored = make_ignore(a.ignore)
            mse = a.observer == "mse"
            self.rtn_probe = rtn_probe(model, self.spec, ignored, ctx.score, mse=mse)
        result = calibrate_layers(
            model,
            calib_ids,
            self._method(self.spec),
            device=ctx.device,
            ignore=make_ignore(a.ignore),
            warn=ctx.warn,
            checkpoint_dir=ctx.checkpoint_dir,
            fingerprint=ctx.fingerprint,
            progress=ctx.progress,
        )
        self.records = result.records
        self.warn = ctx.warn
        if w8a8:  # the perplexity after is measured with int8 activations, as the engine runs it
            from llmctl.compress.quant.w8a8 import quantize_inputs
            from llmctl.models.linears import weights_root

            quantize_inputs(weights_root(model), list(self.records))  # names are under the root
        return result

    def _smooth(self, model: torch.nn.Module, calib_ids, ctx) -> None:
        """SmoothQuant's pass over the calibration data (llm-compressor's SmoothQuantModifier
        before its quantization modifier): folds the scales into the model, quantizes nothing."""
        from llmctl.compress.quant.smoothquant import SmoothQuantMethod

        a = self.args
        method = SmoothQuantMethod(a.smoothquant_strength)
        calibrate_layers(
            model, calib_ids, method, device=ctx.device, ignore=make_ignore(a.ignore), warn=ctx.warn
        )

    def review(self, perplexity_after: float | None) -> list[str]:
        """The RTN probe's verdict: a warning when this method did worse than RTN would have."""
        from llmctl.compress.quant.probe import probe_warning

        message = probe_warning(self.args.method, perplexity_after, self.rtn_probe)
        return [message] if message else []

    def config_entry(self) -> dict[str, Any]:
        return {}  # quantization_config comes from the writer, which knows the layout

    def write(self, folder: Path, rt, extra_config: dict[str, Any], out_dtype) -> None:
        """The quantized linears in --format's layout, every other weight dense in out_dtype."""
        from llmctl.models.linears import checkpoint_names, export_state, kept_dense, weights_root
        from llmctl.runtime.formats import write_quantized
        from llmctl.runtime.formats.ct import consumer_note

        model = rt.model
        # under the checkpoint's names (mixtral's experts: block_sparse_moe.experts.E.w1), which
        # export_state's dense tensors and vLLM use too
        spelled = checkpoint_names(weights_root(model), list(self.records))
        linears = {spelled[name]: rec.result for name, rec in self.records.items()}
        dense = {
            k: v.detach().to("cpu", out_dtype)
            for k, v in export_state(model).items()
            if k.rsplit(".", 1)[0] not in linears or not k.endswith(".weight")
        }
        if rt.config.tie_word_embeddings:
            dense.pop("lm_head.weight", None)
        a = self.args
        note = consumer_note(self.spec) if a.format == "compressed-tensors" else None
        if note and self.warn is not None:
            self.warn(note)
        ignore = [*a.ignore, *kept_dense(model)]
        qcfg = write_quantized(
            folder, a.format, dense, linears, self.spec, ignore, out_dtype, a.max_shard_size
        )
        raw = json.loads((rt.model_path / "config.json").read_text())
        config = output_config(raw, {**extra_config, "quantization_config": qcfg})
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(rt.model_path, folder)
