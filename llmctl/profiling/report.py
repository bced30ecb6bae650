"""Writers for sweep records: the versioned JSON document, CSV rows, a Markdown table and a PNG
plot.

Owns: the layout of a sweep record (`sweep_record`), `load_record` (schema check for `compare`), and
the flat column names shared by CSV and Markdown. matplotlib is an optional extra (`pip install
llmctl[plot]`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from llmctl.errors import UsageError
from llmctl.profiling.sweep import FORMULAS, METRICS, SWEEP_SCHEMA, SWEEP_SCHEMA_VERSION

STATS = ("mean", "p50", "p90", "p99")
ENV_COLUMNS = (
    "llmctl_version",
    "torch_version",
    "device",
    "cpu_model",
    "cpu_threads",
    "gpu_name",
    "dtype",
    "date",
)


def sweep_record(
    model: str,
    environment: dict[str, Any],
    engine: dict[str, Any],
    settings: dict[str, Any],
    machine_peaks: dict[str, Any] | None,
    points: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "schema": SWEEP_SCHEMA,
        "schema_version": SWEEP_SCHEMA_VERSION,
        "model": model,
        "environment": environment,
        "engine": engine,
        "settings": settings,
        "machine_peaks": machine_peaks,
        "formulas": FORMULAS,
        "points": points,
    }


def write_json(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def load_record(path: Path) -> dict[str, Any]:
    """A sweep JSON written by `profile --report-json`; one-line errors for anything else."""
    try:
        record = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not JSON ({e})") from None
    if not isinstance(record, dict) or record.get("schema") != SWEEP_SCHEMA:
        raise UsageError(f"{path}: not an llmctl profile sweep (expected schema {SWEEP_SCHEMA!r})")
    if record.get("schema_version") != SWEEP_SCHEMA_VERSION:
        raise UsageError(
            f"{path}: schema version {record.get('schema_version')!r} is not supported "
            f"(this llmctl reads version {SWEEP_SCHEMA_VERSION})"
        )
    return record


def flat_row(record: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: point settings, every metric statistic, memory, KV, MBU/MFU and the
    environment."""
    row: dict[str, Any] = {"model": record["model"]}
    row.update({k: point[k] for k in ("batch_size", "prompt_len", "gen_len", "repeats")})
    for metric in METRICS:
        summary = point.get(metric) or {}
        for stat in STATS:
            row[f"{metric}_{stat}"] = summary.get(stat)
    for k in ("kv_blocks_used", "peak_memory_bytes", "peak_memory_kind", "mbu", "mfu"):
        row[k] = point.get(k)
    env = record.get("environment") or {}
    row.update({k: env.get(k) for k in ENV_COLUMNS})
    return row


def write_csv(record: dict[str, Any], path: Path) -> None:
    rows = [flat_row(record, p) for p in record["points"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        writer.writerows(rows)


def _stat(
    point: dict[str, Any], metric: str, stat: str = "p50", scale: float = 1.0
) -> float | None:
    value = (point.get(metric) or {}).get(stat)
    return None if value is None else value * scale


def _cell(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(record: dict[str, Any]) -> str:
    """A GitHub Markdown table of the p50 values (what most readers want), environment above it."""
    env = record.get("environment") or {}
    where = env.get("gpu_name") or f"{env.get('cpu_model')} x{env.get('cpu_threads')} threads"
    lines = [
        f"**{record['model']}** on {env.get('device')} ({where}), dtype {env.get('dtype')}, "
        f"llmctl {env.get('llmctl_version')}, torch {env.get('torch_version')}, {env.get('date')}",
        "",
        "| batch | prompt | gen | TTFT p50 (ms) | TPOT p50 (ms) | e2e p50 (s) | decode tok/s | "
        "decode tok/s/seq "
        "| prefill tok/s | peak mem (MiB) | KV blocks | MBU | MFU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in record["points"]:
        mem = p.get("peak_memory_bytes")
        cells = [
            str(p["batch_size"]),
            str(p["prompt_len"]),
            str(p["gen_len"]),
            _cell(_stat(p, "ttft_s", scale=1e3), ".2f"),
            _cell(_stat(p, "tpot_s", scale=1e3), ".2f"),
            _cell(_stat(p, "e2e_s"), ".3f"),
            _cell(_stat(p, "decode_tokens_per_s"), ".1f"),
            _cell(_stat(p, "decode_tokens_per_s_per_sequence"), ".1f"),
            _cell(_stat(p, "prefill_tokens_per_s"), ".1f"),
            _cell(None if mem is None else mem / 2**20, ".1f"),
            _cell(p.get("kv_blocks_used"), "d"),
            _cell(p.get("mbu"), ".1%"),
            _cell(p.get("mfu"), ".1%"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "p50 over repeats; TPOT = (e2e - TTFT) / (output tokens - 1); formulas in the JSON record."
    )
    return "\n".join(lines) + "\n"


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def plot(record: dict[str, Any], path: Path) -> None:
    """PNG: decode and output throughput, TTFT and TPOT against batch size, one line per (prompt,
    gen)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib: pip install 'llmctl[plot]' (or pip install matplotlib)"
        ) from None
    series: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for p in record["points"]:
        series.setdefault((p["prompt_len"], p["gen_len"]), []).append(p)
    panels = [
        ("decode_tokens_per_s", "Decode throughput, all sequences", "tokens/s", 1.0),
        ("ttft_s", "Time to first token (TTFT)", "ms", 1e3),
        ("tpot_s", "Time per output token (TPOT)", "ms", 1e3),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, (metric, title, unit, scale) in zip(axes, panels):
        for (prompt_len, gen_len), pts in sorted(series.items()):
            pts = sorted(pts, key=lambda p: p["batch_size"])
            xs = [p["batch_size"] for p in pts]
            ys = [
                _nan(_stat(p, metric, scale=scale)) for p in pts
            ]  # None (e.g. TPOT of 1-token outputs) -> gap
            hi = [_nan(_stat(p, metric, "p90", scale)) for p in pts]
            (line,) = ax.plot(xs, ys, marker="o", label=f"prompt {prompt_len}, gen {gen_len}")
            ax.fill_between(xs, ys, hi, color=line.get_color(), alpha=0.15)
        batch_sizes = sorted({p["batch_size"] for p in record["points"]})
        if len(batch_sizes) > 1 and batch_sizes[0] > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (concurrent sequences)")
        ax.set_title(
            f"{title} (higher is better)" if unit == "tokens/s" else f"{title} (lower is better)"
        )
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    env = record.get("environment") or {}
    where = env.get("gpu_name") or f"{env.get('cpu_model')}, threads: {env.get('cpu_threads')}"
    fig.suptitle(
        f"llmctl profile: {record['model']} on {env.get('device')} ({where}), dtype "
        f"{env.get('dtype')} "
        f"- lines p50, bands p50..p90 over repeats",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
