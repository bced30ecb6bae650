"""`llmctl distill`: knowledge distillation of a teacher model into a smaller student.

The work is in llmctl.train (job.py). Owns: the command (its options are the records of
`_distill_options`), the training progress (a Rich bar with loss, KL, tokens/s and ETA on a
terminal, plain lines otherwise) and the report.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from llmctl.commands import _distill_options as o
from llmctl.commands._records import record_command
from llmctl.train.args import DistillArgs

HELP = """Distill TEACHER into a smaller student trained to match its next-token distributions.

\b
Examples (on the embedded demo model; use your own model folder or hub id):
  llmctl distill --teacher llmctl/data/demo-model -o demo-student \\
      --student-layers 2 --data llmctl/compress/data/calib_default.txt \\
      --steps 4 --batch-size 2 --seq-len 32
  llmctl distill --teacher llmctl/data/demo-model -o demo-jsd \\
      --student demo-student --data llmctl/compress/data/calib_default.txt \\
      --loss jsd --beta 0.5 --steps 4 --batch-size 2 --seq-len 32 --eval-every 2
  llmctl distill --teacher llmctl/data/demo-model -o demo-ce --student-layers 1 \\
      --data llmctl/compress/data/calib_default.txt --alpha-ce 1 \\
      --steps 2 --batch-size 2 --seq-len 32 --report-json demo-ce.json
  llmctl distill --teacher llmctl/data/demo-model -o demo-gkd --student-layers 2 \\
      --data llmctl/compress/data/calib_default.txt --loss jsd \\
      --on-policy-fraction 0.5 --steps 4 --batch-size 2 --seq-len 32
  llmctl distill --teacher llmctl/data/demo-model -o demo-cached --student-layers 2 \\
      --data llmctl/compress/data/calib_default.txt --cache-teacher demo-teacher.json \\
      --steps 4 --batch-size 2 --seq-len 32

\b
Student: --student-layers N copies N evenly spaced teacher layers (first and
  last kept) with its embeddings, final norm and lm_head; --student S is an
  existing model with the teacher's tokenizer; --student-config FILE a fresh
  model of a config.json (random weights from --seed).
--data / --eval-data: JSONL or Parquet rows with text, prompt + completion
  (loss on the completion only) or messages (the chat template; loss on the
  assistant tokens only), or plain text; packed into --seq-len sequences and
  streamed. Without --eval-data, --eval-every holds out the last 10% of
  --data's sequences.
--loss: fkl, forward KL(teacher || student) on distributions softened by
  --temperature, scaled by T^2; rkl, reverse KL; jsd, GKD's generalised
  Jensen-Shannon divergence with --beta; tvd, total variation. Every loss is
  mixed with cross-entropy: (1 - alpha_ce) * divergence + alpha_ce * CE.
--on-policy-fraction F: that share of the steps (picked from --seed and the
  step) keeps each sequence's prompt (the tokens before its first target, else
  its first half), lets the student sample the rest through llmctl's engine at
  temperature 1, and trains on the sampled tokens only (GKD; TRL's lmbda).
--cache-teacher FILE: when FILE does not exist, one teacher pass stores its
  --cache-top-k largest log-probabilities per position (safetensors shards
  beside FILE, a JSON index); training then reads them instead of running the
  teacher. A cache of other data, teacher, --seq-len or K is refused.
Training: AdamW, --warmup steps of linear warm-up then cosine decay to lr/10,
  --grad-accum micro-batches per step, gradients clipped at norm 1. --dtype is
  the teacher's; the student trains and is saved in float32 (with bf16 or fp16
  autocast on CUDA when the teacher runs in that dtype).
The output is an ordinary Hugging Face folder (config.json, model.safetensors,
  the teacher's tokenizer, distill.yaml, distill_report.json) that run-batch,
  eval and quantize load, and a --draft for its teacher in run-batch. It is
  written in OUTPUT/.llmctl-work and moved into place at the end. Ctrl-C (or
  --save-every) saves a checkpoint there; the same command with --resume
  continues it exactly. --overwrite replaces an earlier llmctl output in -o
  (never the teacher, the student, or files llmctl did not write). Under
  torchrun every rank takes its share of each batch and only rank 0 writes.
"""


def register(app: typer.Typer) -> None:
    app.command("distill", help=HELP, no_args_is_help=True)(record_command(_distill))


def _distill(
    job: o.DistillJob,
    student: o.StudentFlags,
    train: o.TrainFlags,
    loss: o.LossFlags,
    cache: o.TeacherCacheFlags,
    schedule: o.ScheduleFlags,
    run: o.DistillRunFlags,
) -> None:
    args = o.distill_args(job, schedule, student, train, loss, cache, run)
    _main(args, run.report_json, run.quiet)


def _main(args: DistillArgs, report_json: Optional[Path], quiet: bool) -> None:
    from llmctl.commands._output import emit_json
    from llmctl.runtime.output_dir import check_output_file

    if report_json is not None and str(report_json) != "-":
        check_output_file(report_json, "--report-json", inputs=(Path(args.data),))
    report = _run(args, quiet)
    if report is None:  # another rank of a torchrun job: rank 0 reports
        return
    emit_json(report_json, report)
    if not quiet and str(report_json) != "-":
        _print_report(report)


def _run(args: DistillArgs, quiet: bool) -> dict | None:
    from llmctl.train.job import run_distill

    with train_progress(quiet) as (progress, warn):
        return run_distill(args, progress=progress, warn=warn)


def _metrics_text(m: dict) -> str:
    div = "-" if m.get("divergence") is None else f"{m['divergence']:.4f}"
    text = f"loss {m['loss']:.4f}  kl {div}  {m['tokens_per_s']:,.0f} tok/s"
    if m.get("eval"):
        text += f"  held-out ppl {m['eval']['perplexity']:.3f}"
    return text


@contextmanager
def train_progress(quiet: bool) -> Iterator[tuple]:
    """(progress(step, steps, metrics), warn) for the training run: a Rich bar on a terminal,
    a plain line about every 10% of the steps (and at each evaluation) otherwise."""
    from llmctl.commands._output import stage_progress

    with stage_progress(quiet) as (stage, warn):
        if stage is None:
            yield None, warn
            return
        if not sys.stderr.isatty():

            def plain(step: int, steps: int, m: dict) -> None:
                if step == steps or step % max(1, steps // 10) == 0 or m.get("eval"):
                    print(f"step {step}/{steps}: {_metrics_text(m)}", file=sys.stderr, flush=True)

            yield plain, warn
            return
        yield _rich_progress(), warn


def _rich_progress():
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("distill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}"), console=Console(stderr=True), transient=True,
    )  # fmt: skip
    task: list[int] = []

    def update(step: int, steps: int, m: dict) -> None:
        if not task:
            bar.start()
            task.append(bar.add_task("distill", total=steps, completed=step - 1, metrics=""))
        bar.update(task[0], completed=step, metrics=_metrics_text(m))
        if step == steps:
            bar.stop()

    return update


def _print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"llmctl distill: {r['output']}", show_header=False)
    s = r["student"]
    table.add_row(
        "student", f"{s['num_layers']} layers, {s['parameters']:,} parameters ({s['from']})"
    )
    table.add_row(
        "training", f"{r['steps']} steps, {r['target_tokens']:,} target tokens, {r['loss']}"
    )
    table.add_row("final loss", f"{r['final_loss']:.4f}")
    if r.get("tokens_per_s"):
        table.add_row("throughput", f"{r['tokens_per_s']:,.0f} tokens/s")
    e = r.get("final_eval")
    if e:
        table.add_row(
            "held-out",
            f"perplexity {e['perplexity']:.3f} (teacher {e['teacher_perplexity']:.3f}), "
            f"KL(teacher || student) {e['kl_teacher_student']:.4f}",
        )
    if r.get("on_policy_steps"):
        table.add_row("on-policy", f"{r['on_policy_steps']} of {r['steps']} steps")
    c = r.get("teacher_cache")
    if c:
        how = "made" if c["built"] else "read"
        table.add_row("teacher cache", f"top-{c['top_k']} of {c['sequences']} sequences ({how})")
    table.add_row("wall time", f"{r['wall_time_s']:.1f} s")
    Console().print(table)
