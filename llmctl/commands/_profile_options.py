"""profile's options as option records (`_records`), in the help panels of its forms.

Owns: every profile flag's name, panel and help, grouped into the records its sub-commands take
(`SweepFlags`, `RunFlags`, `DeviceFlags`, `EstimateFlags`, `CompareFlags`, `DtypeFlag`,
`CommonFlags`, `MachineFlag`, and `EstimateSwitch` of the old `--estimate` spelling), and the
positional arguments of each form. Flags default to None; the help quotes the defaults that
`SweepRequest`, `EstimateRequest`, `AdviseRequest` (--repeat) and `profiling.compare` own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.commands._options import MODEL_HELP, NO_AUTOTUNE_HELP, default_of
from llmctl.profiling.advise import AdviseRequest
from llmctl.profiling.compare import DEFAULT_STAT, DEFAULT_THRESHOLD
from llmctl.profiling.estimate_job import EstimateRequest
from llmctl.profiling.sweep_job import SweepRequest

SWEEP, ESTIMATE, COMPARE, COMMON = (
    "Measured sweep",
    "Estimate (--estimate)",
    "Compare (profile compare A B)",
    "Common",
)


def _opt(*names: str, panel: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, show_default=False, **kw)


def _switch(name: str, panel: str, help: str) -> Any:
    return typer.Option(name, help=help, rich_help_panel=panel)


def _list_default(name: str) -> str:
    value = {f.name: f.default for f in fields(SweepRequest)}[name]
    return f" (default: {','.join(str(v) for v in value)})"


def _sweep(name: str) -> str:
    return default_of(SweepRequest, name)


def _est(name: str) -> str:
    return default_of(EstimateRequest, name)


# The positional arguments of the forms (the old spelling's TARGETS holds all of them).
TargetsArg = Annotated[
    Optional[list[str]],
    typer.Argument(metavar="MODEL | compare A B", help=MODEL_HELP, show_default=False),
]
ModelArg = Annotated[
    Optional[str], typer.Argument(metavar="[MODEL]", help=MODEL_HELP, show_default=False)
]
ModelOrConfigArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL_OR_CONFIG",
        help="A model folder, its config.json, or a hub id (no weights are loaded).",
        show_default=False,
    ),
]
RecordsArg = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="A.json B.json",
        help="Two records of `profile --report-json`: A the baseline, B the candidate.",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class SweepFlags:
    """A measured sweep's grid, repeats and outputs (`profile sweep`)."""

    batch_sizes: Annotated[
        Optional[str],
        _opt(
            "--batch-sizes",
            panel=SWEEP,
            help="Comma-separated batch sizes" + _list_default("batch_sizes") + ".",
        ),
    ] = None
    prompt_lens: Annotated[
        Optional[str],
        _opt(
            "--prompt-lens",
            panel=SWEEP,
            help="Comma-separated prompt lengths (tokens)" + _list_default("prompt_lens") + ".",
        ),
    ] = None
    gen_lens: Annotated[
        Optional[str],
        _opt(
            "--gen-lens",
            panel=SWEEP,
            help="Comma-separated generation lengths (tokens)" + _list_default("gen_lens") + ".",
        ),
    ] = None
    warmup: Annotated[
        Optional[int],
        _opt(
            "--warmup",
            min=0,
            panel=SWEEP,
            help="Unrecorded warm-up repeats per point" + _sweep("warmup"),
        ),
    ] = None
    csv_path: Annotated[
        Optional[Path], _opt("--csv", panel=SWEEP, help="Write one CSV row per point.")
    ] = None
    plot_path: Annotated[
        Optional[Path],
        _opt(
            "--plot",
            panel=SWEEP,
            help="Write a PNG of throughput and latency vs batch size (needs matplotlib).",
        ),
    ] = None
    kv_cache_memory: Annotated[
        Optional[str],
        _opt(
            "--kv-cache-memory",
            panel=SWEEP,
            help="KV-cache size, e.g. 4GiB (default: what the largest point needs).",
        ),
    ] = None
    no_autotune: Annotated[bool, _switch("--no-autotune", SWEEP, NO_AUTOTUNE_HELP)] = False


@dataclass(frozen=True)
class RunFlags:
    """What measured runs share (`profile sweep` and `profile advise`)."""

    repeat: Annotated[
        Optional[int],
        _opt(
            "--repeat",
            min=1,
            panel=SWEEP,
            help="Measured repeats per point" + _sweep("repeat") + "; profile advise: fresh-engine "
            "passes per measurement, each request's best kept"
            + default_of(AdviseRequest, "repeats"),
        ),
    ] = None
    seed: Annotated[
        Optional[int],
        _opt("--seed", panel=SWEEP, help="Seed of the random prompts" + _sweep("seed")),
    ] = None
    markdown: Annotated[
        bool, _switch("--markdown", SWEEP, "Print a Markdown table instead of the rich table.")
    ] = False


@dataclass(frozen=True)
class DeviceFlags:
    """The device measured on (sweep, advise, machine)."""

    device: Annotated[
        Optional[str],
        _opt(
            "--device",
            panel=SWEEP,
            help="auto (cuda when present, else cpu), cpu or cuda" + _sweep("device") + ".",
        ),
    ] = None


@dataclass(frozen=True)
class EstimateSwitch:
    """The old spelling's form switch: `profile --estimate MODEL_OR_CONFIG`."""

    estimate: Annotated[
        bool,
        _switch("--estimate", ESTIMATE, "Estimate from config.json alone (no weights loaded)."),
    ] = False


@dataclass(frozen=True)
class EstimateFlags:
    """What `profile estimate` assumes."""

    group_size: Annotated[
        Optional[str],
        _opt(
            "--group-size",
            panel=ESTIMATE,
            help="int8/int4 group size along the input dimension, by quantize's rule: auto, "
            "channel, or a power of two >= 16 dividing every layer" + _est("group_size") + ".",
        ),
    ] = None
    kv_dtype: Annotated[
        Optional[str],
        _opt(
            "--kv-dtype",
            "--kv-cache-dtype",
            panel=ESTIMATE,
            help="KV element type, as run-batch's --kv-cache-dtype: bfloat16, float16, float32, "
            "fp8 (= fp8_e4m3), fp8_e5m2, or int8 (estimate only) (default: the weights' float "
            "dtype).",
        ),
    ] = None
    seq_len: Annotated[
        Optional[int],
        _opt(
            "--seq-len",
            min=1,
            panel=ESTIMATE,
            help="Tokens per sequence (default: max_position_embeddings).",
        ),
    ] = None
    batch: Annotated[
        Optional[int],
        _opt("--batch", min=1, panel=ESTIMATE, help="Concurrent sequences" + _est("batch") + "."),
    ] = None
    memory: Annotated[
        Optional[str],
        _opt(
            "--memory",
            panel=ESTIMATE,
            help="Memory budget, e.g. 24GiB: how many sequences fit next to the weights.",
        ),
    ] = None
    bandwidth: Annotated[
        Optional[str],
        _opt(
            "--bandwidth",
            panel=ESTIMATE,
            help="Memory bandwidth in GB/s (e.g. 900 or 3.35TB/s) for the decode ceiling "
            "(default: this machine's, if measured).",
        ),
    ] = None
    quantize_embeddings: Annotated[
        bool,
        _switch(
            "--quantize-embeddings", ESTIMATE, "Count embeddings and lm_head at the int dtype too."
        ),
    ] = False


@dataclass(frozen=True)
class CompareFlags:
    """How `profile compare` judges B against A."""

    threshold: Annotated[
        Optional[str],
        _opt(
            "--threshold",
            panel=COMPARE,
            help=f"Allowed change before B counts as a regression (default: {DEFAULT_THRESHOLD}).",
        ),
    ] = None
    stat: Annotated[
        Optional[str],
        _opt(
            "--stat",
            panel=COMPARE,
            help=f"Statistic compared: mean, p50, p90 or p99 (default: {DEFAULT_STAT}).",
        ),
    ] = None


@dataclass(frozen=True)
class DtypeFlag:
    """The dtype measured or estimated (sweep, estimate, advise)."""

    dtype: Annotated[
        Optional[str],
        _opt(
            "--dtype",
            panel=COMMON,
            help="auto, bfloat16, float16 or float32 (bf16, fp16, fp32 are read too); --estimate "
            "also int8, int4 (auto: the checkpoint's dtype).",
        ),
    ] = None


@dataclass(frozen=True)
class CommonFlags:
    """Every form's JSON record and quietness."""

    report_json: Annotated[
        Optional[Path],
        _opt(
            "--report-json",
            panel=COMMON,
            help="Write the versioned JSON record to this file ('-': standard output, no table).",
        ),
    ] = None
    json_path: Annotated[
        Optional[Path],
        _opt("--json", panel=COMMON, hidden=True, help="Old spelling of --report-json."),
    ] = None
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="No progress output on stderr.", rich_help_panel=COMMON),
    ] = False


@dataclass(frozen=True)
class MachineFlag:
    """--measure-machine: measure this machine's peaks first (`profile machine` alone)."""

    measure_machine: Annotated[
        bool,
        _switch(
            "--measure-machine",
            COMMON,
            "Measure this machine's memory bandwidth and bfloat16/float32 matmul peaks now and "
            "cache them (for MBU/MFU).",
        ),
    ] = False
