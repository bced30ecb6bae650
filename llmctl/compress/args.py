"""The resolved arguments of the compression steps, with their defaults written once.

Owns: `QuantizeArgs` and `SparsifyArgs` (every default of `llmctl quantize` / `llmctl sparsify`
and of a recipe's sections: the command modules pass None for what the user did not set), their
`resolve()` checks that need no model (each error names the flag) and the keys of a recipe's
sections (`CALIBRATION_KEYS`, `SPARSIFY_KEYS`, `QUANTIZE_KEYS`: the fields a recipe sets, in the
order a run's recipe.yaml lists them). Both carry the two second-order knobs under one name:
`dampening` (the fraction of the mean Hessian diagonal added before the Cholesky factorisation)
and `column_block` (the columns GPTQ and SparseGPT process per lazy update block; not the KV
cache's `--block-size`). Light on purpose (no torch): the command modules quote these defaults
in their help, and `llmctl --help` must stay instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmctl.errors import UsageError
from llmctl.runtime.shards import DEFAULT_MAX_SHARD_SIZE

QUANT_METHODS = ("awq", "gptq", "rtn")
PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt")
CALIBRATION_KEYS = ("calib", "eval_data", "num_samples", "seq_len")
SPARSIFY_KEYS = ("method", "pattern", "sparsity", "ignore", "dampening", "column_block")
QUANTIZE_KEYS = (
    "method", "bits", "group_size", "symmetric", "format", "ignore", "act_order", "observer",
    "dampening", "column_block", "scheme", "smoothquant", "smoothquant_strength",
)  # fmt: skip
SCHEMES = ("w8a8",)  # llm-compressor's scheme names llmctl writes (weight-only needs none)


def check_column_block(column_block: int, pattern=None) -> None:
    """--column-block: a positive number of columns, a multiple of an N:M pattern's width M."""
    if isinstance(column_block, bool) or not isinstance(column_block, int) or column_block < 1:
        raise UsageError(f"--column-block must be a positive number of columns, got {column_block}")
    if pattern is not None and pattern.structured and column_block % pattern.m:
        raise UsageError(
            f"--column-block {column_block} must be a multiple of the pattern's "
            f"group width {pattern.m} (--pattern {pattern.label()})"
        )


OBSERVERS = ("mse", "minmax")


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
    act_order: bool = False  # measured worse held-out (BENCHMARKS.md, quantization quality)
    # each group's range: "mse" (shrink search; AWQ: for the linears its clip search skips) or
    # "minmax"; None: mse, measured best for every method
    observer: str | None = None
    dampening: float = 0.01
    # GPTQ's result does not depend on it (up to rounding); 32 columns keep the per-column
    # rank-1 updates in cache: measured faster than 128 (BENCHMARKS.md, GPTQ speed)
    column_block: int = 32
    overwrite: bool = False
    report_json: str | None = None
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE  # weights above it go into several files
    # "w8a8": int8 weights per channel and int8 activations per token at run time (None:
    # weight-only); SmoothQuant's migration before it, with its strength
    scheme: str | None = None
    smoothquant: bool = False
    smoothquant_strength: float = 0.8  # llm-compressor's SmoothQuantModifier default

    def resolve(self) -> "QuantizeArgs":
        """Every check that needs no model; raises UsageError naming the flag."""
        from llmctl.compress.job_common import check_common_options
        from llmctl.runtime.formats import FORMATS
        from llmctl.runtime.formats.spec import (
            BITS,
            BITS_TEXT,
            parse_group_size,
            resolve_group_size,
        )

        if self.method not in QUANT_METHODS:
            raise UsageError(f"unknown method {self.method!r}; use --awq, --gptq or --rtn")
        self._resolve_scheme()
        if self.format not in FORMATS:
            raise UsageError(
                f"unknown --format {self.format!r}; choose one of {', '.join(FORMATS)}"
            )
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise UsageError(f"--bits must be {BITS_TEXT}, got {self.bits!r}")
        if self.format == "awq" and self.bits != 4:
            raise UsageError(
                "--format awq stores 4-bit weights only; "
                "use --bits 4 or --format compressed-tensors"
            )
        self.group_size = parse_group_size(self.group_size)
        if self.format == "awq" and self.group_size == "channel":
            resolve_group_size("channel", [], channel_format="awq")  # raises with the one message
        check_common_options(self)
        check_column_block(self.column_block)
        if self.symmetric is None:
            self.symmetric = self.method != "awq"
        if self.observer is None:
            self.observer = "mse"
        if self.observer not in OBSERVERS:
            raise UsageError(f"--observer must be mse or minmax, got {self.observer!r}")
        return self

    def _resolve_scheme(self) -> None:
        """--scheme w8a8 fixes the weights (8-bit symmetric per channel, compressed-tensors) and
        takes RTN or GPTQ; --smoothquant needs it. The default --bits 4 becomes 8."""
        if self.scheme is not None:
            self.scheme = str(self.scheme).lower()
            if self.scheme not in SCHEMES:
                raise UsageError(f"unknown --scheme {self.scheme!r}; choose w8a8")
        if self.scheme is None:
            if self.smoothquant:
                raise UsageError("--smoothquant needs --scheme w8a8 (it helps int8 activations)")
            return
        strength = self.smoothquant_strength
        if isinstance(strength, bool) or not isinstance(strength, (int, float)):
            raise UsageError(f"--smoothquant-strength must be a number in [0, 1], got {strength!r}")
        if not 0.0 <= strength <= 1.0:
            raise UsageError(f"--smoothquant-strength must be in [0, 1], got {strength}")
        if self.method == "awq":
            raise UsageError("--scheme w8a8 takes --rtn or --gptq, not --awq (use --smoothquant)")
        if self.format != "compressed-tensors":
            raise UsageError(
                f"--scheme w8a8 is written as compressed-tensors int-quantized, not --format "
                f"{self.format}"
            )
        if self.bits not in (4, 8):  # 4: the default, not chosen (the command refuses --bits 4)
            raise UsageError(f"--scheme w8a8 stores 8-bit weights, not --bits {self.bits}")
        if str(self.group_size).lower() not in ("auto", "channel"):
            raise UsageError(
                f"--scheme w8a8 has one weight scale per output channel, not --group-size "
                f"{self.group_size}"
            )
        if self.symmetric is False:
            raise UsageError("--scheme w8a8 is symmetric (vLLM's int8 kernels), not --asymmetric")
        self.bits, self.group_size, self.symmetric = 8, "channel", True

    @property
    def spec_group_size(self) -> int | None:
        """The resolved group size as QuantSpec takes it (None: per channel)."""
        return None if self.group_size == "channel" else int(self.group_size)


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
    column_block: int = 128
    evaluate: bool = True
    overwrite: bool = False
    report_json: str | None = None
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE  # weights above it go into several files

    def resolve(self) -> "SparsifyArgs":
        """Every check that needs no model; raises UsageError naming the flag."""
        from llmctl.compress.job_common import check_common_options
        from llmctl.compress.sparse.masks import parse_pattern

        if self.method not in PRUNE_METHODS:
            raise UsageError(
                f"unknown --method {self.method!r}; choose one of {', '.join(PRUNE_METHODS)}"
            )
        pattern = parse_pattern(self.pattern, self.sparsity)  # raises UsageError on bad input
        if pattern.structured:
            self.pattern, self.sparsity = pattern.label(), None
        check_common_options(self)
        check_column_block(self.column_block, pattern)
        return self
