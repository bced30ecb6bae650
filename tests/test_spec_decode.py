"""Speculative decoding: greedy output identical to plain decoding; sampled output distributed as
the target's (statistical test of the accept/reject rule on a tiny vocabulary)."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.spec_decode import NgramProposer, verify


def truncated_draft(src, dst, layers: int = 2):
    """A draft model: the first `layers` decoder layers of `src`, with its embeddings and head."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    keep = {
        k: v
        for k, v in sd.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    save_file(keep, str(dst / "model.safetensors"))
    return dst


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(max_n=3)
    assert p.propose("r", [1, 2, 3, 9, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]
    assert p.propose("r", [4, 5, 6], 3) == []


PROMPTS = [
    "ROMEO:\nO, I will not.\n\nROMEO:\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nJULIET:\nO Romeo",
]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_decoding(method, shakespeare_model, tmp_path):
    kw = dict(speculative=method, num_speculative_tokens=3)
    if method == "draft":
        kw["draft_model"] = str(truncated_draft(shakespeare_model, tmp_path / "draft"))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(str(shakespeare_model), dtype="float32").generate(PROMPTS, params)
    spec_llm = LLM(str(shakespeare_model), dtype="float32", **kw)
    spec = spec_llm.generate(PROMPTS, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    stats = spec_llm.engine.stats
    assert stats.spec_proposed > 0 and 0 < stats.spec_accepted <= stats.spec_proposed
    assert stats.steps < 3 * 40  # speculation saved steps


def test_speculation_stops_at_large_batch(shakespeare_model):
    llm = LLM(str(shakespeare_model), dtype="float32", speculative="ngram", speculative_max_batch=2)
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert llm.engine.stats.spec_proposed == 0


def test_verify_preserves_the_target_distribution():
    """Point-mass drafts through the accept/reject rule: emitted tokens follow the target
    exactly."""
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    logits = target.log()
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(4)
    second = torch.zeros(4)
    accepted_first = 0
    for _ in range(n):
        out = verify(logits, [2], params, g)  # draft token 2 at the first position
        first[out[0]] += 1
        if len(out) == 2:
            accepted_first += 1
            second[out[1]] += 1
    assert torch.allclose(first / n, target[0], atol=0.012)
    assert abs(accepted_first / n - 0.15) < 0.012  # acceptance probability p(draft)
    assert torch.allclose(second / second.sum(), target[1], atol=0.03)


def test_sampled_speculation_runs_and_reports_acceptance(shakespeare_model):
    llm = LLM(str(shakespeare_model), dtype="float32", speculative="ngram")
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=24, temperature=0.7, seed=3, ignore_eos=True)
    )
    assert all(len(o.output_token_ids) == 24 for o in outs)
    assert llm.engine.stats.spec_acceptance_rate is not None


def test_verification_tokens_attend_as_decodes(stories_model):
    """A verifying sequence's last token and drafts are laid out as decode rows (each its own
    context length over the paged cache, causal because the step writes every K/V first), sorted
    with the one-token decodes by context, longest first; a prompt chunk stays a chunk."""
    from llmctl.engine.scheduler import ScheduledBatch
    from llmctl.engine.sequence import Sequence

    runner = LLM(str(stories_model), dtype="float32").engine.runner
    params = SamplingParams(max_tokens=8)
    decode, verify_, prompt = (
        Sequence("d", list(range(3, 14)), params, 64),
        Sequence("v", list(range(3, 24)), params, 64),
        Sequence("p", list(range(3, 11)), params, 64),
    )
    decode.num_computed_tokens, decode.block_table = 10, [3]
    verify_.num_computed_tokens, verify_.block_table = 20, [4, 5]
    verify_.spec_token_ids = [5, 6, 7]
    prompt.block_table = [6]
    batch = ScheduledBatch([decode, verify_, prompt], [1, 4, 8])
    st = runner._step_inputs(batch)
    assert st.dec_lens == [21, 22, 23, 24, 11]
    assert st.dec_tables == [[4, 5]] * 4 + [[3]]
    assert st.ids[:5] == [23, 5, 6, 7, 13]
    assert [(c.start, c.length) for c in st.prefills] == [(5, 8)]
    assert st.logits_idx == [0, 1, 2, 3, 4, 12]
    assert st.sampling == [verify_, decode, prompt]


def test_the_draft_cache_extends_the_dense_forward(shakespeare_model):
    """forward_cached (the draft's dense per-request cache) runs the layers' forward_dense: the
    last token's logits after a cache built in pieces (and trimmed) equal the whole sequence's."""
    from llmctl.runtime.weights import load_model

    model, _ = load_model(shakespeare_model, "float32", "cpu")
    ids = torch.randint(3, 2000, (12,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = model.forward_dense(ids[None])[0]  # [12, V]
        _, cache = model.forward_cached(ids[:7], 0, None)
        cache = model.trim_cache(cache, 5)  # as after a rejected draft
        last, cache = model.forward_cached(ids[5:], 5, cache)
        assert cache[0][0].shape[2] == 12
        torch.testing.assert_close(last, whole[-1], rtol=1e-4, atol=1e-4)
        first, _ = model.forward_cached(ids[:1], 0, None)
        torch.testing.assert_close(first, whole[0], rtol=1e-4, atol=1e-4)
