"""CLI options that `quantize` and `sparsify` (and `recipe`) share, declared once.

Owns: `option` (a typer.Option that shows no Typer default: the dataclasses own them), the
aliases of the calibration and second-order knobs, and the option records built from them:
`CalibFlags` (the calibration data, also recipe's overrides) and `CompressRunFlags` (device,
report, shards, overwrite, quiet), with `calib_given`, the calibration flags a user set. The help
quotes the defaults of llmctl.compress.args (QuantizeArgs and SparsifyArgs hold the same ones, a
test checks it; column_block differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, List, Optional

import typer

from llmctl.commands._options import (
    CalibOpt,
    DeviceOpt,
    EvalDataOpt,
    OverwriteOpt,
    QuietOpt,
    ReportJsonOpt,
    default_of,
    given,
    path_str,
)
from llmctl.compress.args import QuantizeArgs, SparsifyArgs
from llmctl.runtime.shards import SHARD_SIZE_RULE


def option(*decls: str, help: str, **kw) -> typer.models.OptionInfo:
    """typer.Option without a shown Typer default (the option's default is None)."""
    return typer.Option(*decls, help=help, show_default=False, **kw)


def _shared(name: str, *decls: str, help: str, **kw) -> typer.models.OptionInfo:
    return option(*decls, help=help + default_of(QuantizeArgs, name) + ".", **kw)


NumSamplesOpt = Annotated[
    Optional[int], _shared("num_samples", "--num-samples", help="Calibration sequences")
]
SeqLenOpt = Annotated[
    Optional[int], _shared("seq_len", "--seq-len", help="Tokens per calibration sequence")
]
IgnoreOpt = Annotated[
    Optional[List[str]],
    option("--ignore", help="Linear layers to leave as they are (repeatable)."),
]
DampeningOpt = Annotated[
    Optional[float],
    _shared(
        "dampening",
        "--dampening",
        help="GPTQ and SparseGPT: fraction of the mean Hessian diagonal added to it",
    ),
]
# Not shared: GPTQ's result ignores the block (speed only), SparseGPT picks masks per block
ColumnBlockOpt = Annotated[
    Optional[int],
    option(
        "--column-block",
        help="GPTQ and SparseGPT: weight columns per lazy update block (not the KV cache's "
        f"--block-size) (default: {QuantizeArgs.column_block} for quantize, "
        f"{SparsifyArgs.column_block} for sparsify).",
    ),
]
MaxShardSizeOpt = Annotated[
    Optional[str],
    _shared(
        "max_shard_size",
        "--max-shard-size",
        help="Largest weight file: above it the weights are split into shards with an index "
        f"(huggingface_hub's save_torch_state_dict); {SHARD_SIZE_RULE}",
        metavar="SIZE",
    ),
]


@dataclass(frozen=True)
class CalibFlags:
    """The calibration data and its held-out part."""

    calib: CalibOpt = None
    eval_data: EvalDataOpt = None
    num_samples: NumSamplesOpt = None
    seq_len: SeqLenOpt = None


def calib_given(flags: CalibFlags) -> dict[str, Any]:
    """The calibration flags a user set, paths as strings."""
    return given(
        calib=path_str(flags.calib),
        eval_data=path_str(flags.eval_data),
        num_samples=flags.num_samples,
        seq_len=flags.seq_len,
    )


@dataclass(frozen=True)
class CompressRunFlags:
    """Where the job runs and what it writes besides the model."""

    device: DeviceOpt = None
    report_json: ReportJsonOpt = None
    max_shard_size: MaxShardSizeOpt = None
    overwrite: OverwriteOpt = False
    quiet: QuietOpt = False
