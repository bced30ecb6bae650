"""`profile --estimate`: one estimate from a config end to end, and the lines it is shown as.

Owns: `EstimateRequest` (every estimate option and its default), choosing the weight dtype (auto:
the checkpoint's), the bandwidth (given, else this machine's measured one) and the group size (by
quantize's rule), the versioned record, and `estimate_rows`, the (label, value) lines a table
shows. Nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmctl.engine.config import format_bytes, parse_bytes
from llmctl.profiling import estimate as est
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.environment import environment
from llmctl.profiling.machine import MachinePeaks

ESTIMATE_SCHEMA, ESTIMATE_SCHEMA_VERSION = "llmctl.profile.estimate", 1


@dataclass(frozen=True)
class EstimateRequest:
    """The options of one estimate (the command passes the ones a user set)."""

    dtype: str = "auto"  # auto: the config's torch_dtype when it names a float dtype
    group_size: str = "auto"
    kv_dtype: str | None = None  # None: the weights' float dtype
    seq_len: int | None = None  # None: max_position_embeddings
    batch: int = 1
    memory: str | None = None  # e.g. "24GiB"
    bandwidth: str | None = None  # e.g. "900" (GB/s) or "3.35TB/s"; None: measured, if cached
    quantize_embeddings: bool = False
    block_size: int = 16


@dataclass(frozen=True)
class EstimateResult:
    estimate: est.Estimate
    source: str  # where the config came from
    bandwidth_source: str | None
    group_size_note: str | None

    def record(self) -> dict[str, Any]:
        """The versioned JSON record of --report-json."""
        return {
            "schema": ESTIMATE_SCHEMA,
            "schema_version": ESTIMATE_SCHEMA_VERSION,
            "source": self.source,
            "environment": environment("none", self.estimate.dtype),
            "bandwidth_source": self.bandwidth_source,
            "formulas": est.ESTIMATE_FORMULAS,
            "estimate": self.estimate.to_dict(),
            "group_size_note": self.group_size_note,
        }


def weight_dtype(req_dtype: str, config) -> str:
    """--dtype auto: the checkpoint's own dtype when it names a float one we know, else bfloat16."""
    if req_dtype != "auto":
        return req_dtype
    named = canonical_dtype(config.torch_dtype or "")
    return named if named in est.WEIGHT_BITS else "bfloat16"


def run_estimate(
    target: str, req: EstimateRequest, peaks: MachinePeaks | None = None
) -> EstimateResult:
    """Read `target`'s config and estimate; `peaks` give the bandwidth when none was passed."""
    config, source = est.find_config(target)
    bw, bw_source = (None, None)
    if req.bandwidth:
        bw, bw_source = est.parse_bandwidth(req.bandwidth), "--bandwidth"
    elif peaks is not None:
        bw, bw_source = peaks.memory_bandwidth, f"measured on this machine ({peaks.key})"
    est.parse_group_size(req.group_size)  # a size quantize refuses is refused before anything
    group, note = est.group_size_for(config, req.group_size, req.quantize_embeddings)
    e = est.estimate(
        config,
        model=target,
        dtype=weight_dtype(req.dtype, config),
        group_size=group,
        kv_dtype=req.kv_dtype,
        seq_len=req.seq_len,
        batch=req.batch,
        block_size=req.block_size,
        memory_budget=parse_bytes(req.memory) if req.memory else None,
        bandwidth=bw,
        quantize_embeddings=req.quantize_embeddings,
    )
    return EstimateResult(e, source, bw_source, note)


def size_text(n: float | None) -> str:
    """'13.48 GB (12.55 GiB)' for big sizes, '512.00 KiB' for small ones."""
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB ({format_bytes(n)})" if n >= 1e8 else format_bytes(n)


def _format_name(e: est.Estimate) -> str:
    if e.group_size:
        return f"{e.dtype} (group {e.group_size})"
    return e.dtype + (" (per channel)" if e.dtype.startswith("int") else "")


def estimate_rows(result: EstimateResult) -> list[tuple[str, str]]:
    """The (label, value) lines of the estimate table."""
    e, w, size = result.estimate, result.estimate.weights, size_text
    rows = [
        ("config", result.source),
        ("parameters", f"{e.num_parameters:,} ({e.num_parameters / 1e9:.3f} B)"),
        *([("active per token (MoE)", f"{e.active_parameters:,}")] if e.active_parameters else []),
        (f"weights, {_format_name(e)}", size(w.total)),
        ("  linear / scales / zeros", f"{size(w.linear)} / {size(w.scales)} / {size(w.zeros)}"),
        ("  embeddings + lm_head / norms, biases", f"{size(w.embeddings)} / {size(w.other)}"),
        (f"KV per token ({e.kv_dtype})", format_bytes(e.kv_bytes_per_token)),
        (f"KV per sequence ({e.seq_len} tokens)", size(e.kv_bytes_per_sequence)),
        (f"KV for batch {e.batch}", size(e.kv_bytes_batch)),
        ("weights + KV", size(e.total_bytes)),
        ("decode FLOPs per token", f"{e.flops_per_token / 1e9:.2f} GFLOP at context {e.seq_len}"),
    ]
    if e.memory_budget is not None:
        rows.append(
            (
                f"sequences of {e.seq_len} tokens in {format_bytes(e.memory_budget)}",
                f"{e.max_sequences} (weights + KV only; leave room for activations)",
            )
        )
    if e.bandwidth is not None:
        rows += [
            ("bandwidth", f"{e.bandwidth / 1e9:.1f} GB/s, {result.bandwidth_source}"),
            ("decode ceiling per sequence", f"{e.decode_tokens_per_s_per_sequence:,.1f} tokens/s"),
            (
                f"decode ceiling, batch {e.batch}",
                f"{e.decode_tokens_per_s_aggregate:,.1f} tokens/s",
            ),
        ]
    else:
        rows.append(
            ("decode ceiling", "pass --bandwidth GB/s (or run --measure-machine) for tokens/s")
        )
    if result.group_size_note and e.dtype.startswith("int"):
        rows.append(("group size", result.group_size_note))
    rows += [("note", note) for note in e.notes]
    return rows
