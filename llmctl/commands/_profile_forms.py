"""The forms of `llmctl profile`, each run from the option records its sub-command took.

Owns: what each form reads from its records, hands to llmctl.profiling (`sweep_job`,
`estimate_job`, `compare`, `machine`, `advise_job`) and prints through `_output`: `sweep`,
`estimate`, `compare`, `measure`, `advise`, and `common_of` / `check_outputs`, which every form
runs first. Which form a command line means is `profile`'s business.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import typer

from llmctl.commands._advise_options import AdviseFlags
from llmctl.commands._options import given
from llmctl.commands._output import (
    emit_json,
    info,
    json_to_stdout,
    print_lines,
    print_table,
    report_json_of,
)
from llmctl.commands._profile_options import (
    CommonFlags,
    CompareFlags,
    DeviceFlags,
    EstimateFlags,
    RunFlags,
    SweepFlags,
)
from llmctl.errors import LlmctlError, UsageError


def common_of(c: CommonFlags) -> CommonFlags:
    """`c` with the old --json folded into --report-json (giving both is refused)."""
    report = report_json_of(c.report_json, c.json_path, "--json", "--report-json")
    return dataclasses.replace(c, report_json=report, json_path=None)


def check_outputs(
    c: CommonFlags, markdown: bool = False, csv: Path | None = None, plot: Path | None = None
) -> None:
    """--report-json/--csv/--plot are written after the run: check them before it (parents are
    created); --markdown and --report-json - would both write stdout."""
    from llmctl.runtime.output_dir import check_output_file

    if markdown and json_to_stdout(c.report_json):
        raise UsageError("--markdown and --report-json - both write standard output; pick one")
    report = None if json_to_stdout(c.report_json) else c.report_json
    for flag, path in (("--report-json", report), ("--csv", csv), ("--plot", plot)):
        check_output_file(None if path is None else Path(path), flag, create_parents=True)


def _device(d: DeviceFlags) -> str:
    from llmctl.runtime.resolve import resolve_device

    return resolve_device(d.device or "auto")


def measure(d: DeviceFlags, c: CommonFlags) -> None:
    """Measure and cache this machine's peaks; the table on stderr when stdout has the JSON."""
    from llmctl.profiling.machine import measure_machine, save_peaks
    from llmctl.profiling.tables import machine_rows

    device = _device(d)
    info(f"measuring memory bandwidth and bfloat16/float32 matmul peaks on {device} ...", c.quiet)
    peaks = measure_machine(device)
    path = save_peaks(peaks)
    title = f"Machine peaks ({peaks.key})"
    rows = machine_rows(peaks, str(path))
    print_table(title, rows, min_width=110, stderr=json_to_stdout(c.report_json))


def _default_peaks():
    """Cached peaks of the machine a user most likely means: its GPU when present, else its CPU."""
    import torch

    from llmctl.profiling.machine import cached_peaks

    return cached_peaks("cuda" if torch.cuda.is_available() else "cpu")


def estimate(target: str, e: EstimateFlags, dtype: str | None, c: CommonFlags) -> None:
    from llmctl.profiling.estimate_job import EstimateRequest, estimate_rows, run_estimate

    fields = given(
        dtype=dtype,
        group_size=e.group_size,
        kv_dtype=e.kv_dtype,
        seq_len=e.seq_len,
        batch=e.batch,
        memory=e.memory,
        bandwidth=e.bandwidth,
    )
    req = EstimateRequest(**fields, quantize_embeddings=e.quantize_embeddings)
    result = run_estimate(target, req, None if req.bandwidth else _default_peaks())
    if not json_to_stdout(c.report_json):
        print_table(f"Estimate: {target}", estimate_rows(result), min_width=110)
    emit_json(c.report_json, result.record())


def _sweep_request(s: SweepFlags, r: RunFlags, d: DeviceFlags, dtype: str | None):
    from llmctl.profiling.sweep_job import SweepRequest, int_list

    lists = {
        name: int_list(getattr(s, name), "--" + name.replace("_", "-"))
        for name in ("batch_sizes", "prompt_lens", "gen_lens")
        if getattr(s, name) is not None
    }
    fields = given(repeat=r.repeat, warmup=s.warmup, dtype=dtype, seed=r.seed)
    return SweepRequest(
        **lists,
        **fields,
        device=_device(d),
        kv_cache_memory=s.kv_cache_memory,
        plot=s.plot_path is not None,
        autotune=not s.no_autotune,
    )


def sweep(
    target: str | None,
    s: SweepFlags,
    r: RunFlags,
    d: DeviceFlags,
    dtype: str | None,
    c: CommonFlags,
) -> None:
    from llmctl.profiling import report
    from llmctl.profiling.sweep_job import profile_sweep
    from llmctl.profiling.tables import SWEEP_COLUMNS, sweep_rows, sweep_title
    from llmctl.runtime.loader import load_runtime
    from llmctl.runtime.output_dir import writing

    def progress(i: int, n: int, point: Any) -> None:
        if point is not None:
            where = f"batch {point.batch_size}, prompt {point.prompt_len}, gen {point.gen_len}"
            info(f"[{i + 1}/{n}] {where}", c.quiet)

    record = profile_sweep(_sweep_request(s, r, d, dtype), target, load_runtime, progress)
    emit_json(c.report_json, record)
    with writing("the profile results"):
        if s.csv_path:
            report.write_csv(record, s.csv_path)
        if s.plot_path:
            report.plot(record, s.plot_path)
    if r.markdown:
        typer.echo(report.markdown(record), nl=False)
    elif not json_to_stdout(c.report_json):
        print_table(sweep_title(record), sweep_rows(record), SWEEP_COLUMNS, min_width=140)
    if record.get("machine_peaks") is None:
        info(
            "MBU/MFU need this machine's peaks: run `llmctl profile --measure-machine` once",
            c.quiet,
        )


def compare(files: list[str], k: CompareFlags, c: CommonFlags) -> None:
    """Print the table; raise LlmctlError (exit 1) when B regresses beyond the threshold."""
    from llmctl.profiling import compare as cmp
    from llmctl.profiling.report import load_record
    from llmctl.profiling.tables import COMPARE_COLUMNS, COMPARE_LEFT, compare_notes, compare_rows

    if len(files) != 2:
        raise UsageError("usage: llmctl profile compare A.json B.json [--threshold 5%]")
    ra, rb = load_record(Path(files[0])), load_record(Path(files[1]))
    stat = k.stat or cmp.DEFAULT_STAT
    threshold = cmp.parse_threshold(k.threshold or cmp.DEFAULT_THRESHOLD)
    result = cmp.compare_records(ra, rb, threshold, stat)
    differences = cmp.environment_differences(ra, rb)
    if not json_to_stdout(c.report_json):
        title = f"{files[0]} (A) vs {files[1]} (B), {stat}, threshold {result.threshold:.1%}"
        rows = compare_rows(result)
        print_table(title, rows, COMPARE_COLUMNS, min_width=120, left=COMPARE_LEFT)
        print_lines(compare_notes(result, differences), min_width=120)
    if not result.deltas:
        raise UsageError("the two records share no (batch, prompt, gen) point; nothing to compare")
    emit_json(c.report_json, {**result.to_dict(), "environment_differences": differences})
    n = len(result.regressions)
    if n:
        raise LlmctlError(f"{n} regression(s) of B beyond {result.threshold:.1%} ({stat})")
    info(f"no regression beyond {result.threshold:.1%} ({stat})")


def _advise_request(a: AdviseFlags, r: RunFlags, d: DeviceFlags, dtype: str | None):
    from llmctl.profiling.advise import AdviseRequest

    if not a.workload:
        raise UsageError("profile advise needs --workload PROMPTS.jsonl|.parquet")
    fields = given(
        objective=a.objective,
        sample=a.sample,
        budget=a.budget,
        max_tokens=a.max_tokens,
        max_kl=a.max_kl,
        dtype=dtype,
        seed=r.seed,
        repeats=r.repeat,
        confirm_rounds=a.confirm_rounds,
    )
    req = AdviseRequest(
        workload=a.workload,
        **fields,
        concurrency=a.concurrency,
        draft=a.draft,
        quality_data=a.quality_data,
        calib=a.calib,
        device=_device(d),
    )
    req.check()
    return req


def advise(
    models: list[str],
    a: AdviseFlags,
    r: RunFlags,
    d: DeviceFlags,
    dtype: str | None,
    c: CommonFlags,
    tools: Callable[[], Any],
) -> None:
    """Measure the trials on the workload with `tools()` (an `AdviseTools`, made once the flags
    are checked); print (or write) what was measured, even when interrupted (then exit 130)."""
    from llmctl.profiling import advise_report as rep
    from llmctl.profiling.advise_job import run_advise

    if len(models) > 1:
        raise UsageError(f"profile advise takes one MODEL, got {len(models)}: {' '.join(models)}")
    req = _advise_request(a, r, d, dtype)
    target = models[0] if models else None
    state = run_advise(req, target, tools(), lambda m: info(m, c.quiet))
    emit_json(c.report_json, state.record())
    if r.markdown:
        typer.echo(rep.markdown(state), nl=False)
    elif not json_to_stdout(c.report_json):
        title = f"profile advise: {state.ctx.runtime.model_name}, objective {req.objective}"
        print_table(title, rep.table_rows(state), rep.COLUMNS, min_width=150, left=rep.LEFT)
        print_lines(rep.notes(state), min_width=150)
        for line in rep.commands(state):  # unwrapped, to copy
            typer.echo(line)
    if state.interrupted:
        raise typer.Exit(130)
