"""CLI options that `quantize` and `sparsify` share, declared once as `Annotated` aliases.

Owns: `option` (a typer.Option that shows no Typer default: the dataclasses own them) and the
aliases of the calibration and second-order knobs. Their help quotes the defaults of
llmctl.compress.args (QuantizeArgs and SparsifyArgs hold the same ones, a test checks it;
column_block differs).
"""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from llmctl.commands._options import default_of
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
