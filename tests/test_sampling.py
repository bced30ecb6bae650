"""Sampling: the per-request settings on tensors, seeded reproducibility, and stop conditions."""

from __future__ import annotations

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.params import SamplingParams as SP
from llmctl.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p
from llmctl.engine.sequence import Sequence
from llmctl.errors import RequestError


def seqs_for(params_list, tokens=(1, 2, 3)):
    return [Sequence(str(i), list(tokens), p, max_len=100) for i, p in enumerate(params_list)]


def test_top_k_keeps_exactly_k_tokens():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p(logits, [SP(top_k=2)])
    assert torch.isfinite(out)[0].nonzero().flatten().tolist() == [1, 3]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_k_top_p(probs.log(), [SP(top_p=0.75)])
    assert torch.isfinite(out)[0].nonzero().flatten().tolist() == [0, 1]  # 0.5 < 0.75 <= 0.8
    out = apply_top_k_top_p(probs.log(), [SP(top_p=0.1)])
    assert torch.isfinite(out)[0].nonzero().flatten().tolist() == [0]  # the top token always stays


def test_min_p_and_top_k_restrict_draws():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[2.0, 1.9, -5.0, -6.0]]).repeat(200, 1)
    drawn = set(sampler(logits, seqs_for([SP(temperature=1.0, min_p=0.5)] * 200)))
    assert drawn == {0, 1}
    drawn = set(sampler(logits, seqs_for([SP(temperature=1.0, top_k=1)] * 200)))
    assert drawn == {0}


def test_draws_follow_the_distribution():
    sampler = Sampler(seed=1)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    draws = torch.tensor(sampler(logits, seqs_for([SP(temperature=1.0)] * 4000)))
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seq = Sequence("x", [0, 1], SP(repetition_penalty=2.0), max_len=10)
    out = apply_penalties(logits.clone(), [seq])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    seq = Sequence("y", [3], SP(presence_penalty=0.5, frequency_penalty=0.25), max_len=10)
    seq.token_ids += [2, 2, 0]  # outputs: 2 twice, 0 once; the prompt token 3 is not penalised
    out = apply_penalties(logits.clone(), [seq])
    assert out.tolist() == [[2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]]


def test_invalid_params_are_request_errors():
    for kw in (
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(stop=[""]),
        dict(seed="x"),
    ):
        with pytest.raises(RequestError):
            SP(**kw)


@pytest.fixture(scope="module")
def llm(shakespeare_model):
    return LLM(str(shakespeare_model), dtype="float32", kv_cache_memory=16 * 1024**2)


def test_seeded_request_is_independent_of_batch_mates(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    other = SamplingParams(max_tokens=24, temperature=1.0)
    alone = llm.generate(["ROMEO:"], seeded)[0].output_token_ids
    mixed = llm.generate(["JULIET:", "ROMEO:", "First Citizen:\nSpeak."], [other, seeded, other])[
        1
    ].output_token_ids
    assert alone == mixed
    different = llm.generate(
        ["ROMEO:"], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99)
    )[0]
    assert different.output_token_ids != alone


def test_stop_strings_stop_tokens_and_lengths(llm):
    greedy = llm.generate(["ROMEO:"], SamplingParams(max_tokens=40, temperature=0))[0]
    assert greedy.finish_reason == "length" and len(greedy.output_token_ids) == 40
    stop_word = greedy.text.strip().split()[1]
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=40, temperature=0, stop=[stop_word]))[
        0
    ]
    assert out.finish_reason == "stop" and stop_word not in out.text
    assert greedy.text.startswith(out.text) and len(out.output_token_ids) < 40
    stop_id = greedy.output_token_ids[5]
    out = llm.generate(
        ["ROMEO:"], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_id])
    )[0]
    first = greedy.output_token_ids.index(stop_id)
    assert (
        out.finish_reason == "stop" and out.output_token_ids == greedy.output_token_ids[: first + 1]
    )


def test_eos_stops_unless_ignored(llm):
    eos = llm.runtime.eos_token_ids[0]
    engine = llm.engine
    engine.eos_token_ids = frozenset(
        {
            llm.generate(["ROMEO:"], SamplingParams(max_tokens=3, temperature=0))[
                0
            ].output_token_ids[1]
        }
    )
    try:
        out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=10, temperature=0))[0]
        assert out.finish_reason == "stop" and len(out.output_token_ids) == 2
        out = llm.generate(
            ["ROMEO:"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        )[0]
        assert len(out.output_token_ids) == 10
    finally:
        engine.eos_token_ids = frozenset({eos})


def test_prompt_too_long_is_a_request_error(shakespeare_model):
    llm = LLM(
        str(shakespeare_model), dtype="float32", kv_cache_memory=16 * 1024**2, max_model_len=32
    )
    with pytest.raises(RequestError) as e:
        llm.generate([list(range(3, 40))], SamplingParams(max_tokens=4))
    assert e.value.code == "prompt_too_long"
    out = llm.generate(
        [list(range(3, 30))], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 5  # capped by the context


def test_greedy_is_argmax_on_ties_and_nans():
    from llmctl.engine.sampler import greedy

    g = torch.Generator().manual_seed(0)
    for vocab in (7, 49152):  # a short row and one long enough for the vectorised reduction
        ties = torch.randint(0, 4, (16, vocab), generator=g).float()  # many equal maxima per row
        assert torch.equal(greedy(ties), ties.argmax(dim=-1))
        nans = torch.randn(4, vocab, generator=g)
        nans[1, [3, vocab - 1]] = float("nan")
        assert torch.equal(greedy(nans), nans.argmax(dim=-1)) and greedy(nans)[1] == 3
        # bf16 logits as the engine hands them over: the argmax of their float32 widening
        assert torch.equal(greedy(nans.bfloat16()), nans.bfloat16().float().argmax(dim=-1))
        assert torch.equal(greedy(ties.bfloat16()), ties.argmax(dim=-1))


def test_engine_hands_the_sampler_logits_in_the_model_dtype(shakespeare_model):
    """A bf16 model's greedy steps read bf16 logits (no float32 copy); penalties and sampling
    widen them first, so seeded and penalised requests still compute in float32."""

    seen = []
    orig = Sampler.__call__

    def spy(self, logits, seqs):
        seen.append(logits.dtype)
        return orig(self, logits, seqs)

    llm = LLM(str(shakespeare_model), dtype="bfloat16", device="cpu")
    Sampler.__call__ = spy
    try:
        greedy_out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        llm.generate(
            [[5, 6, 7]],
            SamplingParams(max_tokens=4, temperature=0.8, seed=3, repetition_penalty=1.3),
        )
    finally:
        Sampler.__call__ = orig
    assert seen and set(seen) == {torch.bfloat16}
    assert len(greedy_out.output_token_ids) == 4
