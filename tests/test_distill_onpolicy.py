"""--on-policy-fraction: the student's own samples, drawn through our engine, scored by the teacher;
the loss only on generated tokens, fresh weights every time, a bounded KV cache, exact resume."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from test_distill_resume import N, args, stop_after

from llmctl.engine.llm_engine import LLMEngine
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.tensors import read_tensors
from llmctl.train import loop, onpolicy
from llmctl.train.job import TrainingInterrupted, run_distill


@pytest.fixture
def recorded(monkeypatch):
    """Every engine built, what its steps returned, and what student_samples gave the loop."""
    seen = {"engines": [], "outputs": [], "samples": []}
    real_init, real_step, real_samples = LLMEngine.__init__, LLMEngine.step, loop.student_samples

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        seen["engines"].append(self)

    def step(self):
        outs = real_step(self)
        seen["outputs"].extend((int(o.request_id), list(o.output_token_ids)) for o in outs)
        return outs

    def samples(student, ids, mask, *rest):
        new_ids, new_mask = real_samples(student, ids, mask, *rest)
        seen["samples"].append((ids, mask, new_ids, new_mask))
        return new_ids, new_mask

    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(loop, "student_samples", samples)
    return seen


def test_all_on_policy_trains_only_on_tokens_the_engine_generated(tmp_path, recorded):
    report = run_distill(args(tmp_path / "out", on_policy_fraction=1.0))
    steps, micro = 2 * N, 2  # grad_accum 2: one engine per micro-batch
    assert report["on_policy_steps"] == steps and all(h["on_policy"] for h in report["history"])
    assert len(recorded["engines"]) == len(recorded["samples"]) == steps * micro
    outputs = iter(recorded["outputs"])
    for ids, mask, new_ids, new_mask in recorded["samples"]:
        by_row = dict(next(outputs) for _ in range(ids.shape[0]))
        for r in range(ids.shape[0]):
            p = onpolicy.prompt_length(mask[r])
            assert torch.equal(new_ids[r, :p], ids[r, :p])  # the data's prompt is kept
            assert not new_mask[r, :p].any()  # no loss on the prompt
            assert new_ids[r][new_mask[r]].tolist() == by_row[r]  # the engine's tokens
    targets = [int(m[:, 1:].sum()) for *_, m in recorded["samples"]]
    assert sum(h["target_tokens"] for h in report["history"]) == sum(targets)
    cfg = recorded["engines"][0].model_config
    bound = onpolicy.kv_budget(cfg, 2, 16, torch.float32)
    assert all(e.kv_cache_bytes <= bound for e in recorded["engines"])
    assert bound < 1 << 20  # a batch's worth, not the engine's default of up to 2 GiB


def test_fraction_zero_never_builds_an_engine_and_keeps_the_fingerprint(tmp_path, recorded):
    a = args(tmp_path / "out")
    report = run_distill(a)
    assert recorded["engines"] == [] and report["on_policy_steps"] == 0
    assert not any(h["on_policy"] for h in report["history"])
    later = ("on_policy_fraction", "cache_teacher", "cache_top_k", "overwrite", "max_shard_size")
    old = {
        k: v
        for k, v in asdict(a).items()
        if k not in ("resume", "report_json", "eval_every", "save_every", "quiet") + later
    }  # the fingerprint before these options existed: its checkpoints still resume
    expected = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert a.fingerprint() == expected
    assert args(tmp_path / "x", on_policy_fraction=0.5).fingerprint() != expected


def test_resume_with_half_on_policy_is_bit_exact(tmp_path):
    picks = [onpolicy.is_on_policy(0, s, 0.5) for s in range(2 * N)]
    assert any(picks[:N]) and not all(picks[:N]) and any(picks[N:]) and not all(picks[N:])
    whole = run_distill(args(tmp_path / "whole", on_policy_fraction=0.5))
    with pytest.raises(TrainingInterrupted):
        run_distill(args(tmp_path / "split", on_policy_fraction=0.5), progress=stop_after(N))
    resumed = run_distill(args(tmp_path / "split", on_policy_fraction=0.5, resume=True))
    a, b = read_tensors(tmp_path / "whole"), read_tensors(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in whole["history"]] == [h["loss"] for h in resumed["history"]]
    assert [h["on_policy"] for h in whole["history"]] == picks
    assert whole["on_policy_steps"] == resumed["on_policy_steps"] == sum(picks)


def test_the_engine_samples_from_the_current_weights():
    from llmctl.runtime.weights import load_model

    student, _ = load_model(Path(DEMO_MODEL_DIR), "float32", "cpu")
    ids = torch.randint(3, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)

    def sample(model):
        return onpolicy.student_samples(model, ids, mask, 0, 7, 0, ())

    first, gen_mask = sample(student)
    assert torch.equal(sample(student)[0], first)  # seeded per step and row
    assert int(gen_mask.sum()) == 2 * 12 and student.lm_head.packed is None  # no stale copy
    with torch.no_grad():
        student.lm_head.weight.neg_()  # an update in place, as the optimizer makes
    after = sample(student)[0]
    assert not torch.equal(after, first)
    assert torch.equal(after, sample(copy.deepcopy(student))[0])  # = a fresh copy's samples


def test_prompt_length_is_the_prompt_or_half():
    assert onpolicy.prompt_length(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.bool)) == 3
    assert onpolicy.prompt_length(torch.ones(8, dtype=torch.bool)) == 4
    assert onpolicy.prompt_length(torch.zeros(8, dtype=torch.bool)) == 4


@pytest.mark.parametrize(
    "extra, words",
    [
        (dict(on_policy_fraction=1.5), "--on-policy-fraction must be between"),
        (dict(on_policy_fraction=0.5, alpha_ce=1.0), "--alpha-ce below 1"),
    ],
)
def test_bad_on_policy_options(tmp_path, extra, words):
    from llmctl.errors import UsageError

    with pytest.raises(UsageError, match=words):
        args(tmp_path / "out", **extra).resolve()
