"""The whole `llmctl distill` run below the CLI: checks, models, data, training and the output.

Owns: `run_distill` and `TrainingInterrupted`. Every check that can fail runs before the first
step (options, files, the output folder, the tokenizers, layers, the context length, the data);
the finished student is written into OUT/.llmctl-work/result and moved into place at the end
(runtime/output_dir.py), and checkpoints live in OUT/.llmctl-work/checkpoint until then. Under
torchrun every rank runs this; only rank 0 writes.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.errors import LlmctlError, UsageError
from llmctl.runtime.output_dir import (
    OutputFolder,
    check_input_file,
    check_output_file,
    same_or_inside,
    writing,
)
from llmctl.train import student as students
from llmctl.train.args import DistillArgs
from llmctl.train.checkpoint import has_checkpoint, load_checkpoint
from llmctl.train.data import (
    SequenceStream,
    Tokenize,
    count_sequences,
    file_tokens,
    packed,
    tail_tokens,
)
from llmctl.train.distributed import close_world, init_world
from llmctl.train.loop import Progress, StopRequested, Trainer
from llmctl.train.output import write_student

HELDOUT_FRACTION = 0.1  # of --data's sequences, held out when --eval-every has no --eval-data
EVAL_MAX_TOKENS = 65536


class TrainingInterrupted(LlmctlError):
    """Ctrl-C: a checkpoint was saved; the same command with --resume continues."""

    exit_code = 130


@dataclass
class _Setup:
    teacher_path: Path
    out: OutputFolder
    teacher: Any  # None when an existing --cache-teacher file stands in for it
    teacher_config: Any  # ModelConfig
    teacher_dtype: torch.dtype
    tokenizer: Any
    student: Any
    student_raw: dict
    student_info: dict
    device: str


def _check_files(args: DistillArgs) -> None:
    check_input_file(args.data, "--data")
    check_input_file(args.eval_data, "--eval-data")
    if args.student_config is not None and not Path(args.student_config).exists():
        raise UsageError(f"--student-config {args.student_config} not found")
    if Path(args.data).stat().st_size == 0:
        raise UsageError(f"--data {args.data} is empty")


def _plan_output(args: DistillArgs, teacher_path: Path) -> OutputFolder:
    from llmctl.runtime.resolve import resolve_model_path

    # --overwrite replaces only an earlier llmctl output (never the teacher or student, below)
    keep = (Path(args.report_json),) if args.report_json not in (None, "-") else ()
    out = OutputFolder.plan(args.output, overwrite=args.overwrite, keep=keep)
    out.check_source(teacher_path)
    if args.student is not None:
        out.check_source(resolve_model_path(args.student))
    if args.cache_teacher is not None:
        check_output_file(args.cache_teacher, "--cache-teacher", inputs=(Path(args.data),))
        if same_or_inside(Path(args.cache_teacher), out.final):
            raise UsageError(
                f"--cache-teacher {args.cache_teacher} lies inside -o, which the run replaces; "
                "put it elsewhere"
            )
    saved = has_checkpoint(out.work / "checkpoint")
    if args.resume and not saved:
        raise UsageError(f"--resume: {args.output} holds no checkpoint to resume")
    if saved and not args.resume:
        raise UsageError(
            f"{args.output} holds a checkpoint of an earlier run: pass --resume to continue "
            f"it, or remove {out.work} to start again"
        )
    return out


def _load_student(args: DistillArgs, teacher_path: Path, raw: dict, tok, device: str):
    """(model, raw config, info for the report) of the chosen student."""
    from llmctl.runtime.resolve import resolve_model_path
    from llmctl.runtime.tokenizer import load_tokenizer

    if args.student_layers is not None:
        model, _, sraw, keep = students.student_from_layers(
            teacher_path, raw, args.student_layers, device
        )
        return model, sraw, {"from": "teacher layers", "teacher_layers_kept": keep}
    if args.student_config is not None:
        model, _, sraw = students.student_from_config(
            Path(args.student_config), raw, args.seed, device
        )
        return model, sraw, {"from": f"config {args.student_config}"}
    path = resolve_model_path(args.student)
    students.check_same_tokenizer(tok, load_tokenizer(path), args.student)
    model, _, sraw = students.load_student(path, raw, device)
    return model, sraw, {"from": f"model {args.student}"}


def _setup(args: DistillArgs, device: str) -> _Setup:
    from llmctl.runtime.resolve import resolve_model_path
    from llmctl.runtime.tokenizer import load_tokenizer

    teacher_path = resolve_model_path(args.teacher)
    out = _plan_output(args, teacher_path)
    teacher, tconfig, tdtype = _load_teacher(args, teacher_path, device)
    tok = load_tokenizer(teacher_path)
    if tok is None:
        raise UsageError(f"the teacher {args.teacher} has no tokenizer; distill needs one")
    torch.manual_seed(args.seed)
    student, sraw, info = _load_student(args, teacher_path, tconfig.raw, tok, device)
    for who, ctx in (
        ("teacher", tconfig.max_position_embeddings),
        ("student", student.config.max_position_embeddings),
    ):
        if args.seq_len > ctx:
            raise UsageError(f"--seq-len {args.seq_len} exceeds the {who}'s context ({ctx})")
    info.update(
        num_layers=student.config.num_layers,
        parameters=sum(p.numel() for p in student.parameters()),
    )
    return _Setup(teacher_path, out, teacher, tconfig, tdtype, tok, student, sraw, info, device)


def _load_teacher(args: DistillArgs, teacher_path: Path, device: str):
    """(model or None, ModelConfig, dtype). An existing --cache-teacher file serves every
    training step, so the teacher's weights are not loaded at all (a teacher too big to sit
    beside the student); held-out evaluation then reports no teacher-student KL."""
    from llmctl.models.config import ModelConfig
    from llmctl.runtime.resolve import resolve_dtype
    from llmctl.runtime.weights import load_model

    if args.cache_teacher is not None and Path(args.cache_teacher).exists():
        config = ModelConfig.from_file(teacher_path / "config.json")
        return None, config, resolve_dtype(args.dtype, config, device)
    teacher, config = load_model(teacher_path, args.dtype, device)
    return teacher, config, next(teacher.parameters()).dtype


def _data(args: DistillArgs, tokenize: Tokenize) -> tuple[int | None, torch.Tensor | None]:
    """(training sequences per epoch or None for all, held-out tokens or None)."""
    data = Path(args.data)
    if next(packed(data, tokenize, args.seq_len), None) is None:
        raise UsageError(
            f"--data {args.data} has fewer tokens than one sequence of --seq-len {args.seq_len}"
        )
    if args.eval_data is not None:
        held = file_tokens(Path(args.eval_data), tokenize, EVAL_MAX_TOKENS)
        if held.numel() < 2:
            raise UsageError(f"--eval-data {args.eval_data} has fewer than 2 tokens")
        return None, held
    if not args.eval_every:
        return None, None
    total = count_sequences(data, tokenize, args.seq_len)
    if total < 2:
        raise UsageError(
            f"--eval-every without --eval-data holds out the last {HELDOUT_FRACTION:.0%} of "
            f"--data, which has only {total} sequence(s); give --eval-data or more data"
        )
    first = total - max(1, int(total * HELDOUT_FRACTION))
    return first, tail_tokens(data, tokenize, args.seq_len, first, EVAL_MAX_TOKENS)


def _wrap_note(args: DistillArgs, warn: Callable[[str], None] | None):
    if warn is None:
        return None
    return lambda n: warn(
        f"--data gives {n} sequences of {args.seq_len} tokens; the run goes on from its start "
        "(more data, or fewer --steps, avoid repeating it)"
    )


def _will_build(args: DistillArgs) -> bool:
    return args.cache_teacher is not None and not Path(args.cache_teacher).exists()


def _teacher_cache(args: DistillArgs, s: _Setup, tokenize: Tokenize, limit, world, warn):
    """The --cache-teacher cache this run reads (None without one), made first when FILE does not
    exist yet (rank 0 runs the teacher; the other ranks wait)."""
    from llmctl.train import teacher_cache as tc

    if args.cache_teacher is None:
        return None
    index = Path(os.path.abspath(args.cache_teacher))
    fp = tc.fingerprint(s.teacher_path, args, s.teacher_dtype, limit)
    needed = args.steps * args.batch_size * args.grad_accum * world.size
    if not index.exists() and world.is_main:
        seqs = itertools.islice(packed(Path(args.data), tokenize, args.seq_len), limit)
        with writing(f"--cache-teacher {index}"):
            tc.build_cache(index, s.teacher, seqs, needed, args.batch_size, fp, warn)
    world.barrier()
    return tc.TeacherCache.open(index, fp, needed)


def _autocast(device: str, dtype: torch.dtype) -> Any:
    return dtype if device.startswith("cuda") and dtype in (torch.bfloat16, torch.float16) else None


def run_distill(
    args: DistillArgs, progress: Progress | None = None, warn: Callable[[str], None] | None = None
) -> dict | None:
    """The whole run; returns the report (also written into the output folder) on rank 0, None
    on the other ranks of a torchrun job."""
    from llmctl.runtime.resolve import resolve_device
    from llmctl.runtime.tokenizer import read_generation_eos

    args.resolve()
    _check_files(args)
    world, device = init_world(resolve_device(args.device))
    try:
        t0 = time.perf_counter()
        s = _setup(args, device)
        eos = read_generation_eos(s.teacher_path, s.teacher_config)
        tokenize = Tokenize(s.tokenizer, eos[0] if eos else s.tokenizer.eos_token_id)
        limit, heldout = _data(args, tokenize)
        stream = SequenceStream(
            Path(args.data), tokenize, args.seq_len, limit, _wrap_note(args, warn)
        )
        t_cache, built = time.perf_counter(), _will_build(args)
        cache = _teacher_cache(args, s, tokenize, limit, world, warn)
        cache_s = time.perf_counter() - t_cache
        trainer = Trainer(
            args, s.student, s.teacher, stream, world, device,
            s.out.work / "checkpoint", heldout, _autocast(device, s.teacher_dtype), eos_ids=eos,
            cache=cache,
        )  # fmt: skip
        if args.resume:
            trainer.state = load_checkpoint(
                trainer.checkpoint_dir, s.student, trainer.optimizer, trainer.scheduler,
                args.fingerprint(),
            )  # fmt: skip
            stream.skip(trainer.state.sequences)
        final = _train(trainer, args, progress if world.is_main else None)
        report = _report(args, s, trainer, final, time.perf_counter() - t0)
        report["teacher_cache"] = None if cache is None else {
            "index": str(cache.index), "top_k": cache.top_k,
            "sequences": cache.doc["sequences"], "built": built, "seconds": cache_s,
        }  # fmt: skip
        if world.is_main:
            write_student(s.out, s.teacher_path, s.student, s.student_raw, args, report)
        world.barrier()
        return report if world.is_main else None
    finally:
        close_world(world)


def _train(trainer: Trainer, args: DistillArgs, progress: Progress | None) -> dict | None:
    """Train to the last step, then the final evaluation (None without held-out data)."""
    try:
        trainer.run(progress)
    except StopRequested:
        raise TrainingInterrupted(
            f"interrupted after step {trainer.state.step} of {args.steps}; checkpoint saved: "
            "rerun the same command with --resume to continue"
        ) from None
    return trainer.evaluate()


def _report(
    args: DistillArgs, s: _Setup, trainer: Trainer, final: dict | None, wall: float
) -> dict:
    st = trainer.state
    trained = [h for h in st.history if "tokens_per_s" in h]
    return {
        "schema": "llmctl.distill",
        "schema_version": 1,
        "teacher": args.teacher,
        "output": str(s.out.final),
        "student": s.student_info,
        "loss": args.loss,
        "steps": st.step,
        "on_policy_fraction": args.on_policy_fraction,
        "on_policy_steps": st.on_policy_steps,
        "target_tokens": st.tokens,
        "sequences": st.sequences,
        "world_size": trainer.world.size,
        "device": s.device,
        "wall_time_s": wall,
        "tokens_per_s": trained[-1]["tokens_per_s"] if trained else None,
        "final_loss": st.history[-1]["loss"] if st.history else None,
        "final_eval": final,
        "evals": st.evals,
        "history": st.history,
    }
