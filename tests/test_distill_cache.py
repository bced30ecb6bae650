"""--cache-teacher: the teacher's top-k logits as safetensors shards + a JSON index, read instead
of the teacher; the sparse-teacher losses against the dense ones; caches of other runs refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_distill_resume import DATA, N, args

from llmctl.errors import UsageError
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.tensors import read_tensors
from llmctl.train import losses
from llmctl.train.args import LOSSES
from llmctl.train.job import run_distill

V = 2048  # the demo model's vocabulary


def top_k(logits: torch.Tensor, k: int):
    logp = torch.log_softmax(logits, dim=-1)
    values, indices = logp.topk(k, dim=-1)
    rest = torch.logsumexp(logp.scatter(-1, indices, float("-inf")), dim=-1)
    return values, indices, rest


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sparse_teacher_with_k_equal_vocab_is_the_dense_teacher(name, temperature):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g) * 3
    targets = torch.randint(0, 7, (5,), generator=g)
    kw = dict(alpha_ce=0.25, beta=0.3, temperature=temperature)
    dense = losses.distill_loss(name, student, teacher, targets, **kw)
    sparse = losses.distill_loss_top_k(name, student, top_k(teacher, 7), targets, **kw)
    for a, b in zip(dense, sparse):
        assert torch.allclose(a, b, atol=1e-6), (name, a, b)


def test_mass_outside_the_top_k_is_spread_evenly():
    teacher = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]])
    values, indices, rest = top_k(teacher, 2)
    p = losses.teacher_from_top_k(values, indices, rest, 5).exp()[0]
    exact = torch.softmax(teacher, -1)[0]
    assert torch.allclose(p[:2], exact[:2]) and torch.allclose(p.sum(), torch.tensor(1.0))
    assert torch.allclose(p[2:], exact[2:].sum().expand(3) / 3)


def test_cached_run_with_k_equal_vocab_equals_the_live_run(tmp_path):
    live = run_distill(args(tmp_path / "live"))
    index = tmp_path / "cache" / "teacher.json"
    index.parent.mkdir()
    cached = run_distill(args(tmp_path / "c", cache_teacher=str(index), cache_top_k=V))
    again = run_distill(args(tmp_path / "d", cache_teacher=str(index), cache_top_k=V))
    assert cached["teacher_cache"]["built"] and not again["teacher_cache"]["built"]
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "teacher-00000.safetensors", "teacher.json",
    ]  # fmt: skip
    doc = json.loads(index.read_text())
    assert doc["schema"] == "llmctl.teacher_cache" and doc["sequences"] == 2 * 3 * 2 * 2
    shard = load_file(index.parent / "teacher-00000.safetensors")  # safetensors, not pickle
    assert shard["values"].shape == (24, 15, V) and shard["indices"].dtype == torch.int32
    for report in (cached, again):
        got = [h["loss"] for h in report["history"]]
        assert got == pytest.approx([h["loss"] for h in live["history"]], rel=1e-5)
    a, b = read_tensors(tmp_path / "live"), read_tensors(tmp_path / "c")
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_small_k_trains_and_a_cache_of_other_data_teacher_or_seq_len_is_refused(tmp_path):
    index = tmp_path / "t.json"
    run_distill(args(tmp_path / "a", steps=1, cache_teacher=str(index), cache_top_k=4))
    assert json.loads(index.read_text())["fingerprint"]["top_k"] == 4
    other = tmp_path / "other.txt"
    other.write_text(DATA.read_text()[::-1])
    teacher = tmp_path / "teacher"
    shutil.copytree(DEMO_MODEL_DIR, teacher)
    (teacher / "model.safetensors").touch()  # rewritten weights
    for kw, words in (
        (dict(data=str(other)), "another data sha256"),
        (dict(teacher=str(teacher)), "another teacher"),
        (dict(seq_len=12), "another seq len"),
        (dict(cache_top_k=8), "another top k"),
        (dict(steps=3), "covers 4 sequences; this run needs 12"),
    ):
        with pytest.raises(UsageError, match=words):
            run_distill(args(tmp_path / "b", cache_teacher=str(index), **{"cache_top_k": 4, **kw}))


def test_cache_options_refused_before_training(tmp_path):
    with pytest.raises(UsageError, match="drop --cache-teacher"):
        run_distill(args(tmp_path / "a", cache_teacher=str(tmp_path / "t.json"),
                         on_policy_fraction=0.5))  # fmt: skip
    (tmp_path / "b").mkdir()  # an empty -o is fine; a cache in it would be replaced with it
    with pytest.raises(UsageError, match="lies inside -o"):
        run_distill(args(tmp_path / "b", cache_teacher=str(tmp_path / "b" / "t.json")))
    (tmp_path / "bad.json").write_text('{"schema": "x"}')
    with pytest.raises(UsageError, match="not an llmctl teacher cache"):
        run_distill(args(tmp_path / "c", cache_teacher=str(tmp_path / "bad.json")))
    with pytest.raises(UsageError, match="caches a teacher nothing reads"):
        args(tmp_path / "e", cache_teacher=str(tmp_path / "t.json"), alpha_ce=1.0).resolve()
    with pytest.raises(UsageError, match="--cache-top-k must be at least 1"):
        args(tmp_path / "d", cache_top_k=0).resolve()


def test_an_existing_cache_stands_in_for_the_teacher_whose_weights_are_not_loaded(
    tmp_path, monkeypatch
):
    """A teacher too big to sit beside the student: once the cache exists, training reads it and
    never loads the teacher's weights; the losses equal the run that built it, and evaluation
    reports the student's perplexity without a teacher-student KL."""
    import llmctl.runtime.weights as weights

    index = tmp_path / "cache" / "teacher.json"
    index.parent.mkdir()
    kw = dict(cache_teacher=str(index), cache_top_k=V, eval_every=N)
    built = run_distill(args(tmp_path / "a", **kw))
    loads: list = []
    real = weights.load_model
    monkeypatch.setattr(weights, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    reused = run_distill(args(tmp_path / "b", **kw))
    assert loads == []  # neither the teacher nor (taken from its layers) a student via load_model
    assert [h["loss"] for h in reused["history"]] == [h["loss"] for h in built["history"]]
    evals = reused["evals"]
    assert evals and all(e["kl_teacher_student"] is None for e in evals)
    assert all(e["perplexity"] > 1 for e in evals)
