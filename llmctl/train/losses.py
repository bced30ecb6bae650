"""Distillation losses: pure functions on logits, no state.

Owns: `forward_kl`, `reverse_kl`, `generalized_jsd`, `total_variation`, `cross_entropy` and
`distill_loss`, which mixes the chosen divergence with cross-entropy on the data's next tokens.
Every function takes student and teacher logits [N, V] of the N scored positions (already
selected by the loss mask) and returns the mean over those positions (a 0-d float32 tensor).
Temperature T divides both logits before the softmax; `forward_kl` is scaled by T^2 (Hinton et
al.) so its gradients keep their size as T changes. `generalized_jsd` follows GKD (Agarwal et al.)
as TRL's GKDTrainer computes it: with M = beta * p_teacher + (1 - beta) * p_student,
JSD_beta = beta * KL(p_teacher || M) + (1 - beta) * KL(p_student || M); beta 0 is taken as
KL(teacher || student) and beta 1 as KL(student || teacher), as TRL does.

A teacher read from a --cache-teacher file (teacher_cache.py) is sparse: its k largest
log-probabilities at temperature 1 with their token ids, and the log of the mass left to the other
V - k tokens. `teacher_from_top_k` spreads that mass evenly over those tokens (the most uncertain
guess the cache allows, and what keeps every divergence finite: no teacher probability is 0) and
returns full log-probabilities [N, V]; temperature then softens them as it would the logits, since
log-probabilities differ from the logits by a constant per row. With k = V it is the dense teacher
exactly; `distill_loss_top_k` is `distill_loss` on that teacher.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmctl.train.args import LOSSES  # noqa: F401 (the names, where the CLI reads them)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(logits.float() / temperature, dim=-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(p || q) = sum_v p (log p - log q), from log-probabilities [N, V]."""
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def forward_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0):
    """T^2 * KL(p_teacher || p_student) on temperature-softened distributions."""
    kl = _kl(_log_probs(teacher, temperature), _log_probs(student, temperature))
    return kl * temperature**2


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0):
    """KL(p_student || p_teacher) (mode-seeking, MiniLLM)."""
    return _kl(_log_probs(student, temperature), _log_probs(teacher, temperature))


def generalized_jsd(
    student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5, temperature: float = 1.0
):
    """GKD's generalised Jensen-Shannon divergence (see the module docstring for beta's ends)."""
    log_s, log_t = _log_probs(student, temperature), _log_probs(teacher, temperature)
    if beta == 0:
        return _kl(log_t, log_s)
    if beta == 1:
        return _kl(log_s, log_t)
    # log M = log(beta * p_t + (1 - beta) * p_s), computed stably in log space: [N, V]
    log_m = torch.logsumexp(
        torch.stack((log_t + math.log(beta), log_s + math.log(1 - beta))), dim=0
    )
    return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)


def total_variation(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0):
    """TVD = 1/2 sum_v |p_teacher - p_student|."""
    p_s = _log_probs(student, temperature).exp()
    p_t = _log_probs(teacher, temperature).exp()
    return 0.5 * (p_t - p_s).abs().sum(-1).mean()


def cross_entropy(student: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of `targets` [N] under the student's logits [N, V] (temperature 1)."""
    return F.cross_entropy(student.float(), targets)


def divergence(
    name: str, student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """The divergence `name` (one of LOSSES) between student and teacher logits [N, V]."""
    if name == "fkl":
        return forward_kl(student, teacher, temperature)
    if name == "rkl":
        return reverse_kl(student, teacher, temperature)
    if name == "jsd":
        return generalized_jsd(student, teacher, beta, temperature)
    if name == "tvd":
        return total_variation(student, teacher, temperature)
    raise ValueError(f"unknown loss {name!r}")


REST_FLOOR = -1e4  # log-mass floor outside the top k: exp() is 0 but no 0 * -inf


def teacher_from_top_k(
    values: torch.Tensor, indices: torch.Tensor, rest: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Full teacher log-probabilities [N, V] from its top-k log-probabilities values [N, k], their
    ids indices [N, k] and the log of the remaining mass rest [N] (see the module docstring)."""
    n, k = values.shape
    if k >= vocab:
        fill = torch.zeros(n, 1, device=values.device)
    else:
        fill = (rest.float().clamp(min=REST_FLOOR) - math.log(vocab - k)).unsqueeze(-1)
    out = fill.expand(n, vocab).clone()
    return out.scatter_(-1, indices.long(), values.float())


def distill_loss_top_k(
    name: str,
    student: torch.Tensor,
    top_k: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """distill_loss against a sparse teacher top_k = (values [N, k], indices [N, k], rest [N])."""
    teacher = teacher_from_top_k(*top_k, student.shape[-1])
    return distill_loss(name, student, teacher, targets, **kw)


def distill_loss(
    name: str,
    student: torch.Tensor,
    teacher: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    alpha_ce: float,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, ce, divergence) with loss = (1 - alpha_ce) * divergence + alpha_ce * ce.

    student [N, V], teacher [N, V] or None (only when alpha_ce is 1: no divergence), targets [N]."""
    ce = cross_entropy(student, targets)
    if teacher is None:
        return ce, ce, None
    div = divergence(name, student, teacher, beta, temperature)
    if alpha_ce == 0:
        return div, ce, div
    return (1 - alpha_ce) * div + alpha_ce * ce, ce, div
