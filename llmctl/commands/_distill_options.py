"""distill's options as option records, and their mapping to `DistillArgs`.

Owns: `DistillJob` (teacher, output, data), `StudentFlags`, `TrainFlags`, `LossFlags`,
`TeacherCacheFlags`, `ScheduleFlags` and `DistillRunFlags`: every distill flag's name and help
(flags default to None; the help quotes the default DistillArgs owns), and `distill_args`, which
passes on only the flags a user set.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.commands._compress_options import MaxShardSizeOpt
from llmctl.commands._options import (
    DeviceOpt,
    DtypeOpt,
    EvalDataOpt,
    OverwriteOpt,
    QuietOpt,
    ReportJsonOpt,
    default_of,
    given,
    path_str,
)
from llmctl.train.args import DistillArgs


def _o(flag: str, text: str, field: str | None = None) -> Any:
    """A typer.Option without a shown default; its help quotes DistillArgs' default of `field`."""
    suffix = default_of(DistillArgs, field) if field else ""
    return typer.Option(flag, help=text + suffix, show_default=False)


@dataclass(frozen=True)
class DistillJob:
    """The teacher, the output folder and the training data (all required)."""

    teacher: Annotated[str, typer.Option("--teacher", help="Teacher model folder or hub id.")]
    output: Annotated[Path, typer.Option("--output", "-o", help="Output folder.")]
    data: Annotated[Path, typer.Option("--data", help="Training data: .jsonl, .parquet or text.")]


@dataclass(frozen=True)
class StudentFlags:
    """Where the student comes from."""

    student: Annotated[
        Optional[str], _o("--student", "Existing student model (the teacher's tokenizer).")
    ] = None
    student_layers: Annotated[
        Optional[int], _o("--student-layers", "Student of N evenly spaced teacher layers.")
    ] = None
    student_config: Annotated[
        Optional[Path], _o("--student-config", "config.json of a fresh student.")
    ] = None


@dataclass(frozen=True)
class TrainFlags:
    """The held-out data, the batches and the learning-rate schedule."""

    eval_data: EvalDataOpt = None
    steps: Annotated[Optional[int], _o("--steps", "Optimizer steps.", "steps")] = None
    batch_size: Annotated[
        Optional[int], _o("--batch-size", "Sequences per micro-batch (per rank).", "batch_size")
    ] = None
    grad_accum: Annotated[
        Optional[int], _o("--grad-accum", "Micro-batches per step.", "grad_accum")
    ] = None
    seq_len: Annotated[Optional[int], _o("--seq-len", "Tokens per sequence.", "seq_len")] = None
    lr: Annotated[Optional[float], _o("--lr", "Peak learning rate.", "lr")] = None
    warmup: Annotated[Optional[int], _o("--warmup", "Warm-up steps.", "warmup")] = None


@dataclass(frozen=True)
class LossFlags:
    """The divergence, its mixture with cross-entropy and the on-policy share."""

    loss: Annotated[Optional[str], _o("--loss", "fkl, rkl, jsd or tvd.", "loss")] = None
    beta: Annotated[
        Optional[float], _o("--beta", "jsd's mixture weight of the teacher.", "beta")
    ] = None
    temperature: Annotated[
        Optional[float], _o("--temperature", "Softening temperature.", "temperature")
    ] = None
    alpha_ce: Annotated[
        Optional[float], _o("--alpha-ce", "Weight of cross-entropy (0 to 1).", "alpha_ce")
    ] = None
    on_policy_fraction: Annotated[
        Optional[float],
        _o(
            "--on-policy-fraction",
            "Share of the steps trained on the student's own samples.",
            "on_policy_fraction",
        ),
    ] = None


@dataclass(frozen=True)
class TeacherCacheFlags:
    """The teacher's top-k logits cache."""

    cache_teacher: Annotated[
        Optional[Path],
        _o("--cache-teacher", "Teacher top-k logits cache (JSON index); made when missing."),
    ] = None
    cache_top_k: Annotated[
        Optional[int],
        _o("--cache-top-k", "Logits per position a new cache keeps.", "cache_top_k"),
    ] = None


@dataclass(frozen=True)
class ScheduleFlags:
    """Evaluations, checkpoints, resume, overwrite and the seed."""

    eval_every: Annotated[
        Optional[int], _o("--eval-every", "Evaluate every N steps (0: at the end).", "eval_every")
    ] = None
    save_every: Annotated[
        Optional[int], _o("--save-every", "Checkpoint every N steps (0: on Ctrl-C).", "save_every")
    ] = None
    resume: Annotated[bool, typer.Option("--resume", help="Continue the checkpoint in -o.")] = False
    overwrite: OverwriteOpt = False
    seed: Annotated[
        Optional[int], _o("--seed", "Seed of a fresh student and of on-policy samples.", "seed")
    ] = None


@dataclass(frozen=True)
class DistillRunFlags:
    """Where it runs and what it writes besides the student."""

    device: DeviceOpt = None
    dtype: DtypeOpt = None
    report_json: ReportJsonOpt = None
    max_shard_size: MaxShardSizeOpt = None
    quiet: QuietOpt = False


# the DistillArgs fields an option may set (teacher, output, data, resume, overwrite: always given)
TUNED = tuple(
    f.name
    for f in fields(DistillArgs)
    if f.name not in ("teacher", "output", "data", "resume", "overwrite")
)
_PATHS = ("student_config", "eval_data", "report_json", "cache_teacher")


def distill_args(job: DistillJob, schedule: ScheduleFlags, *records: Any) -> DistillArgs:
    """The resolved DistillArgs of the flags in `job`, `schedule` and `records` (the other
    records), with only the tuned flags a user set."""
    values = {f.name: getattr(r, f.name) for r in (schedule, *records) for f in fields(r)}
    options = given(
        **{k: path_str(v) if k in _PATHS else v for k, v in values.items() if k in TUNED}
    )
    return DistillArgs(
        teacher=job.teacher,
        output=str(job.output),
        data=str(job.data),
        resume=schedule.resume,
        overwrite=schedule.overwrite,
        **options,
    ).resolve()
