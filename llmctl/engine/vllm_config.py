"""vLLM's spellings of engine settings, read into `EngineConfig` fields.

Owns: `parse_vllm_bytes` (vLLM's human-readable integers: `4G` is 4 GiB, `4g` is 4e9) and
`speculative_from_vllm` (a `--speculative-config` JSON object with vLLM's keys: `method`, `model`,
`num_speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min`). A key or method that llmctl
does not implement is a one-line UsageError, never silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmctl.engine.config import parse_bytes
from llmctl.errors import UsageError

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

VLLM_SPEC_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
)
# vLLM's prompt-lookup window when --speculative-config gives neither bound (llmctl's own
# --speculative ngram keeps EngineConfig's defaults).
VLLM_PROMPT_LOOKUP = 5


def parse_vllm_bytes(text: str) -> int:
    """vLLM's `--kv-cache-memory-bytes`: an integer, or one with k/m/g/t (powers of 1000) or
    K/M/G/T (powers of 1024, whole numbers only); llmctl's units (4GiB, 512MB) are read too."""
    value = str(text).strip()
    if value.isdigit():
        return int(value)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m is None:
        return parse_bytes(value)
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise UsageError(
            f"--kv-cache-memory-bytes {value}: no decimals with the binary suffix {suffix} "
            f"(as in vLLM); write {number}{suffix.lower()} or {number}{suffix}iB"
        )
    return int(number) * _BINARY[suffix]


def _positive_int(spec: dict, key: str) -> int | None:
    v = spec.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise UsageError(f"--speculative-config: {key} must be a positive integer, got {v!r}")
    return v


def _method(spec: dict) -> str:
    """'ngram' or 'draft', from vLLM's method (or, without one, from its model)."""
    method, model = spec.get("method"), spec.get("model")
    if method is None:
        if model is None:
            raise UsageError("--speculative-config needs a method (ngram or draft_model)")
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method in ("ngram", "[ngram]"):
        return "ngram"
    if method in ("draft_model", "draft"):
        if not isinstance(model, str) or not model:
            raise UsageError('--speculative-config: method draft_model needs "model": a folder')
        return "draft"
    raise UsageError(
        f"--speculative-config: method {method!r} is not implemented by llmctl; "
        f"use ngram or draft_model"
    )


def _lookup_bounds(spec: dict) -> tuple[int, int]:
    """(max, min) n-gram lengths by vLLM's rule: one bound given sets the other."""
    hi, lo = _positive_int(spec, "prompt_lookup_max"), _positive_int(spec, "prompt_lookup_min")
    if hi is None and lo is None:
        hi = lo = VLLM_PROMPT_LOOKUP
    hi, lo = hi or lo, lo or hi
    if lo > hi:
        raise UsageError(
            f"--speculative-config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
        )
    return hi, lo


def speculative_from_vllm(config: str | dict) -> dict[str, Any]:
    """`--speculative-config JSON` (or vLLM's `speculative_config=` dict) -> EngineConfig fields
    (speculative, draft_model, ...)."""
    try:
        spec = json.loads(config) if isinstance(config, str) else config
    except json.JSONDecodeError as e:
        raise UsageError(f"--speculative-config is not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(spec, dict):
        raise UsageError(
            "--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\"}'"
        )
    spec = {k.replace("-", "_"): v for k, v in spec.items() if v is not None}
    unknown = sorted(set(spec) - set(VLLM_SPEC_KEYS))
    if unknown:
        raise UsageError(
            f"--speculative-config: {', '.join(unknown)} not implemented by llmctl "
            f"(it reads {', '.join(VLLM_SPEC_KEYS)})"
        )
    method = _method(spec)
    fields: dict[str, Any] = {"speculative": method}
    tokens = _positive_int(spec, "num_speculative_tokens")
    if tokens is not None:
        fields["num_speculative_tokens"] = tokens
    if method == "draft":
        if "prompt_lookup_max" in spec or "prompt_lookup_min" in spec:
            raise UsageError("--speculative-config: prompt_lookup_max/min are for method ngram")
        fields["draft_model"] = spec["model"]
    else:
        fields["prompt_lookup_max"], fields["prompt_lookup_min"] = _lookup_bounds(spec)
    return fields
