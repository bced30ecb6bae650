"""The optimisation loop of distill: batches, losses, AdamW steps, evaluation and checkpoints.

Owns: `Trainer` (one run's student, teacher, optimizer, scheduler, data stream and state) and
`schedule` (linear warm-up, then cosine decay to min_lr_ratio * lr). A step takes grad_accum
micro-batches of batch_size sequences per rank; the data's global order is shared by all ranks
(rank r takes sequences r, r + world, ... of each micro-batch), so W ranks with batch B train on
what one process with batch W x B would. Teacher logits are computed on the fly without
gradients, or read from a --cache-teacher file (teacher_cache.py). With --on-policy-fraction,
the steps that onpolicy.is_on_policy picks replace each sequence's continuation by what the
student samples (onpolicy.py) and train on those tokens only. Ctrl-C only sets a flag: the step
in progress finishes, a checkpoint is written, and the run stops with StopRequested.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llmctl.train.args import DistillArgs
from llmctl.train.checkpoint import TrainState, save_checkpoint
from llmctl.train.data import SequenceStream
from llmctl.train.distributed import World
from llmctl.train.losses import distill_loss, teacher_from_top_k
from llmctl.train.onpolicy import is_on_policy, student_samples

Progress = Callable[[int, int, dict], None]  # (step, steps, metrics of the step)


class StopRequested(Exception):
    """Ctrl-C (or a progress callback's KeyboardInterrupt) stopped the run at a step boundary."""


def schedule(warmup: int, steps: int, min_ratio: float) -> Callable[[int], float]:
    """The learning-rate factor after `i` optimizer steps."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class DenseLM(torch.nn.Module):
    """The student's dense forward as `forward`, which DDP's hooks need: ids [B, S] -> logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.forward_dense(ids)


@dataclass
class Trainer:
    args: DistillArgs
    student: Any
    teacher: Any
    stream: SequenceStream
    world: World
    device: str
    checkpoint_dir: Path
    heldout: torch.Tensor | None = None
    autocast: Any = None  # a torch dtype for CUDA autocast, or None
    state: TrainState = field(default_factory=TrainState)
    stop: bool = False
    eos_ids: tuple[int, ...] = ()  # where the student's on-policy samples may stop
    on_policy: bool = False  # whether the step in progress samples from the student
    cache: Any = None  # a teacher_cache.TeacherCache: the teacher's top-k instead of the teacher

    def __post_init__(self) -> None:
        a = self.args
        self.module = self.world.wrap(DenseLM(self.student), self.device)
        self.optimizer = torch.optim.AdamW(
            self.student.parameters(), lr=a.lr, weight_decay=a.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, schedule(a.warmup, a.steps, a.min_lr_ratio)
        )

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """This rank's micro-batch: ids [B, S], target mask [B, S] (see the module docstring) and
        the sequences' numbers within their epoch (where the teacher cache has them)."""
        seqs = []
        for _ in range(self.args.batch_size * self.world.size):
            seqs.append((self.stream.next(), self.stream.last_index))
        mine = seqs[self.world.rank :: self.world.size]
        ids = torch.stack([s.ids for s, _ in mine]).to(self.device)
        mask = torch.stack([s.mask for s, _ in mine]).to(self.device)
        return ids, mask, [n for _, n in mine]

    def _teacher(self, ids: torch.Tensor, tmask: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        """Teacher log-probabilities or logits [N, V] at the target positions tmask [B, S - 1]."""
        if self.cache is None:
            with torch.no_grad():
                return self.teacher.forward_dense(ids)[:, :-1][tmask].float()
        values, indices, rest = (t.to(self.device) for t in self.cache.rows(seqs))
        vocab = self.student.config.vocab_size
        return teacher_from_top_k(values[tmask], indices[tmask], rest[tmask], vocab)

    def _micro_step(self, index: int, last: bool) -> tuple[float, float, float | None, int]:
        """Forward and backward of micro-batch `index` of the step; (loss, ce, divergence,
        target tokens)."""
        a = self.args
        ids, mask, seqs = self._batch()
        if self.on_policy:  # row numbers unique across micro-batches and ranks: the seeds
            row0 = (index * self.world.size + self.world.rank) * a.batch_size
            ids, mask = student_samples(
                self.student, ids, mask, a.seed, self.state.step, row0, self.eos_ids
            )
        tmask = mask[:, 1:]  # position t - 1 predicts token t: [B, S - 1]
        targets = ids[:, 1:][tmask]  # [N]
        teacher = self._teacher(ids, tmask, seqs) if a.alpha_ce < 1 else None  # [N, V]
        sync = contextlib.nullcontext() if last or self.world.size == 1 else self.module.no_sync()
        cast = (
            torch.autocast("cuda", dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        with sync:
            with cast:
                logits = self.module(ids)[:, :-1][tmask].float()  # [N, V]
            if targets.numel() == 0:  # nothing to learn here: a zero loss keeps DDP in step
                loss, ce, div = logits.sum() * 0.0, logits.sum() * 0.0, None
            else:
                loss, ce, div = distill_loss(
                    a.loss, logits, teacher, targets,
                    alpha_ce=a.alpha_ce, beta=a.beta, temperature=a.temperature,
                )  # fmt: skip
            (loss / a.grad_accum).backward()
        d = None if div is None else div.item()
        return loss.item(), ce.item(), d, int(targets.numel())

    def step(self) -> dict:
        """One optimizer step; returns its metrics (means over micro-batches and ranks)."""
        a, n = self.args, self.args.grad_accum
        self.on_policy = is_on_policy(a.seed, self.state.step, a.on_policy_fraction)
        parts = [self._micro_step(i, i == n - 1) for i in range(n)]
        norm = torch.nn.utils.clip_grad_norm_(self.student.parameters(), a.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.sequences = self.stream.position
        tokens = self.world.total(sum(p[3] for p in parts))
        self.state.tokens += tokens
        self.state.on_policy_steps += int(self.on_policy)
        divs = [p[2] for p in parts if p[2] is not None]
        metrics = {
            "step": self.state.step,
            "loss": self.world.mean(sum(p[0] for p in parts) / n),
            "ce": self.world.mean(sum(p[1] for p in parts) / n),
            "divergence": self.world.mean(sum(divs) / len(divs)) if divs else None,
            "lr": lr,
            "grad_norm": float(norm),
            "target_tokens": tokens,
            "on_policy": self.on_policy,
        }
        self.state.history.append(metrics)
        return metrics

    def evaluate(self) -> dict | None:
        """Held-out perplexity of the student and KL(teacher || student), as `llmctl eval` does."""
        from llmctl.runtime.evaluate import perplexity

        if self.heldout is None or self.heldout.numel() < 2 or not self.world.is_main:
            return None
        window = self.args.seq_len
        r = perplexity(self.student, self.heldout, window, window, reference=self.teacher)
        doc = {
            "step": self.state.step,
            "perplexity": r.perplexity,
            "teacher_perplexity": r.reference_perplexity,
            "kl_teacher_student": r.mean_kl,
            "scored_tokens": r.num_scored_tokens,
        }
        self.state.evals.append(doc)
        return doc

    def save(self) -> None:
        from llmctl.runtime.output_dir import writing

        if self.world.is_main:
            with writing(f"the checkpoint {self.checkpoint_dir}"):
                save_checkpoint(
                    self.checkpoint_dir, self.student, self.optimizer, self.scheduler,
                    self.state, self.args.fingerprint(),
                )  # fmt: skip
        self.world.barrier()

    def run(self, progress: Progress | None) -> None:
        """Steps from the current state to args.steps; StopRequested after saving on Ctrl-C."""
        a = self.args
        tokens_per_step = a.batch_size * a.seq_len * a.grad_accum * self.world.size
        with _ctrl_c_sets(self):
            t0, first = time.perf_counter(), self.state.step
            while self.state.step < a.steps:
                metrics = self.step()
                metrics["tokens_per_s"] = (
                    (self.state.step - first) * tokens_per_step / (time.perf_counter() - t0)
                )
                shown = dict(metrics)  # what progress sees: the step's metrics and any eval
                if a.eval_every and self.state.step % a.eval_every == 0:
                    if self.state.step < a.steps:  # the last step has the final evaluation
                        shown["eval"] = self.evaluate()
                if a.save_every and self.state.step % a.save_every == 0:
                    self.save()
                try:
                    if progress is not None:
                        progress(self.state.step, a.steps, shown)
                except KeyboardInterrupt:
                    self.stop = True
                if self._stop_now():
                    self.save()
                    raise StopRequested(self.state.step)

    def _stop_now(self) -> bool:
        """Whether any rank asked to stop (all ranks stop at the same step)."""
        return self.world.total(int(self.stop)) > 0


@contextlib.contextmanager
def _ctrl_c_sets(trainer: Trainer):
    """While training, the first Ctrl-C sets trainer.stop; a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if trainer.stop:
            raise KeyboardInterrupt
        trainer.stop = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
