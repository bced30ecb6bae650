"""The distillation losses on tiny tensors against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from llmctl.train import losses

# One position, vocabulary 2: the student is uniform, the teacher puts 3/4 on token 0.
STUDENT = torch.tensor([[0.0, 0.0]])
TEACHER = torch.tensor([[math.log(3.0), 0.0]])
P_T, P_S = (0.75, 0.25), (0.5, 0.5)


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_forward_kl_is_kl_teacher_student():
    assert losses.forward_kl(STUDENT, TEACHER).item() == pytest.approx(kl(P_T, P_S), rel=1e-6)


def test_forward_kl_softens_by_temperature_and_scales_by_its_square():
    r3 = math.sqrt(3.0)  # teacher logits / 2: probabilities proportional to sqrt(3) and 1
    p_t = (r3 / (1 + r3), 1 / (1 + r3))
    got = losses.forward_kl(STUDENT, TEACHER, temperature=2.0).item()
    assert got == pytest.approx(4 * kl(p_t, P_S), rel=1e-6)


def test_reverse_kl_is_kl_student_teacher():
    assert losses.reverse_kl(STUDENT, TEACHER).item() == pytest.approx(kl(P_S, P_T), rel=1e-6)


def test_generalized_jsd_by_hand():
    beta = 0.25
    m = tuple(beta * t + (1 - beta) * s for t, s in zip(P_T, P_S))
    want = beta * kl(P_T, m) + (1 - beta) * kl(P_S, m)
    got = losses.generalized_jsd(STUDENT, TEACHER, beta=beta).item()
    assert got == pytest.approx(want, rel=1e-6)


def test_generalized_jsd_ends_are_the_two_kls():
    assert losses.generalized_jsd(STUDENT, TEACHER, 0.0).item() == pytest.approx(kl(P_T, P_S))
    assert losses.generalized_jsd(STUDENT, TEACHER, 1.0).item() == pytest.approx(kl(P_S, P_T))


def test_total_variation_by_hand():
    assert losses.total_variation(STUDENT, TEACHER).item() == pytest.approx(0.25, rel=1e-6)


def test_mixing_with_cross_entropy():
    targets = torch.tensor([1])
    loss, ce, div = losses.distill_loss("fkl", STUDENT, TEACHER, targets, alpha_ce=0.25)
    assert ce.item() == pytest.approx(math.log(2.0), rel=1e-6)
    assert div.item() == pytest.approx(kl(P_T, P_S), rel=1e-6)
    assert loss.item() == pytest.approx(0.75 * kl(P_T, P_S) + 0.25 * math.log(2.0), rel=1e-6)
    ce_only, _, none = losses.distill_loss("fkl", STUDENT, None, targets, alpha_ce=1.0)
    assert none is None and ce_only.item() == pytest.approx(math.log(2.0), rel=1e-6)


@pytest.mark.parametrize("name", losses.LOSSES)
def test_every_loss_is_zero_at_the_teacher_and_positive_elsewhere(name):
    torch.manual_seed(0)
    t = torch.randn(5, 7)
    s = torch.randn(5, 7, requires_grad=True)
    same = losses.divergence(name, t.clone(), t, beta=0.5, temperature=1.5)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    d = losses.divergence(name, s, t, beta=0.5, temperature=1.5)
    assert d.item() > 0
    d.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_mean_over_positions():
    two_s, two_t = torch.cat([STUDENT, TEACHER]), torch.cat([TEACHER, TEACHER])
    got = losses.forward_kl(two_s, two_t).item()
    assert got == pytest.approx(kl(P_T, P_S) / 2, rel=1e-6)
