"""The calibration, sparsify and quantize sections both recipe forms share, checked by pydantic.

Owns: `Section` (strict: unknown keys refused, YAML's types kept as written), `CalibrationSection`,
`SparsifySection`, `QuantizeSection`, `DEPRECATED` (old key -> new key) and `keys`. The
multi-stage recipe (llmctl.recipes.schema) nests them under `calibration` and `stages`;
`llmctl sparsify --recipe`'s single-run file (llmctl.recipes.sparsify_recipe) has them at the top.
Their keys are the fields of QuantizeArgs / SparsifyArgs a recipe sets, and their defaults are
those dataclasses' (llmctl.compress.args).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmctl.compress.args import OBSERVERS, PRUNE_METHODS, QUANT_METHODS, SCHEMES
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.errors import UsageError
from llmctl.runtime.formats import FORMATS
from llmctl.runtime.formats.spec import BITS, BITS_TEXT, parse_group_size

DEPRECATED = {"block_size": "column_block"}  # old key -> new key (sparsify section)


def _one_of(value: Any, allowed: tuple, what: str = "value") -> Any:
    if value is not None and value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(map(str, allowed))}")
    return value


def _rule(check, value: Any) -> Any:
    """A shared rule's UsageError as the ValueError pydantic reports with the field path."""
    if value is None:
        return value
    try:
        check(value)
    except UsageError as e:
        raise ValueError(str(e)) from None
    return value


class Section(BaseModel):
    # strict: YAML's types are kept as written (no "8" for 8, no 1 for true)
    model_config = ConfigDict(extra="forbid", strict=True)


class CalibrationSection(Section):
    calib: str | None = None
    eval_data: str | None = None
    num_samples: int | None = Field(None, ge=1)
    seq_len: int | None = Field(None, ge=2)


class SparsifySection(Section):
    method: str | None = None
    pattern: str | None = None
    sparsity: float | None = None
    ignore: list[str] | None = None
    dampening: float | None = Field(None, gt=0, lt=1)
    column_block: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)  # deprecated: column_block

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        return _one_of(v, PRUNE_METHODS, "method")

    @field_validator("pattern", mode="before")
    @classmethod
    def _quoted(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):  # YAML 1.1 reads 2:4 as 124 (base 60)
            raise ValueError('quote the pattern, for example pattern: "2:4"')
        return v

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v):
        return _rule(lambda p: parse_pattern(p, None), v)

    @field_validator("sparsity")
    @classmethod
    def _sparsity(cls, v):
        return _rule(lambda s: parse_pattern(None, s), v)


class QuantizeSection(Section):
    method: str | None = None
    bits: int | None = None
    group_size: int | str | None = None
    symmetric: bool | None = None
    format: str | None = None
    ignore: list[str] | None = None
    act_order: bool | None = None
    observer: str | None = None
    dampening: float | None = Field(None, gt=0, lt=1)
    column_block: int | None = Field(None, ge=1)
    scheme: str | None = None  # "w8a8": int8 activations too (compressed-tensors int-quantized)
    smoothquant: bool | None = None
    smoothquant_strength: float | None = Field(None, ge=0, le=1)

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, v):
        return _one_of(v if v is None else str(v).lower(), SCHEMES, "scheme")

    @model_validator(mode="after")
    def _w8a8_bits(self):
        """bits other than 8 with scheme w8a8: refused here, where a given 4 is not the default."""
        if self.scheme is not None and self.bits not in (None, 8):
            raise ValueError(f"scheme {self.scheme} stores 8-bit weights, not bits {self.bits}")
        if self.smoothquant_strength is not None and self.smoothquant is None:
            self.smoothquant = True  # a strength means SmoothQuant on, as on the command line
        return self

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        return _one_of(v, QUANT_METHODS, "method")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v):
        if v is not None and v not in BITS:
            raise ValueError(f"must be {BITS_TEXT}, got {v}")
        return v

    @field_validator("format")
    @classmethod
    def _format(cls, v):
        return _one_of(v, FORMATS, "format")

    @field_validator("observer")
    @classmethod
    def _observer(cls, v):
        return _one_of(v, OBSERVERS, "observer")

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v):
        return _rule(parse_group_size, v)


def keys(section: type[Section]) -> tuple[str, ...]:
    """The keys a section takes (deprecated ones left out)."""
    return tuple(k for k in section.model_fields if k not in DEPRECATED)
