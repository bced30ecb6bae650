"""The arguments of `llmctl distill`: one dataclass that owns every default, and its checks.

Owns: `DistillArgs` (the resolved recipe, saved as the output's distill.yaml) and `resolve()`,
every check that needs no model (the model-dependent ones, layers and context, are in job.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

from llmctl.errors import UsageError
from llmctl.runtime.shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size

LOSSES = ("fkl", "rkl", "jsd", "tvd")  # llmctl.train.losses implements them
# Options that change nothing in the training itself: a resumed run may change them.
NOT_IN_FINGERPRINT = (
    "resume",
    "report_json",
    "eval_every",
    "save_every",
    "quiet",
    "overwrite",
    "max_shard_size",
)
# Options added after checkpoints existed: left out of the fingerprint at these values, so a run
# that does not use them resumes a checkpoint of an earlier llmctl.
LATER_OPTIONS = {"on_policy_fraction": 0.0, "cache_teacher": None, "cache_top_k": 32}


@dataclass
class DistillArgs:
    teacher: str
    output: str
    data: str
    student: str | None = None
    student_layers: int | None = None
    student_config: str | None = None
    eval_data: str | None = None
    steps: int = 200
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 10  # steps of linear warm-up before the cosine decay
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: str = "fkl"
    beta: float = 0.5
    temperature: float = 1.0
    alpha_ce: float = 0.0
    on_policy_fraction: float = 0.0  # share of the steps on sequences the student samples
    cache_teacher: str | None = None  # the JSON index of a teacher top-k logits cache
    cache_top_k: int = 32  # logits per position kept in a cache --cache-teacher writes
    eval_every: int = 0  # 0: evaluate only at the end (when there is held-out data)
    save_every: int = 0  # 0: checkpoint only on Ctrl-C
    resume: bool = False
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    report_json: str | None = None
    overwrite: bool = False  # replace an earlier llmctl distill output in -o
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE  # weights above it go into several files

    def resolve(self) -> "DistillArgs":
        """Every check that needs no model; raises UsageError naming the flag."""
        chosen = [
            flag
            for flag, value in (
                ("--student", self.student),
                ("--student-layers", self.student_layers),
                ("--student-config", self.student_config),
            )
            if value is not None
        ]
        if len(chosen) != 1:
            raise UsageError(
                "choose exactly one student: --student S, --student-layers N or "
                f"--student-config FILE (got {', '.join(chosen) or 'none'})"
            )
        if self.student_layers is not None and self.student_layers < 1:
            raise UsageError(f"--student-layers must be at least 1, got {self.student_layers}")
        if self.loss not in LOSSES:
            raise UsageError(f"unknown --loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        for flag, value, low in (
            ("--steps", self.steps, 1),
            ("--batch-size", self.batch_size, 1),
            ("--grad-accum", self.grad_accum, 1),
            ("--seq-len", self.seq_len, 2),
            ("--warmup", self.warmup, 0),
            ("--eval-every", self.eval_every, 0),
            ("--save-every", self.save_every, 0),
            ("--cache-top-k", self.cache_top_k, 1),
        ):
            if value < low:
                raise UsageError(f"{flag} must be at least {low}, got {value}")
        self._check_floats()
        parse_shard_size(self.max_shard_size)
        return self

    def _check_floats(self) -> None:
        for flag, value, low, high in (
            ("--lr", self.lr, 0.0, math.inf),
            ("--beta", self.beta, 0.0, 1.0),
            ("--alpha-ce", self.alpha_ce, 0.0, 1.0),
            ("--temperature", self.temperature, 0.0, math.inf),
            ("--on-policy-fraction", self.on_policy_fraction, 0.0, 1.0),
        ):
            if not (low <= value <= high) or math.isnan(value) or math.isinf(value):
                rng = f"between {low} and {high}" if high != math.inf else f"above {low}"
                raise UsageError(f"{flag} must be {rng}, got {value}")
        if self.temperature == 0 or self.lr == 0:
            raise UsageError("--temperature and --lr must be above 0")
        if self.on_policy_fraction > 0 and self.alpha_ce == 1:
            raise UsageError(
                "--on-policy-fraction needs the teacher's divergence: --alpha-ce below 1"
            )
        if self.cache_teacher is not None and self.alpha_ce == 1:
            raise UsageError("--cache-teacher with --alpha-ce 1 caches a teacher nothing reads")
        if self.on_policy_fraction > 0 and self.cache_teacher is not None:
            raise UsageError(
                "--on-policy-fraction needs the live teacher to score the student's samples; "
                "drop --cache-teacher"
            )

    def fingerprint(self) -> str:
        """What a checkpoint must match to be resumed (the options that shape the training)."""
        d = {
            k: v
            for k, v in asdict(self).items()
            if k not in NOT_IN_FINGERPRINT and not (k in LATER_OPTIONS and v == LATER_OPTIONS[k])
        }
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def to_recipe(self) -> dict:
        """The resolved recipe written as distill.yaml."""
        skip = ("resume", "report_json", "overwrite")
        return {k: v for k, v in asdict(self).items() if k not in skip}
