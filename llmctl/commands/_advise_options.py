"""profile advise's options: the option record `AdviseFlags` and the advise form's MODEL.

Owns: the name, panel and help of each flag only `profile advise` reads (flags default to None;
the help quotes the defaults that `AdviseRequest` owns). Advise also reads the sweep's --repeat,
--seed, --markdown and --device and the common flags (`_profile_options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from llmctl.commands._options import MODEL_HELP, default_of
from llmctl.profiling.advise import AdviseRequest

ADVISE = "Advise (profile advise MODEL --workload FILE)"


def _opt(*names: str, panel: str, help: str, **kw: Any) -> Any:
    return typer.Option(*names, help=help, rich_help_panel=panel, show_default=False, **kw)


def _adv(name: str) -> str:
    return default_of(AdviseRequest, name)


AdviseModelArg = Annotated[
    Optional[list[str]], typer.Argument(metavar="[MODEL]", help=MODEL_HELP, show_default=False)
]


@dataclass(frozen=True)
class AdviseFlags:
    """What `profile advise` measures and how it ranks."""

    workload: Annotated[
        Optional[str],
        _opt(
            "--workload",
            panel=ADVISE,
            help="The user's prompts, in run-batch's input formats (.jsonl or .parquet).",
        ),
    ] = None
    objective: Annotated[
        Optional[str],
        _opt(
            "--objective",
            panel=ADVISE,
            help="What the ranking optimises: throughput, ttft, tpot or memory" + _adv("objective"),
        ),
    ] = None
    sample: Annotated[
        Optional[int],
        _opt("--sample", min=1, panel=ADVISE, help="Workload rows measured" + _adv("sample")),
    ] = None
    budget: Annotated[
        Optional[str],
        _opt(
            "--budget",
            panel=ADVISE,
            help="Time for all trials, e.g. 10m, 90s (a trial that would exceed it is skipped)"
            + _adv("budget"),
        ),
    ] = None
    max_tokens: Annotated[
        Optional[int],
        _opt(
            "--max-tokens",
            min=1,
            panel=ADVISE,
            help="Output tokens per request unless its row says max_tokens" + _adv("max_tokens"),
        ),
    ] = None
    concurrency: Annotated[
        Optional[int],
        _opt(
            "--concurrency",
            min=1,
            panel=ADVISE,
            help="Requests in flight at once (default: the whole sample, as run-batch sends it).",
        ),
    ] = None
    draft: Annotated[
        Optional[str],
        _opt("--draft", panel=ADVISE, help="Draft model folder: also try speculative draft."),
    ] = None
    quality_data: Annotated[
        Optional[str],
        _opt(
            "--quality-data",
            panel=ADVISE,
            help="Text file (or .jsonl/.parquet rows) the quantization KL is measured on "
            "(default: the workload's prompts).",
        ),
    ] = None
    calib: Annotated[
        Optional[str],
        _opt(
            "--calib",
            panel=ADVISE,
            help="Calibration text: also try int4 GPTQ and AWQ weights (quantize --calib).",
        ),
    ] = None
    confirm_rounds: Annotated[
        Optional[int],
        _opt(
            "--confirm-rounds",
            min=0,
            panel=ADVISE,
            help="Rounds of the printed run-batch line against the baseline's, in fresh processes "
            "on the sample, to confirm the advised gain (0: no confirmation)"
            + _adv("confirm_rounds"),
        ),
    ] = None
    max_kl: Annotated[
        Optional[float],
        _opt(
            "--max-kl",
            panel=ADVISE,
            help="Quantization costing more mean KL (nats/token) is not advised" + _adv("max_kl"),
        ),
    ] = None
