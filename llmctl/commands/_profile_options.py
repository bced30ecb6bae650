"""profile's options, declared once as `Annotated` aliases, in the help panels of its forms.

Owns: every profile flag's name, panel and help. Flags default to None; the help quotes the
defaults that `SweepRequest`, `EstimateRequest` and `profiling.compare` own.
"""

from __future__ import annotations

from dataclasses import fields
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


TargetsArg = Annotated[
    Optional[list[str]],
    typer.Argument(metavar="MODEL | compare A B", help=MODEL_HELP, show_default=False),
]
BatchSizesOpt = Annotated[
    Optional[str],
    _opt(
        "--batch-sizes",
        panel=SWEEP,
        help="Comma-separated batch sizes" + _list_default("batch_sizes") + ".",
    ),
]
PromptLensOpt = Annotated[
    Optional[str],
    _opt(
        "--prompt-lens",
        panel=SWEEP,
        help="Comma-separated prompt lengths (tokens)" + _list_default("prompt_lens") + ".",
    ),
]
GenLensOpt = Annotated[
    Optional[str],
    _opt(
        "--gen-lens",
        panel=SWEEP,
        help="Comma-separated generation lengths (tokens)" + _list_default("gen_lens") + ".",
    ),
]
RepeatOpt = Annotated[
    Optional[int],
    _opt(
        "--repeat",
        min=1,
        panel=SWEEP,
        help="Measured repeats per point" + _sweep("repeat") + "; profile advise: fresh-engine "
        "passes per measurement, each request's best kept" + default_of(AdviseRequest, "repeats"),
    ),
]
WarmupOpt = Annotated[
    Optional[int],
    _opt(
        "--warmup",
        min=0,
        panel=SWEEP,
        help="Unrecorded warm-up repeats per point" + _sweep("warmup"),
    ),
]
CsvOpt = Annotated[Optional[Path], _opt("--csv", panel=SWEEP, help="Write one CSV row per point.")]
MarkdownOpt = Annotated[
    bool, _switch("--markdown", SWEEP, "Print a Markdown table instead of the rich table.")
]
NoAutotuneOpt = Annotated[bool, _switch("--no-autotune", SWEEP, NO_AUTOTUNE_HELP)]
PlotOpt = Annotated[
    Optional[Path],
    _opt(
        "--plot",
        panel=SWEEP,
        help="Write a PNG of throughput and latency vs batch size (needs matplotlib).",
    ),
]
DeviceOpt = Annotated[
    Optional[str],
    _opt(
        "--device",
        panel=SWEEP,
        help="auto (cuda when present, else cpu), cpu or cuda" + _sweep("device") + ".",
    ),
]
KvMemoryOpt = Annotated[
    Optional[str],
    _opt(
        "--kv-cache-memory",
        panel=SWEEP,
        help="KV-cache size, e.g. 4GiB (default: what the largest point needs).",
    ),
]
SeedOpt = Annotated[
    Optional[int], _opt("--seed", panel=SWEEP, help="Seed of the random prompts" + _sweep("seed"))
]
EstimateOpt = Annotated[
    bool, _switch("--estimate", ESTIMATE, "Estimate from config.json alone (no weights loaded).")
]
GroupSizeOpt = Annotated[
    Optional[str],
    _opt(
        "--group-size",
        panel=ESTIMATE,
        help="int8/int4 group size along the input dimension, by quantize's rule: auto, "
        "channel, or a power of two >= 16 dividing every layer" + _est("group_size") + ".",
    ),
]
KvDtypeOpt = Annotated[
    Optional[str],
    _opt(
        "--kv-dtype",
        panel=ESTIMATE,
        help="KV element type: bfloat16, float16, float32, fp8, int8 (default: the weights' "
        "float dtype).",
    ),
]
SeqLenOpt = Annotated[
    Optional[int],
    _opt(
        "--seq-len",
        min=1,
        panel=ESTIMATE,
        help="Tokens per sequence (default: max_position_embeddings).",
    ),
]
BatchOpt = Annotated[
    Optional[int],
    _opt("--batch", min=1, panel=ESTIMATE, help="Concurrent sequences" + _est("batch") + "."),
]
MemoryOpt = Annotated[
    Optional[str],
    _opt(
        "--memory",
        panel=ESTIMATE,
        help="Memory budget, e.g. 24GiB: how many sequences fit next to the weights.",
    ),
]
BandwidthOpt = Annotated[
    Optional[str],
    _opt(
        "--bandwidth",
        panel=ESTIMATE,
        help="Memory bandwidth in GB/s (e.g. 900 or 3.35TB/s) for the decode ceiling "
        "(default: this machine's, if measured).",
    ),
]
QuantizeEmbeddingsOpt = Annotated[
    bool,
    _switch(
        "--quantize-embeddings", ESTIMATE, "Count embeddings and lm_head at the int dtype too."
    ),
]
ThresholdOpt = Annotated[
    Optional[str],
    _opt(
        "--threshold",
        panel=COMPARE,
        help=f"Allowed change before B counts as a regression (default: {DEFAULT_THRESHOLD}).",
    ),
]
StatOpt = Annotated[
    Optional[str],
    _opt(
        "--stat",
        panel=COMPARE,
        help=f"Statistic compared: mean, p50, p90 or p99 (default: {DEFAULT_STAT}).",
    ),
]
DtypeOpt = Annotated[
    Optional[str],
    _opt(
        "--dtype",
        panel=COMMON,
        help="auto, bfloat16, float16 or float32 (bf16, fp16, fp32 are read too); --estimate "
        "also int8, int4 (auto: the checkpoint's dtype).",
    ),
]
ReportJsonOpt = Annotated[
    Optional[Path],
    _opt(
        "--report-json",
        panel=COMMON,
        help="Write the versioned JSON record to this file ('-': standard output, no table).",
    ),
]
OldJsonOpt = Annotated[
    Optional[Path], _opt("--json", panel=COMMON, hidden=True, help="Old spelling of --report-json.")
]
MeasureOpt = Annotated[
    bool,
    _switch(
        "--measure-machine",
        COMMON,
        "Measure this machine's memory bandwidth and bfloat16/float32 matmul peaks now and cache "
        "them (for MBU/MFU).",
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="No progress output on stderr.", rich_help_panel=COMMON),
]

ADVISE = "Advise (profile advise MODEL --workload FILE)"


def _adv(name: str) -> str:
    return default_of(AdviseRequest, name)


WorkloadOpt = Annotated[
    Optional[str],
    _opt(
        "--workload",
        panel=ADVISE,
        help="The user's prompts, in run-batch's input formats (.jsonl or .parquet).",
    ),
]
ObjectiveOpt = Annotated[
    Optional[str],
    _opt(
        "--objective",
        panel=ADVISE,
        help="What the ranking optimises: throughput, ttft, tpot or memory" + _adv("objective"),
    ),
]
SampleOpt = Annotated[
    Optional[int],
    _opt("--sample", min=1, panel=ADVISE, help="Workload rows measured" + _adv("sample")),
]
BudgetOpt = Annotated[
    Optional[str],
    _opt(
        "--budget",
        panel=ADVISE,
        help="Time for all trials, e.g. 10m, 90s (a trial that would exceed it is skipped)"
        + _adv("budget"),
    ),
]
MaxTokensAdviseOpt = Annotated[
    Optional[int],
    _opt(
        "--max-tokens",
        min=1,
        panel=ADVISE,
        help="Output tokens per request unless its row says max_tokens" + _adv("max_tokens"),
    ),
]
ConcurrencyOpt = Annotated[
    Optional[int],
    _opt(
        "--concurrency",
        min=1,
        panel=ADVISE,
        help="Requests in flight at once (default: the whole sample, as run-batch sends it).",
    ),
]
DraftOpt = Annotated[
    Optional[str],
    _opt("--draft", panel=ADVISE, help="Draft model folder: also try speculative draft."),
]
CalibOpt = Annotated[
    Optional[str],
    _opt(
        "--calib",
        panel=ADVISE,
        help="Calibration text: also try int4 GPTQ and AWQ weights (quantize --calib).",
    ),
]
ConfirmRoundsOpt = Annotated[
    Optional[int],
    _opt(
        "--confirm-rounds",
        min=0,
        panel=ADVISE,
        help="Rounds of the printed run-batch line against the baseline's, in fresh processes "
        "on the sample, to confirm the advised gain (0: no confirmation)" + _adv("confirm_rounds"),
    ),
]
QualityDataOpt = Annotated[
    Optional[str],
    _opt(
        "--quality-data",
        panel=ADVISE,
        help="Text file (or .jsonl/.parquet rows) the quantization KL is measured on "
        "(default: the workload's prompts).",
    ),
]
MaxKlOpt = Annotated[
    Optional[float],
    _opt(
        "--max-kl",
        panel=ADVISE,
        help="Quantization costing more mean KL (nats/token) is not advised" + _adv("max_kl"),
    ),
]
