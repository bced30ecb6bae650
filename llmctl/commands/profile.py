"""`llmctl profile`: measured sweeps, config-only estimates, machine peaks and CI comparisons.

Five sub-commands, one per form (and the one-command spellings of before them):
  llmctl profile sweep [MODEL] [sweep options]      measured sweep through the serving engine
                                                    (old: llmctl profile [MODEL] ...)
  llmctl profile estimate MODEL_OR_CONFIG ...       memory / speed estimate from config.json alone
                                                    (old: llmctl profile --estimate MODEL ...)
  llmctl profile compare A.json B.json              side-by-side table; exit 1 when B regresses
  llmctl profile advise [MODEL] --workload FILE     each optimisation measured on the workload
  llmctl profile machine                            cache this machine's peaks
                                                    (old: llmctl profile --measure-machine)
Owns: the sub-commands, their help, and the hidden default command (`_default_group`) that takes
every command line not starting with a sub-command's name, as the one command did. Options are
option records (`_profile_options`, `_advise_options`; None defaults: `SweepRequest`,
`EstimateRequest` and `AdviseRequest` own them); each form is run by `_profile_forms`.
"""

from __future__ import annotations

import typer

from llmctl.commands import _profile_forms as forms
from llmctl.commands import _profile_options as o
from llmctl.commands._advise_options import AdviseFlags, AdviseModelArg
from llmctl.commands._default_group import DefaultCommand, DefaultGroup
from llmctl.commands._records import record_command
from llmctl.errors import LlmctlError, UsageError

# Long lines are joined here, not in the source: the help keeps the newlines it is given.
HELP = (
    """Profile a model: measured sweeps, estimates from config.json, and regression checks.

\b
  llmctl profile sweep [MODEL] [--batch-sizes 1,8,32] [--prompt-lens 128,512] ...
  llmctl profile estimate MODEL_OR_CONFIG [--dtype int4] [--memory 24GiB]
  llmctl profile compare A.json B.json [--threshold 5%]  (1: B regressed)
  llmctl profile machine                     (cache peaks for MBU and MFU)
  llmctl profile advise MODEL --workload PROMPTS.jsonl [--objective ttft] [--budget 10m]

\b
Each sub-command has its own --help. The one-command spellings still work:
  llmctl profile MODEL [--batch-sizes 1,8,32] [--prompt-lens 128,512] ...
  llmctl profile --estimate MODEL_OR_CONFIG [--dtype int4] [--memory 24GiB]
  llmctl profile --measure-machine           (cache peaks for MBU and MFU)

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

SWEEP_HELP = (
    "Measured sweep: prefill and decode timed through the serving engine over every batch size,"
    " prompt length and generation length (old spelling: llmctl profile [MODEL] ...).\n"
    "\n\b\nExamples:\n"
    "  llmctl profile sweep --batch-sizes 1,2 --prompt-lens 16 --gen-lens 8 --report-json run.json"
    "\n"
    "  llmctl profile sweep llmctl/data/demo-model --batch-sizes 1 --prompt-lens 8 --gen-lens 4"
    " --repeat 2 --markdown\n"
    "\n"
    "MODEL is a local folder or hub id (default: the embedded demo model). --report-json - writes"
    " the JSON record to standard output instead of the table.\n"
)
ESTIMATE_HELP = (
    "Estimate memory and decode speed from config.json alone, no weights loaded (old spelling:"
    " llmctl profile --estimate MODEL_OR_CONFIG ...).\n"
    "\n\b\nExamples:\n"
    "  llmctl profile estimate llmctl/data/demo-model/config.json --dtype int4 --seq-len 256"
    " --batch 8 --memory 24GiB --bandwidth 1000\n"
    "  llmctl profile estimate llmctl/data/demo-model --kv-dtype fp8 --bandwidth 3.35TB/s"
    " --report-json -\n"
)
COMPARE_HELP = (
    "Compare two records of profile --report-json side by side; exit 1 when B regresses beyond"
    " --threshold.\n"
    "\n\b\nExamples:\n"
    "  llmctl profile sweep --batch-sizes 1 --prompt-lens 8 --gen-lens 4 --report-json a.json -q\n"
    "  llmctl profile compare a.json a.json --threshold 10%\n"
    "  llmctl profile compare a.json a.json --stat p90 --report-json -\n"
)
ADVISE_HELP = (
    "Measure each optimisation (prefix caching, speculative decoding, int8/int4 weights, ...) on"
    " a sample of your workload and advise the run-batch line that serves it best.\n"
    "\n\b\nExamples:\n"
    "  llmctl profile advise --workload examples/prompts.jsonl --sample 2 --max-tokens 2"
    " --budget 15s --confirm-rounds 0 --markdown\n"
    "\n"
    "MODEL is a local folder or hub id (default: the embedded demo model).\n"
)
MACHINE_HELP = (
    "Measure this machine's memory bandwidth and bfloat16/float32 matmul peaks and cache them,"
    " for the MBU and MFU of sweeps (old spelling: llmctl profile --measure-machine).\n"
    "\n\b\nExamples:\n"
    "  llmctl profile machine --device cpu\n"
)
HELPS = {
    "sweep": SWEEP_HELP,
    "estimate": ESTIMATE_HELP,
    "compare": COMPARE_HELP,
    "advise": ADVISE_HELP,
    "machine": MACHINE_HELP,
}


def register(app: typer.Typer) -> None:
    group = typer.Typer(cls=DefaultGroup, help=HELP, add_completion=False)
    group.command("forms", cls=DefaultCommand, help=HELP, hidden=True)(record_command(_forms))
    for name, body in (
        ("sweep", _sweep),
        ("estimate", _estimate),
        ("compare", _compare),
        ("advise", _advise),
        ("machine", _machine),
    ):
        group.command(name, help=HELPS[name])(record_command(body))
    app.add_typer(group, name="profile")


def _forms(
    *,
    targets: o.TargetsArg = None,
    sweep: o.SweepFlags,
    run: o.RunFlags,
    device: o.DeviceFlags,
    switch: o.EstimateSwitch,
    estimate: o.EstimateFlags,
    compare: o.CompareFlags,
    dtype: o.DtypeFlag,
    common: o.CommonFlags,
    machine: o.MachineFlag,
    advise: AdviseFlags,
) -> None:
    """The one-command spellings: the first word (compare, advise), --measure-machine and
    --estimate pick the form; a sweep otherwise."""
    common = forms.common_of(common)
    forms.check_outputs(common, run.markdown, sweep.csv_path, sweep.plot_path)
    targets = targets or []
    if targets and targets[0] == "compare":
        forms.compare(targets[1:], compare, common)
        return
    if targets and targets[0] == "advise":
        forms.advise(targets[1:], advise, run, device, dtype.dtype, common, _advise_tools)
        return
    if len(targets) > 1:
        raise UsageError(
            f"profile takes one MODEL, got {len(targets)} ({' '.join(targets)}); "
            "to compare two records use: llmctl profile compare A.json B.json"
        )
    target = targets[0] if targets else None
    if machine.measure_machine:
        forms.measure(device, common)
        if target is None and not switch.estimate:
            return
    if switch.estimate:
        if target is None:
            raise UsageError("--estimate needs a model folder, config.json or hub id")
        forms.estimate(target, estimate, dtype.dtype, common)
        return
    forms.sweep(target, sweep, run, device, dtype.dtype, common)


def _sweep(
    *,
    model: o.ModelArg = None,
    sweep: o.SweepFlags,
    run: o.RunFlags,
    device: o.DeviceFlags,
    dtype: o.DtypeFlag,
    common: o.CommonFlags,
    machine: o.MachineFlag,
) -> None:
    """`profile sweep`: the measured sweep (after --measure-machine, if given)."""
    common = forms.common_of(common)
    forms.check_outputs(common, run.markdown, sweep.csv_path, sweep.plot_path)
    if machine.measure_machine:
        forms.measure(device, common)
    forms.sweep(model, sweep, run, device, dtype.dtype, common)


def _estimate(
    target: o.ModelOrConfigArg,
    estimate: o.EstimateFlags,
    dtype: o.DtypeFlag,
    common: o.CommonFlags,
    machine: o.MachineFlag,
    device: o.DeviceFlags,
) -> None:
    """`profile estimate`: the estimate from config.json (after --measure-machine)."""
    common = forms.common_of(common)
    forms.check_outputs(common)
    if machine.measure_machine:
        forms.measure(device, common)
    forms.estimate(target, estimate, dtype.dtype, common)


def _compare(*, files: o.RecordsArg = None, compare: o.CompareFlags, common: o.CommonFlags) -> None:
    """`profile compare A B`."""
    common = forms.common_of(common)
    forms.check_outputs(common)
    forms.compare(files or [], compare, common)


def _advise(
    *,
    models: AdviseModelArg = None,
    advise: AdviseFlags,
    run: o.RunFlags,
    device: o.DeviceFlags,
    dtype: o.DtypeFlag,
    common: o.CommonFlags,
) -> None:
    """`profile advise [MODEL] --workload FILE`."""
    common = forms.common_of(common)
    forms.check_outputs(common, run.markdown)
    forms.advise(models or [], advise, run, device, dtype.dtype, common, _advise_tools)


def _machine(device: o.DeviceFlags, common: o.CommonFlags) -> None:
    """`profile machine`: measure and cache this machine's peaks."""
    common = forms.common_of(common)
    forms.check_outputs(common)
    forms.measure(device, common)


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
