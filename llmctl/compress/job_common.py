"""What quantize and sparsify check and set up before any work, written once for both jobs.

Owns: `JobArgs` (the fields both argument classes share), `check_common_options` (range checks of
those fields), `prepare` (the output folder's plan, nothing created yet; the input files; the model
folder resolved and kept apart from the output; its config read without loading weights; the
device), `Notes` (a job's warnings, shown at once and kept for the report) and `settle` (after
the job's own checks: --seq-len capped at the model's context, and a warning for each --ignore
pattern that matches no layer). Loading and calibrating come after (llmctl.compress.oneshot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from llmctl.compress.driver import make_ignore, unmatched_patterns
from llmctl.errors import UsageError
from llmctl.runtime.output_dir import OutputFolder, check_input_file, check_output_file
from llmctl.runtime.shards import parse_shard_size

STDOUT = "-"  # --report-json - : the report goes to standard output


class JobArgs(Protocol):
    model: str | None
    output: str
    calib: str | None
    eval_data: str | None
    num_samples: int
    seq_len: int
    ignore: list[str]
    device: str
    dampening: float
    overwrite: bool
    report_json: str | None


def check_common_options(args: JobArgs) -> None:
    """Range checks of the options quantize and sparsify share; UsageError names the flag."""
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2, got {args.seq_len}")
    if not 0 < args.dampening < 1:
        raise UsageError(f"--dampening must be between 0 and 1 (exclusive), got {args.dampening}")
    make_ignore(args.ignore)  # a bad re: pattern fails here
    parse_shard_size(args.max_shard_size)


@dataclass
class Prepared:
    out: OutputFolder
    model_path: Path
    config: object  # llmctl.models.config.ModelConfig
    device: str
    linears: list[tuple[str, int, int]]  # (name, out_features, in_features) of every decoder linear


def plan_output(args: JobArgs, inputs: tuple[Path, ...] = ()) -> OutputFolder:
    """The output folder and --report-json (not one of `inputs`; '-' is standard output, not a
    file), checked before anything is created."""
    to_file = args.report_json not in (None, STDOUT)
    report = (Path(args.report_json),) if to_file else ()
    out = OutputFolder.plan(args.output, overwrite=args.overwrite, keep=report)
    if to_file:
        # a report inside the output folder: its folder exists once the run is done
        in_output = OutputFolder.at(report[0].parent).final == out.final
        check_output_file(args.report_json, "--report-json", inputs, create_parents=in_output)
    return out


@dataclass
class Notes:
    """A job's warnings: each one is shown at once through `show` and kept for the report."""

    show: Callable[[str], None]
    items: list[str] = field(default_factory=list)

    def __call__(self, message: str) -> None:
        self.items.append(message)
        self.show(message)


def prepare(args: JobArgs, inputs: tuple[Path, ...] = ()) -> Prepared:
    """Every shared check that needs no weights (see the module docstring); `inputs`: more files
    the run reads (a recipe), which --report-json may not overwrite either."""
    from llmctl.models.config import ModelConfig
    from llmctl.models.linears import config_linears
    from llmctl.runtime.resolve import resolve_device, resolve_model_path

    check_common_options(args)
    local = Path(args.model).expanduser() if args.model else None
    if local is not None and local.exists():  # the clearest error first, before -o's contents
        OutputFolder.at(args.output).check_source(local)
    files = (*inputs, *(Path(p) for p in (args.calib, args.eval_data) if p))
    out = plan_output(args, files)
    check_input_file(args.calib, "--calib")
    check_input_file(args.eval_data, "--eval-data")
    model_path = resolve_model_path(args.model)
    out.check_source(model_path)
    plan_output(args, (model_path, *files))  # --report-json may not overwrite a file of the model
    config = ModelConfig.from_file(model_path / "config.json")
    device = resolve_device(args.device)
    return Prepared(out, model_path, config, device, config_linears(config))


def settle(
    args: JobArgs,
    prep: Prepared,
    warn: Callable[[str], None],
    ignores: list[list[str]] | None = None,
) -> None:
    """After every check passed: cap args.seq_len at the model's context and warn about --ignore
    patterns (args.ignore, or those of each step in `ignores`) that match no layer (warnings, so
    they come after the errors)."""
    context = prep.config.max_position_embeddings
    if args.seq_len > context:
        warn(
            f"--seq-len {args.seq_len} is above the model's context ({context} tokens); "
            f"calibrating on sequences of {context}"
        )
        args.seq_len = context
    patterns = list(dict.fromkeys(p for ps in (ignores or [args.ignore]) for p in ps))
    for pattern in unmatched_patterns(patterns, [n for n, _, _ in prep.linears] + ["lm_head"]):
        warn(f"--ignore {pattern!r} matches no linear layer of the model")


def load_job_calibration(args: JobArgs, rt, warn: Callable[[str], None], calibrates: bool = True):
    """The calibration set (llmctl.compress.calib_data) for this run; its warnings go to `warn`,
    except the built-in-data one when the method only scores perplexity on the data."""
    from llmctl.compress.calib_data import DEFAULT_WARNING, load_calibration

    calib = load_calibration(
        Path(args.calib) if args.calib else None,
        rt,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        eval_data=Path(args.eval_data) if args.eval_data else None,
        separator=rt.eos_token_ids[0] if rt.eos_token_ids else None,
        vocab_size=rt.config.vocab_size,
    )
    for w in calib.warnings:
        if calibrates or w != DEFAULT_WARNING:
            warn(w)
    return calib


def calibration_summary(calib) -> dict:
    """The report's `calibration` entry."""
    return {
        "source": calib.source,
        "num_samples": int(calib.input_ids.shape[0]),
        "seq_len": int(calib.input_ids.shape[1]),
    }


def eval_tokens(heldout) -> int:
    """Held-out tokens the perplexity read (0 without any)."""
    from llmctl.runtime.evaluate import HELDOUT_MAX_TOKENS

    return 0 if heldout is None else min(heldout.numel(), HELDOUT_MAX_TOKENS)
