"""`LLM.generate(prompts, reorder="prefix")`: the same outputs in input order, more prefix-cache
hits on interleaved shared prefixes (the embedded demo model, float32, CPU)."""

from __future__ import annotations

import pytest

from llmctl import LLM, SamplingParams
from llmctl.errors import UsageError

GREEDY = SamplingParams(max_tokens=3, temperature=0)


def small_llm() -> LLM:
    # a KV cache of about three of the prompts below: input order evicts a prefix before its
    # next sharer comes
    return LLM(dtype="float32", device="cpu", max_num_seqs=2, kv_cache_memory=1 << 20)


def test_prefix_order_gives_the_same_outputs_with_more_cache_hits():
    docs = [" ".join(f"d{g}w{j}" for j in range(40)) for g in range(5)]
    prompts = [f"{docs[i % 5]} question {i}?" for i in range(15)]
    got = {}
    for reorder in ("none", "prefix"):
        llm = small_llm()
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, reorder=reorder)
        assert [o.prompt for o in outs] == prompts  # input order
        got[reorder] = ([o.outputs[0].token_ids for o in outs], llm.engine.block_manager)
    assert got["prefix"][0] == got["none"][0]
    hits = {k: bm.prefix_hits / bm.prefix_queries for k, (_, bm) in got.items()}
    assert hits["prefix"] > hits["none"] + 0.2, hits


def test_an_unknown_order_is_a_usage_error():
    with pytest.raises(UsageError, match="reorder must be"):
        small_llm().generate(["hi"], GREEDY, reorder="length")
