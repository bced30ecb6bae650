"""The text cells of profile's tables: sweep points, comparisons and machine peaks.

Owns: titles, column names and formatted cells (plain strings; a regression verdict carries Rich
markup, which the command's table renders). The command draws them; nothing here prints.
"""

from __future__ import annotations

from typing import Any

SWEEP_COLUMNS = (
    "batch",
    "prompt",
    "gen",
    "TTFT ms",
    "TPOT ms",
    "e2e s",
    "decode tok/s",
    "tok/s/seq",
    "prefill tok/s",
    "peak MiB",
    "KV blocks",
    "MBU",
    "MFU",
)
COMPARE_COLUMNS = ("batch", "prompt", "gen", "metric", "better", "A", "B", "B/A", "")
COMPARE_LEFT = ("metric", "better", "")


def sweep_title(record: dict[str, Any]) -> str:
    env = record["environment"]
    where = env.get("gpu_name") or env["cpu_model"]
    return (
        f"{record['model']} on {env['device']} ({where}), {env['dtype']}: "
        f"p50 over {record['settings']['repeat']} repeats"
    )


def _p50(p: dict, metric: str, scale: float = 1.0, fmt: str = ".1f") -> str:
    v = (p.get(metric) or {}).get("p50")
    return "-" if v is None else format(v * scale, fmt)


def _percent(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def sweep_rows(record: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per point, in SWEEP_COLUMNS order."""
    rows = []
    for p in record["points"]:
        mem = p.get("peak_memory_bytes")
        rows.append(
            (
                str(p["batch_size"]),
                str(p["prompt_len"]),
                str(p["gen_len"]),
                _p50(p, "ttft_s", 1e3, ".2f"),
                _p50(p, "tpot_s", 1e3, ".2f"),
                _p50(p, "e2e_s", 1, ".3f"),
                _p50(p, "decode_tokens_per_s"),
                _p50(p, "decode_tokens_per_s_per_sequence"),
                _p50(p, "prefill_tokens_per_s"),
                "-" if mem is None else f"{mem / 2**20:.0f}",
                str(p.get("kv_blocks_used") or "-"),
                _percent(p.get("mbu")),
                _percent(p.get("mfu")),
            )
        )
    return rows


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def compare_rows(result) -> list[tuple[str, ...]]:
    """One row per compared metric of `result` (a `compare.Comparison`), in COMPARE_COLUMNS
    order."""
    rows = []
    for d in result.deltas:
        rows.append(
            (
                *(str(x) for x in d.point),
                d.metric,
                "lower" if d.lower_is_better else "higher",
                _num(d.a),
                _num(d.b),
                "-" if d.ratio is None else f"{d.ratio:.3f}",
                "[red]REGRESSION[/red]" if d.regression else "",
            )
        )
    return rows


def compare_notes(result, differences: list[str]) -> list[str]:
    """Points only one record has, and how the two environments differ."""
    notes = []
    for label, keys in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
        if keys:
            notes.append(
                f"{label} (not compared): "
                + ", ".join(f"batch {k[0]}/prompt {k[1]}/gen {k[2]}" for k in keys)
            )
    if differences:
        notes.append(
            "note: the records come from different environments: " + "; ".join(differences)
        )
    return notes


def machine_rows(peaks, cached_in: str) -> list[tuple[str, str]]:
    """The lines of the machine peaks table (`peaks`: a `machine.MachinePeaks`)."""
    return [
        ("memory bandwidth", f"{peaks.memory_bandwidth / 1e9:.1f} GB/s"),
        ("bfloat16 matmul", f"{peaks.matmul_flops_bf16 / 1e12:.3f} TFLOP/s"),
        ("float32 matmul", f"{peaks.matmul_flops_fp32 / 1e12:.3f} TFLOP/s"),
        ("cached in", cached_in),
    ]
