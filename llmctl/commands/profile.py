"""`llmctl profile`: measured sweeps, config-only estimates, machine peaks and CI comparisons.

One command with four forms (the first word decides):
  llmctl profile MODEL [sweep options]            measured sweep through the serving engine
  llmctl profile --estimate MODEL_OR_CONFIG ...   memory / speed estimate from config.json alone
  llmctl profile compare A.json B.json            side-by-side table; exit 1 when B regresses
  llmctl profile advise [MODEL] --workload FILE    each optimisation measured on the workload
Owns: the options (None defaults: `SweepRequest` and `EstimateRequest` own them) and what is
printed, through `_output`. The work is in llmctl.profiling (`sweep_job`, `estimate_job`,
`compare`, `machine`, `advise_job`); its cells in `profiling.tables` and `advise_report`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer

from llmctl.commands import _profile_options as o
from llmctl.commands._options import given
from llmctl.commands._output import (
    emit_json,
    info,
    json_to_stdout,
    print_lines,
    print_table,
    report_json_of,
)
from llmctl.errors import LlmctlError, UsageError

# Long lines are joined here, not in the source: the help keeps the newlines it is given.
HELP = (
    """Profile a model: measured sweeps, estimates from config.json, and regression checks.

\b
  llmctl profile MODEL [--batch-sizes 1,8,32] [--prompt-lens 128,512] ...
  llmctl profile --estimate MODEL_OR_CONFIG [--dtype int4] [--memory 24GiB]
  llmctl profile compare A.json B.json [--threshold 5%]  (1: B regressed)
  llmctl profile --measure-machine           (cache peaks for MBU and MFU)
  llmctl profile advise MODEL --workload PROMPTS.jsonl [--objective ttft] [--budget 10m]

\b
Examples:
"""
    # one example per line, as a user copies it
    "  llmctl profile --batch-sizes 1,4 --prompt-lens 32 --gen-lens 16"
    " --report-json run.json --csv run.csv\n"
    "  llmctl profile --estimate llmctl/data/demo-model/config.json --dtype int4 --seq-len 256"
    " --batch 8 --memory 24GiB --bandwidth 1000\n"
    "  llmctl profile compare run.json run.json --threshold 10%\n"
    "\n"
    "MODEL is a local folder or hub id (default: the embedded demo model); --estimate also takes "
    "a config.json file. --report-json - writes the JSON record to standard output instead of "
    "the table.\n"
)


def register(app: typer.Typer) -> None:
    @app.command("profile", help=HELP, no_args_is_help=False)
    def profile(
        targets: o.TargetsArg = None,
        batch_sizes: o.BatchSizesOpt = None,
        prompt_lens: o.PromptLensOpt = None,
        gen_lens: o.GenLensOpt = None,
        repeat: o.RepeatOpt = None,
        warmup: o.WarmupOpt = None,
        csv_path: o.CsvOpt = None,
        markdown: o.MarkdownOpt = False,
        plot_path: o.PlotOpt = None,
        device: o.DeviceOpt = None,
        kv_cache_memory: o.KvMemoryOpt = None,
        seed: o.SeedOpt = None,
        estimate: o.EstimateOpt = False,
        group_size: o.GroupSizeOpt = None,
        kv_dtype: o.KvDtypeOpt = None,
        seq_len: o.SeqLenOpt = None,
        batch: o.BatchOpt = None,
        memory: o.MemoryOpt = None,
        bandwidth: o.BandwidthOpt = None,
        quantize_embeddings: o.QuantizeEmbeddingsOpt = False,
        threshold: o.ThresholdOpt = None,
        stat: o.StatOpt = None,
        dtype: o.DtypeOpt = None,
        report_json: o.ReportJsonOpt = None,
        json_path: o.OldJsonOpt = None,
        measure_machine: o.MeasureOpt = False,
        quiet: o.QuietOpt = False,
        workload: o.WorkloadOpt = None,
        objective: o.ObjectiveOpt = None,
        sample: o.SampleOpt = None,
        budget: o.BudgetOpt = None,
        max_tokens: o.MaxTokensAdviseOpt = None,
        concurrency: o.ConcurrencyOpt = None,
        draft: o.DraftOpt = None,
        quality_data: o.QualityDataOpt = None,
        calib: o.CalibOpt = None,
        confirm_rounds: o.ConfirmRoundsOpt = None,
        max_kl: o.MaxKlOpt = None,
        no_autotune: o.NoAutotuneOpt = False,
    ) -> None:
        _profile(SimpleNamespace(**locals()))


def _profile(a: SimpleNamespace) -> None:
    """Pick the form (compare, measure, estimate, sweep) and run it."""
    targets = a.targets or []
    a.report_json = report_json_of(a.report_json, a.json_path, "--json", "--report-json")
    _check_outputs(a)
    if targets and targets[0] == "compare":
        _compare(targets[1:], a)
        return
    if targets and targets[0] == "advise":
        _advise(targets[1:], a)
        return
    if len(targets) > 1:
        raise UsageError(
            f"profile takes one MODEL, got {len(targets)} ({' '.join(targets)}); "
            "to compare two records use: llmctl profile compare A.json B.json"
        )
    target = targets[0] if targets else None
    if a.measure_machine:
        _measure(_device(a.device), a.quiet, stderr=json_to_stdout(a.report_json))
        if target is None and not a.estimate:
            return
    if a.estimate:
        if target is None:
            raise UsageError("--estimate needs a model folder, config.json or hub id")
        _estimate(target, a)
        return
    _sweep(target, a)


def _check_outputs(a: SimpleNamespace) -> None:
    """--report-json/--csv/--plot are written after the run: check them before it (parents are
    created); --markdown and --report-json - would both write stdout."""
    from llmctl.runtime.output_dir import check_output_file

    if a.markdown and json_to_stdout(a.report_json):
        raise UsageError("--markdown and --report-json - both write standard output; pick one")
    report = None if json_to_stdout(a.report_json) else a.report_json
    for flag, path in (("--report-json", report), ("--csv", a.csv_path), ("--plot", a.plot_path)):
        check_output_file(None if path is None else Path(path), flag, create_parents=True)


def _device(device: str | None) -> str:
    from llmctl.runtime.resolve import resolve_device

    return resolve_device(device or "auto")


def _measure(device: str, quiet: bool, stderr: bool) -> None:
    from llmctl.profiling.machine import measure_machine, save_peaks
    from llmctl.profiling.tables import machine_rows

    info(f"measuring memory bandwidth and bfloat16/float32 matmul peaks on {device} ...", quiet)
    peaks = measure_machine(device)
    path = save_peaks(peaks)
    title = f"Machine peaks ({peaks.key})"
    print_table(title, machine_rows(peaks, str(path)), min_width=110, stderr=stderr)


def _default_peaks():
    """Cached peaks of the machine a user most likely means: its GPU when present, else its CPU."""
    import torch

    from llmctl.profiling.machine import cached_peaks

    return cached_peaks("cuda" if torch.cuda.is_available() else "cpu")


def _estimate(target: str, a: SimpleNamespace) -> None:
    from llmctl.profiling.estimate_job import EstimateRequest, estimate_rows, run_estimate

    fields = given(
        dtype=a.dtype,
        group_size=a.group_size,
        kv_dtype=a.kv_dtype,
        seq_len=a.seq_len,
        batch=a.batch,
        memory=a.memory,
        bandwidth=a.bandwidth,
    )
    req = EstimateRequest(**fields, quantize_embeddings=a.quantize_embeddings)
    result = run_estimate(target, req, None if req.bandwidth else _default_peaks())
    if not json_to_stdout(a.report_json):
        print_table(f"Estimate: {target}", estimate_rows(result), min_width=110)
    emit_json(a.report_json, result.record())


def _sweep_request(a: SimpleNamespace):
    from llmctl.profiling.sweep_job import SweepRequest, int_list

    lists = {
        name: int_list(getattr(a, name), "--" + name.replace("_", "-"))
        for name in ("batch_sizes", "prompt_lens", "gen_lens")
        if getattr(a, name) is not None
    }
    fields = given(repeat=a.repeat, warmup=a.warmup, dtype=a.dtype, seed=a.seed)
    return SweepRequest(
        **lists,
        **fields,
        device=_device(a.device),
        kv_cache_memory=a.kv_cache_memory,
        plot=a.plot_path is not None,
        autotune=not a.no_autotune,
    )


def _sweep(target: str | None, a: SimpleNamespace) -> None:
    from llmctl.profiling import report
    from llmctl.profiling.sweep_job import profile_sweep
    from llmctl.profiling.tables import SWEEP_COLUMNS, sweep_rows, sweep_title
    from llmctl.runtime.loader import load_runtime
    from llmctl.runtime.output_dir import writing

    def progress(i: int, n: int, point: Any) -> None:
        if point is not None:
            where = f"batch {point.batch_size}, prompt {point.prompt_len}, gen {point.gen_len}"
            info(f"[{i + 1}/{n}] {where}", a.quiet)

    record = profile_sweep(_sweep_request(a), target, load_runtime, progress)
    emit_json(a.report_json, record)
    with writing("the profile results"):
        if a.csv_path:
            report.write_csv(record, a.csv_path)
        if a.plot_path:
            report.plot(record, a.plot_path)
    if a.markdown:
        typer.echo(report.markdown(record), nl=False)
    elif not json_to_stdout(a.report_json):
        print_table(sweep_title(record), sweep_rows(record), SWEEP_COLUMNS, min_width=140)
    if record.get("machine_peaks") is None:
        info(
            "MBU/MFU need this machine's peaks: run `llmctl profile --measure-machine` once",
            a.quiet,
        )


def _compare(files: list[str], a: SimpleNamespace) -> None:
    """Print the table; raise LlmctlError (exit 1) when B regresses beyond the threshold."""
    from llmctl.profiling import compare as c
    from llmctl.profiling.report import load_record
    from llmctl.profiling.tables import COMPARE_COLUMNS, COMPARE_LEFT, compare_notes, compare_rows

    if len(files) != 2:
        raise UsageError("usage: llmctl profile compare A.json B.json [--threshold 5%]")
    ra, rb = load_record(Path(files[0])), load_record(Path(files[1]))
    stat = a.stat or c.DEFAULT_STAT
    result = c.compare_records(ra, rb, c.parse_threshold(a.threshold or c.DEFAULT_THRESHOLD), stat)
    differences = c.environment_differences(ra, rb)
    if not json_to_stdout(a.report_json):
        title = f"{files[0]} (A) vs {files[1]} (B), {stat}, threshold {result.threshold:.1%}"
        rows = compare_rows(result)
        print_table(title, rows, COMPARE_COLUMNS, min_width=120, left=COMPARE_LEFT)
        print_lines(compare_notes(result, differences), min_width=120)
    if not result.deltas:
        raise UsageError("the two records share no (batch, prompt, gen) point; nothing to compare")
    emit_json(a.report_json, {**result.to_dict(), "environment_differences": differences})
    n = len(result.regressions)
    if n:
        raise LlmctlError(f"{n} regression(s) of B beyond {result.threshold:.1%} ({stat})")
    info(f"no regression beyond {result.threshold:.1%} ({stat})")


def _advise(models: list[str], a: SimpleNamespace) -> None:
    """Measure the trials on the workload; print (or write) what was measured, even when
    interrupted (then exit 130)."""
    from llmctl.profiling import advise_report as rep
    from llmctl.profiling.advise import AdviseRequest
    from llmctl.profiling.advise_job import run_advise

    if len(models) > 1:
        raise UsageError(f"profile advise takes one MODEL, got {len(models)}: {' '.join(models)}")
    if not a.workload:
        raise UsageError("profile advise needs --workload PROMPTS.jsonl|.parquet")
    fields = given(
        objective=a.objective,
        sample=a.sample,
        budget=a.budget,
        max_tokens=a.max_tokens,
        max_kl=a.max_kl,
        dtype=a.dtype,
        seed=a.seed,
        repeats=a.repeat,
        confirm_rounds=a.confirm_rounds,
    )
    req = AdviseRequest(
        workload=a.workload,
        **fields,
        concurrency=a.concurrency,
        draft=a.draft,
        quality_data=a.quality_data,
        calib=a.calib,
        device=_device(a.device),
    )
    req.check()
    stderr = json_to_stdout(a.report_json)
    target = models[0] if models else None
    state = run_advise(req, target, _advise_tools(), lambda m: info(m, a.quiet))
    emit_json(a.report_json, state.record())
    if a.markdown:
        typer.echo(rep.markdown(state), nl=False)
    elif not stderr:
        title = f"profile advise: {state.ctx.runtime.model_name}, objective {req.objective}"
        print_table(title, rep.table_rows(state), rep.COLUMNS, min_width=150, left=rep.LEFT)
        print_lines(rep.notes(state), min_width=150)
        for line in rep.commands(state):  # unwrapped, to copy
            typer.echo(line)
    if state.interrupted:
        raise typer.Exit(130)


def _advise_tools():
    """run-batch's input parsing, quantize's one-shot pipeline and a fresh `llmctl` process,
    lent to profiling (its peers)."""
    from llmctl.batch.inputs import open_input
    from llmctl.profiling.advise import AdviseTools
    from llmctl.runtime.loader import load_runtime

    def quantize(model: str, folder: str, bits: int, method: str, calib: str | None) -> None:
        from llmctl.compress.args import QuantizeArgs
        from llmctl.compress.quantize_job import run_quantize

        args = QuantizeArgs(model=model, output=folder, method=method, bits=bits, calib=calib,
                            overwrite=True)  # fmt: skip
        run_quantize(args.resolve())

    return AdviseTools(open_input, quantize, lambda *a, **k: load_runtime(*a, **k), run_line)


def run_line(words: list[str]) -> tuple[dict, int | None]:
    """`llmctl WORDS --report-json R -q` in a fresh interpreter: (the record, the process's peak
    resident memory from wait4). A failed run is a one-line error with its last stderr line."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmctl-line-") as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "llmctl.cli", *words, "--report-json", report, "-q"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err = proc.stderr.read() if proc.stderr else ""
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0 or not os.path.exists(report):
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise LlmctlError(f"llmctl {' '.join(words[:2])} failed ({proc.returncode}): {last}")
        with open(report, encoding="utf-8") as f:
            return json.load(f), int(usage.ru_maxrss) * 1024
