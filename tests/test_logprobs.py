"""logprobs and prompt_logprobs against transformers' log_softmax (float32, within 1e-4), on
the engine configurations that change how positions are computed: chunked prefill, preemption,
prefix caching, speculative decoding and the batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.logprobs import score
from tests.conftest import make_random_model

TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("lp"), "llama", seed=3)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is log p(. | ids[: p + 1])."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 160, (20,), generator=g).tolist()
    out = [shared + torch.randint(3, 160, (k,), generator=g).tolist() for k in (5, 13)]
    return out + [torch.randint(3, 160, (k,), generator=g).tolist() for k in (1, 37)][: n - 2]


def check_output(hf, out, k: int, prompt_k: int | None) -> None:
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    ref = hf_logprobs(hf, prompt + gen)  # [P + G, V]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(gen)
    for j, (tok, pos) in enumerate(zip(gen, lps)):
        row = ref[len(prompt) + j - 1]
        assert abs(pos[tok].logprob - row[tok].item()) < TOL
        assert pos[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        alternatives = sorted((lp.rank, t) for t, lp in pos.items() if lp.rank <= k)
        assert [t for _, t in alternatives] == top.indices.tolist()
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(pos[t].logprob - v) < TOL
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(pos[t].logprob for t, pos in zip(gen, lps))
    )
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        pos, row = out.prompt_logprobs[p], ref[p - 1]
        assert abs(pos[prompt[p]].logprob - row[prompt[p]].item()) < TOL
        assert len([lp for lp in pos.values() if lp.rank <= prompt_k]) >= prompt_k


@pytest.mark.parametrize(
    "engine",
    [
        dict(),
        dict(max_num_batched_tokens=7),  # prompts scored chunk by chunk
        dict(kv_cache_memory=12 * 2048, block_size=4, max_num_batched_tokens=8),  # preemptions
        dict(batch_invariant=True),
    ],
    ids=["plain", "chunked", "preempted", "invariant"],
)
def test_logprobs_and_prompt_logprobs_match_transformers(model_dir, hf, engine):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **engine)
    sp = SamplingParams(
        max_tokens=6, temperature=0.8, seed=5, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    outs = llm.generate(prompts(), sp)
    for out in outs:
        check_output(hf, out, 3, 2)
    if "kv_cache_memory" in engine:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_are_never_skipped_by_a_prefix_cache_hit(model_dir, hf):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4)
    p = prompts()[0]
    llm.generate([p], SamplingParams(max_tokens=2, temperature=0))  # fills the prefix cache
    hits = llm.engine.block_manager.prefix_hits
    out = llm.generate([p], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert llm.engine.block_manager.prefix_hits == hits  # no hit taken
    check_output_prompt_only(hf, out)
    again = llm.generate([p], SamplingParams(max_tokens=2, temperature=0))[0]
    assert llm.engine.block_manager.prefix_hits > hits  # the cache serves requests without
    assert again.prompt_logprobs is None


def check_output_prompt_only(hf, out) -> None:
    prompt = out.prompt_token_ids
    ref = hf_logprobs(hf, prompt)
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL
    assert out.outputs[0].logprobs is None


def test_logprobs_of_accepted_drafts_are_the_target_models(model_dir, hf):
    # the model drafting for itself: greedy drafts are all accepted
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", speculative_config={"model": str(model_dir)}
    )
    rep = [5, 6, 7, 8] * 6
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    out = llm.generate([rep], sp)[0]
    assert llm.engine.stats.spec_accepted >= 6
    check_output(hf, out, 2, None)
    plain = LLM(str(model_dir), dtype="float32", device="cpu").generate([rep], sp)[0]
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_job_without_logprobs_runs_no_logprob_code(model_dir, monkeypatch):
    import llmctl.engine.llm_engine as eng

    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    sp = SamplingParams(max_tokens=5, temperature=0.7, seed=1)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts(), sp)]

    def boom(*a, **k):
        raise AssertionError("logprob code ran for a job that asked for none")

    monkeypatch.setattr(eng, "add_sampled", boom)
    monkeypatch.setattr(eng, "add_prompt", boom)
    monkeypatch.setattr(eng, "to_dicts", boom)
    outs = llm.generate(prompts(), sp)
    assert [o.outputs[0].token_ids for o in outs] == before
    assert all(o.outputs[0].logprobs is None and o.prompt_logprobs is None for o in outs)
    with_lp = llm.generate(prompts(), SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    assert [o.outputs[0].token_ids for o in with_lp] == before


def test_logprobs_leave_the_sampled_tokens_unchanged(model_dir):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", batch_invariant=True)
    sp = dict(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    plain = llm.generate(prompts(), SamplingParams(**sp))
    scored = llm.generate(prompts(), SamplingParams(**sp, logprobs=5, prompt_logprobs=1))
    assert [o.outputs[0].token_ids for o in scored] == [o.outputs[0].token_ids for o in plain]


def test_score_ranks_and_top_k():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 0.0, 0.0, -1.0]])
    entries = score(logits, [2, 3], [2, 0])
    lp = torch.log_softmax(logits, dim=-1)
    assert entries[0].rank == 3 and entries[1].rank == 4
    assert entries[0].logprob == pytest.approx(lp[0, 2].item())
    assert set(entries[0].top_ids) == {1, 3} and entries[1].top_ids == ()
