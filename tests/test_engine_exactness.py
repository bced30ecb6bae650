"""Greedy outputs of our engine equal transformers' `generate`, token for token, in float32.

Covers every supported architecture, the shared trained models, and the engine configurations that
change the arithmetic path: prefix caching on/off, block size 1, a tiny token budget (chunked
prefill) and a tiny KV budget (preemption and recompute).
"""

from __future__ import annotations

import pytest
import torch

from llmctl import LLM, SamplingParams
from tests.conftest import make_random_model

MAX_NEW = 12


def hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model_greedy(hf, prompts, max_new)


def model_greedy(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """A transformers model's greedy tokens after each prompt, past any EOS."""
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:  # one at a time: no padding in the reference
        ids = torch.tensor([p])
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (32,), generator=g).tolist()
    prompts = [
        torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 9, 26)
    ]  # 9 prompts: runs of similar-length decodes
    prompts += [
        shared + [7, 8, 9],
        shared + torch.randint(3, vocab, (20,), generator=g).tolist(),
        shared[:],
    ]
    return prompts


def engine_greedy(path, prompts, **engine_kwargs):
    llm = LLM(str(path), dtype="float32", device="cpu", **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    return [o.output_token_ids for o in outs], llm.engine


@pytest.fixture(
    scope="module", params=["llama", "llama3-rope", "qwen3-yarn", "mistral", "qwen2", "qwen3"]
)
def random_model(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    if arch == "llama3-rope":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500000.0,
        }
        return make_random_model(folder, "llama", seed=1, rope_parameters=rope, attention_bias=True)
    if arch == "qwen3-yarn":  # a context 4x the original (Qwen3's long-context setting)
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
        return make_random_model(
            folder, "qwen3", seed=2, rope_parameters={**rope, "rope_theta": 1e4}
        )
    return make_random_model(folder, arch, seed=2)


def test_random_architectures_match_transformers(random_model):
    prompts = random_prompts(160)
    ours, _ = engine_greedy(random_model, prompts, kv_cache_memory=8 * 1024**2)
    assert ours == hf_greedy(random_model, prompts, MAX_NEW)


def test_shakespeare_text_prompts_match_transformers(shakespeare_model):
    llm = LLM(str(shakespeare_model), dtype="float32", kv_cache_memory=16 * 1024**2)
    texts = [
        "ROMEO:",
        "First Citizen:\nBefore we proceed any further, hear me speak.",
        "KING RICHARD III:\nNow is the winter of our discontent\n"
        "Made glorious summer by this sun of York;",
    ]
    prompts = [llm.runtime.encode(t) for t in texts]
    outs = llm.generate(texts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == hf_greedy(shakespeare_model, prompts, 20)
    assert all(o.text == llm.runtime.decode(o.output_token_ids) for o in outs)


CONFIGS = {
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "block-size-1": dict(block_size=1),
    "tiny-token-budget": dict(max_num_batched_tokens=7),
    "tiny-kv-budget": dict(block_size=4, kv_budget_blocks=18),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_engine_configurations_match_transformers(name, stories_model):
    kw = dict(CONFIGS[name])
    blocks = kw.pop("kv_budget_blocks", None)
    if blocks:  # K and V, 5 layers, 4 KV heads of 8 dims, 4 bytes: exactly `blocks` blocks
        kw["kv_cache_memory"] = blocks * kw["block_size"] * 2 * 5 * 4 * 8 * 4
    else:
        kw.setdefault("kv_cache_memory", 8 * 1024**2)
    prompts = [[1] + p for p in random_prompts(512, seed=3)]  # token ids; 1 is BOS
    ours, engine = engine_greedy(stories_model, prompts, **kw)
    assert ours == hf_greedy(stories_model, prompts, MAX_NEW)
    if name == "tiny-kv-budget":
        assert engine.num_kv_blocks == 18
        assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    if name == "tiny-token-budget":
        assert engine.stats.steps > MAX_NEW + 40 // 7


def test_prefix_caching_hits_shared_prompts(stories_model):
    prompts = [[1] + p for p in random_prompts(512, seed=4)]
    _, engine = engine_greedy(stories_model, prompts + prompts, kv_cache_memory=8 * 1024**2)
    assert engine.block_manager.prefix_hits >= 32


def test_warm_up_leaves_no_trace(tmp_path):
    # run-batch warms the engine before its job clock starts: afterwards the engine must be as
    # new (blocks in id order, no prefix cache, zero statistics) and give the same tokens
    path = make_random_model(tmp_path / "m", "llama")
    prompts = random_prompts(vocab=128)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    fresh, warmed = LLM(str(path), dtype="float32"), LLM(str(path), dtype="float32")
    warmed.engine.warm_up()
    bm = warmed.engine.block_manager
    assert list(bm.free_queue) == list(range(bm.num_blocks)) and not bm.hash_to_block
    assert warmed.engine.stats.steps == 0 and warmed.engine.stats.prompt_tokens == 0
    assert [r.output_token_ids for r in warmed.generate(prompts, params)] == [
        r.output_token_ids for r in fresh.generate(prompts, params)
    ]
